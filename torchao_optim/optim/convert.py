"""Optimizer checkpoints from bitsandbytes and torchao, and back to them: :func:`convert_state_dict`.

Into ours, each source state is read as its library stores it and dequantized exactly as that library
dequantizes it (codebook value times block scale, in fp32), under our key names (``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, ``step``). The result is an ordinary state_dict that ``load_state_dict`` of
:class:`~torchao_optim.Adam` / :class:`~torchao_optim.AdamW` (any format) takes, and so does
``torch.optim.Adam`` / ``AdamW`` where every state is plain. ``load_state_dict`` quantizes each plain state into
the optimizer's format: that is the one requantization a conversion costs. Where the source already is our
``"dtq8"`` layout (the 8-bit dynamic map, whose codes are indexes into the sorted map in bitsandbytes', torchao's
and our 8-bit states alike), the state comes as a :class:`~torchao_optim.DTQ8bitTensor` holding the source's codes
and scales, which an optimizer with that layout keeps as they are: no requantization at all.

Back to a library, each state is dequantized and quantized with that library's layout (for torchao, by
torchao's own classes).

Layouts were read from, and the conversions are tested against, bitsandbytes 0.50.2 and torchao 0.18.0.
Anything else that a state_dict may hold (another optimizer's states, a codebook of another size, a block
count that fits no block size the library used, a tensor subclass we do not know) raises one ``ValueError``
that names the source, the parameter, the key and what was found.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torchao_optim.optim.sharded import is_dtensor
from torchao_optim.quant import dequantize_blockwise, dynamic_map_values, unpack_nibbles
from torchao_optim.state import DTQ8bitTensor, QuantizedState

__all__ = ["convert_state_dict", "SOURCES", "OURS"]

OURS = "torchao_optim"
SOURCES = ("bitsandbytes", "torchao")
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}


def convert_state_dict(
    state_dict: dict[str, Any],
    source: str,
    target: str = OURS,
    *,
    torchao_format: str | None = None,
    block_size: int | None = None,
    min_8bit_size: int = 4096,
) -> dict[str, Any]:
    """A copy of an Adam/AdamW optimizer ``state_dict`` converted from ``source``'s layout to ``target``'s.

    ``source`` or ``target`` is ``"torchao_optim"`` (ours, which is also ``torch.optim.Adam``'s and ``AdamW``'s
    layout), the other ``"bitsandbytes"`` or ``"torchao"``. Nothing in ``state_dict`` is changed.

    From bitsandbytes: ``Adam8bit``, ``AdamW8bit``, their paged and 32-bit forms (state1/state2 with blockwise
    absmax1/absmax2 of 256- or 2048-element blocks, or one max1/max2 per tensor; qmap1/qmap2; fp32 states for
    tensors under ``min_8bit_size``), flat or wrapped in ``"__bnb_optimizer_quant_state__"``. bitsandbytes
    decays weights decoupled in its Adam and its AdamW alike: continue with :class:`~torchao_optim.AdamW`.
    From torchao: ``Adam8bit``/``AdamW8bit``, ``Adam4bit``/``AdamW4bit``, ``AdamFp8``/``AdamWFp8`` states
    (``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``, live or as :func:`load_torchao_checkpoint`
    reads them without torchao), amsgrad included; the state_dict does not say whether it was the Adam or the
    AdamW class: load it into the one you trained with.

    Args:
        state_dict (dict): the optimizer's ``state_dict()`` (or ``torch.load`` of it).
        source (str): ``"bitsandbytes"``, ``"torchao"`` or ``"torchao_optim"``.
        target (str, optional): ``"torchao_optim"``, ``"bitsandbytes"`` or ``"torchao"``. Default: ``"torchao_optim"``.
        torchao_format (str, optional): with ``target="torchao"``: ``"8bit"``, ``"4bit"`` or ``"fp8"``, the
            optimizer the state is for (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``).
        block_size (int, optional): with ``target="torchao"``: its optimizer's ``block_size``. Default: torchao's
            (256, 128 for ``"4bit"``).
        min_8bit_size (int, optional): with ``target="bitsandbytes"``: its optimizer's ``min_8bit_size``
            (smaller tensors keep fp32 state). Default: ``4096``.

    Returns:
        dict: a new state_dict (``"state"`` and ``"param_groups"``) in ``target``'s layout.
    """
    pair = (source, target)
    if source == target or OURS not in pair or any(x not in (OURS, *SOURCES) for x in pair):
        raise ValueError(
            f"convert_state_dict converts between {OURS!r} and one of {list(SOURCES)}, got source={source!r}, "
            f"target={target!r}"
        )
    if target != "torchao" and (torchao_format is not None or block_size is not None):
        raise ValueError(f"torchao_format and block_size describe a torchao target, not target={target!r}")
    if target != "bitsandbytes" and min_8bit_size != 4096:
        raise ValueError(f"min_8bit_size describes a bitsandbytes target, not target={target!r}")
    _check_state_dict(state_dict, source)
    if "bitsandbytes" in pair:
        from torchao_optim.optim import convert_bnb as peer
    else:
        from torchao_optim.optim import convert_torchao as peer
    if target == OURS:
        return peer.to_ours(state_dict)
    options = (
        dict(min_8bit_size=min_8bit_size)
        if target == "bitsandbytes"
        else dict(fmt=torchao_format, block_size=block_size)
    )
    return peer.from_ours(state_dict, **options)


def _check_state_dict(state_dict: Any, source: str) -> None:
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        found = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{source} state_dict: expected a dict with 'state' and 'param_groups', got {found}")
    if not isinstance(state_dict["state"], dict) or not isinstance(state_dict["param_groups"], (list, tuple)):
        raise ValueError(f"{source} state_dict: 'state' must be a dict and 'param_groups' a list")
    for i, group in enumerate(state_dict["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), (list, tuple)):
            raise ValueError(f"{source} state_dict: param group {i} must be a dict with a list 'params'")


# ---- helpers both peers use ----------------------------------------------------------------------------


def where(source: str, pid: Any, key: str | None = None) -> str:
    return f"{source} state_dict, parameter id {pid!r}" + ("" if key is None else f", state[{key!r}]")


def step_value(value: Any, at: str) -> float:
    """A step count (a number or a one-element tensor) as a float."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = float(value.detach().reshape(()).cpu())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    else:
        raise ValueError(f"{at}: a step count must be a number or a one-element tensor, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{at}: a step count must be finite and >= 0, got {value}")
    return value


