"""Loading an optimizer checkpoint: check all of it, convert it, and only then let the optimizer take it.

:func:`checked_state` reads a ``state_dict`` (ours, or the matching ``torch.optim`` optimizer's) against what the
optimizer would create for each of its parameters and returns the new param groups and state, without
touching the optimizer. Anything inconsistent raises one ``ValueError`` that names the parameter (its
index over all groups, and its name where the checkpoint has ``param_names``), the key, what was expected
and what was found: a missing key, a state of another shape, a dtype that is not floating, a quantized
state whose fields do not fit its shape (truncated codes, an absmax of the wrong length, a NaN absmax),
non-finite or (for ``exp_avg_sq``) negative values, a state on the meta device, another library's tensor
subclass (converting other libraries' states is not supported yet). Loading such a checkpoint would otherwise
train on garbage or fail deep inside a compiled step, or inside the other library's code.

A DTensor parameter's state (FSDP2) is a DTensor with the parameter's mesh and placements: its local tensor
is checked and converted as above, on each rank; a whole tensor of the global shape is also accepted, and
each rank keeps its rows.

What converts rather than fails: a state of another format or precision (fp32 into a quantized format,
quantized into plain state, another block size, fp16/bf16/fp64 values) and a state on another device.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torchao_optim.optim.sharded import is_dtensor, like_param, local, local_part
from torchao_optim.optim.sharded_columns import quantize_shard
from torchao_optim.optim.state_form import block_size_for, format_for, plain_state_dtype, state_device
from torchao_optim.state import QuantizedState

__all__ = ["checked_state", "checked_step", "checked_moment", "check_usable"]

# What the optimizer declares: ``STATE_KEYS`` (every state it may hold besides "step"), ``UNSIGNED_STATE_KEYS``,
# ``REQUIRED_GROUP_KEYS`` (what a group of its state_dict must hold; any other key of the optimizer's groups
# is filled in from the optimizer, as torch.optim does for old checkpoints) and ``STEP_OPTIONAL``.


def checked_state(optimizer, state_dict, storage_keys: Sequence[str]) -> tuple[list[dict], dict[Tensor, dict]]:
    """``(param_groups, state)`` for ``optimizer`` from ``state_dict``, or a ValueError; changes nothing.

    ``storage_keys`` are the group keys that stay the optimizer's own (how states are stored)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"an optimizer state_dict is a dict with 'state' and 'param_groups', got {keys}")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(saved_state, dict):
        raise ValueError("state_dict['param_groups'] must be a list and state_dict['state'] a dict")
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer {len(optimizer.param_groups)}"
        )

    groups, id_map, names = [], {}, {}
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        groups.append(_checked_group(optimizer, i, group, saved, storage_keys))
        for j, (p, pid) in enumerate(zip(group["params"], saved["params"])):
            if pid in id_map:
                raise ValueError(f"param group {i} lists parameter id {pid!r}, which an earlier entry lists too")
            id_map[pid] = (p, groups[-1], len(id_map))
            if "param_names" in saved and j < len(saved["param_names"]):
                names[pid] = saved["param_names"][j]

    # a defaultdict, as torch.optim's: a parameter without a saved entry gets its state at its first step
    state: dict[Tensor, dict] = defaultdict(dict)
    for pid, entry in saved_state.items():
        if pid not in id_map:
            raise ValueError(
                f"state_dict['state'] holds state for parameter id {pid!r}, which no param group "
                f"lists (ids listed: {sorted(id_map, key=str)[:8]}...)"
            )
        p, group, index = id_map[pid]
        where = f"parameter {index}" + (f" ({names[pid]!r})" if pid in names else "") + f" of shape {tuple(p.shape)}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: its state must be a dict, got {type(entry).__name__}")
        if entry:  # an empty entry: no state yet, created at the parameter's first step
            state[p] = _checked_param_state(optimizer, p, group, entry, where)
    return groups, state


def _checked_group(optimizer, i: int, group: dict, saved: Any, storage_keys: Sequence[str]) -> dict:
    if not isinstance(saved, dict):
        raise ValueError(f"param group {i} of the state_dict must be a dict, got {type(saved).__name__}")
    required = optimizer.REQUIRED_GROUP_KEYS
    missing = [k for k in required if k not in saved]
    if missing:
        raise ValueError(
            f"param group {i} of the state_dict has no {missing} (keys: {sorted(saved)}); a "
            f"{type(optimizer).__name__} state_dict has {list(required)}: is it another optimizer's?"
        )
    if not isinstance(saved["params"], (list, tuple)):
        raise ValueError(f"param group {i} of the state_dict: 'params' must be a list of ids, got {saved['params']!r}")
    if len(saved["params"]) != len(group["params"]):
        raise ValueError(
            f"param group {i} of the state_dict has {len(saved['params'])} parameters, the "
            f"optimizer's {len(group['params'])}"
        )
    new = copy.deepcopy({k: v for k, v in saved.items() if k != "params"})
    for key in group:
        if key not in required and key != "param_names":
            new.setdefault(key, group[key])
    new.update({k: group[k] for k in storage_keys})
    new["params"] = group["params"]
    if "param_names" in group and "param_names" not in new:
        new["param_names"] = group["param_names"]
    optimizer._check_group(new, i)
    return new


