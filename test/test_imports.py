"""Imports flow one way between the package's layers (docs/design.md, "Architecture").

Read statically from the source (``ast``: no module is executed), counting every import wherever it is written,
in a function body as much as at the top of a file: a function-level import is still a dependency, only a later
one. A module may import its own layer and the layers below it, never one above, and no two subpackages may
import each other in a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "torchao_optim"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
# lowest first: codebooks and encoder tables, formats, update rules as data, kernels (leaves: they know layouts and
# rules as data, never optimizers), optimizers (planning, executors), the shared test cases, then the public API
LAYERS = ("quant", "state", "rules", "kernels", "optim", "testing", "", "__main__")  # "": torchao_optim/__init__.py


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, tuple[str, bool]]:
    """Every module of the package: its name -> (its source, whether it is a package's ``__init__``)."""
    return {_module_name(path): (path.read_text(), path.name == "__init__.py") for path in sorted(ROOT.rglob("*.py"))}


def _layer(module: str) -> str:
    """The subpackage of ``torchao_optim.<layer>.…`` ("" for the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(sources: dict[str, tuple[str, bool]]) -> list[tuple[str, int, str]]:
    """``(importing module, line, imported module)`` for every import of a module of the package in ``sources``
    (as :func:`_sources` gives them)."""
    found = []
    for name, (source, is_package) in sources.items():
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package, up level - 1 packages
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                # ``from a import b`` imports module a.b where there is one, else a name of a
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else base for alias in node.names
                ]
            else:
                continue
            found += [(name, node.lineno, t) for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")]
    return list(dict.fromkeys(found))  # one per imported module and line


def upward_imports(edges) -> list[str]:
    bad = []
    for importer, line, imported in edges:
        low, high = _layer(importer), _layer(imported)
        for layer in (low, high):
            assert layer in LAYERS, f"{PACKAGE}.{layer} is in no layer of test_imports.LAYERS: give it its place"
        if LAYERS.index(high) > LAYERS.index(low):
            bad.append(
                f"{importer} (line {line}) imports {imported}: {low} may not import {high or PACKAGE} "
                f"(the order is {' -> '.join(x or PACKAGE for x in LAYERS)})"
            )
    return bad


def subpackage_cycles(edges) -> list[str]:
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for importer, line, imported in edges:
        a, b = _layer(importer), _layer(imported)
        if a != b:
            graph.setdefault(a, set()).add(b)
            where.setdefault((a, b), f"{importer} (line {line}) imports {imported}")
    cycles, seen = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt) :] + [nxt]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(
                        " -> ".join(x or PACKAGE for x in cycle)
                        + ": "
                        + "; ".join(where[(x, y)] for x, y in zip(cycle, cycle[1:]))
                    )
            else:
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def test_the_checks_see_function_level_and_relative_imports():
    sources = {
        "torchao_optim.kernels": ("from . import x\n", True),
        "torchao_optim.kernels.x": ("import torch\n\ndef f():\n    from ..optim.fused import plan_group\n", False),
        "torchao_optim.optim.fused": ("", False),
        "torchao_optim.optim.y": ("import torchao_optim.kernels.x as x\n", False),
    }
    edges = imports(sources)
    assert sorted(edges) == [
        ("torchao_optim.kernels", 1, "torchao_optim.kernels.x"),
        ("torchao_optim.kernels.x", 4, "torchao_optim.optim.fused"),
        ("torchao_optim.optim.y", 1, "torchao_optim.kernels.x"),
    ]
    assert upward_imports(edges) == [
        "torchao_optim.kernels.x (line 4) imports torchao_optim.optim.fused: kernels may not import optim (the "
        "order is quant -> state -> rules -> kernels -> optim -> testing -> torchao_optim -> __main__)"
    ]
    assert subpackage_cycles(edges) == [
        "kernels -> optim -> kernels: torchao_optim.kernels.x (line 4) imports torchao_optim.optim.fused; "
        "torchao_optim.optim.y (line 1) imports torchao_optim.kernels.x"
    ]


def test_no_module_imports_a_higher_layer():
    bad = upward_imports(imports(_sources()))
    assert not bad, "imports against the layers' order:\n" + "\n".join(bad)


def test_no_cycle_between_subpackages():
    cycles = subpackage_cycles(imports(_sources()))
    assert not cycles, "subpackages that import each other:\n" + "\n".join(cycles)
