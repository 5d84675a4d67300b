"""The form a parameter's state takes: its format (or plain fp32/fp64), block size, device, and whether a value
already has that form.

Decided from the group's storage settings (``state_format``, ``block_size``, ``min_quant_size``) and the
parameter's global shape, so that a parameter sharded by rows is quantized on every mesh or on none (one sharded
by columns, tensor parallelism's ``Shard(1)``, also by its mesh's size: ``optim/sharded.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchao_optim.optim.sharded import is_dtensor, like_param, local, quantizable_sharding, state_block_size
from torchao_optim.state import QuantizedState, get_state_format

__all__ = [
    "block_size_for",
    "format_for",
    "is_own_moment",
    "new_state_tensor",
    "offloads",
    "plain_state_dtype",
    "state_attrs",
    "state_device",
    "state_tensors",
]


def offloads(optimizer, p: Tensor) -> bool:
    """Whether ``p``'s state lives in host memory (``offload_state``): parameters on the fused device."""
    return optimizer._offload_state and (p.device.type == "cuda" or (optimizer._interpreter and p.device.type == "cpu"))


def state_device(optimizer, p: Tensor) -> torch.device:
    """Where ``p``'s states live between steps: host memory when offloaded, else ``p``'s device."""
    return torch.device("cpu") if offloads(optimizer, p) else local(p).device


def format_for(p: Tensor, group) -> type | None:
    """The format class for ``p``'s state, or None for plain (unquantized) state. Decided from the global shape
    (a DTensor's ``shape``), so a parameter sharded by rows is quantized on every mesh or on none; one whose
    columns are split (``Shard(1)``) also from its mesh's size (``optim/sharded.py``), the same on every rank."""
    if group["state_format"] == "none" or p.numel() < group["min_quant_size"]:
        return None
    fmt = get_state_format(group["state_format"])
    block_size = block_size_for(p, group, fmt)
    if block_size is None:
        return None  # sharded, and no block fits within a row (see optim/sharded.py)
    try:
        fmt.check_attrs(p.shape, **fmt._attrs(signed=True, block_size=block_size))
    except ValueError:
        return None  # the format cannot store this shape: keep plain state
    return fmt


def block_size_for(p: Tensor, group, fmt: type) -> int | None:
    """The block size of ``p``'s quantized state: the group's (or the format's default); for a DTensor parameter
    the row-aligned one (:func:`~torchao_optim.optim.sharded.state_block_size`), or None when there is none, when
    its placements split blocks (columns split off block boundaries, on this mesh) or when ``fmt`` cannot be split
    that way (``row_shardable``, ``column_shardable``)."""
    block_size = group["block_size"] or fmt.default_block_size
    if not is_dtensor(p):
        return block_size
    whole_rows = quantizable_sharding(p.placements)
    if not (fmt.row_shardable if whole_rows else fmt.column_shardable):
        return None
    return state_block_size(p, block_size)


def plain_state_dtype(p: Tensor) -> torch.dtype:
    """Unquantized state is fp32, or fp64 for fp64 parameters (torch.optim's numbers)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def new_state_tensor(
    optimizer, p: Tensor, group, signed: bool, device: torch.device | str | None = None, fill: float = 0.0
) -> Tensor:
    """A state of zeros for ``p`` (``fill``: of that value; a quantized state holds it exactly, one value per
    block); for a DTensor parameter, the state of its local shard as a DTensor laid out like ``p``. An offloaded
    state is created on the meta device: the step's planner makes it, as zeros, in host memory
    (:func:`~torchao_optim.optim.offload.plan_offloaded`; an optimizer whose states start elsewhere refuses
    ``offload_state``). ``device`` overrides where (``"meta"``: what the state would be, with no memory)."""
    fmt = format_for(p, group)
    lp = local(p)
    if device is None:
        device = torch.device("meta") if offloads(optimizer, p) else lp.device
    if fmt is None:
        state = torch.full(lp.shape, fill, dtype=plain_state_dtype(p), device=device)
    else:
        state = fmt.zeros(lp.shape, device=device, **state_attrs(p, group, fmt, signed))
        if fill != 0.0:
            state.copy_(torch.full(lp.shape, fill, dtype=torch.float32, device=device))  # requantizes
    return like_param(p, state) if is_dtensor(p) else state


def state_attrs(p: Tensor, group, fmt: type, signed: bool) -> dict:
    """The attributes ``fmt`` is asked for when it stores ``p``'s state: ``signed`` and the block size, and for a
    DTensor parameter what the format adds for a row shard (``QuantizedState.shard_attrs``: rank-1 scales count
    the rows of the whole tensor's matrix that the shard holds)."""
    attrs = dict(signed=signed, block_size=block_size_for(p, group, fmt))
    return fmt.shard_attrs(p.shape, local(p).shape, **attrs) if is_dtensor(p) else attrs


def is_own_moment(optimizer, p: Tensor, group, key: str, value) -> bool:
    """Whether ``value`` is in the form the optimizer keeps ``p``'s ``key`` in (what :func:`new_state_tensor`
    makes): the step can use it as it is."""
    if not isinstance(value, Tensor) or is_dtensor(value) != is_dtensor(p):
        return False
    if is_dtensor(p) and (value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements)):
        return False
    lv, lp = local(value), local(p)
    if lv.shape != lp.shape:
        return False
    if lv.device != state_device(optimizer, p) and not (lv.is_meta and offloads(optimizer, p)):
        return False
    fmt = format_for(p, group)
    if fmt is None:
        return type(lv) is Tensor and lv.dtype == plain_state_dtype(p) and lv.is_contiguous()
    return type(lv) is fmt and fmt.matches_layout(lv, **state_attrs(p, group, fmt, optimizer._signed(key)))


def state_tensors(optimizer, group, params: list[Tensor], states: list[dict]) -> list[Tensor]:
    """The plain tensors that hold the states of ``params``: per parameter, each state's fields (a quantized state's
    codes and scales, or the plain state). Not the step counts: a compiled graph never reads them, and on the fused
    CUDA path they are views of one tensor (optim/fused.py), which a graph's inputs must not be. Not offloaded
    states either: they are held in host memory and streamed by the step itself, so no graph can read them."""
    tensors = []
    for p, state in zip(params, states):
        if offloads(optimizer, p):
            continue
        for key in optimizer._state_keys(group, p):
            value = local(state[key])
            tensors.extend(value.fields().values() if isinstance(value, QuantizedState) else [value])
    return tensors
