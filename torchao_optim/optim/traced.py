"""The optimizer step as one registered operator per parameter group, for a user's ``torch.compile``.

Under ``torch.compile`` (``fullgraph=True`` too) the step of a :class:`~torchao_optim.optim.base.LowBitOptimizer`
is traced as one call per parameter group of ``torchao_optim::step_``, a ``torch.library.custom_op`` that names
what it mutates (the parameters and the plain tensors that hold the states: codes, scales, plain states; the
step counts, which no graph reads, stay inside) and has a fake implementation that changes nothing. The
compiler therefore sees no graph break, never traces into the quantized state, and keeps the call in its graph
as it is; at run time the operator steps the
group through the optimizer's own executors (the fused CUDA kernels, the fused CPU step or the per-parameter
compiled path), exactly as an eager ``step()`` would. With ``mode="reduce-overhead"`` the fused CUDA kernels it
launches are meant to join the compiled function's CUDA graph (the gradient-pointer copy is capture-safe); the
CUDA cases of test/test_compiled_step.py check it, and have not yet passed on a GPU.

The operator receives the tensors the optimizer itself holds: the optimizer's parameters and states are static
inputs of the compiled graph, which the compiler updates in place. If it ever receives copies instead (a
compiler that does not reinplace the mutation), it steps the optimizer's own tensors and writes the results into
the copies, which the compiler then copies back: the same numbers either way.

Dynamo runs the optimizer's ``_init_group`` on the real objects while tracing (as it does for ``torch.optim``'s
optimizers), so creating states on the first step and finding the tensors to hand over are never traced. As with
``torch.optim`` under ``torch.compile``, a learning rate changed as a Python float recompiles the step; a tensor lr
does not.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from torchao_optim.optim import dispatch

__all__ = ["register", "step_group"]

_OPTIMIZERS: weakref.WeakValueDictionary[int, torch.optim.Optimizer] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(optimizer) -> int:
    """A key by which the operator finds ``optimizer`` at run time (kept only while the optimizer lives)."""
    key = next(_KEYS)
    _OPTIMIZERS[key] = optimizer
    return key


@torch.library.custom_op("torchao_optim::step_", mutates_args=("params", "tensors"))
def step_group(params: list[Tensor], grads: list[Tensor], tensors: list[Tensor], optimizer: int, group: int) -> None:
    """One step of parameter group ``group`` of the optimizer registered as ``optimizer``: ``params`` are the
    group's parameters that have a gradient, ``grads`` those gradients, ``tensors`` the tensors holding their
    states, in the order of :func:`~torchao_optim.optim.state_form.state_tensors`."""
    opt = _OPTIMIZERS.get(optimizer)
    if opt is None:
        raise RuntimeError(
            f"torchao_optim::step_: optimizer {optimizer} no longer exists (a compiled step outlived its optimizer)"
        )
    dispatch.step_group_with(opt, opt.param_groups[group], params, grads, tensors)


@step_group.register_fake
def _(params, grads, tensors, optimizer, group) -> None:
    return None