def _checked_param_state(optimizer, p: Tensor, group: dict, entry: dict, where: str) -> dict:
    keys = optimizer.STATE_KEYS
    expected = ("step",) + optimizer._state_keys(group, p)
    entry = dict(entry)
    if "step" not in entry and optimizer.STEP_OPTIONAL:  # torch.optim's form: its buffers exist, so one step ran
        entry["step"] = 1.0
    missing = [k for k in expected if k not in entry]
    if missing:
        because = f", as amsgrad={group['amsgrad']}" if "amsgrad" in group else ""
        raise ValueError(
            f"{where}: state has no {missing} (keys: {sorted(map(str, entry))}; expected {list(expected)}{because})"
        )
    unknown = [k for k in entry if k not in ("step",) + keys]
    if unknown:
        raise ValueError(
            f"{where}: state has unknown keys {unknown}; a {type(optimizer).__name__} state holds {['step', *keys]}"
        )
    for key, value in entry.items():
        check_usable(value, f"{where}: state[{key!r}]")
    out = {"step": checked_step(p, entry["step"], where)}
    for key in keys:
        if key in entry:
            out[key] = checked_moment(optimizer, p, group, key, entry[key], f"{where}: state[{key!r}]")
    return out


def check_usable(value: Any, where: str) -> None:
    """ValueError for a state no check or conversion may run an op on: another library's tensor subclass, or a
    tensor on the meta device."""
    _refuse_foreign(value, where)
    if isinstance(value, Tensor) and value.device.type == "meta":
        raise ValueError(
            f"{where} is on the meta device, which holds no data (a checkpoint loaded with "
            f"torch.load(..., map_location='meta')?): load it with a map_location that holds data, "
            f"such as 'cpu'"
        )


def _refuse_foreign(value: Any, where: str) -> None:
    """ValueError for a tensor subclass of another library (torchao's 8-bit state, say), or a DTensor over one:
    the checks below run ops on every state, which such a subclass implements in its own way or not at all."""
    inner = value
    if is_dtensor(value):
        with torch.no_grad():  # the local tensor itself: to_local() with grad enabled runs an op on it
            inner = value.to_local()
    known = (Tensor, torch.nn.Parameter)
    if not isinstance(inner, Tensor) or type(inner) in known or isinstance(inner, QuantizedState):
        return
    cls = type(inner)
    raise ValueError(
        f"{where} is a {cls.__module__}.{cls.__qualname__}, a tensor subclass this library does not "
        f"know (another library's state?): converting optimizer state from other libraries is not "
        f"supported yet; load a state_dict whose states are plain tensors, dequantized by that library"
    )


def checked_step(p: Tensor, step: Any, where: str) -> Tensor:
    if isinstance(step, Tensor):
        if step.numel() != 1 or step.is_complex() or isinstance(step, QuantizedState):
            raise ValueError(
                f"{where}: state['step'] must be a number or a one-element real tensor, got "
                f"{type(step).__name__} of shape {tuple(step.shape)} and dtype {step.dtype}"
            )
        value = float(step.detach().reshape(()).cpu())
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise ValueError(f"{where}: state['step'] must be a number or a one-element tensor, got {step!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{where}: state['step'] must be a finite count >= 0, got {value}")
    return torch.tensor(value, dtype=torch.float32, device=p.device)


