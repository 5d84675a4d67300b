"""CUDA behaviour: the fused multi-tensor step against the per-parameter compiled path. Skipped without CUDA."""

import io

import pytest
import torch

import torchao_optim
from torchao_optim import DTQ8bitTensor
from torchao_optim.optim.fused import fused_available

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


def code_step(state):
    # one code of the signed map near its top: 0.9/64 of the block's absmax
    return 0.9 / 64 * state.absmax.max().item()


@pytest.mark.skipif(not fused_available(), reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_compiled_path(dtype):
    # The two paths round differently (FMA, the fused quantizer decides on a rounded position), so a value
    # within fp32 rounding of the midpoint between two codes can take either: the states may differ by a
    # code at a few elements, and such an element's next updates by a fraction of lr. A wrong kernel
    # differs by O(lr * steps) everywhere, or by whole codes in most elements.
    lr, steps = 1e-2, 20
    a, b = make_params(dtype), make_params(dtype)
    opt_a = torchao_optim.AdamW(a, lr=lr, fused=True)
    opt_b = torchao_optim.AdamW(b, lr=lr, fused=False)
    run(a, opt_a, steps)
    run(b, opt_b, steps)
    for pa, pb in zip(a, b):
        tol = lr if dtype == torch.float32 else lr + 2**-7 * pb.abs().max().item()  # + one bf16 ulp
        assert (pa.float() - pb.float()).abs().max().item() <= tol
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa["step"].item() == sb["step"].item() == steps
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(sa[key]) is type(sb[key])
            diff = (sa[key].dequantize() - sb[key].dequantize()).abs().max().item()
            if isinstance(sa[key], DTQ8bitTensor):
                assert diff <= 2 * code_step(sa[key]), (key, diff)
                assert (sa[key].codes != sb[key].codes).float().mean().item() < 0.02
            else:
                assert diff <= 1e-5 * sb[key].abs().max().item() + 1e-7, (key, diff)


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


@pytest.mark.skipif(not fused_available(), reason="needs Triton")
def test_moving_gradients_do_not_rebuild_plans(monkeypatch):
    # zero_grad(set_to_none=True) + backward gives gradients new addresses; only their table is refreshed
    import torchao_optim.optim.fused as fused

    built = []
    init = fused.GroupPlan.__init__
    monkeypatch.setattr(fused.GroupPlan, "__init__", lambda self, *a: (built.append(1), init(self, *a))[1])
    a, b = make_params(), make_params()
    opt_a = torchao_optim.AdamW8bit(a, lr=1e-2)
    opt_b = torchao_optim.AdamW8bit(b, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    keep = []
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g).to("cuda") for p in a]
        keep.append([torch.empty_like(x) for x in grads])  # hold memory so new grads land elsewhere
        for pa, pb, x in zip(a, b, grads):
            pa.grad, pb.grad = x.clone(), x.clone()
        opt_a.step()
        opt_b.step()
    assert len(built) == 4  # two plans (8-bit and fp32 state) per optimizer, built once
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


@pytest.mark.skipif(not fused_available(), reason="needs Triton")
def test_a_register_cap_that_spills_is_dropped():
    # REGISTER_CAPS were measured on Adam's update: AdamW8bit with bf16 parameters keeps its cap, without spills;
    # RMSprop's momentum update (its state depends on a correctly rounded division) spills under it, and its plan
    # compiles without one from the next launch on
    import torchao_optim.optim.fused as fused

    cap = fused.REGISTER_CAPS[(8, 2)]
    for make, kept in [
        (lambda ps: torchao_optim.AdamW8bit(ps, lr=1e-3), True),
        (lambda ps: torchao_optim.RMSprop8bit(ps, lr=1e-3, momentum=0.9), False),
    ]:
        params = make_params(torch.bfloat16)
        opt = make(params)
        run(params, opt, 2)
        plans = [p for p in opt._plans[id(opt.param_groups[0])]["plans"] if p.layouts[0].quantized]
        assert plans and all(p.maxnreg == (cap if kept else None) for p in plans), [p.maxnreg for p in plans]
        assert all(p.compiled.n_spills == 0 for p in plans)
