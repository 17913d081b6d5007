"""The class-structure check behind `tests/test_architecture.py` (issue 25): composition over multiple inheritance.

A class may have at most one base that brings methods with it. A second behaviour-bearing base (a diamond like
`TQPolicy(TQFacade, Policy)`) mixes two implementations into one namespace, where the MRO decides silently which
`shutdown` or `train` runs; holding the second object as a component keeps every forwarded call explicit.

Every module under relayrl/ is parsed (nothing is imported) and each class's bases are resolved through the module's
own classes and its `from relayrl... import` names (following package re-exports). A base brings no methods when it
is a typing construct (`Protocol`, `Generic`, `TypedDict`, `NamedTuple`, `ABC`, `object`), a builtin (exception
classes mixed in for `except` compatibility), a Protocol, or a relayrl class whose own functions are all abstract or
trivial (a docstring, `...`, `pass`) and whose bases bring none either. Any other base outside relayrl (`nn.Module`,
`torch.autograd.Function`, ...) brings methods. A relayrl name that cannot be resolved is reported, never skipped.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass
from pathlib import Path

#: Bases that only declare an interface or a typing role.
INTERFACE_NAMES = frozenset({"Protocol", "Generic", "TypedDict", "NamedTuple", "ABC", "object"})


@dataclass
class ClassInfo:
    module: str
    name: str
    line: int
    bases: list[str]  # resolved: "relayrl.x.Cls", or "external:<dotted source>"
    concrete: bool  # defines at least one function that is neither abstract nor trivial
    protocol: bool

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


def _base_expr(node: ast.expr) -> ast.expr:
    return node.value if isinstance(node, ast.Subscript) else node  # Generic[T], ModelFacade[W] -> the class


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def _trivial(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return all(
        isinstance(s, ast.Pass)
        or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and s.value.value is ...)
        for s in body
    )


def _abstract(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(_dotted(d) in ("abstractmethod", "abc.abstractmethod") for d in fn.decorator_list)


def _imported_names(module: str, tree: ast.Module, is_package: bool) -> dict[str, str]:
    """Local name -> dotted source (`from a.b import C as D` gives D -> a.b.C; `import a.b as m` gives m -> a.b)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                out[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
    return out


def scan_classes(files: dict[str, Path], package: str) -> tuple[dict[str, ClassInfo], list[str]]:
    """Every top-level class of every module (`files`: dotted name -> path), bases resolved; plus unresolved bases."""
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in files.items()}
    names = {m: _imported_names(m, t, files[m].name == "__init__.py") for m, t in trees.items()}
    classes = {m: {n.name for n in t.body if isinstance(n, ast.ClassDef)} for m, t in trees.items()}
    unresolved: list[str] = []

    def resolve(module: str, dotted: str, depth: int = 0) -> str | None:
        head, _, rest = dotted.partition(".")
        if not rest and head in classes.get(module, ()):
            return f"{module}.{head}"
        source = names.get(module, {}).get(head)
        if source is None:
            return None if head in classes.get(module, ()) or depth else f"external:{dotted}"
        full = f"{source}.{rest}" if rest else source
        if not (full == package or full.startswith(package + ".")):
            return f"external:{full}"
        owner, _, cls = full.rpartition(".")
        if owner in files and depth < 8:
            return resolve(owner, cls, depth + 1)  # a class of that module, or a name it re-exports
        return None

    out: dict[str, ClassInfo] = {}
    for module, tree in trees.items():
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for b in node.bases:
                dotted = _dotted(_base_expr(b))
                target = None if dotted is None else resolve(module, dotted)
                if target is None:
                    unresolved.append(f"{module}.{node.name}: base {ast.unparse(b)}")
                else:
                    bases.append(target)
            fns = [f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            concrete = any(not _abstract(f) and not _trivial(f) for f in fns)
            protocol = any(b.rpartition(".")[2].rpartition(":")[2] == "Protocol" for b in bases)
            out[f"{module}.{node.name}"] = ClassInfo(module, node.name, node.lineno, bases, concrete, protocol)
    return out, unresolved


def brings_methods(base: str, classes: dict[str, ClassInfo]) -> bool:
    """Whether inheriting from `base` (a resolved name) brings method implementations."""
    if base.startswith("external:"):
        last = base.rpartition(".")[2].rpartition(":")[2]
        return not (last in INTERFACE_NAMES or (base.count(".") == 0 and hasattr(builtins, last)))
    info = classes[base]
    if info.protocol:
        return False
    return info.concrete or any(brings_methods(b, classes) for b in info.bases)


def multiple_behaviour_bases(classes: dict[str, ClassInfo], prefix: str) -> list[str]:
    """`module.Class (line N): A, B` for every class under `prefix` with two or more method-bearing bases."""
    bad = []
    for qualname, info in sorted(classes.items()):
        if not qualname.startswith(prefix):
            continue
        heavy = [b for b in info.bases if brings_methods(b, classes)]
        if len(heavy) > 1:
            bad.append(f"{qualname} (line {info.line}): {', '.join(heavy)}")
    return bad
