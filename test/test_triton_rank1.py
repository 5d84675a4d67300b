"""Scales over a whole matrix on the Triton kernels: rank-1 scales ("4bit_rank1": the first pass's row and column
maxima, the step's decode with the old ones and encode with the new) and factored states ("factored", "factored4": the
first pass's fp64 row and column sums, the step's decode with the old means and no codes written, the new means stored
last), in every kernel (one, two and three states), equal the compiled path's codes, maxima and means bit for bit, at
the edges: fewer columns than a tile, a row ending inside a tile, an all-zero row, a subnormal scale. In Triton's
interpreter on a machine without CUDA (conftest.py); on CUDA, on the GPU."""

from __future__ import annotations

import pytest
import torch

from torchao_optim import Adagrad8bit, AdamW
from torchao_optim.optim import fused
from torchao_optim.optim.fused import fused_available
from torchao_optim.state import QuantizedState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not fused_available(torch.device(DEVICE)), reason="needs CUDA, or Triton's interpreter (TRITON_INTERPRET=1)"
)
# (300, 7): 150 tiles of the first pass down one column of tiles, each row ending inside a tile
SHAPES = ((37, 5), (3, 1000), (64, 128), (2, 3, 40), (300, 7)) + (
    ((600, 700),) if DEVICE == "cuda" else ()
)  # many strips on a GPU
STEPS = 3
FORMATS = ("4bit_rank1", "factored", "factored4")
RULES = {
    "adamw": (lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, **kw), 2),
    "adamw-amsgrad-maximize": (lambda ps, **kw: AdamW(ps, lr=1e-2, amsgrad=True, maximize=True, **kw), 3),
    "adagrad": (lambda ps, **kw: Adagrad8bit(ps, lr=1e-2, **kw), 1),
}


# rows of whole tiles (128 columns), each in one block: the first pass's vector loads (ALIGNED)
ALIGNED_SHAPES = ((5, 256), (70, 128), (2, 3, 128))
# rows of whole step tiles (256 columns): factored sums in the step itself (FOLD), no first pass; 40 rows are a strip
# of FOLD_ROWS (32) and one of 8, two strips side by side
STRIP_SHAPES = ((5, 256), (40, 512), (2, 2, 256))
# the same kind of rows, every row count a multiple of 4: rank-1 scales' columns then at 16-byte boundaries (vectors)
ROW_SHAPES = ((4, 256), (12, 512), (4, 2, 256))


def _train(make, fused, fmt, shapes=SHAPES):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    opt = make(params, fused=fused, compile=False, state_format=fmt, min_quant_size=0)
    for step in range(STEPS):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            rows = g.view(g.shape[0], -1)
            rows[0] = 0.0  # an all-zero row: its maximum (or mean) and scales 0
            rows[1] *= 3e-20  # a second moment of order 1e-42: a subnormal scale (the 2**64 lift)
            if step == 1:  # non-finite gradient elements: skipped, their old values counted in the new statistics
                rows[-1, -1], rows[-1, 0] = float("nan"), float("inf")
            p.grad = g.to(DEVICE)
        opt.step()
    return params, opt


# Every rule at the edges; AdamW alone on rows of whole tiles in CI (the vector loads are the rule's inputs, the same
# for every rule), the other rules there with --runslow; on strips, the factored formats with the rules of two and three
# states (sums in the step); rank-1 scales and one state, which take the first pass there too, with --runslow.
CASES = [
    pytest.param(name, shapes_id, fmt, marks=marks)
    for fmt in FORMATS
    for name, (_, n) in RULES.items()
    for shapes_id, marks in (
        ("edges", ()),
        ("aligned", () if name == "adamw" else pytest.mark.slow),
        ("strips", () if n > 1 and fmt != "4bit_rank1" else pytest.mark.slow),
        # rows of whole step tiles, every row count a multiple of 4: rank-1 scales read by row, with the new maxima's
        # reciprocals, their columns as vectors
        ("rows", () if name == "adamw" and fmt == "4bit_rank1" else pytest.mark.slow),
        # the first pass's programs strips of three tiles down a column (the last one short, or past the rows), for
        # every kind of scales (the edges take rank-1 scales' strips of 32 tiles of 4 rows: (300, 7) is three, the last
        # one short)
        ("pass-strips", pytest.mark.slow),
        # the same over aligned rows, which the first pass reads row by row (a strip's end, an odd count of rows)
        ("aligned-pass-strips", pytest.mark.slow),
        # and with each tile's rows' loads first (StatsTile.grouped), the last group of a strip past its rows
        ("aligned-pass-groups", () if name == "adamw" and fmt == "4bit_rank1" else pytest.mark.slow),
    )
]
SHAPE_SETS = {
    "edges": SHAPES,
    "aligned": ALIGNED_SHAPES,
    "strips": STRIP_SHAPES,
    "rows": ROW_SHAPES,
    "pass-strips": SHAPES,
    "aligned-pass-strips": ALIGNED_SHAPES,
    "aligned-pass-groups": ALIGNED_SHAPES,
}


