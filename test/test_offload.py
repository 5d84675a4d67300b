"""``offload_state=True``: the state lives in host memory in its low-bit form and is streamed through the fused
kernels chunk by chunk. Training is bit for bit the GPU-resident fused step's, for every optimizer, format and
parameter dtype of the fused path, with many chunks and with one; checkpoints resume exactly, either way round;
what cannot be offloaded is refused by name. On the CPU the fused kernels run in Triton's interpreter (conftest)
with CPU slots; on CUDA the same tests also check that the state is page-locked and that the GPU holds only the
two slots."""

import pytest
import torch
from c_only_rule import DecayingMomentumCOnly8bit

import torchao_optim.optim.offload as offload
from torchao_optim import AdamW, AdamW8bit, AdEMAMix8bit, Lion8bit, Muon8bit, SGD8bit, step_in_backward
from torchao_optim.optim.fused import fused_available
from torchao_optim.state import QuantizedState
from torchao_optim.testing import fresh_function
from torchao_optim.testing.compare import save_load

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not fused_available(DEVICE), reason="needs the fused path (Triton)")

# quantized from 256 elements on (small, for Triton's interpreter): whole blocks, a partial block, plain state
SHAPES = [(16, 32), (24,), (8, 64), (40, 16)]
SMALL = dict(fused=True, min_quant_size=256)
OPTIMIZERS = {
    "AdamW8bit": lambda ps, **kw: AdamW8bit(ps, lr=1e-2, **SMALL, **kw),
    "AdamW-4bit": lambda ps, **kw: AdamW(ps, lr=1e-2, state_format="4bit", **SMALL, **kw),
    "AdamW-fp8": lambda ps, **kw: AdamW(ps, lr=1e-2, state_format="fp8", **SMALL, **kw),
    "SGD8bit": lambda ps, **kw: SGD8bit(ps, lr=1e-2, momentum=0.9, nesterov=True, **SMALL, **kw),
    "Lion8bit": lambda ps, **kw: Lion8bit(ps, lr=1e-3, weight_decay=0.1, **SMALL, **kw),
    "AdEMAMix8bit": lambda ps, **kw: AdEMAMix8bit(ps, lr=1e-2, t_alpha=2, t_beta3=2, **SMALL, **kw),  # three states
}


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(DEVICE, dtype).requires_grad_() for s in SHAPES]


