"""quantize_optimizer_state: stock torch.optim optimizers over quantized state, rounded once per step."""

import copy
import pickle
import warnings

import pytest
import torch

import torchao_optim
from torchao_optim import DTQ8bitTensor, QuantizedState, quantize_optimizer_state
from torchao_optim.testing import SpreadProblem, save_load

SHAPES = ((64, 96), (8192,), (50,))  # two quantized (whole blocks), one below min_quant_size
STEPS = 5

STOCK = {
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "Adam amsgrad": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, **kw),
    "SGD momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3, **kw),
    "SGD nesterov": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, **kw),
    "RMSprop centered": lambda ps, **kw: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.5, **kw),
    "Adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=1e-2, **kw),
}
UNSIGNED = {"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"}


PROBLEM = SpreadProblem(SHAPES)


def params():
    return PROBLEM.params()


def grads(step):
    return PROBLEM.grads(step)


def train(opt, ps, steps, start=0):
    for k in range(start, start + steps):
        for p, g in zip(ps, grads(k)):
            p.grad = g.clone()
        opt.step()
    return ps


def errors(ps, ref):
    """(max, mean) of |p - p_ref| over the parameters with quantized state."""
    err = torch.cat([(p - q).detach().abs().reshape(-1) for p, q in zip(ps, ref) if p.numel() >= 4096])
    return err.max().item(), err.mean().item()


def per_op(make, ps):
    """The state dtype dropped into the stock optimizer by hand: every in-place op requantizes."""
    opt = make(ps, foreach=False)
    train(opt, ps, 1)
    for p in ps:
        if p.numel() >= 4096:
            for key, v in opt.state[p].items():
                if v.shape == p.shape:
                    opt.state[p][key] = DTQ8bitTensor.from_float(v, signed=key not in UNSIGNED)
    return train(opt, ps, STEPS - 1, start=1)


@pytest.mark.parametrize("name", list(STOCK))
def test_states_quantized_once_per_step(name):
    """States are dtq8 with the map their values need; the parameters follow the fp32 run more closely than with
    per-op requantization (measured 0.5-0.95x its mean error: RMSprop's and Adagrad's denominators are dominated
    by their first step's values, which both quantize once)."""
    make = STOCK[name]
    ref = params()
    train(make(ref, foreach=False), ref, STEPS)
    ps = params()
    opt = quantize_optimizer_state(make(ps, foreach=False))
    train(opt, ps, STEPS)
    for p in ps:
        for key, v in opt.state[p].items():
            if key == "step":
                continue
            if p.numel() >= 4096:
                assert type(v) is DTQ8bitTensor and v.signed == (key not in UNSIGNED), (name, key)
            else:
                assert type(v) is torch.Tensor, (name, key)
    max_err, mean_err = errors(ps, ref)
    if name == "Adam amsgrad":  # per-op fails (aten.maximum.out); our Adam(amsgrad=True) is the yardstick
        with pytest.raises(NotImplementedError, match="maximum"):
            per_op(make, params())
        ours = params()
        train(torchao_optim.Adam(ours, lr=1e-2, amsgrad=True, compile=False, fused=False), ours, STEPS)
        naive_max, naive_mean = errors(ours, ref)
        naive_max, naive_mean = naive_max * 1.0001, naive_mean * 1.0001
    else:
        naive_max, naive_mean = errors(per_op(make, params()), ref)
    assert mean_err < naive_mean, (name, mean_err, naive_mean)
    assert max_err <= naive_max * 1.0001, (name, max_err, naive_max)
    for p, q in zip(ps, ref):  # plain state: the stock optimizer's numbers
        if p.numel() < 4096:
            assert torch.equal(p, q), name


def test_adamw_within_1_5x_of_adamw8bit():
    """The issue's target: AdamW through quantize_optimizer_state within 1.5x of our AdamW8bit's error against
    fp32 AdamW (measured 1.0x: the same rounding, once per step; per-op requantization was 1.6x)."""
    ps_ref = params()
    train(torch.optim.AdamW(ps_ref, lr=1e-2, weight_decay=0.1, foreach=False), ps_ref, STEPS)
    ours = params()
    train(torchao_optim.AdamW8bit(ours, lr=1e-2, weight_decay=0.1, compile=False, fused=False), ours, STEPS)
    for foreach in (False, True):
        ps = params()
        train(quantize_optimizer_state(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=foreach)), ps, STEPS)
        got, yardstick = errors(ps, ps_ref), errors(ours, ps_ref)
        assert got[0] <= 1.5 * yardstick[0] and got[1] <= 1.5 * yardstick[1], (foreach, got, yardstick)


