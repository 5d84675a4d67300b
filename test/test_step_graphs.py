"""A group's CUDA step replayed from a CUDA graph (optim/replay.py) steps exactly as the step issued from Python
(on a GPU), and what decides when a graph is captured, replayed or dropped (on the CPU, with the capture
stood in for: the signature and the capture policy are plain Python)."""

import pytest
import torch

import torchao_optim
from torchao_optim.optim import dispatch, replay
from torchao_optim.optim.fused import fused_available
from torchao_optim.state import QuantizedState

requires_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused_available()), reason="needs a CUDA device and Triton"
)

SHAPES = [(256, 64), (1000, 7), (300,), (5000,), (3, 4096)]


def fields(state):
    return list(state.fields().values()) if isinstance(state, QuantizedState) else [state]


def train(opt, params, grads, graphs: bool, lr_tensor=None):
    """Ten steps: gradients written in place, except that param 0's moves to a new tensor at step 4; the lr
    changes every step; ``maximize`` flips at step 7 (a setting: the graph must be dropped)."""
    old = replay.ENABLED
    replay.ENABLED = graphs
    try:
        for i, g in enumerate(grads):
            for p, gi in zip(params, g):
                if p.grad is None or (i == 4 and p is params[0]):
                    p.grad = gi.clone()
                else:
                    p.grad.copy_(gi)
            lr = 1e-3 * (1 + 0.1 * i)
            for group in opt.param_groups:
                if lr_tensor is not None:
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
                group["maximize"] = i >= 7
            opt.step()
    finally:
        replay.ENABLED = old


@requires_cuda
@pytest.mark.parametrize(
    "case",
    [
        "fused-fp32",
        "compiled-fp32",
        "fused-bf16-sr",
        "compiled-bf16-sr",
        "fused-tensor-lr",
        "sgd8bit",
        "compiled-4bit",
        "muon8bit",
    ],
)
def test_replayed_step_equals_the_step_from_python(case, monkeypatch):
    dtype = torch.bfloat16 if "bf16" in case else torch.float32
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to("cuda", dtype) * 1e-2 for s in SHAPES] for _ in range(10)]
    captures = []
    real_capture = replay.StepGraph._capture
    monkeypatch.setattr(
        replay.StepGraph, "_capture", lambda self, work, device: captures.append(1) or real_capture(self, work, device)
    )

    def build():
        params = [torch.nn.Parameter(x.to("cuda", dtype)) for x in init]
        lr = torch.tensor(1e-3, device="cuda") if case == "fused-tensor-lr" else 1e-3
        kw = dict(lr=lr, min_quant_size=512, bf16_stochastic_round="sr" in case)
        if case == "sgd8bit":
            opt = torchao_optim.SGD8bit(params, lr=1e-3, momentum=0.9, min_quant_size=512)
        elif case == "muon8bit":  # Newton-Schulz matmuls on the compiled path, the AdamW fallback fused
            opt = torchao_optim.Muon8bit(params, lr=2e-2, min_quant_size=512)
        elif case == "compiled-4bit":
            opt = torchao_optim.AdamW(params, state_format="4bit", fused=False, **kw)
        else:
            opt = torchao_optim.AdamW(params, fused=None if case.startswith("fused") else False, **kw)
        return params, opt

    (a, opt_a), (b, opt_b) = build(), build()
    lr_tensor = case == "fused-tensor-lr" or None
    train(opt_a, a, grads, graphs=True, lr_tensor=lr_tensor)
    n_captures = len(captures)
    train(opt_b, b, grads, graphs=False, lr_tensor=lr_tensor)
    # captured after the first steps, again after the moved gradient (the compiled path reads it by address)
    # or not (the fused path's table follows it), and again after maximize flipped; never without graphs
    assert n_captures >= 2 and len(captures) == n_captures, captures
    assert opt_a._graphs and all(g.graph is not None and not g.failed for g in opt_a._graphs.values())
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            for x, y in zip(fields(sa[key]), fields(sb[key])):
                assert torch.equal(x, y), (case, key)