def _train(params, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(DEVICE, p.dtype)
        opt.step()


def _equal_state(a, b):
    for x, y in zip(a.state.values(), b.state.values()):
        assert x.keys() == y.keys()
        for k in x:
            u, v = x[k], y[k]
            if isinstance(u, QuantizedState):
                assert all(torch.equal(f.cpu(), v.fields()[n].cpu()) for n, f in u.fields().items()), k
            else:
                assert torch.equal(u.cpu(), v.cpu()), k


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of at most 256 bytes: every parameter a chunk of its own, the two slots alternating."""
    monkeypatch.setattr(offload, "CHUNK_BYTES", 256)


@pytest.mark.parametrize(
    "name,chunks",
    [
        # AdEMAMix's three states with many chunks in CI (about 1.3 s in Triton's interpreter), with one --runslow
        pytest.param(name, chunks, marks=pytest.mark.slow if (name, chunks) == ("AdEMAMix8bit", "one") else ())
        for name in OPTIMIZERS
        for chunks in ("one", "many")
    ],
)
def test_same_training_as_gpu_resident_state(name, chunks, request):
    if chunks == "many":
        request.getfixturevalue("small_chunks")
    ref_params, params = _params(), _params()
    ref, opt = OPTIMIZERS[name](ref_params), OPTIMIZERS[name](params, offload_state=True)
    _train(ref_params, ref, 3)
    _train(params, opt, 3)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    _equal_state(ref, opt)
    n_chunks = len(next(iter(opt._plans.values()))["chunks"])
    assert (n_chunks > 2) if chunks == "many" else (n_chunks <= 2)  # one per plan key (quantized / plain state)
    for s in opt.state.values():
        for k, v in s.items():
            if k != "step":
                assert v.device.type == "cpu"
                if DEVICE == "cuda":
                    inner = v.fields().values() if isinstance(v, QuantizedState) else [v]
                    assert all(t.is_pinned() for t in inner)


def test_bf16_params_with_stochastic_rounding(small_chunks):
    ref_params, params = _params(torch.bfloat16), _params(torch.bfloat16)
    ref = AdamW8bit(ref_params, lr=1e-3, bf16_stochastic_round=True, **SMALL)
    opt = AdamW8bit(params, lr=1e-3, bf16_stochastic_round=True, offload_state=True, **SMALL)
    _train(ref_params, ref, 3)
    _train(params, opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))


@pytest.mark.parametrize("target", ["offloaded", "resident"])
def test_checkpoint_resumes_exactly(target, small_chunks):
    """Offloaded state saved with torch.save and loaded (into an offloaded optimizer, or into one that keeps state
    on the device) continues bit for bit as the uninterrupted run. (The host arenas are one per dtype: torch.save
    refuses views of one storage as two dtypes.)"""
    params = _params()
    opt = AdamW8bit(params, lr=1e-2, offload_state=True, **SMALL)
    _train(params, opt, 2)
    saved = save_load(opt.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in params]
    opt2 = AdamW8bit(resumed, lr=1e-2, offload_state=target == "offloaded", **SMALL)
    opt2.load_state_dict(saved)
    _train(params, opt, 2, seed=7)
    _train(resumed, opt2, 2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))
    _equal_state(opt, opt2)


def test_resident_checkpoint_loads_into_host_memory(small_chunks):
    params = _params()
    opt = AdamW8bit(params, lr=1e-2, **SMALL)
    _train(params, opt, 2)
    resumed = [p.detach().clone().requires_grad_() for p in params]
    opt2 = AdamW8bit(resumed, lr=1e-2, offload_state=True, **SMALL)
    opt2.load_state_dict(opt.state_dict())
    assert all(v.device.type == "cpu" for s in opt2.state.values() for k, v in s.items() if k != "step")
    _train(params, opt, 2, seed=7)
    _train(resumed, opt2, 2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


def test_step_in_backward(small_chunks):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16)).to(DEVICE)

    ref, ours = model(), model()
    ref_opt = AdamW8bit(ref.parameters(), lr=1e-2, **SMALL)
    opt = AdamW8bit(ours.parameters(), lr=1e-2, offload_state=True, **SMALL)
    step_in_backward(ours, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g).to(DEVICE), torch.randn(8, 16, generator=g).to(DEVICE)
        (ref(x) - y).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (ours(x) - y).square().mean().backward()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters()))


def test_refusals():
    p = torch.randn(64, 96, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="fused=False"):
        AdamW8bit([p], fused=False, offload_state=True)
    with pytest.raises(ValueError, match=r"rule 'decaying_momentum_c_only' has no Triton element update"):
        DecayingMomentumCOnly8bit([p], fused=True, offload_state=True)
    with pytest.raises(ValueError, match="Muon"):
        Muon8bit([p], offload_state=True)
    with pytest.raises(ValueError, match="offload_state: 1"):
        AdamW8bit([p], fused=True, offload_state=1)
    # a parameter the fused path does not cover (not contiguous) is named; the optimizer stays usable
    q = torch.randn(32, 16, device=DEVICE).t().requires_grad_()
    opt = AdamW8bit([q], offload_state=True, **SMALL)
    q.grad = torch.randn_like(q)
    with pytest.raises(ValueError, match=r"shape \(16, 32\).*not covered"):
        opt.step()
    assert "exp_avg" not in opt.state[q]


@pytest.mark.skipif(DEVICE != "cuda", reason="GPU memory")
def test_gpu_holds_two_slots_not_the_state():
    params = [torch.randn(1024, 1024, device="cuda", requires_grad=True) for _ in range(64)]  # 64M params
    for p in params:
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = AdamW8bit(params, offload_state=True)
    opt.step()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    slots = 2 * opt._offload.slots.nbytes
    assert slots == 2 * offload.CHUNK_BYTES
    assert grown < slots + (4 << 20), (grown, slots)  # the slots and the plans' small tables
    state_bytes = sum(offload.state_nbytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    assert state_bytes > 2 * 64 * 2**20  # 2 bytes a parameter and the scales, all in host memory


def test_step_inside_torch_compile(small_chunks):
    """A compiled function calling the step (optim/traced.py) with offloaded state: the offloaded states are not
    handed to the graph (only the parameters), and training is the eager twin's bit for bit."""
    a, b = _params(), _params()
    oa, ob = OPTIMIZERS["AdamW8bit"](a, offload_state=True), OPTIMIZERS["AdamW8bit"](b, offload_state=True)
    step = torch.compile(fresh_function(lambda: oa.step()), fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=g).to(DEVICE)
            q.grad = p.grad.clone()
        step()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    _equal_state(oa, ob)


def test_host_memory_stays_registered_while_the_states_use_it(monkeypatch):
    """Each arena is page-locked until its tensor is freed (pinned_empty); the states and chunks view the fp32 arena
    as fp32, a view that does not keep its base tensor, so the plan must. (On CUDA the states would otherwise be
    unpinned after the first step, and every copy would wait.)"""
    import weakref

    freed = []
    made = offload.pinned_empty

    def recorded(nbytes):
        t = made(nbytes)
        weakref.finalize(t, freed.append, nbytes)
        return t

    monkeypatch.setattr(offload, "pinned_empty", recorded)
    params = _params()
    opt = AdamW8bit(params, lr=1e-2, offload_state=True, **SMALL)
    _train(params, opt, 2)
    import gc

    gc.collect()
    assert freed == []
