"""CUDA behaviour: the fused multi-tensor step against the per-parameter compiled path. Skipped without CUDA."""
import io

import pytest
import torch

import torchao_optim
from torchao_optim import DTQ8bitTensor
from torchao_optim.optim.fused import triton_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(256, 64), (1000, 7), (300,), (5000,), (3, 4096)]


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", dtype)) for s in SHAPES]


def run(params, opt, steps, seed=1, nan_at=None):
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to("cuda", p.dtype)
        if nan_at is not None and i == nan_at:
            params[0].grad.view(-1)[3] = float("nan")
        opt.step()


def max_code_step(state):
    # one code of the signed map near the top is 0.9/64 of the block's absmax: the most two paths may differ
    return 0.9 / 64 * state.absmax.max().item() * 1.01


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_compiled_path(dtype):
    a, b = make_params(dtype), make_params(dtype)
    opt_a = torchao_optim.AdamW(a, lr=1e-2, fused=True)
    opt_b = torchao_optim.AdamW(b, lr=1e-2, fused=False)
    run(a, opt_a, 20)
    run(b, opt_b, 20)
    for pa, pb in zip(a, b):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(pa, pb, rtol=tol, atol=tol)
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa["step"].item() == sb["step"].item() == 20
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(sa[key]) is type(sb[key])
            diff = (sa[key].dequantize() - sb[key].dequantize()).abs().max().item()
            bound = max_code_step(sa[key]) if isinstance(sa[key], DTQ8bitTensor) else 1e-6
            assert diff <= bound, (key, diff, bound)


def test_state_lives_on_the_param_device_and_checkpoints_exactly():
    params = make_params()
    opt = torchao_optim.AdamW8bit(params)
    run(params, opt, 3)
    st = opt.state[params[0]]
    assert isinstance(st["exp_avg"], DTQ8bitTensor) and st["exp_avg"].codes.device.type == "cuda"
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    ref = [p.detach().clone() for p in params]
    run(params, opt, 3, seed=7)
    after_ref = [p.detach().clone() for p in params]
    for p, r in zip(params, ref):
        p.data.copy_(r)
    buf.seek(0)
    opt2 = torchao_optim.AdamW8bit(params)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    run(params, opt2, 3, seed=7)
    for p, r in zip(params, after_ref):
        assert torch.equal(p, r)


def test_nan_gradient_stays_in_its_element():
    params = make_params()
    opt = torchao_optim.AdamW8bit(params, lr=1e-2)
    before = params[0].detach().clone()
    run(params, opt, 1, nan_at=0)
    assert params[0].view(-1)[3] == before.view(-1)[3]
    for p in params:
        assert torch.isfinite(p).all()
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim():
                assert torch.isfinite(v.dequantize() if isinstance(v, DTQ8bitTensor) else v).all()


def test_params_that_stop_and_start_having_grads_and_late_groups():
    params = make_params()
    opt = torchao_optim.AdamW8bit(params[:3], lr=1e-2)
    run(params[:3], opt, 2)
    params[1].grad = None
    frozen = params[1].detach().clone()
    params[0].grad = torch.randn_like(params[0])
    params[2].grad = torch.randn_like(params[2])
    opt.step()
    assert torch.equal(params[1], frozen)
    assert opt.state[params[1]]["step"].item() == 2 and opt.state[params[0]]["step"].item() == 3
    opt.add_param_group({"params": params[3:], "lr": 1e-3})
    run(params, opt, 2)
    assert opt.state[params[1]]["step"].item() == 4 and opt.state[params[4]]["step"].item() == 2
    assert all(torch.isfinite(p).all() for p in params)
