"""The clipped-momentum candidate of the language-model benchmark (benchmarks/clipped_momentum.py): AdamW whose decoded
exp_avg is held to |m| <= C sqrt(v), the bound exact Adam state keeps. The bound holds along exact AdamW; on plain fp32
state the clamp never binds (the candidate steps as AdamW, bit for bit); on 4-bit state it binds; its fused Triton
update (in Triton's interpreter on a machine without CUDA) equals its compiled-path update bit for bit."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import run_benchmark_modules

from torchao_optim import AdamW
from torchao_optim.optim.fused import fused_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BETAS = (0.9, 0.95)


@pytest.fixture
def cm(monkeypatch):
    return run_benchmark_modules(monkeypatch, "fourbit_variants", "clipped_momentum")


def _train(make, steps=20, nan_at=None, rows=64):
    gen = torch.Generator().manual_seed(0)
    # every 32 columns another scale, four decades in a block of 128 (heads of different scales in one block)
    scales = torch.logspace(-4, 0, 4).repeat_interleave(32).repeat(2)[None, :].to(DEVICE)
    w = torch.nn.Parameter((torch.randn(rows, 256, generator=gen).to(DEVICE)) * scales)
    opt = make([w])
    for step in range(steps):
        # rare large gradients: |m| / sqrt(v) near its bound after them
        spike = 30.0 if step % 7 == 3 else 1.0
        w.grad = torch.randn(w.shape, generator=gen).to(DEVICE) * scales * spike
        if step == nan_at:
            w.grad[3, 5] = float("nan")
        opt.step()
    return w.detach().clone(), opt


def _clipped(cm, fused, state_format="4bit"):
    return lambda ps: cm["AdamWClipped"](
        ps, lr=1e-2, betas=BETAS, state_format=state_format, min_quant_size=0, compile=False, fused=fused
    )


def _bound(cm, betas):
    b1, b2 = (torch.tensor(b, dtype=torch.float64) for b in betas)
    return cm["moment_bound"](1 - b1, b2).item()


def test_bound_holds_along_exact_adam(cm):
    assert _bound(cm, (0.9, 0.95)) == pytest.approx(1.1650, abs=1e-4)
    assert _bound(cm, (0.9, 0.999)) == pytest.approx(7.2703, abs=1e-4)
    assert _bound(cm, (0.9, 0.8)) == float("inf")  # beta1**2 >= beta2: no bound, no clamp
    gen = torch.Generator().manual_seed(0)
    for betas in ((0.9, 0.95), (0.9, 0.999), (0.5, 0.3)):
        m = v = torch.zeros(4096, dtype=torch.float64)
        worst = 0.0
        for t in range(400):
            # a spike after a long quiet stretch drives |m| / sqrt(v) towards the bound
            g = torch.randn(4096, generator=gen, dtype=torch.float64) * (100.0 if t % 97 == 96 else 1e-3)
            m, v = betas[0] * m + (1 - betas[0]) * g, betas[1] * v + (1 - betas[1]) * g * g
            worst = max(worst, (m.abs() / v.sqrt()).max().item())
        assert 0.5 * _bound(cm, betas) < worst <= _bound(cm, betas), (betas, worst)


def test_clamp_never_binds_on_fp32_state_and_binds_on_4bit(cm):
    a, _ = _train(_clipped(cm, False, "none"), nan_at=4)
    b, _ = _train(lambda ps: AdamW(ps, lr=1e-2, betas=BETAS, state_format="none", compile=False, fused=False), nan_at=4)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c, _ = _train(_clipped(cm, False, "4bit"))
    d, _ = _train(lambda ps: AdamW(ps, lr=1e-2, betas=BETAS, state_format="4bit", min_quant_size=0, compile=False))
    assert not torch.equal(c, d)  # 4-bit exp_avg's error beyond the bound is clamped


@pytest.mark.skipif(not fused_available(torch.device(DEVICE)), reason="needs CUDA, or Triton's interpreter")
def test_fused_update_equals_compiled_path(cm):
    # exp_avg_sq on the square map (benchmarks/fourbit_variants.py), finer than "4bit"'s near 0: the clamp binds
    fmt = "4bit_vsq"
    a, oa = _train(_clipped(cm, True, fmt), steps=8, nan_at=4, rows=8)  # Triton's interpreter: a second or so a step
    b, ob = _train(_clipped(cm, False, fmt), steps=8, nan_at=4, rows=8)
    c, _ = _train(
        lambda ps: AdamW(ps, lr=1e-2, betas=BETAS, state_format=fmt, min_quant_size=0, fused=False, compile=False),
        8,
        4,
        8,
    )
    assert not torch.equal(b, c)
    plans = oa._plans[id(oa.param_groups[0])]
    assert {plan.executor for plan in plans["plans"]} == {"triton"} and plans["rest"] == []
    sa, sb = oa.state[oa.param_groups[0]["params"][0]], ob.state[ob.param_groups[0]["params"][0]]
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(sa[key].dequantize(), sb[key].dequantize(), rtol=0, atol=0, msg=key)
    if DEVICE == "cpu":  # a GPU build may contract multiply-adds in the parameter's update
        torch.testing.assert_close(a, b, rtol=0, atol=0)
