"""The import structure of relayrl/ (issue 13): layers only import downwards, and no import cycles.

Every module under relayrl/ is parsed (ast, nothing is imported) and each of its imports of a relayrl module is
checked. Layers, top to bottom (an import may go to its own layer or any lower one):

    relayrl.cli
    trainers: every relayrl.algorithms module that is not a math module (grpo, ppo, setup, runner, parity, ...)
    core: the algorithms math modules (MATH_MODULES), relayrl.models, relayrl.experience, relayrl.environments
    infrastructure: relayrl.data_plane, relayrl.distributed
    relayrl.utils
    relayrl.config

Inside core, math modules import nothing from models, experience or environments (pure functions over tensors).
Module-level and function-level imports both count for the layers (so do `if TYPE_CHECKING:` imports and
`importlib.import_module` of a relayrl module named by a string literal). Cycles are searched twice: among the imports
that run when a module is imported (module level, outside `if TYPE_CHECKING:`), and with function-level and dynamic
imports added (modules that need each other, one of them importing late to dodge the import-time error). An import
`a.b.c` is an edge to a.b.c only (not to the packages a, a.b whose __init__ also runs). A third rule: no module
imports another module's private (underscore) name. `relayrl/__init__.py` is exempt. A new top-level package must be
given a layer here (an unclassified module is an error). Each violation prints as `importer -> imported (line N)`.

One rule is about classes, not imports (issue 25): no class in relayrl/algorithms subclasses another relayrl/algorithms
class. A trainer varies by what it is given (a `RolloutSource`, a loss, an estimator), never by overriding another
trainer's private hooks; Protocols, which only compose interfaces, are exempt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.architecture_classes import multiple_behaviour_bases, scan_classes
from tests.architecture_imports import (
    CLI,
    CONFIG,
    CORE,
    INFRA,
    PACKAGE,
    ROOT,
    TRAINERS,
    UTILS,
    Import,
    algorithms_subclasses,
    import_cycles,
    layer_of,
    layer_violations,
    module_names,
    private_imports,
    report,
    scan,
    unclassified_modules,
)

# --------------------------------------------------------------------------------------------- the real tree


def test_every_module_has_a_layer() -> None:
    assert module_names(ROOT), f"no modules found under {ROOT}"
    unclassified = unclassified_modules()
    assert not unclassified, report("modules without a layer (add them to TOP_LEVEL)", unclassified)


def test_imports_follow_the_layer_order() -> None:
    bad = layer_violations(scan())
    assert not bad, report("imports against the layer order (importer -> imported)", map(str, bad))


def cycle_lines(cycles: list[list[Import]]) -> list[str]:
    return [" ; ".join(f"{e}{'' if e.kind == 'module' else f' [{e.kind}]'}" for e in cycle) for cycle in cycles]


def test_no_import_cycles() -> None:
    """Module-level imports: a cycle here makes importing depend on which module is imported first."""
    cycles = import_cycles(scan())
    assert not cycles, report("import cycles (importer -> imported, around the cycle)", cycle_lines(cycles))


def test_no_cycles_through_deferred_imports() -> None:
    """Module-level plus function-level imports: modules that need each other, one of them importing late."""
    cycles = import_cycles(scan(), deferred=True)
    assert not cycles, report("dependency cycles (importer -> imported, around the cycle)", cycle_lines(cycles))


def test_no_private_names_imported_across_modules() -> None:
    bad = private_imports(scan())
    lines = [f"{imp}: {', '.join(n for n in imp.names if n.startswith('_'))}" for imp in bad]
    assert not bad, report("private names imported from another module (importer -> imported)", lines)


def test_no_algorithms_class_subclasses_another() -> None:
    """A trainer is configured by what it is given (its `RolloutSource`: generated, produced ahead, recorded), so
    asynchronous GRPO is `GRPOSyncSteps` with a `ProducerSource`, not a subclass overriding its private hooks."""
    bad = algorithms_subclasses()
    assert not bad, report("relayrl.algorithms classes subclassing another (give it a seam instead)", bad)


# --------------------------------------------------------------------------------------------- the checker itself


def write_tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / PACKAGE
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(pkg).parents:
            init = pkg / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        path.write_text(text)
    return pkg


def test_checker_reports_upward_imports_math_imports_cycles_and_private_names(tmp_path: Path) -> None:
    pkg = write_tree(
        tmp_path,
        {
            "config.py": "import os\n",
            "utils/a.py": "from relayrl.utils import b\n",  # a <-> b: a cycle within one layer
            "utils/b.py": "import relayrl.utils.a\nfrom relayrl import config\n",
            "utils/c.py": "def f():\n    from relayrl.cli.main import run  # upward, inside a function\n",
            "cli/main.py": "from relayrl.algorithms.grpo import train\nfrom relayrl.algorithms import gae\n",
            "algorithms/grpo.py": "from relayrl.algorithms.gae import gae\nfrom relayrl.algorithms.ppo import _private\n",
            "algorithms/ppo.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relayrl.algorithms import grpo\n",
            "algorithms/setup.py": "def run():\n    from relayrl.algorithms.ppo_setup import run_ppo\n",
            "algorithms/ppo_setup.py": "from relayrl.algorithms.setup import helper\n",
            "algorithms/gae.py": "from relayrl.models.policy import worker\nfrom . import advantages\n",
            "algorithms/advantages.py": "from ..distributed.batched_data_dict import B\n",
            "models/policy/worker.py": "import importlib\nX = importlib.import_module('relayrl.experience.data')\n",
            "experience/data.py": "from relayrl.models.policy.worker import W\nfrom relayrl.data_plane import memory\n",
            "data_plane/memory.py": "from relayrl.experience import data  # upward\n",
            "distributed/batched_data_dict.py": "from relayrl.config import X\n",
        },
    )
    imports = scan(pkg)
    assert unclassified_modules(pkg) == []
    got = {str(i) for i in layer_violations(imports)}
    assert got == {
        "relayrl.utils.c -> relayrl.cli.main (line 2)",  # function-level imports count
        "relayrl.algorithms.gae -> relayrl.models.policy.worker (line 1)",  # math must not import models
        "relayrl.data_plane.memory -> relayrl.experience.data (line 1)",
    }, got
    by_edge = {str(i): i.kind for i in imports}
    assert by_edge["relayrl.algorithms.advantages -> relayrl.distributed.batched_data_dict (line 1)"] == "module"
    assert by_edge["relayrl.models.policy.worker -> relayrl.experience.data (line 2)"] == "dynamic"
    assert by_edge["relayrl.algorithms.ppo -> relayrl.algorithms.grpo (line 3)"] == "type_checking"
    # import time: worker -> data is dynamic, setup -> ppo_setup deferred and ppo -> grpo type-only, so only two
    assert cycle_lines(import_cycles(imports)) == [
        "relayrl.data_plane.memory -> relayrl.experience.data (line 1) ; "
        "relayrl.experience.data -> relayrl.data_plane.memory (line 2)",
        "relayrl.utils.a -> relayrl.utils.b (line 1) ; relayrl.utils.b -> relayrl.utils.a (line 1)",
    ]
    # with deferred imports: setup <-> ppo_setup, and worker -> data -> worker joins the data/memory cycle
    assert cycle_lines(import_cycles(imports, deferred=True)) == [
        "relayrl.algorithms.ppo_setup -> relayrl.algorithms.setup (line 1) ; "
        "relayrl.algorithms.setup -> relayrl.algorithms.ppo_setup (line 2) [function]",
        "relayrl.data_plane.memory -> relayrl.experience.data (line 1) ; "
        "relayrl.experience.data -> relayrl.data_plane.memory (line 2)",
        "relayrl.utils.a -> relayrl.utils.b (line 1) ; relayrl.utils.b -> relayrl.utils.a (line 1)",
    ]
    assert [str(i) for i in private_imports(imports)] == ["relayrl.algorithms.grpo -> relayrl.algorithms.ppo (line 2)"]
    # an unclassified top-level package is reported, not silently accepted
    write_tree(tmp_path, {"newpkg/x.py": ""})
    assert unclassified_modules(pkg) == ["relayrl.newpkg", "relayrl.newpkg.x"]


def test_checker_reports_algorithms_subclasses(tmp_path: Path) -> None:
    """The shape the asynchronous trainer had (a steps class subclassing the sync one) fails, however the base is
    named, and so does a rollout source built on a base; Protocols composing Protocols, a data holder specialising
    another, and classes deriving from outside relayrl.algorithms, pass."""
    pkg = write_tree(
        tmp_path,
        {
            "algorithms/grpo_sync.py": "class GRPOSyncSteps:\n    pass\n\n\nclass Local(GRPOSyncSteps):\n    pass\n",
            "algorithms/grpo_async.py": (
                "from relayrl.algorithms.grpo_sync import GRPOSyncSteps\n\n\n"
                "class GRPOAsyncSteps(GRPOSyncSteps):\n    pass\n"
            ),
            "algorithms/replay.py": (
                "from relayrl.algorithms import grpo_sync as gs\nimport relayrl.algorithms.ppo as ppo_module\n"
                "from .ppo import PPOSteps as Base\n\n\n"
                "class Replay(gs.GRPOSyncSteps):\n    pass\n\n\nclass PPOReplay(ppo_module.PPOSteps):\n    pass\n\n\n"
                "class Aliased(Base):\n    pass\n"
            ),
            "algorithms/ppo.py": "class PPOSteps:\n    pass\n",
            "algorithms/setup.py": "class Components:\n    pass\n\n\nclass DataPlaneComponents(Components):\n    pass\n",
            "algorithms/sources.py": ("class Helper:\n    pass\n\n\nclass ActorSource(Helper):\n    pass\n"),
            "algorithms/protocols.py": (
                "from typing import Protocol\n\n\nclass A(Protocol):\n    pass\n\n\nclass B(A, Protocol):\n    pass\n"
            ),
            "algorithms/errors.py": "import enum\n\n\nclass E(RuntimeError):\n    pass\n\n\nclass K(enum.Enum):\n    A = 1\n",
            "models/policy.py": "from relayrl.algorithms.ppo import PPOSteps\n\n\nclass Outside(PPOSteps):\n    pass\n",
        },
    )
    assert algorithms_subclasses(pkg) == [
        "relayrl.algorithms.grpo_async.GRPOAsyncSteps (line 4) subclasses relayrl.algorithms.grpo_sync.GRPOSyncSteps",
        "relayrl.algorithms.grpo_sync.Local (line 5) subclasses relayrl.algorithms.grpo_sync.GRPOSyncSteps",
        "relayrl.algorithms.replay.Aliased (line 14) subclasses relayrl.algorithms.ppo.PPOSteps",
        "relayrl.algorithms.replay.PPOReplay (line 10) subclasses relayrl.algorithms.ppo.PPOSteps",
        "relayrl.algorithms.replay.Replay (line 6) subclasses relayrl.algorithms.grpo_sync.GRPOSyncSteps",
        "relayrl.algorithms.sources.ActorSource (line 5) subclasses relayrl.algorithms.sources.Helper",
    ]


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("relayrl.cli.main", CLI),
        ("relayrl.algorithms.grpo", TRAINERS),
        ("relayrl.algorithms.setup", TRAINERS),
        ("relayrl.algorithms", TRAINERS),
        ("relayrl.algorithms.gae", CORE),
        ("relayrl.algorithms.kl", CORE),
        ("relayrl.models.policy.worker", CORE),
        ("relayrl.environments.math_env", CORE),
        ("relayrl.data_plane.memory", INFRA),
        ("relayrl.distributed.refit", INFRA),
        ("relayrl.utils.device", UTILS),
        ("relayrl.config", CONFIG),
        ("relayrl", None),
    ],
)
def test_layer_of(module: str, layer: int | None) -> None:
    assert layer_of(module) == layer


# --------------------------------------------------------------------------------------------- class structure


def test_no_model_class_has_two_method_bearing_bases() -> None:
    """Composition over multiple inheritance in relayrl/models (issue 25): see `tests/architecture_classes.py`."""
    classes, unresolved = scan_classes(module_names(ROOT), PACKAGE)
    assert not unresolved, report("relayrl bases that could not be resolved", unresolved)
    bad = multiple_behaviour_bases(classes, f"{PACKAGE}.models.")
    assert not bad, report("classes with two or more method-bearing bases (hold one as a component instead)", bad)


def test_class_checker_flags_diamonds_and_spares_interfaces(tmp_path: Path) -> None:
    pkg = write_tree(
        tmp_path,
        {
            "models/base.py": (
                "from abc import ABC, abstractmethod\nfrom typing import Generic, Protocol, TypeVar\n"
                "W = TypeVar('W')\n"
                "class Facade(Generic[W]):\n    def train(self):\n        return 1\n"
                "class Iface(ABC):\n    @abstractmethod\n    def train(self):\n        '''Doc.'''\n"
                "class Seam(Protocol):\n    def fetch(self) -> int:\n        return 0\n"
                "class Marker:\n    def hook(self) -> None:\n        ...\n"
            ),
            "models/__init__.py": "from relayrl.models.base import Facade\n",
            "models/impl.py": (
                "from torch import nn\nfrom relayrl.models import Facade\nfrom relayrl.models import base\n"
                "class Policy(Facade[int], base.Iface):\n    pass\n"  # one concrete base, one interface
                "class TQFacade(Facade[int]):\n    def shutdown(self):\n        return True\n"
                "class TQPolicy(TQFacade, Policy):\n    pass\n"  # the diamond: both bases bring methods
                "class Ok(base.Seam, base.Marker, Policy):\n    pass\n"  # Protocol + trivial + one concrete
                "class Err(Policy, RuntimeError):\n    pass\n"  # a builtin mixed in
                "class Net(nn.Module, Facade):\n    pass\n"  # an external class brings methods
                "class Lost(base.Missing):\n    pass\n"
            ),
        },
    )
    classes, unresolved = scan_classes(module_names(pkg), PACKAGE)
    assert unresolved == ["relayrl.models.impl.Lost: base base.Missing"]
    assert multiple_behaviour_bases(classes, "relayrl.models.") == [
        "relayrl.models.impl.Net (line 15): external:torch.nn.Module, relayrl.models.base.Facade",
        "relayrl.models.impl.TQPolicy (line 9): relayrl.models.impl.TQFacade, relayrl.models.impl.Policy",
    ]