def plain_tensor(value: Any, at: str) -> Tensor:
    """``value`` if it is a plain tensor (not a subclass, not a DTensor), else a ValueError naming what it is."""
    if is_dtensor(value):
        raise ValueError(
            f"{at} is a DTensor (a sharded checkpoint): gather it first (value.full_tensor() on every rank, or "
            f"torch.distributed.checkpoint's format_utils.dcp_to_torch_save), then convert"
        )
    if type(value) is not Tensor:
        raise ValueError(f"{at}: expected a tensor, got {type(value).__module__}.{type(value).__qualname__}")
    return value


def float_state(value: Tensor, at: str) -> Tensor:
    """A plain floating-point state, as an fp32 copy."""
    if not value.is_floating_point():
        raise ValueError(f"{at}: a plain state must be floating point, got {value.dtype}")
    return value.detach().to(torch.float32, copy=True)


def codebook(qmap: Any, size: int, at: str) -> tuple[float, ...]:
    """A decode table (``qmap``) of ``size`` finite fp32 values, as a tuple."""
    qmap = plain_tensor(qmap, at)
    if qmap.dtype != torch.float32 or tuple(qmap.shape) != (size,):
        raise ValueError(f"{at}: expected a float32 codebook of shape ({size},), got {qmap.dtype} {tuple(qmap.shape)}")
    if not torch.isfinite(qmap).all():
        raise ValueError(f"{at}: the codebook holds non-finite values")
    return tuple(qmap.tolist())