@requires_cuda
def test_a_group_that_cannot_be_captured_steps_without_a_graph(monkeypatch):
    # a capture that fails (here: a host copy of pageable memory, which a capture refuses) warns once and
    # leaves the group stepping from Python, with the same results
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES]
    opt = torchao_optim.AdamW(params, fused=False, min_quant_size=512)
    real = dispatch.step_compiled

    def with_a_host_copy(*args):
        torch.ones(4).to("cuda")
        return real(*args)

    monkeypatch.setattr(dispatch, "step_compiled", with_a_host_copy)
    for p in params:
        p.grad = torch.ones_like(p)  # in place from here on: the signature repeats
    with pytest.warns(RuntimeWarning, match="could not capture"):
        for _ in range(replay.REPEATS + 2):
            opt.step()
    graph = next(iter(opt._graphs.values()))
    assert graph.failed and graph.graph is None
    assert all(opt.state[p]["step"].item() == replay.REPEATS + 2 for p in params)


class _Recorded:
    """Stands in for a CUDA graph on the CPU: its "replay" runs the work it was "captured" from."""

    def __init__(self, work):
        self.work = work

    def replay(self):
        self.work()


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Replay on the CPU: every step reports (signature, what happened, which way) to the returned list; the way
    is "full" (the signature built and compared) or "steady" (replay.Steady's checks only)."""
    events = []
    monkeypatch.setattr(dispatch, "replay_device", lambda optimizer, group, params: torch.device("cpu"))
    monkeypatch.setattr(replay.StepGraph, "_capture", lambda self, work, device: _Recorded(work))
    real_run, real_again = replay.StepGraph.run, replay.StepGraph.again

    def run(self, signature, keep, work, device):
        before = self.graph
        replayed = real_run(self, signature, keep, work, device)
        events.append(
            (
                signature,
                "replayed"
                if before is not None and self.graph is before
                else "captured"
                if self.graph is not None
                else "python",
                "full",
            )
        )
        return replayed

    def again(self):
        real_again(self)
        events.append((self.signature, "replayed", "steady"))

    monkeypatch.setattr(replay.StepGraph, "run", run)
    monkeypatch.setattr(replay.StepGraph, "again", again)
    return events


@pytest.mark.parametrize("fused", [None, False])
def test_what_keeps_and_what_drops_a_graph(cpu_graphs, fused):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 32), (300,)]]
    opt = torchao_optim.AdamW(params, fused=fused, min_quant_size=512)
    group = opt.param_groups[0]

    def step(**change):
        for k, v in change.items():
            group[k] = v
        opt.step()
        return cpu_graphs[-1][1]

    for p in params:
        p.grad = torch.randn_like(p)
    assert [step() for _ in range(replay.REPEATS + 2)] == ["python"] * replay.REPEATS + ["captured", "replayed"]
    # numbers the hyperparameter tensor carries are data: a new lr, betas or weight decay replays the graph
    assert step(lr=3e-4) == step(betas=(0.8, 0.99)) == step(weight_decay=0.1) == "replayed"
    # a setting is a constant of the graph: it is dropped, and captured again once the change has repeated
    assert [step(maximize=True) for _ in range(replay.REPEATS + 2)] == ["python"] * replay.REPEATS + [
        "captured",
        "replayed",
    ]
    # a moved gradient: the fused path reads its address from a table refreshed before each replay; the
    # compiled path reads it directly, so its graph is dropped
    params[0].grad = params[0].grad.clone()
    assert step() == ("replayed" if fused is None else "python")
    if fused is False:  # a state replaced by assignment: the compiled path's graph reads states by address
        for _ in range(replay.REPEATS + 1):
            opt.step()
        assert cpu_graphs[-1][1] == "replayed"
        state = opt.state[params[0]]
        state["exp_avg"] = state["exp_avg"].clone()
        assert step() == "python"
    # a parameter without a gradient is a new list of parameters to step
    params[1].grad = None
    assert step() == "python"


