"""The optimizer's state is the truth: what users and frameworks do to ``optimizer.state`` and ``param_groups``
between steps is honoured as ``torch.optim`` honours it."""

from __future__ import annotations

import copy
import unittest
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from torchao_optim import AdamW, AdamW8bit
from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim.fused import fused_available
from torchao_optim.state import QuantizedState, get_state_format
from torchao_optim.testing import assert_same_tensor, save_load


def _grads(shape, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def test_load_before_the_first_step_then_step():
    # accelerate (and so transformers' Trainer) loads the optimizer's own state_dict before its first step
    p = torch.nn.Parameter(torch.randn(64, 128))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = AdamW8bit([p]), AdamW8bit([q])
    opt.load_state_dict(opt.state_dict())
    for g in _grads(p.shape, 3):
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert len(opt.state_dict()["state"]) == 1


def _pair(fmt="dtq8", **kw):
    """Two optimizers over equal parameters: the one a test edits, and a fresh one it is compared with."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    q = torch.nn.Parameter(p.detach().clone())
    return p, q, AdamW([p], state_format=fmt, **kw), AdamW([q], state_format=fmt, **kw)


def _step(pairs, grads):
    for g in grads:
        for p, opt in pairs:
            p.grad = g.clone()
            opt.step()


def _reload_from(opt, ref, edit):
    """``ref`` loaded with ``opt``'s state_dict after ``edit``: what the edited live optimizer must equal."""
    sd = copy.deepcopy(opt.state_dict())
    edit(sd["state"][0])
    ref.load_state_dict(sd)


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("through_state_dict", [False, True])
def test_a_replaced_moment_is_used(fused, through_state_dict):
    # The fused CPU plan used to keep pointers to the replaced codes (freed memory) and write there.
    p, q, opt, ref = _pair(fused=fused, compile=False)
    grads = _grads(p.shape, 6)
    _step([(p, opt)], grads[:3])
    entry = opt.state_dict()["state"][0] if through_state_dict else opt.state[p]
    entry["exp_avg"] = torch.zeros_like(p)
    entry["exp_avg_sq"] = torch.zeros_like(p)
    q.data.copy_(p.data)
    _reload_from(opt, ref, lambda e: None)
    _step([(p, opt), (q, ref)], grads[3:])
    torch.testing.assert_close(p, q, rtol=0, atol=0)
    # requantized at the step, into the optimizer's format (docs/optimizers.md)
    assert type(opt.state[p]["exp_avg"]) is type(ref.state[q]["exp_avg"])


@pytest.mark.parametrize("fused", [None, False])
def test_a_deleted_moment_starts_again_from_zeros(fused):
    p, q, opt, ref = _pair(fused=fused, compile=False)
    grads = _grads(p.shape, 6)
    _step([(p, opt)], grads[:3])
    del opt.state_dict()["state"][0]["exp_avg"]  # state_dict()'s entries are the live dicts, as torch.optim's
    q.data.copy_(p.data)
    _reload_from(opt, ref, lambda e: e.update(exp_avg=torch.zeros_like(p)))
    _step([(p, opt), (q, ref)], grads[3:])
    torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("reset", ["clear", "empty dict", "del", "new defaultdict"])
def test_a_reset_state_starts_again(reset):
    p, q, opt, ref = _pair()
    grads = _grads(p.shape, 6)
    _step([(p, opt)], grads[:3])
    if reset == "clear":
        opt.state.clear()
    elif reset == "empty dict":
        opt.state[p] = {}
    elif reset == "del":
        del opt.state[p]
    else:
        opt.state = defaultdict(dict)
    q.data.copy_(p.data)
    _step([(p, opt), (q, ref)], grads[3:])
    torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt.state_dict()["state"][0]["step"].item() == 3.0


def test_a_state_that_cannot_be_used_is_refused_by_name():
    p, _, opt, _ = _pair()
    _step([(p, opt)], _grads(p.shape, 1))
    opt.state[p]["exp_avg"] = torch.zeros(3)
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=r"parameter 0 of shape \(64, 128\): state\['exp_avg'\] has shape \(3,\)"):
        opt.step()
    opt.state[p] = None
    with pytest.raises(ValueError, match=r"the state of parameter 0 of shape \(64, 128\) must be a dict, got NoneType"):
        opt.step()


def test_a_state_of_the_optimizers_own_form_is_used_as_it_is():
    # a plain fp32 tensor where the optimizer keeps fp32 state is the state from then on, as in torch.optim
    p, _, opt, _ = _pair(fmt="none")
    _step([(p, opt)], _grads(p.shape, 1))
    mine = torch.zeros_like(p)
    opt.state[p]["exp_avg"] = mine
    _step([(p, opt)], _grads(p.shape, 1, seed=1))
    assert opt.state[p]["exp_avg"] is mine and mine.abs().sum() > 0


def test_rolling_back_while_stepping_in_backward():
    from torchao_optim import step_in_backward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    opt = AdamW8bit(model.parameters(), lr=1e-2)
    step_in_backward(model, opt)
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def train(batches):
        for x in batches:
            model(x).pow(2).mean().backward()

    train(xs[:3])
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(xs[3:])
    expected = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    train(xs[3:])
    assert [s["step"].item() for s in opt.state.values()] == [6.0] * 4
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=0)


