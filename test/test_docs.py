"""Every ``python`` code block of README.md, CONTRIBUTING.md and docs/*.md runs as pasted.

Each block runs in a fresh Python process, as a reader pastes it: in an empty folder, on the CPU, with this
checkout first on the path, with a time limit. Two markers on a block's first line (CONTRIBUTING.md, "Code blocks
in the documentation"):

- ``# Fragment: <why>``: a piece of a larger program (it needs a GPU, torchrun, a download, names defined
  elsewhere); it is only compiled, so that it is at least valid Python;
- ``# after <what>``: it reads files that the blocks before it in its section (``## `` heading) wrote; those
  run first, in the same folder.

A block that imports a package missing here (an optional framework) is skipped, naming it. docs/integrations.md's
recipes train under the frameworks (about 10 s each on a 2-core CPU): they are marked slow here, since
test/integrations/test_docs_recipes.py runs them, in page order, in every run of the suite.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SLOW_PAGES = {"docs/integrations.md"}
TIMEOUT_S = 180
# a reader pastes a block to see a result: a few lines, not a screenful of numbers
MAX_STDOUT_CHARS = 2000


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    section: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def fragment(self) -> bool:
        return self.code.startswith("# Fragment")

    @property
    def after(self) -> bool:
        return self.code.startswith("# after")


def blocks_of(path: Path) -> list[Block]:
    """The ``python`` fenced blocks of a Markdown page, with the line of each fence and its ``## `` section."""
    page = path.relative_to(ROOT).as_posix()
    found, section, lines, i = [], "", path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"{page}:{i + 1}: a code block that is never closed"
            if line.strip() == "```python":
                found.append(Block(page, i + 1, section, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


def missing_imports(code: str) -> list[str]:
    """Top-level packages the code imports that are not installed here."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


def reader_environment() -> dict[str, str]:
    """A reader's environment: this checkout first on the path, the CPU, nothing downloaded, and none of the test
    session's settings (conftest.py sets TRITON_INTERPRET, which would run ``fused=True`` in Triton's interpreter).
    One intra-op thread: the blocks' models are small, and on a shared 2-core machine a second thread costs more in
    waiting than it saves; no block's result depends on the thread count."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(
        PYTHONPATH=str(ROOT),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return env


def run_block(block: Block, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=folder,
        env=reader_environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def run_with_earlier(block: Block, folder: Path) -> list[tuple[Block, subprocess.CompletedProcess]]:
    """Run ``block`` in ``folder``; an ``# after`` block after the runnable blocks before it in its section. Stops
    at the first that fails."""
    chain = [block]
    if block.after:
        chain = [
            b
            for b in BLOCKS
            if b.page == block.page and b.section == block.section and b.line < block.line and not b.fragment
        ] + chain
    done = []
    for b in chain:
        done.append((b, run_block(b, folder)))
        if done[-1][1].returncode != 0:
            break
    return done


def runnable(block: Block) -> bool:
    return not block.fragment and not missing_imports(block.code)


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory):
    """Each selected runnable block's run, started in the background in the tests' order, a few at a time: every
    block is a process of its own, mostly importing torch, so while a test waits for its block the next runs."""
    selected = [
        item.callspec.params["block"]
        for item in request.session.items
        if item.module is request.module
        and "block" in getattr(getattr(item, "callspec", None), "params", {})
        and item.get_closest_marker("skip") is None
    ]
    pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))
    futures = {
        b.id: pool.submit(run_with_earlier, b, tmp_path_factory.mktemp(re.sub(r"\W", "_", b.id)))
        for b in selected
        if runnable(b)
    }
    yield futures
    pool.shutdown(cancel_futures=True)


def _params():
    for block in BLOCKS:
        marks = [pytest.mark.slow] if block.page in SLOW_PAGES else []
        yield pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", _params())
def test_block_runs_as_pasted(block: Block, ran):
    if block.fragment:
        compile(block.code, block.id, "exec")  # a fragment is at least valid Python
        return
    missing = missing_imports(block.code)
    if missing:
        pytest.skip(f"{block.id} imports {', '.join(missing)}, not installed here")
    try:
        done = ran[block.id].result()
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id} (or a block it runs after) ran for more than {TIMEOUT_S} s: {e}")
    for b, proc in done[:-1]:
        assert proc.returncode == 0, f"{b.id}, which {block.id} runs after, failed:\n{proc.stderr[-3000:]}"
    proc = done[-1][1]
    assert proc.returncode == 0, f"{block.id} failed as pasted:\n{proc.stderr[-3000:]}"
    assert len(proc.stdout) <= MAX_STDOUT_CHARS, (
        f"{block.id} printed {len(proc.stdout)} characters (at most {MAX_STDOUT_CHARS}: print something short that "
        f"shows the point):\n{proc.stdout[:500]}..."
    )


def test_every_page_is_read():
    """The blocks are found: every page with a ``python`` fence yields as many blocks as it has fences, and a
    fragment says why it is one."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fences = len(re.findall(r"^```python$", text, re.M))
        assert len(blocks_of(page)) == fences, page
    assert BLOCKS
    for block in BLOCKS:
        if block.fragment:
            first = block.code.splitlines()[0]
            assert re.match(r"# Fragment: \S", first), f"{block.id}: '# Fragment: <why>', got {first!r}"


def test_every_optimizer_documents_its_arguments():
    """``help()`` of every public optimizer lists each constructor argument under ``Args:`` as torch.optim's do,
    one ``name (type): meaning`` entry each, rather than pointing to another class for some."""
    import inspect

    import torch

    import torchao_optim

    optimizers = [
        getattr(torchao_optim, name)
        for name in torchao_optim.__all__
        if isinstance(getattr(torchao_optim, name), type)
        and issubclass(getattr(torchao_optim, name), torch.optim.Optimizer)
    ]
    assert {"Adam", "AdamW8bit", "AdamW4bit", "AdamWFp8", "SGD8bit", "Lion8bit", "Muon8bit"} <= {
        cls.__name__ for cls in optimizers
    }
    undocumented = {}
    for cls in optimizers:
        doc = inspect.getdoc(cls) or ""
        args = doc.split("\nArgs:\n", 1)[1] if "\nArgs:\n" in doc else ""
        names = [n for n in inspect.signature(cls).parameters if n != "self"]
        missing = [n for n in names if not re.search(rf"^    {n} \([^)]*\): \S", args, re.M)]
        if missing:
            undocumented[cls.__name__] = missing
    assert not undocumented, f"arguments without an 'Args:' entry: {undocumented}"