@pytest.mark.parametrize("name", ["AdamW", "SGD momentum", "RMSprop centered"])
def test_foreach_matches_single_tensor(name):
    """foreach=True (the CUDA default; its _foreach_* ops never reach the state dtype) trains as foreach=False."""
    a, b = params(), params()
    train(quantize_optimizer_state(STOCK[name](a, foreach=False)), a, 3)
    train(quantize_optimizer_state(STOCK[name](b, foreach=True)), b, 3)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_chunks_bound_what_is_dequantized_and_change_nothing():
    """With chunk_numel smaller than a parameter each parameter is its own chunk: the stock step sees one
    parameter at a time and at most its states in fp32; results are bit-identical to one chunk."""
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            fp32 = [
                k
                for p in self.param_groups[0]["params"]
                for k, v in self.state[p].items()
                if type(v) is torch.Tensor and v.numel() >= 4096
            ]
            quantized = [v for s in self.state.values() for v in s.values() if isinstance(v, QuantizedState)]
            seen.append((len(self.param_groups[0]["params"]), len(fp32), len(quantized)))
            return super().step(closure)

    a, b = params(), params()
    train(quantize_optimizer_state(Recording(a, lr=1e-2, momentum=0.9), chunk_numel=4096), a, 2)
    assert seen[:3] == [(1, 0, 0), (1, 0, 1), (1, 0, 2)]  # first step: no state yet, quantized as created
    assert seen[3:] == [(1, 1, 1), (1, 1, 1), (1, 0, 2)]  # then one parameter's state in fp32 at a time
    train(quantize_optimizer_state(torch.optim.SGD(b, lr=1e-2, momentum=0.9)), b, 2)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize(
    "kw, hint",
    [
        ({"fused": True}, "foreach=True"),
        ({"capturable": True}, "capturable=False"),
        ({"differentiable": True}, "differentiable=False"),
    ],
)
def test_refuses_what_it_cannot_run(kw, hint):
    with pytest.raises(ValueError, match=hint):
        quantize_optimizer_state(torch.optim.AdamW(params(), **kw))
    opt = quantize_optimizer_state(torch.optim.AdamW(params()[:1]))
    with pytest.raises(ValueError, match=hint):
        opt.add_param_group({"params": params()[1:], **kw})
    assert len(opt.param_groups) == 1


def test_refuses_twice_unknown_format_and_our_optimizers():
    opt = quantize_optimizer_state(torch.optim.AdamW(params()))
    with pytest.raises(ValueError, match="already keeps quantized state"):
        quantize_optimizer_state(opt)
    with pytest.raises(ValueError, match="registered formats"):
        quantize_optimizer_state(torch.optim.AdamW(params()), state_format="int3")
    with pytest.raises(ValueError, match="state_format="):
        quantize_optimizer_state(torchao_optim.AdamW(params()))
    with pytest.raises(ValueError, match="LBFGS"):
        quantize_optimizer_state(torch.optim.LBFGS(params()))
    assert isinstance(opt, torch.optim.AdamW) and type(opt).__name__ == "AdamW"


def test_group_storage_options_are_honoured():
    """A group's own state_format, min_quant_size and block_size (as overrides() produces them) win."""
    a, b, c = params()
    opt = quantize_optimizer_state(
        torch.optim.AdamW(
            [
                {"params": [a], "state_format": "none"},
                {"params": [b], "block_size": 128},
                {"params": [c], "min_quant_size": 10},
            ]
        )
    )
    train(opt, [a, b, c], 1)
    assert type(opt.state[a]["exp_avg"]) is torch.Tensor
    assert opt.state[b]["exp_avg"].block_size == 128
    assert type(opt.state[c]["exp_avg_sq"]) is DTQ8bitTensor and not opt.state[c]["exp_avg_sq"].signed
    with pytest.raises(ValueError, match="param group 3: unknown state format .int3."):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "state_format": "int3"})


def test_converts_existing_state_and_adagrad_initial_state():
    """An optimizer that has stepped is converted at once; Adagrad's sum (created in __init__) too."""
    ps = params()
    opt = torch.optim.AdamW(ps, lr=1e-2)
    train(opt, ps, 1)
    before = opt.state[ps[0]]["exp_avg"].clone()
    quantize_optimizer_state(opt)
    q = opt.state[ps[0]]["exp_avg"]
    assert type(q) is DTQ8bitTensor
    torch.testing.assert_close(q.dequantize(), before, atol=0.0071 * before.abs().max().item(), rtol=0)
    adagrad = quantize_optimizer_state(torch.optim.Adagrad(params(), initial_accumulator_value=0.1))
    assert type(adagrad.state[adagrad.param_groups[0]["params"][0]]["sum"]) is DTQ8bitTensor


