"""The import-structure checker behind tests/test_architecture.py (its docstring states the rules): every module
under relayrl/ parsed with ast, its relayrl imports classified by layer, cycles and private-name imports found."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "relayrl"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: relayrl.algorithms.<name> modules that hold pure math (losses, advantages, GAE, ...): the core layer.
MATH_MODULES = frozenset(
    {
        "advantages",
        "gae",
        "loss_functions",
        "value_loss",
        "logprob_error",
        "reward_functions",
        "utils",
        "interfaces",
        "kl",
        "shaping",
    }
)
#: Layer ranks, top (highest) to bottom.
CLI, TRAINERS, CORE, INFRA, UTILS, CONFIG = 5, 4, 3, 2, 1, 0
LAYER_NAMES = {
    CLI: "cli",
    TRAINERS: "trainers",
    CORE: "core",
    INFRA: "infrastructure",
    UTILS: "utils",
    CONFIG: "config",
}
#: Top-level packages / modules -> layer (relayrl.algorithms is split by MATH_MODULES).
TOP_LEVEL = {
    "cli": CLI,
    "models": CORE,
    "experience": CORE,
    "environments": CORE,
    "data_plane": INFRA,
    "distributed": INFRA,
    "utils": UTILS,
    "config": CONFIG,
}
#: Core packages a math module must not import from.
NOT_FOR_MATH = ("models", "experience", "environments")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a relayrl module (the package itself for `from relayrl import __version__`)
    line: int
    kind: str  # "module" (runs when the importer is imported), "function", "type_checking" or "dynamic"
    names: tuple[str, ...] = ()  # `from X import a, b`: the names that are not submodules

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} (line {self.line})"


def module_names(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root` (the directory of `package`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def imports_of(module: str, path: Path, known: Iterable[str], package: str = PACKAGE) -> list[Import]:
    """The imports of relayrl modules in one file, resolved to module names (`from a import b` is a.b when a.b is a
    module), each with its line and kind."""
    known = set(known)
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    docstrings = _docstring_nodes(tree)
    found: list[Import] = []

    def add(target: str, line: int, kind: str, names: tuple[str, ...] = ()) -> None:
        if target == package or target.startswith(package + "."):
            while target not in known and "." in target:  # `import relayrl.x.y.attr`-like forms: the module
                target = target.rsplit(".", 1)[0]
            found.append(Import(module, target, line, kind, names))

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        kind = "type_checking" if type_checking else "function" if in_function else "module"
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, kind)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = module.split(".") if is_package else module.split(".")[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            plain = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    add(sub, node.lineno, kind)
                else:
                    plain.append(alias.name)
            if plain:
                add(base, node.lineno, kind, tuple(plain))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(package + ".")
            and node.value in known
            and id(node) not in docstrings
        ):
            add(node.value, node.lineno, "dynamic")  # importlib.import_module("relayrl...."): a dynamic import
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                visit(child, in_function, True)
            else:
                visit(
                    child,
                    in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda),
                    type_checking,
                )

    visit(tree, False, False)
    return found


def layer_of(module: str, package: str = PACKAGE) -> int | None:
    """The layer rank of a relayrl module; None for the exempt package root and for an unclassified module."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if parts[0] == "algorithms":
        return CORE if len(parts) > 1 and parts[1] in MATH_MODULES else TRAINERS
    return TOP_LEVEL.get(parts[0])


