"""A user's torch.compile of a training step that calls our optimizer's step (optim/traced.py).

The step is traced as one ``torchao_optim::step_`` operator per parameter group: no graph break with
``fullgraph=True``, no recompile when a tensor lr changes, and the same parameters, bit for bit, as the same
optimizer stepped eagerly, on every executor (the fused CPU step and the per-parameter compiled path here; the
fused CUDA kernels, also under CUDA-graph capture with ``mode="reduce-overhead"``, where a GPU is).
"""

import warnings

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

import torchao_optim
from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim.fused import fused_available
from torchao_optim.testing import fresh_function

CASES = {  # name: (factory, keyword arguments)
    "AdamW8bit": (torchao_optim.AdamW8bit, {}),
    "AdamW8bit-compiled-path": (torchao_optim.AdamW8bit, {"fused": False}),
    # fused=True with TRITON_INTERPRET=1 (test/conftest.py): the Triton kernels, as on CUDA, in the interpreter
    "AdamW8bit-triton": (torchao_optim.AdamW8bit, {"fused": True}),
    "AdamW4bit": (torchao_optim.AdamW4bit, {}),
    "SGD8bit": (torchao_optim.SGD8bit, {"momentum": 0.9}),
    "Lion8bit": (torchao_optim.Lion8bit, {}),
}


def model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32)).to(device)


def twins(name, device):
    """Two equal models with one optimizer each; lr is a tensor on the device, changed every step."""
    make, kw = CASES[name]
    pair = []
    for _ in range(2):
        m = model(device)
        lr = torch.tensor(1e-3, device=device)
        pair.append((m, make(m.parameters(), lr=lr, min_quant_size=1024, **kw), lr))
    return pair


def backward(m, x):
    m(x).square().mean().backward()


def run(name, device, compile_kwargs, steps=4):
    """``steps`` training steps of the twins: backward eagerly, then the compiled step (with a forward after it,
    in the same graph) on one and the eager step on the other. Returns the twins after checking each step."""
    (ma, oa, lra), (mb, ob, lrb) = twins(name, device)
    x = torch.randn(16, 64, device=device)

    @fresh_function
    def train_step(x):
        oa.step()
        return ma(x).square().mean()

    compiled = torch.compile(train_step, **compile_kwargs)
    counters.clear()
    for k in range(steps):
        for lr in (lra, lrb):
            lr.fill_(1e-3 * (k + 1))
        backward(ma, x + k)
        backward(mb, x + k)
        loss = compiled(x)
        ob.step()
        for p, q in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(p, q), f"step {k}: compiled and eager steps differ"
        torch.testing.assert_close(loss, mb(x).square().mean())
        oa.zero_grad()
        ob.zero_grad()
    assert not counters["graph_break"], dict(counters["graph_break"])
    # compiled once: a new lr (a tensor) and new gradients every step did not recompile
    assert len(_debug_get_cache_entry_list(train_step.__code__)) == 1
    for sa, sb in zip(oa.state.values(), ob.state.values()):
        for key in sa:
            if isinstance(sa[key], torchao_optim.QuantizedState):
                for fa, fb in zip(sa[key].fields().values(), sb[key].fields().values()):
                    assert torch.equal(fa, fb)
            else:
                assert torch.equal(sa[key], sb[key])
    return oa, ob


@pytest.mark.skipif(not cpu_kernels_available(), reason="needs a C compiler for the fused CPU step")
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_train_step_matches_eager_on_cpu(name):
    run(name, "cpu", {"fullgraph": True})


def test_operator_given_copies_writes_the_step_into_them():
    """If a compiler hands the operator copies of the optimizer's tensors (no reinplacing), the copies get the
    step (and so do the optimizer's own tensors, which the compiler would overwrite with the copies)."""
    (ma, oa, _), (mb, ob, _) = twins("AdamW8bit", "cpu")
    x = torch.randn(16, 64)
    for m in (ma, mb):
        backward(m, x)
    params, grads, tensors = [], [], []
    oa._init_group(oa.param_groups[0], params, grads, tensors)
    copies = [t.clone() for t in params], [t.clone() for t in tensors]
    torch.ops.torchao_optim.step_(copies[0], grads, copies[1], oa._key, 0)
    ob.step()
    for p, c, q in zip(ma.parameters(), copies[0], mb.parameters()):
        assert torch.equal(c, q) and torch.equal(p, q)
    params2, grads2, tensors2 = [], [], []
    ob._init_group(ob.param_groups[0], params2, grads2, tensors2)
    for c, t in zip(copies[1], tensors2):
        assert torch.equal(c, t)


def test_operator_refuses_a_group_whose_parameters_changed():
    (ma, oa, _), _ = twins("AdamW8bit", "cpu")
    backward(ma, torch.randn(16, 64))
    params, grads, tensors = [], [], []
    oa._init_group(oa.param_groups[0], params, grads, tensors)
    ma[0].weight.grad = None
    with pytest.raises(RuntimeError, match="traced for 4 parameters"):
        torch.ops.torchao_optim.step_(params, grads, tensors, oa._key, 0)


@pytest.mark.skipif(not (torch.cuda.is_available() and fused_available("cuda")), reason="needs CUDA and Triton")
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "SGD8bit"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_fullgraph_train_step_matches_eager_on_cuda(name, mode):
    """The fused CUDA kernels inside a compiled step; with mode="reduce-overhead" the step is captured in the
    compiled function's CUDA graph and replayed (the lr tensor and the gradients are read at replay)."""
    run(name, "cuda", {"fullgraph": True, "mode": mode}, steps=6)


def test_traced_step_is_one_operator_call_per_group():
    """What the compiler sees of the step: one ``torchao_optim::step_`` call per parameter group with gradients,
    nothing of the quantized state."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    m = model("cpu")
    opt = torchao_optim.AdamW8bit(
        [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 1e-4}], min_quant_size=1024
    )
    backward(m, torch.randn(16, 64))
    backend = EagerAndRecordGraphs()
    torch.compile(fresh_function(lambda: opt.step()), backend=backend, fullgraph=True)()
    (graph,) = backend.graphs
    calls = [
        n.target for n in graph.graph.nodes if n.op == "call_function" and n.target is not torch._C._set_grad_enabled
    ]  # no_grad's enter and exit
    assert calls == [torch.ops.torchao_optim.step_] * 2, calls


def test_compiled_path_serves_every_parameter_under_a_compiled_step():
    """A user's torch.compile of the step marks every tensor of the optimizer a static address (torch's optimizer
    support, for CUDA graphs), and dynamo guards on the identity of such an input: the per-parameter compiled
    update would compile once per parameter, and after the recompile limit (8) run eagerly for good. Ten
    parameters of one shape on the compiled path share one graph, and the step stays compiled."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(10)])
    opt = torchao_optim.AdamW8bit(m.parameters(), min_quant_size=0, fused=False)
    x = torch.randn(4, 32)

    @fresh_function
    def step():
        opt.step()

    compiled = torch.compile(step, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # falling back to eager mode warns
        for _ in range(2):
            backward(m, x)
            compiled()
            opt.zero_grad()
    assert opt._update.enabled
    codes = [opt.state[p]["exp_avg"].codes for p in m.parameters()]
    assert all(hasattr(c, "_dynamo_static_input_type") for c in codes)  # what the user's compile marked