def test_state_dict_round_trip_resumes_exactly():
    """state_dict (through torch.save / weights_only) loads back into a converted optimizer of the same kind and
    training goes on bit for bit; a stock fp32 state_dict loads too, and is quantized on loading."""
    for foreach in (False, True):
        a = params()
        opt = quantize_optimizer_state(torch.optim.AdamW(a, lr=1e-2, foreach=foreach))
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        train(opt, a, 2)
        sched.step()
        ckpt = save_load({"p": [p.detach() for p in a], "opt": opt.state_dict()})
        b = [torch.nn.Parameter(t.clone()) for t in ckpt["p"]]
        opt2 = quantize_optimizer_state(torch.optim.AdamW(b, lr=1e-2, foreach=foreach))
        opt2.load_state_dict(ckpt["opt"])
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        train(opt, a, 2, start=2)
        train(opt2, b, 2, start=2)
        for p, q in zip(a, b):
            assert torch.equal(p, q)
            for key, v in opt.state[p].items():
                w = opt2.state[q][key]
                assert type(v) is type(w)
                if isinstance(v, QuantizedState):
                    assert torch.equal(v.codes, w.codes) and torch.equal(v.absmax, w.absmax)
    c = params()
    stock = torch.optim.AdamW(c, lr=1e-2)
    train(stock, c, 1)
    opt3 = quantize_optimizer_state(torch.optim.AdamW(params(), lr=1e-2))
    opt3.load_state_dict(stock.state_dict())
    assert type(opt3.state[opt3.param_groups[0]["params"][0]]["exp_avg_sq"]) is DTQ8bitTensor


def test_hooks_closure_and_schedulers():
    """Step hooks and the closure run once a step (not once a chunk); a scheduler made before or after the
    conversion sees the step (no 'lr_scheduler.step() before optimizer.step()' warning) and sets lr."""
    for scheduler_first in (False, True):
        ps = params()
        opt = torch.optim.SGD(ps, lr=1.0, momentum=0.9)
        if scheduler_first:
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.0)
        quantize_optimizer_state(opt, chunk_numel=1)
        if not scheduler_first:
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.0)
        calls = []
        opt.register_step_pre_hook(lambda *a, calls=calls: calls.append("pre"))
        opt.register_step_post_hook(lambda *a, calls=calls: calls.append("post"))

        def closure(calls=calls):
            calls.append("closure")
            return torch.tensor(1.0)

        for p, g in zip(ps, grads(0)):
            p.grad = g
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert opt.step(closure).item() == 1.0
            sched.step()
        assert calls == ["pre", "closure", "post"]
        still = [p.detach().clone() for p in ps]
        opt.step()  # lr is 0 now: the momentum buffer moves, the parameters do not
        assert all(torch.equal(p, q) for p, q in zip(ps, still))


def test_non_finite_gradient_stays_in_its_element():
    """torch.optim writes NaN into that element's state and parameter; quantizing keeps it there: every other
    element's parameter is bit-identical to a run with a finite gradient there, and every state is finite."""
    a, b = params(), params()
    oa, ob = (quantize_optimizer_state(torch.optim.AdamW(x, lr=1e-2)) for x in (a, b))
    train(oa, a, 1)
    train(ob, b, 1)
    ga, gb = grads(1), grads(1)
    ga[0].view(-1)[7] = float("nan")
    ga[1].view(-1)[300] = float("inf")
    for p, q, g, h in zip(a, b, ga, gb):
        p.grad, q.grad = g, h
    oa.step()
    ob.step()
    for p, q, i in zip(a[:2], b[:2], (7, 300)):
        others = torch.ones(p.numel(), dtype=torch.bool)
        others[i] = False
        assert torch.equal(p.view(-1)[others], q.view(-1)[others])
        assert not torch.isfinite(p.view(-1)[i])
        for v in oa.state[p].values():
            assert torch.isfinite(v.dequantize() if isinstance(v, QuantizedState) else v).all()


def test_copies_step_like_the_original():
    """copy.deepcopy and pickle give a converted optimizer that steps bit for bit like the original."""
    for clone in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        a = params()
        opt = quantize_optimizer_state(torch.optim.AdamW(a, lr=1e-2), chunk_numel=1000)
        train(opt, a, 1)
        twin = clone({"p": a, "opt": opt})
        assert type(twin["opt"]) is type(opt) and twin["opt"]._quantized_state == opt._quantized_state
        train(twin["opt"], twin["p"], 1, start=1)
        train(opt, a, 1, start=1)
        assert all(torch.equal(p, q) for p, q in zip(twin["p"], a))
        assert type(twin["opt"].state[twin["p"][0]]["exp_avg"]) is DTQ8bitTensor


def test_the_former_format_keyword_still_works_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="use state_format="):
        opt = quantize_optimizer_state(torch.optim.AdamW(params()), format="4bit")
    assert opt._quantized_state["format"] == "4bit"