def is_math(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 2 and parts[1] == "algorithms" and parts[2] in MATH_MODULES


def scan(root: Path = ROOT, package: str = PACKAGE) -> list[Import]:
    known = module_names(root, package)
    return [
        imp for module, path in known.items() if module != package for imp in imports_of(module, path, known, package)
    ]


def unclassified_modules(root: Path = ROOT, package: str = PACKAGE) -> list[str]:
    return [m for m in module_names(root, package) if m != package and layer_of(m, package) is None]


def layer_violations(imports: Iterable[Import]) -> list[Import]:
    """Imports that run against the layer order, and math modules importing models / experience / environments."""
    bad = []
    for imp in imports:
        src, dst = layer_of(imp.importer), layer_of(imp.imported)
        if src is None or dst is None or imp.importer == imp.imported:
            continue  # the exempt package root (unclassified modules are reported on their own)
        upward = dst > src
        math_rule = is_math(imp.importer) and (imp.imported.split(".")[1] in NOT_FOR_MATH or dst == TRAINERS)
        if upward or math_rule:
            bad.append(imp)
    return sorted(set(bad), key=lambda i: (i.importer, i.line, i.imported))


def private_imports(imports: Iterable[Import]) -> list[Import]:
    """`from relayrl.x import _name` in another module than relayrl.x: reaching into a module's private names."""
    return sorted(
        {i for i in imports if i.importer != i.imported and any(n.startswith("_") for n in i.names)},
        key=lambda i: (i.importer, i.line),
    )


def _is_protocol(node: ast.ClassDef) -> bool:
    return any((isinstance(b, ast.Name) and b.id == "Protocol") or (isinstance(b, ast.Attribute) and b.attr == "Protocol")
               for b in node.bases)  # fmt: skip


TRAINER_PARTS = ("Steps", "Source")
"""Name endings of a trainer's step classes and its rollout sources: the classes that must not specialise another."""


def algorithms_subclasses(root: Path = ROOT, package: str = PACKAGE) -> list[str]:
    """Classes of relayrl.algorithms modules with a base class defined in a relayrl.algorithms module (Protocols
    excepted) where either is a trainer part (a `...Steps` or `...Source` class), each as `module.Class (line N)
    subclasses module.Base`. A base is found by its name: a class of the same module, one imported by
    `from ... import Name`, or `module.Name` for an imported module. Plain data holders may specialise a generic
    base (the set-up's `DataPlaneComponents` is `RunComponents` with the data-plane Protocols)."""
    known = module_names(root, package)
    prefix = f"{package}.algorithms"
    modules = {m: p for m, p in known.items() if m == prefix or m.startswith(prefix + ".")}
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in modules.items()}
    classes = {m: {n.name for n in t.body if isinstance(n, ast.ClassDef)} for m, t in trees.items()}
    bad = []
    for module, tree in trees.items():
        names = {c: f"{module}.{c}" for c in classes[module]}  # a name in this module -> the algorithms class it is
        aliases: dict[str, str] = {}  # a name bound to an algorithms module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                is_package = modules[module].name == "__init__.py"
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)] if node.level else []
                base = ".".join(parts + ([node.module] if node.module else [])) if node.level else node.module or ""
                for alias in node.names:
                    bound = alias.asname or alias.name
                    if f"{base}.{alias.name}" in classes:
                        aliases[bound] = f"{base}.{alias.name}"
                    elif alias.name in classes.get(base, ()):
                        names[bound] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in classes and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or _is_protocol(node):
                continue
            for b in node.bases:
                b = b.value if isinstance(b, ast.Subscript) else b  # Generic-style `Base[T]`
                found = None
                if isinstance(b, ast.Name):
                    found = names.get(b.id)
                elif isinstance(b, ast.Attribute):
                    owner = ast.unparse(b.value)
                    owner = aliases.get(owner, owner)
                    found = f"{owner}.{b.attr}" if b.attr in classes.get(owner, ()) else None
                if found is not None and (node.name.endswith(TRAINER_PARTS) or found.endswith(TRAINER_PARTS)):
                    bad.append(f"{module}.{node.name} (line {node.lineno}) subclasses {found}")
    return sorted(bad)


def import_cycles(imports: Iterable[Import], deferred: bool = False) -> list[list[Import]]:
    """One shortest cycle (as its edges) per strongly connected group of modules that import each other.

    Edges: the imports that run when a module is imported (module level, outside `if TYPE_CHECKING:`); with
    `deferred`, also function-level and dynamic ones (a cycle of modules that need each other, one side deferring
    its import to dodge the import-time error). Module-level edges are preferred when reporting."""
    kinds = ("module", "function", "dynamic") if deferred else ("module",)
    edges: dict[str, dict[str, Import]] = {}
    for imp in sorted(imports, key=lambda i: (i.kind != "module", i.line)):
        if imp.kind in kinds and imp.importer != imp.imported:
            edges.setdefault(imp.importer, {}).setdefault(imp.imported, imp)
    cycles = []
    for component in _strongly_connected(edges):
        if len(component) < 2:
            continue
        start = min(component)
        cycles.append(_shortest_cycle(start, edges, component))
    return sorted(cycles, key=lambda c: c[0].importer)


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative."""
    nodes = sorted(set(edges) | {d for targets in edges.values() for d in targets})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def _shortest_cycle(start: str, edges: dict[str, dict[str, Import]], component: set[str]) -> list[Import]:
    """Breadth-first from `start` back to itself inside its component."""
    parent: dict[str, Import] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        for child, imp in sorted(edges.get(node, {}).items()):
            if child not in component:
                continue
            if child == start:
                path = [imp]
                while path[0].importer != start:
                    path.insert(0, parent[path[0].importer])
                return path
            if child not in seen:
                seen.add(child)
                parent[child] = imp
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")  # unreachable for a component of two or more


def report(title: str, lines: Iterable[str]) -> str:
    body = "\n".join(f"  {line}" for line in lines)
    print(f"{title}:\n{body}")
    return f"{title}:\n{body}"
