"""Quantization blocks and the fused kernels' register tiles: blocks smaller than a tile share it (each with its
own absmax), larger ones take a tile of their own with more warps. Whatever the block size, the fused step
stores what the unfused update stores. Without CUDA the fused step runs in Triton's interpreter (conftest.py)."""

import pytest
import torch

import torchao_optim
import torchao_optim.optim.fused as fused_mod
from torchao_optim.optim.fused import MIN_TILE, fused_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# element counts that end tiles and blocks in the middle, and a tensor shorter than one block
SHAPES = [(3000,), (37, 41), (256,), (129,), (5, 64), (20,)]


def _steps(fused: bool, fmt: str, block: int, grad_scale: float = 1e-2):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES]
    grads = [[(torch.randn(s, generator=gen) * grad_scale).to(DEVICE) for s in SHAPES] for _ in range(3)]
    opt = torchao_optim.AdamW(params, state_format=fmt, block_size=block, min_quant_size=0, fused=fused, compile=False)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.skipif(not fused_available(DEVICE), reason="the fused kernels cannot run here (no Triton)")
@pytest.mark.parametrize(
    "fmt,block,grad_scale",
    [
        ("dtq8", 64, 1e-2),
        ("4bit", 32, 1e-2),
        ("fp8", 128, 1e-2),
        ("dtq8", 512, 1e-2),
        ("dtq8", 256, 1e-21),
        ("4bit", 128, 1e-21),
    ],
)
def test_blocks_sharing_a_tile_or_spanning_warps_store_what_the_update_stores(fmt, block, grad_scale):
    # (gradients of 1e-21: exp_avg_sq is subnormal, and so is its absmax, whose reciprocal overflows fp32)
    fused_params, fused = _steps(True, fmt, block, grad_scale)
    plans = fused._group_plans(fused.param_groups[0])["plans"]
    assert len(plans) == 1 and plans[0].block == block and plans[0].tile == max(block, MIN_TILE)
    ref_params, ref = _steps(False, fmt, block, grad_scale)
    # In the interpreter the kernel rounds as eager code does: the states are the same bits, the parameters
    # within a few fp32 ulps (its order of operations). On CUDA the kernel contracts into FMAs where eager
    # code does not, so a value on a code boundary may round to the neighbouring code (test_cuda.py says
    # more): a few codes differ, and with them an element's next updates by a fraction of lr (1e-3).
    exact = DEVICE == "cpu"
    for p, q in zip(fused_params, ref_params):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7 if exact else 1e-3), (p - q).abs().max()
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = fused.state[p][key], ref.state[q][key]
            for name in a.data_fields():
                x, y = getattr(a, name), getattr(b, name)
                if exact:
                    assert torch.equal(x, y), (key, name)
                elif x.dtype.is_floating_point:  # scales
                    assert torch.allclose(x, y, rtol=0.02, atol=0), (key, name)
                else:
                    assert (x != y).float().mean().item() < 0.02, (key, name)


def test_small_plans_spread_their_tiles_over_more_programs():
    # ViT-B's 1-D tensors (biases and norms, about 120K elements) on a GPU of 132 SMs: 125 programs of 8 tiles
    # would leave most SMs idle, so each takes one tile; TinyLlama's matrices keep 8 tiles per program
    small = torch.tensor([768] * 96 + [2304] * 12 + [3072] * 12)
    assert fused_mod.spread_iters(small, 256, 8 * 132) == 1
    assert fused_mod.spread_iters(torch.tensor([2048 * 5632] * 66), 256, 8 * 132) == fused_mod.ITERS
    assert fused_mod.spread_iters(torch.tensor([2048 * 300]), 256, 600) == 4  # 300 programs of 8, 600 of 4
    assert fused_mod.spread_iters(small, 256, 0) == fused_mod.ITERS


def test_program_map_covers_every_tile_once_with_a_tail_of_one_tile_programs():
    numels = torch.tensor([3000, 1517, 256, 129, 320, 20])  # 12, 6, 1, 1, 2 and 1 tiles of 256
    for iters, tail in [(8, 0), (8, 13), (4, 5), (8, 10**6), (1, 0)]:
        tensors, firsts, counts = fused_mod.program_map(numels, 256, iters, tail)
        covered = [(t, f + i) for t, f, c in zip(tensors.tolist(), firsts.tolist(), counts.tolist()) for i in range(c)]
        assert covered == [(t, b) for t, n in enumerate([12, 6, 1, 1, 2, 1]) for b in range(n)]  # once, in order
        assert counts.max() <= iters and counts.min() >= 1
        last = counts[-min(tail, 23) :] if tail else counts[:0]  # the last `tail` tiles: one per program
        assert (last == 1).all() and int(last.numel()) == min(tail, 23)
    # 13 tiles of tail: the first tensor keeps a program of 8 and one of 2 (its tiles before the tail), then ones
    assert fused_mod.program_map(numels, 256, 8, 13)[2].tolist()[:4] == [8, 2, 1, 1]


@pytest.mark.skipif(not fused_available(DEVICE), reason="the fused kernels cannot run here (no Triton)")
@pytest.mark.parametrize("fmt,block", [("dtq8", 256), ("4bit", 128)])
def test_tiles_per_program_change_no_bit(fmt, block, monkeypatch):
    # Spreading a plan over more programs, or ending it with programs of one tile, changes which program updates
    # a tile, not how: the same bits.
    runs = []
    # ITERS tiles per program (tensors of 12 tiles: a whole program, then part of one); one tile per program; and
    # ITERS, with the last 13 tiles one per program (the first tensor split between the two kinds)
    for min_programs, tail in [(0, 0), (10**6, 0), (0, 13)]:
        monkeypatch.setattr(fused_mod, "MIN_PROGRAMS", min_programs)
        monkeypatch.setattr(fused_mod, "TAIL_TILES", tail)
        params, opt = _steps(True, fmt, block)
        plan = opt._group_plans(opt.param_groups[0])["plans"][0]
        runs.append((plan.iters, int((plan.prog_tiles == 1).sum()), params, opt))
    (iters_a, ones_a, params_a, opt_a) = runs[0]
    assert [(r[0], r[1]) for r in runs] == [(fused_mod.ITERS, ones_a), (1, 23), (fused_mod.ITERS, 13)]
    for _, _, params_b, opt_b in runs[1:]:
        for p, q in zip(params_a, params_b):
            assert torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = opt_a.state[p][key], opt_b.state[q][key]
                assert all(torch.equal(getattr(a, name), getattr(b, name)) for name in a.data_fields()), key


@pytest.mark.skipif(not fused_available(DEVICE), reason="the fused kernels cannot run here (no Triton)")
def test_one_coefficients_launch_serves_every_plan_of_a_group():
    # quantized states for the larger tensors, plain fp32 ones under min_quant_size: two plans, whose step counts
    # and coefficients one launch advances and computes, the first plan's
    def run(fused):
        gen = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES]
        opt = torchao_optim.AdamW(params, lr=1e-2, min_quant_size=1000, fused=fused, compile=False)
        for _ in range(3):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(DEVICE)
            opt.step()
        return params, opt

    params, opt = run(True)
    plans = opt._group_plans(opt.param_groups[0])["plans"]
    assert len(plans) == 2 and plans[1].coefs_for is None
    steps, coefs = plans[0].coefs_for
    assert steps.numel() == len(params) and coefs.shape[0] == len(params)
    assert all(opt.state[p]["step"].item() == 3 for p in params)
    ref_params, _ = run(False)
    for p, q in zip(params, ref_params):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7 if DEVICE == "cpu" else 1e-3), (p - q).abs().max()
