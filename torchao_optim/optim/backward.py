"""The optimizer step in backward: each parameter is updated as soon as its gradient is accumulated, and the
gradient is freed there, so the whole set of gradients is never alive at once.

``step_in_backward(model, optimizer)`` registers a post-accumulate-grad hook on every parameter the optimizer
holds (``Tensor.register_post_accumulate_grad_hook``): the hook runs the optimizer's step for that one
parameter (its own fused plan on CUDA, or the compiled path) and sets its ``.grad`` to None. Memory then
holds the parameters, the optimizer state and the gradients of the layers backward is working on, instead of
a gradient per parameter.

What it changes for the training loop: ``optimizer.step()`` and ``zero_grad()`` are no longer called
(``step()`` raises while the hooks are registered); learning-rate schedulers work as usual (they write the
groups' ``lr``, which each parameter's step reads). Anything that needs every gradient before the step is
refused: gradient clipping by the global norm, gradient accumulation over several backward passes (each
backward steps), and ``torch.amp.GradScaler``'s skipped steps. ``handle.remove()`` puts the optimizer back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from torchao_optim.optim.base import LowBitOptimizer

__all__ = ["step_in_backward", "StepInBackward"]


class StepInBackward:
    """What :func:`step_in_backward` returns: ``remove()`` unregisters the hooks and restores ``step()``."""

    def __init__(self, optimizer: LowBitOptimizer, handles: list):
        self.optimizer, self._handles = optimizer, handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.optimizer._in_backward = None
        self.optimizer._plans.clear()  # the per-parameter plans own the step counts now: plan again
        self.optimizer._graphs.clear()
        self.optimizer._with_grad.clear()


def step_in_backward(
    model: torch.nn.Module | Iterable[torch.Tensor], optimizer: LowBitOptimizer, max_grad_norm: float | None = None
) -> StepInBackward:
    """Update each of ``optimizer``'s parameters as soon as backward has accumulated its gradient, then free
    the gradient (see the module docstring). ``model`` is the module (or the parameters) being trained: every
    parameter of the optimizer must be among them. ``max_grad_norm`` exists to be refused: clipping by the
    global norm needs every gradient before any step."""
    if max_grad_norm is not None:
        raise ValueError(
            f"step_in_backward: max_grad_norm={max_grad_norm!r} cannot be honoured: clipping by the "
            f"global gradient norm needs every gradient before the first parameter steps, and here "
            f"each parameter steps (and frees its gradient) as soon as its gradient is ready"
        )
    if not isinstance(optimizer, LowBitOptimizer):
        raise TypeError(
            f"step_in_backward takes one of torchao_optim's optimizers (AdamW8bit, SGD8bit, ...), "
            f"got {type(optimizer).__name__}"
        )
    if optimizer._in_backward is not None:
        raise RuntimeError("step_in_backward: this optimizer already steps in backward")
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    known = {id(p) for p in params}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"step_in_backward: the optimizer holds a parameter of shape {tuple(p.shape)} that "
                    f"is not among the model's parameters"
                )

    def hook(p: torch.Tensor) -> None:
        if p.grad is None:
            return
        optimizer._step_param(p)
        p.grad = None

    optimizer._in_backward = {}
    optimizer._plans.clear()
    optimizer._graphs.clear()
    handles = [
        p.register_post_accumulate_grad_hook(hook)
        for g in optimizer.param_groups
        for p in g["params"]
        if p.requires_grad
    ]
    return StepInBackward(optimizer, handles)
