"""docs/integrations.md's recipes run as pasted: every ``python`` code block not marked ``# Fragment``, in the
page's order, in one empty folder. A block that imports a framework missing here is skipped, and so is a block
that starts with ``# after`` (it reads what an earlier recipe wrote) when a block before it in its section did
not pass."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def recipes():
    """(section heading, code) for each runnable block, in order."""
    found, section = [], ""
    for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S):
        if match.group(1):
            section = match.group(1).strip()
        elif not match.group(2).startswith("# Fragment"):
            found.append((section, match.group(2)))
    return found


RECIPES = recipes()
PASSED = set()


def imported_modules(code: str):
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("recipes")


@pytest.mark.parametrize(
    "index", range(len(RECIPES)), ids=[f"{i}-{section.split()[0]}" for i, (section, _) in enumerate(RECIPES)]
)
def test_recipe_runs_as_pasted(index, folder, monkeypatch):
    section, code = RECIPES[index]
    for module in imported_modules(code):
        pytest.importorskip(module, reason=f"the recipe imports {module}", exc_type=ImportError)
    if code.startswith("# after"):
        earlier = [i for i, (s, _) in enumerate(RECIPES[:index]) if s == section]
        if not set(earlier) <= PASSED:
            pytest.skip("an earlier recipe of its section, whose files it reads, did not run")
    monkeypatch.chdir(folder)
    exec(compile(code, f"{DOC.name}, {section}, block {index}", "exec"), {"__name__": "__main__"})
    PASSED.add(index)
