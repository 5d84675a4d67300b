"""The per-parameter compiled path: every format, every device, one compiled update per parameter.

What falls off the fused plans (a format without a fused layout, a rule no kernel implements, an unplannable
parameter) steps here. The step counts are advanced and the coefficients computed for all such parameters at
once, per device; each parameter is then handed to the optimizer's ``_step_one`` (its rule's compiled update)
as contiguous flat aliases (:func:`flat_aliases`), so that one compiled graph serves every shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from torchao_optim.optim.fused import check_state_shapes
from torchao_optim.optim.sharded import local
from torchao_optim.optim.sharded_columns import ColumnReduce
from torchao_optim.quant.rounding import rounding_key
from torchao_optim.state import QuantizedState

__all__ = ["RoundingRows", "alias", "flat_aliases", "step_compiled", "step_shape"]


def alias(t: Tensor, shape) -> Tensor:
    """``t`` (contiguous) with ``shape``, sharing its storage but not a ``view`` of it: torch.compile with
    dynamic shapes mishandles mutated inputs that are views of a differently shaped base."""
    shape = tuple(shape)
    if isinstance(t, QuantizedState):  # inner tensors are flat already: a new wrapper over them
        return t._new(t.fields(), shape=shape)
    if tuple(t.shape) == shape and type(t) is Tensor and not t._is_view():
        return t
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape, strides)


def step_shape(p: Tensor, states) -> tuple:
    """The shape the compiled update sees: (n_blocks, block_size) when the states are quantized and the
    size is whole blocks, so the update, the per-block absmax and the requantization share one iteration
    space and fuse into one pass; flat otherwise. Either way one graph serves every parameter size."""
    q = next((s for s in states if isinstance(s, QuantizedState)), None)
    bs = getattr(q, "block_size", None)
    if bs and p.numel() % bs == 0 and p.numel() > 0:
        return (p.numel() // bs, bs)
    return (p.numel(),)


@contextlib.contextmanager
def flat_aliases(p: Tensor | None, grad: Tensor, states: Sequence[Tensor | None]):
    """Within: ``(p, grad, states)`` as the compiled update takes them, contiguous and aliased to
    :func:`step_shape`, so that every parameter, whatever its shape, reuses one compiled graph. DTensors (FSDP2)
    are replaced by their local shards: the update is elementwise, and every rank holds whole blocks.

    A quantized state holds its elements in the parameter's logical (row-major) order, whatever the strides.
    A tensor that is not contiguous (a transposed weight, a channels_last conv weight, its gradient) is handed
    over as a contiguous copy in that order, and, where the update writes it, copied back on leaving. Tensors
    of several layouts in one update are what inductor miscompiles: it iterates the parameter's layout and the
    states' flat blocks in loops of their own, and drops a short last block's codes. ``p`` None: a rule that
    does not write the parameter (Muon's momentum)."""
    written = [None if p is None else local(p)] + [local(s) for s in states]
    work = [t if t is None or t.is_contiguous() else t.contiguous() for t in written]
    grad = local(grad)
    grad = grad if grad.is_contiguous() else grad.contiguous()
    shape = step_shape(grad, work[1:])
    olds = work[:1] + [grad] + work[1:]
    out = [None if t is None else alias(t, shape) for t in olds]
    if len(shape) == 2:
        # (n_blocks, block_size): the block size is the format's, a constant of the graph, not a size for
        # dynamo to reason about (with it symbolic, tracing spends a third of its time on symbolic arithmetic
        # and guards). Only on the aliases made here: a caller's own tensor is never marked.
        for new, old in zip(out, olds):
            if new is not None and new is not old:
                torch._dynamo.mark_static(new, 1)
    yield out[0], out[1], out[2:]
    for original, contiguous in zip(written, work):
        if contiguous is not original:
            original.copy_(contiguous)


class RoundingRows:
    """Each parameter's ``(position in the optimizer, element offset of its local shard)`` as an int64 ``(n, 2)``
    tensor on a device: what the stochastic rounding of a bf16 parameter hashes with its step. Static while the
    same parameters step, so copied there once (never inside a CUDA graph, which cannot copy pageable memory)."""

    def __init__(self) -> None:
        self._rows: dict[tuple, tuple[list[Tensor], Tensor]] = {}

    def get(self, optimizer, params: Sequence[Tensor], device: torch.device) -> Tensor:
        ids = (tuple(map(id, params)), device)
        if ids not in self._rows:  # the parameters are kept with it, so that their ids are not reused
            rows = torch.tensor(optimizer._rounding(params), dtype=torch.int64).to(device)
            self._rows[ids] = (list(params), rows)
        return self._rows[ids][1]


def round_keys(optimizer, params, steps, group, device) -> tuple[Tensor, ...] | None:
    """With ``bf16_stochastic_round`` and a bf16 parameter among ``params``: each parameter's int64 ``(key,
    element offset)`` row for :func:`~torchao_optim.rules.store_param`, from its advanced step count, computed for
    all at once; padded by one row like the coefficients. Else None."""
    if not group["bf16_stochastic_round"] or not any(p.dtype == torch.bfloat16 for p in params):
        return None
    info = optimizer._rounding_rows.get(optimizer, params, device)  # (n, 2)
    keys = rounding_key(info[:, 0], torch.stack(steps).reshape(-1))
    return torch.nn.functional.pad(torch.stack([keys, info[:, 1]], 1), (0, 0, 1, 0)).unbind(0)


def step_compiled(optimizer, params: list[Tensor], states: list[dict], group) -> None:
    """The step of ``params`` on the compiled path: step counts advanced and coefficients computed per device
    (a handful of small kernels, not a handful per parameter), then each parameter's ``_step_one`` (through the
    optimizer's ``_step_params``)."""
    check_state_shapes(params, states, optimizer.STATE_KEYS, optimizer._rounding)
    columns = ColumnReduce.for_step(params)  # states whose column statistics span ranks (optim/sharded_columns.py)
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    for device, idx in by_device.items():
        steps = [states[i]["step"] for i in idx]
        torch._foreach_add_(steps, 1)
        coefs = optimizer._coefficients(torch.stack(steps), optimizer._hyperparams(group, device), group)  # (n, k)
        # The update's compute dtype: fp64 for fp64 parameters, fp32 otherwise (as the fused kernels). Each
        # parameter gets a row, a view at storage offset k * (row + 1): dynamo specializes offsets 0 and 1, so a
        # first row at offset 0 would compile a graph of its own.
        coefs = torch.nn.functional.pad(coefs, (0, 0, 1, 0))
        rows64, rows32 = coefs.unbind(0), coefs.to(torch.float32).unbind(0)
        keys = round_keys(optimizer, [params[i] for i in idx], steps, group, device)
        chosen = [params[i] for i in idx]
        staged = [states[i] if columns is None else columns.stage(params[i], states[i]) for i in idx]
        rows = [rows64[row] if p.dtype == torch.float64 else rows32[row] for row, p in enumerate(chosen, start=1)]
        keys = [
            keys[row] if keys is not None and p.dtype == torch.bfloat16 else None
            for row, p in enumerate(chosen, start=1)
        ]
        optimizer._step_params(group, chosen, staged, rows, keys)
    if columns is not None:
        columns.finish()