def test_a_loaded_lr_is_used_while_stepping_in_backward():
    from torchao_optim import step_in_backward

    p, q, opt, ref = _pair()
    step_in_backward([p], opt)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    opt.load_state_dict(sd)
    ref.param_groups[0]["lr"] = 0.5
    for g in _grads(p.shape, 2):
        (p * g).sum().backward()
        q.grad = g.clone()
        ref.step()
    torch.testing.assert_close(p, q, rtol=0, atol=0)


# ---- the stateful property test -------------------------------------------------------------------------------
# Random sequences of what users and frameworks do to an optimizer, on every executor, with plain and quantized
# state. After any sequence of events, a step must be exactly the step of a fresh optimizer of the same settings
# that loaded the live optimizer's state_dict just before it: whatever the optimizer caches follows its state.

SHAPES = ((16, 64), (40,))  # quantized (1024 elements, 4 blocks); below min_quant_size: plain fp32 state
MIN_QUANT_SIZE = 512
EXECUTOR_OPTIONS = {  # executor -> (fused=, compile=)
    "cpu": (None, True),  # the fused C step (the CPU default)
    "compiled": (False, True),  # the per-parameter torch.compile path
    "triton": (True, True),  # the Triton kernels, in Triton's interpreter on the CPU
}


def _executor_skip(executor):
    if executor == "cpu" and not cpu_kernels_available():
        return "the fused CPU step could not be built (no C compiler)"
    if executor == "triton" and not fused_available(_device(executor)):
        return "the Triton kernels cannot run here (Triton and CUDA, or Triton's interpreter on the CPU)"
    return None


def _device(executor):
    """The Triton kernels on the GPU where there is one (their steps are then replayed from CUDA graphs after two
    alike), else in Triton's interpreter; the other executors on the CPU."""
    return torch.device("cuda" if executor == "triton" and torch.cuda.is_available() else "cpu")


def _fill_missing(opt, sd):
    """``sd`` with what the optimizer creates for a state entry that lacks keys (docs/optimizers.md): zeros and
    step 0, so that a fresh optimizer can load it."""
    ids = {
        pid: (p, g)
        for g, saved in zip(opt.param_groups, sd["param_groups"])
        for p, pid in zip(g["params"], saved["params"])
    }
    for pid, entry in sd["state"].items():
        if entry:
            p, g = ids[pid]
            entry.setdefault("step", torch.tensor(0.0))
            for key in opt._state_keys(g, p):
                entry.setdefault(key, torch.zeros_like(p))
    return sd