def block_scales(scale: Any, numel: int, block_sizes: tuple[int, ...], at: str) -> tuple[Tensor, int]:
    """``(scale, block_size)``: one fp32 scale per block of ``numel`` elements, for the first block size in
    ``block_sizes`` whose block count is ``scale``'s length."""
    scale = plain_tensor(scale, at)
    if scale.dtype != torch.float32 or scale.dim() != 1:
        raise ValueError(f"{at}: expected a float32 vector of block scales, got {scale.dtype} {tuple(scale.shape)}")
    for size in block_sizes:
        if -(-numel // size) == scale.numel():
            return scale, size
    counts = ", ".join(f"{-(-numel // b)} for blocks of {b}" for b in block_sizes)
    raise ValueError(f"{at}: {scale.numel()} block scales for {numel} elements; expected {counts}")


def dequantized(codes: Tensor, table: tuple[float, ...], scale: Tensor, block_size: int, shape) -> Tensor:
    """``table[code] * scale of its block`` (fp32, of ``shape``): how both libraries dequantize a codebook state."""
    return dequantize_blockwise(codes.reshape(-1), scale, table, block_size, torch.Size(shape))


def dtq8_or_float(codes: Tensor, table: tuple[float, ...], scale: Tensor, block_size: int, shape, signed: bool):
    """An 8-bit codebook state: our :class:`DTQ8bitTensor` with the very codes and scales where ``table`` is our
    dynamic map (exact), else its fp32 values."""
    if table == dynamic_map_values(signed):
        state = DTQ8bitTensor(
            torch.Size(shape),
            torch.float32,
            codes=codes.reshape(-1).contiguous(),
            absmax=scale.contiguous(),
            signed=signed,
            block_size=block_size,
        )
        state.check_fields()
        return state
    return dequantized(codes, table, scale, block_size, shape)


def nibbles_high_first(packed: Tensor, numel: int) -> Tensor:
    """4-bit codes packed two per byte with the first element in the high nibble (torchao's order), unpacked."""
    return unpack_nibbles((packed << 4) | (packed >> 4), numel)


def our_moment(value: Any, at: str) -> Tensor:
    """One of our states (plain, or any of our formats) as an fp32 tensor."""
    if is_dtensor(value):
        plain_tensor(value, at)  # raises, naming what to do
    if isinstance(value, QuantizedState):
        value.check_fields()
        return value.dequantize(torch.float32)
    return float_state(plain_tensor(value, at), at)


def our_entries(state_dict: dict[str, Any], target: str):
    """``(pid, step, {key: fp32 tensor or our state})`` for each non-empty entry of our state_dict, refusing
    states of optimizers other than Adam/AdamW."""
    for pid, entry in state_dict["state"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"{where(OURS, pid)}: its state must be a dict, got {type(entry).__name__}")
        if not entry:
            continue
        unknown = sorted(set(map(str, entry)) - {"step", *MOMENTS})
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
        if unknown or missing:
            raise ValueError(
                f"{where(OURS, pid)}: an Adam/AdamW state holds step, exp_avg and exp_avg_sq (and max_exp_avg_sq "
                f"with amsgrad), this one {sorted(map(str, entry))}: only Adam/AdamW states convert to {target}"
            )
        yield pid, step_value(entry["step"], where(OURS, pid, "step")), {k: entry[k] for k in MOMENTS if k in entry}


def group_hyperparams(group: dict, source: str, index: int) -> dict:
    """``lr`` (a float), ``betas``, ``eps`` and ``weight_decay`` of an Adam-like group, checked."""
    at = f"{source} state_dict, param group {index}"
    missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in group]
    if missing:
        raise ValueError(f"{at} has no {missing} (keys: {sorted(map(str, group))}): not an Adam/AdamW state_dict?")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{at}: betas must be a pair (beta1, beta2) for Adam/AdamW, got {betas!r}")
    return dict(
        lr=step_value(group["lr"], f"{at}: lr"),
        betas=tuple(float(b) for b in betas),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
    )


def group_ids(group: dict) -> dict:
    """The group's ``params`` (and ``param_names``, where it has them)."""
    out = {"params": list(group["params"])}
    if "param_names" in group:
        out["param_names"] = list(group["param_names"])
    return out