def test_the_short_way_replays_only_what_the_full_way_would(cpu_graphs):
    # after a replay, the next step checks the gradients' and parameters' addresses and the settings' identity
    # only (replay.Steady); whatever else changed goes the full way, which builds the signature and decides
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 32), (300,), (7,)]]
    opt = torchao_optim.AdamW(params, min_quant_size=512)
    group = opt.param_groups[0]
    for p in params:
        p.grad = torch.randn_like(p)

    def way(**change):
        group.update(change)
        opt.step()
        return cpu_graphs[-1][1:]

    for _ in range(replay.REPEATS + 1):
        opt.step()
    assert cpu_graphs[-1][1:] == ("captured", "full")
    steady = ("replayed", "steady")
    assert way() == way(lr=3e-4) == way(betas=(0.8, 0.99)) == way(weight_decay=0.1) == steady
    params[0].grad = params[0].grad.clone()  # moved: the plan's table follows it
    assert way() == steady and opt._plans[id(group)]["plans"][0].grad_key[0] == params[0].grad.data_ptr()
    # a setting set to an equal value of another object: the full way finds the same signature
    assert group["min_quant_size"] == 512 and way(min_quant_size=int("2") * 256) == ("replayed", "full")
    assert way() == steady
    assert way(maximize=True) == ("python", "full")
    for _ in range(replay.REPEATS + 1):
        opt.step()
    assert way() == steady
    params[2].data = params[2].data.clone()  # the plan holds the old address
    assert way() == ("python", "full")
    for _ in range(replay.REPEATS + 1):
        opt.step()
    assert way() == steady
    # the list changed in place, to a parameter at the same address (its state is its own)
    group["params"][2] = new = torch.nn.Parameter(params[2].detach())
    new.grad = torch.randn(7)
    assert way() == ("python", "full") and "exp_avg" in opt.state[new]
    for _ in range(replay.REPEATS + 1):
        opt.step()
    assert way() == steady
    opt._plans[id(group)].clear()  # planned again (as a step traced by torch.compile may): new plans, new graph
    assert way() == ("python", "full")
    for _ in range(replay.REPEATS + 1):
        opt.step()
    assert way() == steady
    g = params[0].grad  # a view at the same address, not contiguous: planned again
    params[0].grad = g.as_strided(g.shape, (1, g.shape[0]))
    assert way() == ("python", "full") and opt._plans[id(group)]["rest"] == [0]
    params[0].grad = g  # contiguous again: the parameter stays on the compiled path until planned again
    opt._plans[id(group)].clear()
    for _ in range(replay.REPEATS + 1):
        opt.step()
    assert way() == steady and opt._plans[id(group)]["rest"] == []
    params[0].grad = params[0].grad.t().contiguous().t()  # moved, and not contiguous: planned again
    assert way() == ("python", "full") and opt._plans[id(group)]["rest"] == [0]
    params[1].grad = None
    assert way() == ("python", "full")
    params[1].grad = torch.randn(300).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_muon_eps_is_a_setting_and_its_lr_is_data(cpu_graphs):
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(300))]
    opt = torchao_optim.Muon8bit(params, lr=2e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    for _ in range(replay.REPEATS + 1):
        opt.step()
    assert cpu_graphs[-1][1] == "captured"
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()
    assert cpu_graphs[-1][1] == "replayed"
    opt.param_groups[0]["eps"] = 1e-6  # read by the Newton-Schulz iteration as a Python number
    opt.step()
    assert cpu_graphs[-1][1] == "python"


def test_replayed_steps_equal_steps_from_python_on_the_cpu(cpu_graphs):
    # the bookkeeping around a replay (hyperparameters refilled outside it, plans' gradient tables refreshed
    # outside it) leaves the step what it was: stood-in replays give the parameters of a plain run
    def train(graphs):
        old, replay.ENABLED = replay.ENABLED, graphs
        try:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 32), (300,)]]
            opt = torchao_optim.AdamW(params, min_quant_size=512)
            for i in range(6):
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.param_groups[0]["lr"] = 1e-3 * (i + 1)
                opt.step()
            return params
        finally:
            replay.ENABLED = old

    for a, b in zip(train(True), train(False)):
        assert torch.equal(a, b)
    assert "replayed" in [e[1] for e in cpu_graphs]
