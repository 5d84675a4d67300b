"""benchmarks/tune_fused.py: its grid of settings and how each reaches the kernels' modules (the timing itself needs
CUDA: one small run where a GPU is present)."""

import pytest
import torch
from benchmark_scripts import load_benchmark

pytest.importorskip("triton")
tune = load_benchmark("tune_fused")

from torchao_optim.kernels import tables, triton_rank1  # noqa: E402
from torchao_optim.optim import fused  # noqa: E402


@pytest.fixture
def kernel_settings(monkeypatch):
    """Every module setting apply() writes, restored after the test."""
    for module, name in [(triton_rank1, "STATS_TILES"), (tables, "FLAT_MAX_BITS")] + [
        (fused, name) for name in ("ITERS", "PREFETCH", "NUM_WARPS", "TAIL_TILES_PER_SM", "FOLD_ROWS", "PDL", "MAXNREG")
    ]:
        monkeypatch.setattr(module, name, getattr(module, name))


# two values of every option of the grid, as the command line spells them, and as grid() gives them
TWO_OF_EACH = {
    "iters": ("1,8", {1, 8}),
    "prefetch": ("0,1", {False, True}),
    "warps": ("1,2", {1, 2}),
    "maxnreg": ("auto,96", {"auto", "96"}),
    "tail": ("0,32", {0, 32}),
    "pdl": ("0,1", {0, 1}),
    "flat_bits": ("0,7", {0, 7}),
    "fold_rows": ("0,8", {0, 8}),
    "stats_strip": ("auto,16", {"auto", "16"}),
    "stats_rows": ("auto,2", {"auto", "2"}),
    "stats_maxnreg": ("auto,0", {"auto", "0"}),
    "stats_grouped": ("auto,1", {"auto", "1"}),
}


def test_grid_is_every_combination_of_every_option():
    assert set(tune.Settings._fields) == set(TWO_OF_EACH)
    argv = [x for name, (text, _) in TWO_OF_EACH.items() for x in ("--" + name.replace("_", "-"), text)]
    points = tune.grid(tune.parse_args(argv))
    assert len(set(points)) == len(points) == 2 ** len(TWO_OF_EACH)
    for name, (_, values) in TWO_OF_EACH.items():  # each option reaches its own field
        assert {getattr(p, name) for p in points} == values, name


def test_apply_sets_each_module_setting(kernel_settings):
    tiles = dict(triton_rank1.STATS_TILES)
    args = tune.parse_args(
        ["--iters", "4", "--prefetch", "0", "--warps", "2", "--maxnreg", "96", "--tail", "16", "--pdl", "0"]
        + ["--flat-bits", "0", "--fold-rows", "8", "--stats-strip", "16", "--stats-rows", "2", "--stats-maxnreg", "0"]
        + ["--stats-grouped", "1"]
    )
    (point,) = tune.grid(args)
    tune.apply(point, tiles)
    assert (fused.ITERS, fused.PREFETCH, fused.NUM_WARPS, fused.MAXNREG) == (4, False, 2, 96)
    assert (fused.TAIL_TILES_PER_SM, fused.FOLD_ROWS, fused.PDL, tables.FLAT_MAX_BITS) == (16, 8, False, 0)
    for kind, tile in triton_rank1.STATS_TILES.items():
        assert (tile.strip, tile.rows, tile.maxnreg, tile.grouped) == (16, 2, None, True)
        assert (tile.cols, tile.warps, tile.rowwise) == (tiles[kind].cols, tiles[kind].warps, tiles[kind].rowwise)
    # "auto" keeps the tiles' own values, and the register cap of the step kernels the planner's choice
    tune.apply(tune.grid(tune.parse_args(["--iters", "8", "--prefetch", "1", "--warps", "1"]))[0], tiles)
    assert triton_rank1.STATS_TILES == tiles
    assert fused.MAXNREG is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tune_fused.py times the fused kernels on CUDA")
def test_tune_fused_runs_on_cuda(kernel_settings, monkeypatch, capsys):
    monkeypatch.setattr(
        "sys.argv",
        ["tune_fused.py", "--geometry", "gpt25m", "--state-format", "4bit_rank1", "--iters", "8", "--prefetch", "1"]
        + ["--warps", "1", "--stats-rows", "2,4", "--stats-grouped", "1", "--steps", "2"],
    )
    tune.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 2 and {row.split("|")[10].strip() for row in rows} == {"2", "4"}
