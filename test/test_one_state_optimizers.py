"""SGD8bit, Lion8bit, Muon8bit, Adagrad8bit and RMSprop8bit beyond the conformance case; torch.optim's
implementation keywords everywhere."""

import pytest
import torch

import torchao_optim
from torchao_optim import Adagrad8bit, AdamW, AdamW8bit, Lion8bit, Muon8bit, RMSprop8bit, SGD8bit
from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim.fused import fused_available
from torchao_optim.optim.muon import newton_schulz

OURS = {
    "AdamW": lambda ps, **kw: AdamW(ps, **kw),
    "AdamW8bit": lambda ps, **kw: AdamW8bit(ps, **kw),
    "SGD8bit": lambda ps, **kw: SGD8bit(ps, **{"lr": 0.1, "momentum": 0.9, **kw}),
    "Lion8bit": lambda ps, **kw: Lion8bit(ps, **kw),
    "Muon8bit": lambda ps, **kw: Muon8bit(ps, **kw),
    "Adagrad8bit": lambda ps, **kw: Adagrad8bit(ps, **{"lr_decay": 0.01, **kw}),
    "RMSprop8bit": lambda ps, **kw: RMSprop8bit(ps, **kw),
    "RMSprop8bit-momentum": lambda ps, **kw: RMSprop8bit(ps, **{"momentum": 0.9, **kw}),
}
FUSED_ONE_AND_TWO_STATE = ["SGD8bit", "Lion8bit", "Adagrad8bit", "RMSprop8bit", "RMSprop8bit-momentum"]


def params(*shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes or ((64, 96), (50,))]


@pytest.mark.parametrize("name", list(OURS))
def test_torch_optim_keywords(name):
    """foreach is accepted (any value: it picks torch.optim's implementation, never its numbers); differentiable=True
    and, without the fused CUDA path, capturable=True are refused with a ValueError naming them."""
    make = OURS[name]
    for foreach in (None, False, True):
        make(params(), foreach=foreach, differentiable=False, capturable=False, compile=False)
    with pytest.raises(ValueError, match="foreach"):
        make(params(), foreach="yes")
    with pytest.raises(ValueError, match="differentiable=True"):
        make(params(), differentiable=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="capturable=True"):
            make(params(), capturable=True)


def test_nesterov_needs_momentum_and_no_dampening():
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        SGD8bit(params(), lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="param group 1: Invalid momentum value: -1"):
        SGD8bit(params(), lr=0.1, momentum=0.9).add_param_group({"params": params((3,)), "momentum": -1})


def test_sgd_without_momentum_keeps_no_state_and_matches_torch():
    ours, ref = params(), params()
    opt, r = SGD8bit(ours, lr=0.1, weight_decay=0.01, compile=False), torch.optim.SGD(ref, lr=0.1, weight_decay=0.01)
    for _ in range(2):
        for p, q in zip(ours, ref):
            p.grad = q.grad = torch.ones_like(p)
        opt.step()
        r.step()
    assert set(opt.state[ours[0]]) == {"step"}
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "cls, ref_cls, kw",
    [
        (SGD8bit, torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
        (Muon8bit, torch.optim.Muon, dict(lr=0.02)),
        (Adagrad8bit, torch.optim.Adagrad, dict(lr=0.01, lr_decay=0.1, initial_accumulator_value=0.5)),
        (RMSprop8bit, torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
    ],
)
def test_loads_torch_optim_state_dict(cls, ref_cls, kw):
    """torch.optim.SGD's and Muon's state_dicts have no step count: the buffers exist, so one step has run
    (Adagrad's and RMSprop's have theirs: 1). With fp32 state, ours continues exactly as torch.optim does."""
    ours, ref = params((64, 96)), params((64, 96))
    r = ref_cls(ref, **kw)
    grads = [torch.randn(64, 96, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    ref[0].grad = grads[0]
    r.step()
    opt = cls(ours, state_format="none", compile=False, **kw)
    ours[0].data.copy_(ref[0])
    opt.load_state_dict(r.state_dict())
    assert float(opt.state[ours[0]]["step"]) == 1.0
    for g in grads[1:]:
        ours[0].grad, ref[0].grad = g.clone(), g.clone()
        opt.step()
        r.step()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-6)


def test_newton_schulz_is_torch_muons_bit_for_bit():
    for shape in ((64, 96), (96, 64), (5, 5)):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        from torch.optim._muon import _zeropower_via_newtonschulz

        assert torch.equal(newton_schulz(g), _zeropower_via_newtonschulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7))
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.randn(3))