@pytest.mark.parametrize("name,shapes_id,fmt", CASES)
def test_matrix_scales_on_triton_equal_compiled_path(name, shapes_id, fmt, monkeypatch):
    monkeypatch.setattr(fused, "FOLD_ROWS", 32)  # strips of 32 rows, whatever the default
    in_strips = "-pass-" in shapes_id
    if in_strips:
        from torchao_optim.kernels import triton_rank1

        grouped = shapes_id.endswith("groups")
        tiles = {kind: tile._replace(strip=3, grouped=grouped) for kind, tile in triton_rank1.STATS_TILES.items()}
        monkeypatch.setattr(triton_rank1, "STATS_TILES", tiles)
    shapes = SHAPE_SETS[shapes_id]
    make, n_states = RULES[name]
    a, oa = _train(make, True, fmt, shapes)
    b, ob = _train(make, False, fmt, shapes)
    plans = oa._plans[id(oa.param_groups[0])]
    assert plans["rest"] == [] and {plan.executor for plan in plans["plans"]} == {"triton"}
    assert {len(plan.layouts) for plan in plans["plans"]} == {n_states}
    matrix_plans = [plan for plan in plans["plans"] if plan.rank1 is not None]
    assert matrix_plans
    from torchao_optim.kernels.triton_rank1 import stats_tile

    for plan in matrix_plans:  # the tile and strip of the plan's kind of scales (strips of three where patched)
        assert plan.stats_tile_shape == stats_tile([layout.scale for layout in plan.layouts])
        assert plan.stats_tile_shape.strip == 3 or not in_strips
    if shapes_id not in ("strips", "rows"):
        assert all(plan.tiles_aligned == (shapes is ALIGNED_SHAPES) for plan in matrix_plans)
    # factored states in a kernel of two or three states over rows of whole tiles: sums in the step, else a first pass
    folds = shapes_id in ("strips", "rows") and fmt != "4bit_rank1" and n_states > 1
    assert all(plan.fold_sums == folds for plan in matrix_plans)
    # rank-1 scales over rows of whole step tiles (two or three states): each tile's row followed, the new maxima's
    # reciprocals read (2: the columns' statistics as vectors, every row count a multiple of 4)
    by_rows = shapes_id in ("strips", "rows") and fmt == "4bit_rank1" and n_states > 1
    assert all(plan.row_tiles == by_rows * (1 + (shapes_id == "rows")) for plan in matrix_plans)
    # a two-state plan that takes its sums in the step runs under FOLD_CAPS' register cap (fp32 parameters here), the
    # other matrix-scale plans under the compiler's choice
    cap = fused.FOLD_CAPS[4] if folds and n_states == 2 else None
    assert all(plan.maxnreg == cap for plan in matrix_plans)
    rank1 = 0
    for p, q in zip(a, b):
        _assert_params(p, q, tuple(p.shape))
        for key, x in oa.state[p].items():
            y = ob.state[q][key]
            if isinstance(x, QuantizedState):
                rank1 += bool(getattr(x, "rows", 0))
                for field in x.__tensor_flatten__()[0]:
                    _assert_field(getattr(x, field), getattr(y, field), (key, field, tuple(p.shape)))
    assert rank1 >= len(shapes)


def _assert_params(p, q, where):
    """The fast reciprocal of Adam's Triton update (on a GPU) and contracted multiply-adds: a few ulps. On a GPU an
    element whose state took the other code of a midpoint (``_assert_field``) takes a step that differs by a fraction
    of a code's width: such elements are rare (at most 0.2%), and each within the learning rate (1e-2) of the
    compiled path's; a wrong kernel differs in most elements."""
    if DEVICE == "cpu":
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=str(where))
        return
    apart = ~torch.isclose(p, q, rtol=1e-6, atol=1e-7)
    assert apart.float().mean().item() <= 0.002, where
    assert (p - q).abs().max().item() <= 1e-2, where


def _assert_field(a, b, where):
    """In the interpreter, the kernels' fp32 operations are the compiled path's: every field bit for bit. On a GPU,
    each side contracts multiply-adds its own way, so a state's new value may differ by an ulp: a maximum by a few
    (rtol 1e-5), and a value within rounding of the midpoint between two codes may take either (at most 2% of the
    code bytes differ; a wrong kernel differs in most)."""
    if DEVICE == "cpu" or a.numel() == 0:
        assert torch.equal(a, b), where
    elif a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0, msg=str(where))
    else:
        assert (a != b).float().mean().item() <= 0.02, where