def checked_moment(optimizer, p: Tensor, group: dict, key: str, value: Any, where: str) -> Tensor:
    """``value`` checked and converted to what ``optimizer`` keeps for ``p``'s ``key``, on ``p``'s device (for a
    DTensor parameter, a DTensor laid out like it; see :func:`_checked_sharded_moment`)."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.shape != p.shape:
        raise ValueError(f"{where} has shape {tuple(value.shape)}; expected the parameter's {tuple(p.shape)}")
    fmt = format_for(p, group)
    block_size = None if fmt is None else block_size_for(p, group, fmt)
    if is_dtensor(p) or is_dtensor(value):
        return _checked_sharded_moment(optimizer, p, fmt, block_size, key, value, where)
    return _checked_local(optimizer, p, fmt, block_size, key, value, where)


def _checked_sharded_moment(optimizer, p: Tensor, fmt, block_size, key: str, value: Tensor, where: str) -> Tensor:
    """The state of a DTensor parameter (FSDP2): a DTensor with the parameter's mesh and placements (what
    ``torch.distributed.checkpoint`` loads), whose local tensor is checked and converted like any state; or a
    whole tensor of the global shape (a checkpoint saved without sharding), of which each rank keeps its rows.
    Checks run on each rank's rows."""
    if not is_dtensor(p):
        raise ValueError(
            f"{where} is a DTensor with placements {value.placements}, but the parameter is a plain "
            f"tensor; load value.full_tensor() instead"
        )
    if is_dtensor(value):
        if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
            raise ValueError(
                f"{where} is sharded as {tuple(value.placements)} over {value.device_mesh}; the "
                f"parameter as {tuple(p.placements)} over {p.device_mesh}: redistribute it first"
            )
        value = value.to_local()
    elif isinstance(value, QuantizedState):
        try:
            value.check_fields()
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        same = fmt is not None and fmt.matches_layout(value, signed=optimizer._signed(key), block_size=block_size)
        # the same layout: this rank's rows are whole blocks of it (an exact slice); otherwise convert
        value = local_part(p, value if same else _whole(optimizer, p, fmt, block_size, key, value))
    else:
        value = local_part(p, _whole(optimizer, p, fmt, block_size, key, value))
    return like_param(p, _checked_local(optimizer, local(p), fmt, block_size, key, value, where, shard=p))


def _whole(optimizer, p: Tensor, fmt, block_size, key: str, value: Tensor) -> Tensor:
    """A whole state of another form, for ``p``'s ranks to take their rows of: dequantized; or, for a format whose
    column statistics span ranks, quantized whole (every rank holds it all), so that the rows a rank takes are
    those of the whole tensor's state, with no collective. Checked by :func:`_checked_local` as every rank's
    part is: a value it refuses is returned as it is."""
    plain = value.dequantize(torch.float32) if isinstance(value, QuantizedState) else value
    if fmt is None or not fmt.shared_columns(p.shape, signed=optimizer._signed(key)):
        return plain
    if not plain.is_floating_point() or plain.is_meta or not torch.isfinite(plain).all():
        return plain
    if not optimizer._signed(key) and (plain < 0).any():
        return plain
    return fmt.from_float(plain.float(), signed=optimizer._signed(key), block_size=block_size)


def _checked_local(optimizer, p: Tensor, fmt, block_size, key: str, value: Tensor, where: str, shard=None) -> Tensor:
    """``value`` (a plain tensor or a quantized state, of ``p``'s shape) checked and converted to ``fmt`` with
    ``block_size`` (None: plain state) where the optimizer keeps ``p``'s state (its device, or host memory with
    ``offload_state``). ``shard``: the DTensor parameter whose local shard ``p`` is; its state's attributes are
    a row shard's, and a conversion whose column statistics span ranks all-reduces them (a collective)."""
    device = state_device(optimizer, p)
    signed = optimizer._signed(key)
    attrs = dict(signed=signed, block_size=block_size)
    if shard is not None and fmt is not None:
        attrs = fmt.shard_attrs(shard.shape, p.shape, **attrs)
    if value.shape != p.shape:
        raise ValueError(
            f"{where}: this rank's part has shape {tuple(value.shape)}; expected the local shard's {tuple(p.shape)}"
        )
    if isinstance(value, QuantizedState):
        try:
            value.check_fields()
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if fmt is not None and fmt.matches_layout(value, **attrs):
            # the layout this optimizer uses: the codes are kept as they are (exact resume)
            return value.to(device=device, dtype=torch.float32, copy=True)
        value = value.dequantize(torch.float32)
    elif not value.is_floating_point() or value.device.type == "meta":
        raise ValueError(f"{where} must be a floating-point tensor holding data, got {value.dtype} on {value.device}")
    bad = ~torch.isfinite(value) | ((value < 0) if not signed else torch.zeros_like(value, dtype=torch.bool))
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0])
        rule = "finite" if signed else "finite and >= 0"
        raise ValueError(f"{where} must be {rule}; element {i} (flat) holds {value.reshape(-1)[i].item()}")
    if fmt is None:
        return value.to(device=device, dtype=plain_state_dtype(p), copy=True).contiguous()
    if shard is not None:
        return quantize_shard(shard, fmt, value.to(device=device, dtype=torch.float32), **attrs)
    return fmt.from_float(value.to(device=device, dtype=torch.float32), **attrs)