class OptimizerEvents(RuleBasedStateMachine):
    format_name = "dtq8"
    executor = "cpu"

    def make(self, groups):
        fused, compile = EXECUTOR_OPTIONS[self.executor]
        return AdamW(
            groups,
            lr=1e-2,
            weight_decay=0.1,
            state_format=self.format_name,
            fused=fused,
            compile=compile,
            min_quant_size=MIN_QUANT_SIZE,
        )

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = _device(self.executor)
        self.params = [torch.nn.Parameter(self.randn(s)) for s in SHAPES]
        self.opt = self.make([{"params": self.params}])
        self.groups_added = 0

    def randn(self, shape):
        return torch.randn(shape, generator=self.gen).to(self.device)

    def all_params(self):
        return [p for g in self.opt.param_groups for p in g["params"]]

    def reference(self):
        """A fresh optimizer over copies of the parameters, loaded with the live one's state_dict."""
        sd = _fill_missing(self.opt, copy.deepcopy(self.opt.state_dict()))
        copies = [[torch.nn.Parameter(p.detach().clone()) for p in g["params"]] for g in self.opt.param_groups]
        ref = self.make([{"params": c} for c in copies])
        ref.load_state_dict(sd)
        return ref, [p for c in copies for p in c]

    @rule(data=st.data())
    def step(self, data):
        params = self.all_params()
        ref, copies = self.reference()
        for p, q in zip(params, copies):
            how = data.draw(st.sampled_from(["new", "new", "in place", "none"]), label=f"grad {tuple(p.shape)}")
            g = self.randn(p.shape)
            if how == "none":
                p.grad = q.grad = None
            elif how == "in place" and p.grad is not None:
                p.grad.copy_(g)
                q.grad = g.clone()
            else:
                p.grad, q.grad = g, g.clone()
        self.opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, copies)):
            assert torch.equal(p, q), f"parameter {i} {tuple(p.shape)}: {(p - q).abs().max().item()} from the reference"
            if q.grad is None:
                continue  # not stepped: its state is as the events left it (the reference's was completed to load)
            mine, theirs = self.opt.state.get(p, {}), ref.state.get(q, {})
            assert sorted(mine) == sorted(theirs), (i, sorted(mine), sorted(theirs))
            for key in mine:
                assert_same_tensor(pytest_case, mine[key], theirs[key], f"parameter {i} state[{key!r}]")

    @rule(
        key=st.sampled_from(["exp_avg", "exp_avg_sq", "step"]),
        i=st.integers(0, 7),
        form=st.sampled_from(["zeros", "plain", "format"]),
    )
    def replace_state(self, key, i, form):
        params = [p for p in self.all_params() if self.opt.state.get(p)]
        if not params:
            return
        p = params[i % len(params)]
        if key == "step":
            self.opt.state[p]["step"] = torch.tensor(float(i))  # on the CPU: moved to the parameter's device
            return
        value = torch.rand(p.shape, generator=self.gen).to(self.device)
        if key == "exp_avg":
            value = 2 * value - 1
        if form == "zeros":
            value = torch.zeros_like(p)
        elif form == "format" and isinstance(self.opt.state[p][key], QuantizedState):
            value = get_state_format(self.format_name).from_float(value, signed=key == "exp_avg")
        self.opt.state[p][key] = value

    @rule(key=st.sampled_from(["exp_avg", "exp_avg_sq", "step"]), i=st.integers(0, 7), through_state_dict=st.booleans())
    def delete_state(self, key, i, through_state_dict):
        params = [p for p in self.all_params() if key in self.opt.state.get(p, {})]
        if not params:
            return
        p = params[i % len(params)]
        if through_state_dict:  # state_dict()'s entries are the live dicts, as torch.optim's
            sd = self.opt.state_dict()
            index = next(j for j, q in enumerate(self.all_params()) if q is p)
            del sd["state"][index][key]
        else:
            del self.opt.state[p][key]

    @rule(how=st.sampled_from(["clear", "empty dict", "del", "new defaultdict"]), i=st.integers(0, 7))
    def reset_state(self, how, i):
        params = self.all_params()
        p = params[i % len(params)]
        if how == "clear":
            self.opt.state.clear()
        elif how == "empty dict":
            self.opt.state[p] = {}
        elif how == "del":
            self.opt.state.pop(p, None)
        else:
            self.opt.state = defaultdict(dict)

    @rule(through_disk=st.booleans())
    def state_dict_round_trip(self, through_disk):
        sd = self.opt.state_dict()
        sd = save_load(sd) if through_disk else copy.deepcopy(sd)
        partial = [pid for pid, entry in sd["state"].items() if entry and len(entry) < 3]
        if partial:  # a key deleted since the last step: a checkpoint lacking it is refused, naming it
            before = self.opt.state_dict()["state"]
            with pytest.raises(ValueError, match=r"parameter \d+ of shape .*: state has no \["):
                self.opt.load_state_dict(sd)
            assert self.opt.state_dict()["state"] is not before and len(self.opt.state_dict()["state"]) == len(before)
        else:
            self.opt.load_state_dict(sd)

    @precondition(lambda self: self.groups_added < 2)
    @rule(lr=st.sampled_from([1e-3, 3e-2]))
    def add_param_group(self, lr):
        shape = SHAPES[self.groups_added % len(SHAPES)]
        self.opt.add_param_group({"params": [torch.nn.Parameter(self.randn(shape))], "lr": lr})
        self.groups_added += 1

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        self.opt.zero_grad(set_to_none=set_to_none)

    @rule(i=st.integers(0, 7))
    def replace_param_data(self, i):
        params = self.all_params()
        p = params[i % len(params)]
        p.data = p.data.clone()

    @rule(lr=st.sampled_from([1e-3, 1e-2, 5e-2]), beta2=st.sampled_from([0.95, 0.999]), g=st.integers(0, 3))
    def change_hyperparameters(self, lr, beta2, g):
        group = self.opt.param_groups[g % len(self.opt.param_groups)]
        group["lr"] = lr
        group["betas"] = (group["betas"][0], beta2)

    @rule()
    def deepcopy(self):
        self.opt = copy.deepcopy(self.opt)  # copies the parameters too: train the copies from now on

    @invariant()
    def state_dict_is_loadable(self):
        if hasattr(self, "opt"):
            sd = self.opt.state_dict()
            assert set(sd["state"]) <= set(range(len(self.all_params())))


pytest_case = unittest.TestCase()
pytest_case.maxDiff = None

STATEFUL_SETTINGS = settings(
    max_examples=12, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@pytest.mark.parametrize("format_name", ["none", "dtq8"])
@pytest.mark.parametrize("executor", list(EXECUTOR_OPTIONS))
def test_events_keep_the_optimizer_its_state(executor, format_name):
    reason = _executor_skip(executor)
    if reason:
        pytest.skip(reason)
    machine = type(
        f"Events_{executor}_{format_name}", (OptimizerEvents,), {"executor": executor, "format_name": format_name}
    )
    run_state_machine_as_test(machine, settings=STATEFUL_SETTINGS)


def test_a_state_on_the_meta_device_put_in_is_refused_by_name():
    p, _, opt, _ = _pair()
    _step([(p, opt)], _grads(p.shape, 1))
    opt.state[p]["exp_avg"] = torch.zeros(p.shape, device="meta")
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=r"parameter 0 of shape \(64, 128\): state\['exp_avg'\] is on the meta device"):
        opt.step()