def test_muon_routes_non_matrices_to_adamw():
    a, b, c = params((64, 96), (96,), (4, 4, 8))
    opt = Muon8bit(
        [{"params": [a, b, c]}, {"params": params((32, 32)), "use_muon": False}], compile=False, min_quant_size=0
    )
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    opt.step()
    assert set(opt.state[a]) == {"step", "momentum_buffer"}
    assert set(opt.state[b]) == set(opt.state[c]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[opt.param_groups[1]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match="use_muon=True: Muon updates 2-D parameters only, got shape \\(96,\\)"):
        Muon8bit([{"params": [b], "use_muon": True}])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon8bit([a], adjust_lr_fn="sqrt")


def test_muon_adjust_lr_match_rms_adamw_matches_torch():
    ours, ref = params((64, 96)), params((64, 96))
    opt = Muon8bit(ours, lr=0.02, adjust_lr_fn="match_rms_adamw", state_format="none", compile=False)
    r = torch.optim.Muon(ref, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for k in range(3):
        ours[0].grad = ref[0].grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(k))
        opt.step()
        r.step()
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not (torch.cuda.is_available() and fused_available("cuda")), reason="needs CUDA and Triton")
@pytest.mark.parametrize("name", ["AdamW8bit"] + FUSED_ONE_AND_TWO_STATE)
def test_capturable_step_replays_in_a_cuda_graph(name):
    """capturable=True: after warm-up steps the step is captured in a CUDA graph; replays with a tensor lr changed
    in place and new gradients copied into the captured ones follow an eager twin bit for bit."""
    make = OURS[name]
    shapes = ((256, 96), (1000,), (50,))
    a = [torch.nn.Parameter(p.detach().cuda()) for p in params(*shapes)]
    b = [torch.nn.Parameter(p.detach().cuda()) for p in params(*shapes)]
    lr_a, lr_b = torch.tensor(1e-3, device="cuda"), torch.tensor(1e-3, device="cuda")
    oa, ob = make(a, lr=lr_a, capturable=True, min_quant_size=256), make(b, lr=lr_b, min_quant_size=256)
    grads = [[torch.randn_like(p) for p in a] for _ in range(6)]
    for p in a:
        p.grad = torch.zeros_like(p)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for k in range(2):  # warm-up: state, plans and kernels are created outside the capture
            for p, q, g in zip(a, b, grads[k]):
                p.grad.copy_(g)
                q.grad = g.clone()
            oa.step()
            ob.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oa.step()
    for k in range(2, 6):
        lr_a.fill_(1e-3 * (k + 1))
        lr_b.fill_(1e-3 * (k + 1))
        for p, q, g in zip(a, b, grads[k]):
            p.grad.copy_(g)
            q.grad = g.clone()
        graph.replay()
        ob.step()
    torch.cuda.synchronize()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.skipif(not (torch.cuda.is_available() and fused_available("cuda")), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FUSED_ONE_AND_TWO_STATE + ["Muon8bit"])
