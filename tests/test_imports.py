"""The import structure of ``megarl``: imports run one way (DESIGN.md's order), lazy imports inside functions
included (those under ``if TYPE_CHECKING:`` name types for annotations and never run), so no two modules and no
two packages import each other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"


def _imports(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the megarl modules it imports anywhere in its source (``from megarl.x import y`` counts
    ``megarl.x`` and, when it is a module, ``megarl.x.y``); with ``type_only``, those under ``if TYPE_CHECKING:``
    too."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps: set[str] = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only and not type_only:  # `if TYPE_CHECKING:`: names for annotations, not run
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megarl"):
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("megarl")}
        found[name] = deps
    return {m: {d for d in deps if d in found and d != m} for m, deps in found.items()}


def test_no_module_circles_through_type_only_imports():
    """Annotations do not tie modules in a loop either: megarl.models.spec imports the family modules (its methods
    call their hooks), which annotated their ``spec`` arguments with ``ModelSpec`` under ``if TYPE_CHECKING:``; they
    take :class:`megarl.models.spec_protocol.SpecLike` now."""
    edges = _imports(type_only=True)
    assert sorted({tuple(sorted((a, b))) for a, deps in edges.items() for b in deps if a in edges[b]}) == []


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def test_no_import_circles():
    """Issue 24: ``megarl.cli`` <-> ``megarl.bench.reshard`` (argument helpers), ``megarl.parallel.launch`` <->
    ``megarl.parallel.mesh`` (``free_port``), and ``trainer`` <-> ``bench`` (the trainer imported the bench
    package's FLOP and throughput accounting, now :mod:`megarl.measure`, below both)."""
    edges = _imports()
    modules = sorted({tuple(sorted((a, b))) for a, deps in edges.items() for b in deps if a in edges[b]})
    assert modules == [], modules

    def package(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    packages: dict[str, set[str]] = {}
    for a, deps in edges.items():
        packages.setdefault(package(a), set()).update(package(b) for b in deps if package(b) != package(a))
    mutual = sorted({tuple(sorted((a, b))) for a, deps in packages.items() for b in deps if a in packages.get(b, ())})
    assert mutual == [], mutual
