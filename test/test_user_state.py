"""The optimizer's state is the truth: what users and frameworks do to ``optimizer.state`` and ``param_groups``
between steps is honoured as ``torch.optim`` honours it."""
from __future__ import annotations

import torch

from torchao_optim import AdamW8bit


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