def test_fused_matches_compiled_path_on_cuda(name, dtype):
    """The one-state kernel (RMSprop with momentum: the two-state one; Muon8bit: the one-state kernel writing the
    directions Newton-Schulz orthogonalizes, and the two-state one for its AdamW fallback) against the compiled
    path, 20 steps. They
    round differently (FMA), so a state value within rounding of a midpoint between two codes may take either code
    (test_cuda.py's bound for Adam: under 2% of the codes differ), and a Lion direction within rounding of 0 may
    take either sign; a wrong kernel differs almost everywhere. Parameters: mean difference under 2% of how far
    they moved."""
    make, steps = OURS[name], 20
    shapes = ((256, 64), (1000, 7), (300,), (5000,))
    a = [torch.nn.Parameter(p.detach().to("cuda", dtype)) for p in params(*shapes)]
    b = [torch.nn.Parameter(p.detach().to("cuda", dtype)) for p in params(*shapes)]
    start = [p.detach().float().clone() for p in a]
    oa, ob = make(a, fused=True, min_quant_size=256), make(b, fused=False, min_quant_size=256)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=gen).to("cuda", dtype)
            q.grad = p.grad.clone()
        oa.step()
        ob.step()
    plans = oa._plans[id(oa.param_groups[0])]
    assert plans["rest"] == [] and sum(len(plan.params) for plan in plans["plans"]) == len(a)
    for p, q, s in zip(a, b, start):
        moved = (q.float() - s).abs().mean().item()
        assert (p.float() - q.float()).abs().mean().item() <= 0.02 * moved
        assert set(oa.state[p]) == set(ob.state[q]) and float(oa.state[p]["step"]) == steps
        for key in set(oa.state[p]) - {"step"}:
            sa, sb = oa.state[p][key], ob.state[q][key]
            assert type(sa) is type(sb)
            if isinstance(sa, torchao_optim.DTQ8bitTensor):
                assert (sa.codes != sb.codes).float().mean().item() < 0.02, key
            else:
                torch.testing.assert_close(sa, sb, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not cpu_kernels_available(), reason="needs a C compiler for the fused CPU step")
@pytest.mark.parametrize("fmt", ["dtq8", "4bit", "none"])
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(nesterov=False, maximize=True), dict(bf16_stochastic_round=True)],
    ids=["nesterov", "plain_maximize", "bf16_stochastic_round"],
)
def test_muon_takes_the_fused_path(kw, fmt):
    """Muon8bit on the fused CPU step: its matrices' momentum in one plan of Muon's rule (which writes the directions
    Newton-Schulz then orthogonalizes), its AdamW parameters in Adam's, with each rule's hyperparameters. Against
    fused=False run eagerly (compile=False: the same arithmetic, StateFormatTestCase's compiled-equals-eager): the
    parameters and the momentum codes bit for bit, a non-finite gradient element skipped alike (its parameter and
    buffer kept, 0 in the direction), bf16 parameters rounded stochastically alike."""
    shapes = ((64, 96), (96, 33), (96,), (5000,))
    dtype = torch.bfloat16 if kw.get("bf16_stochastic_round") else torch.float32
    a, b = ([torch.nn.Parameter(p.detach().to(dtype)) for p in params(*shapes)] for _ in range(2))
    kw = dict(kw, lr=1e-2, weight_decay=0.1, adamw_betas=(0.8, 0.9), state_format=fmt, min_quant_size=0, compile=False)
    oa, ob = Muon8bit(a, **kw), Muon8bit(b, fused=False, **kw)
    for k in range(4):
        for p, q in zip(a, b):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
            if k == 2:
                g.view(-1)[3], g.view(-1)[-1] = float("nan"), float("inf")
            p.grad, q.grad = g.to(dtype), g.to(dtype)
        oa.step()
        ob.step()
    plans = [plan for cache in oa._plans.values() for plan in cache["plans"]]
    assert sorted((plan.rule.name, len(plan.params)) for plan in plans) == [("adam", 2), ("muon", 2)]
    assert all(cache["rest"] == [] for cache in oa._plans.values()) and not ob._plans
    for p, q in zip(a, b):
        assert torch.equal(p, q) and p.isfinite().all()
        for key, s in oa.state[p].items():
            t = ob.state[q][key]
            if isinstance(s, torchao_optim.QuantizedState):
                names, _ = s.__tensor_flatten__()
                assert all(torch.equal(getattr(s, n), getattr(t, n)) for n in names), key
            else:
                assert torch.equal(s, t), key
