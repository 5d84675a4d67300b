"""``step_in_backward``: each parameter steps as soon as its gradient is accumulated and the gradient is freed;
training is bit for bit what backward + ``step()`` gives, on both executors, for every optimizer of ours."""

import warnings

import pytest
import torch

from torchao_optim import AdamW8bit, Lion8bit, Muon8bit, SGD8bit, step_in_backward
from torchao_optim.optim.fused import fused_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIMIZERS = {
    "AdamW8bit": lambda ps, fused: AdamW8bit(ps, lr=1e-2, fused=fused),
    "SGD8bit": lambda ps, fused: SGD8bit(ps, lr=1e-2, momentum=0.9, fused=fused),
    "Lion8bit": lambda ps, fused: Lion8bit(ps, lr=1e-3, weight_decay=0.1, fused=fused),
    # its matrices' momentum a plan of their own each (Muon's rule writes the direction), Newton-Schulz in the hook
    "Muon8bit": lambda ps, fused: Muon8bit(ps, lr=1e-2, fused=fused),
}
# fused=None: the fused C step on the CPU, the Triton kernels on CUDA; True: the Triton kernels (Triton's interpreter on
# the CPU, with TRITON_INTERPRET=1)
EXECUTORS = [False, None] + ([True] if fused_available(DEVICE) else [])


def _model():
    torch.manual_seed(0)
    # 96x64 and 64x96 weights are past min_quant_size (4096): quantized state; biases keep plain state
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64)).to(DEVICE)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=g).to(DEVICE), torch.randn(8, 64, generator=g).to(DEVICE)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x) - y).square().mean()


@pytest.mark.parametrize("fused", EXECUTORS, ids=lambda f: {False: "compiled", None: "default", True: "fused"}[f])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_same_training_as_step_after_backward(name, fused):
    ref, ours = _model(), _model()
    ref_opt = OPTIMIZERS[name](ref.parameters(), fused)
    opt = OPTIMIZERS[name](ours.parameters(), fused)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    handle = step_in_backward(ours, opt)
    for x, y in _batches(4):
        _loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        _loss(ours, x, y).backward()  # steps every parameter
        with warnings.catch_warnings():  # the optimizer has stepped: no "lr_scheduler.step() before" warning
            warnings.simplefilter("error")
            sched.step()
        assert all(p.grad is None for p in ours.parameters())
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)
    handle.remove()
    _loss(ours, *_batches(1)[0]).backward()
    opt.step()  # a plain step again, from the per-parameter step counts
    assert all(float(opt.state[p]["step"]) == 5 for p in ours.parameters())


def test_never_more_than_one_gradient_alive():
    model = _model()
    params = list(model.parameters())
    alive = []
    for p in params:  # registered first: runs before the step's hook, and sees every gradient alive then
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad is not None for q in params)))
    opt = AdamW8bit(model.parameters())
    step_in_backward(model, opt)
    _loss(model, *_batches(1)[0]).backward()
    assert alive == [1] * len(params)


def test_what_needs_every_gradient_is_refused():
    model = _model()
    opt = AdamW8bit(model.parameters())
    with pytest.raises(ValueError, match="max_grad_norm"):
        step_in_backward(model, opt, max_grad_norm=1.0)
    with pytest.raises(TypeError, match="AdamW"):
        step_in_backward(model, torch.optim.AdamW(model.parameters()))
    handle = step_in_backward(model, opt)
    with pytest.raises(RuntimeError, match="already"):
        step_in_backward(model, opt)
    with pytest.raises(ValueError, match="not among the model's parameters"):
        step_in_backward(torch.nn.Linear(2, 2), AdamW8bit(model.parameters()))
    handle.remove()
    opt.step()


def test_step_after_backward_is_a_no_op_and_steps_gradients_set_by_hand():
    """With the hooks registered, step() after backward has nothing left (the hooks stepped every parameter and
    freed its gradient); a gradient set by hand (as torch.distributed.checkpoint's get_state_dict sets zeros, with
    lr 0, to create the states of a fresh optimizer) is stepped as the hooks step one, exactly once."""
    model, ref = _model(), _model()
    opt, ref_opt = AdamW8bit(model.parameters(), lr=1e-2), AdamW8bit(ref.parameters(), lr=1e-2)
    handle = step_in_backward(model, opt)
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()
    opt.step()  # nothing left: no second step
    _loss(ref, x, y).backward()
    ref_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    opt.step()
    ref_opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    handle.remove()


def test_distributed_checkpoint_state_dict_of_a_fresh_optimizer():
    """torch.distributed.checkpoint's get_state_dict creates a fresh optimizer's states by stepping it with zero
    gradients at lr 0: it must work while the optimizer steps in backward, and move no parameter."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    opt = AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1)
    handle = step_in_backward(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    _, osd = get_state_dict(model, opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert osd["state"] and all("exp_avg" in s for s in osd["state"].values())
    handle.remove()
