"""bitsandbytes' Adam/AdamW state_dicts to ours and back (used by
:func:`~torchao_optim.optim.convert.convert_state_dict`).

What bitsandbytes (read from 0.50.2, ``Optimizer2State``) keeps per parameter:

- ``step``: a Python int;
- ``state1``/``state2`` (exp_avg/exp_avg_sq): fp32 of the parameter's shape for a tensor under ``min_8bit_size``
  (or with ``optim_bits=32``), else uint8 codes of its shape;
- with codes, ``qmap1``/``qmap2``: the fp32 signed and unsigned dynamic maps (256 values, sorted; a code is an
  index into them), and either ``absmax1``/``absmax2`` (``block_wise=True``: fp32, one per block of the flat
  tensor, blocks of 256 since 0.44 and of 2048 before) or ``max1``/``max2`` (one scale for the whole tensor,
  after the step that wrote the codes; ``new_max1``/``new_max2`` are scratch space). A value is
  ``qmap[code] * scale``; ``state2`` is v itself, not its square root;
- ``gnorm_vec`` (``percentile_clipping < 100``) or ``unorm_vec`` (``max_unorm > 0``): clipping we do not implement;
- since 0.50 ``state_dict()`` moves every key but ``step`` into a dict under ``"__bnb_optimizer_quant_state__"``.

Groups hold ``lr``, ``betas``, ``eps``, ``weight_decay`` (0.50 adds AdEMAMix's ``alpha``, ``t_alpha``, ``t_beta3``,
which an Adam group holds as 0.0, None, None). Its Adam and AdamW both decay weights decoupled.
"""

from __future__ import annotations

from typing import Any

import torch

from torchao_optim.optim.convert import (
    OURS,
    block_scales,
    codebook,
    dequantized,
    dtq8_or_float,
    float_state,
    group_hyperparams,
    group_ids,
    our_entries,
    our_moment,
    plain_tensor,
    step_value,
    where,
)
from torchao_optim.quant import create_dynamic_map, dynamic_map_values, quantize_blockwise
from torchao_optim.state import DTQ8bitTensor

SOURCE = "bitsandbytes"
WRAPPED = "__bnb_optimizer_quant_state__"
BLOCK_SIZES = (256, 2048)  # 256 since bitsandbytes 0.44; 2048 before
BLOCK_SIZE = 256  # what we write
CODE_KEYS = {"state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2", "max1", "max2", "new_max1", "new_max2"}
UNSUPPORTED = {
    "gnorm_vec": "percentile_clipping < 100 (gradient clipping by a percentile of past norms)",
    "unorm_vec": "max_unorm > 0 (update-norm clipping, as in LAMB and LARS)",
}


def to_ours(state_dict: dict[str, Any]) -> dict[str, Any]:
    groups = []
    for i, group in enumerate(state_dict["param_groups"]):
        _refuse_ademamix(group, i)
        groups.append({**group_hyperparams(group, SOURCE, i), "amsgrad": False, "maximize": False, **group_ids(group)})
    state = {pid: _entry_to_ours(pid, entry) for pid, entry in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}


def _refuse_ademamix(group: dict, i: int) -> None:
    betas = group.get("betas", ())
    alpha = group.get("alpha", 0.0)
    if (isinstance(betas, (tuple, list)) and len(betas) == 3) or alpha not in (0, 0.0, None):
        raise ValueError(
            f"{SOURCE} state_dict, param group {i} is AdEMAMix's (betas={betas!r}, alpha={alpha!r}): only "
            f"Adam/AdamW states convert"
        )


def _unwrapped(pid, entry: Any) -> dict:
    if not isinstance(entry, dict):
        raise ValueError(f"{where(SOURCE, pid)}: its state must be a dict, got {type(entry).__name__}")
    entry = dict(entry)
    wrapped = entry.pop(WRAPPED, None)
    if wrapped is not None:
        if not isinstance(wrapped, dict):
            raise ValueError(f"{where(SOURCE, pid, WRAPPED)} must be a dict, got {type(wrapped).__name__}")
        both = sorted(set(entry) & set(wrapped))
        if both:
            raise ValueError(f"{where(SOURCE, pid)}: keys {both} are both in the state and under {WRAPPED!r}")
        entry.update(wrapped)
    return entry


def _entry_to_ours(pid, entry: Any) -> dict:
    entry = _unwrapped(pid, entry)
    if not entry:
        return {}
    for key, why in UNSUPPORTED.items():
        if key in entry:
            raise ValueError(f"{where(SOURCE, pid, key)}: the source optimizer used {why}, which ours does not do")
    unknown = sorted(set(map(str, entry)) - CODE_KEYS - {"step"})
    if unknown:
        raise ValueError(
            f"{where(SOURCE, pid)}: unknown keys {unknown} (a bitsandbytes Adam state holds step, {sorted(CODE_KEYS)})"
        )
    for key in ("step", "state1", "state2"):
        if key not in entry:
            what = "a one-state optimizer's (SGD, Lion, RMSprop, Adagrad)?" if key == "state2" else ""
            raise ValueError(f"{where(SOURCE, pid)}: no {key!r} (keys: {sorted(entry)}) {what}".rstrip())
    state1 = plain_tensor(entry["state1"], where(SOURCE, pid, "state1"))
    state2 = plain_tensor(entry["state2"], where(SOURCE, pid, "state2"))
    if state1.shape != state2.shape or state1.dtype != state2.dtype:
        raise ValueError(
            f"{where(SOURCE, pid)}: state1 ({state1.dtype} {tuple(state1.shape)}) and state2 ({state2.dtype} "
            f"{tuple(state2.shape)}) differ: AdEMAMix keeps two moments in state1, and does not convert"
        )
    out = {"step": torch.tensor(step_value(entry["step"], where(SOURCE, pid, "step")))}
    for n, (ours, codes) in enumerate((("exp_avg", state1), ("exp_avg_sq", state2)), start=1):
        out[ours] = _moment(pid, entry, n, codes, signed=ours == "exp_avg")
    return out


def _moment(pid, entry: dict, n: int, codes: torch.Tensor, signed: bool):
    at = where(SOURCE, pid, f"state{n}")
    if codes.dtype != torch.uint8:
        return float_state(codes, at)  # a small tensor's fp32 state (or optim_bits=32)
    table = codebook(entry.get(f"qmap{n}"), 256, where(SOURCE, pid, f"qmap{n}"))
    if f"absmax{n}" in entry:
        scale, block_size = block_scales(
            entry[f"absmax{n}"], codes.numel(), BLOCK_SIZES, where(SOURCE, pid, f"absmax{n}")
        )
        return dtq8_or_float(codes, table, scale, block_size, codes.shape, signed)
    if f"max{n}" in entry:
        # one scale for the whole tensor: a single block
        scale = plain_tensor(entry[f"max{n}"], where(SOURCE, pid, f"max{n}"))
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(
                f"{where(SOURCE, pid, f'max{n}')}: expected one float32 value, got {scale.dtype} {tuple(scale.shape)}"
            )
        return dequantized(codes, table, scale.reshape(1), max(codes.numel(), 1), codes.shape)
    raise ValueError(f"{at} holds 8-bit codes, but the state has neither absmax{n} nor max{n} (keys: {sorted(entry)})")


def from_ours(state_dict: dict[str, Any], min_8bit_size: int) -> dict[str, Any]:
    if not isinstance(min_8bit_size, int) or isinstance(min_8bit_size, bool) or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be an int >= 0, got {min_8bit_size!r}")
    groups = []
    for i, group in enumerate(state_dict["param_groups"]):
        at = f"{OURS} state_dict, param group {i}"
        for key, ok in (("amsgrad", False), ("maximize", False)):
            if group.get(key, ok) != ok:
                raise ValueError(f"{at} has {key}={group[key]!r}, which bitsandbytes' Adam does not do")
        hp = group_hyperparams(group, OURS, i)
        if hp["weight_decay"] and group.get("decoupled_weight_decay", True) is False:
            raise ValueError(
                f"{at}: Adam's L2 weight decay (weight_decay={hp['weight_decay']}, decoupled_weight_decay=False); "
                f"bitsandbytes' Adam and AdamW both decay decoupled"
            )
        groups.append({**hp, "alpha": 0.0, "t_alpha": None, "t_beta3": None, **group_ids(group)})
    state = {}
    for pid, step, moments in our_entries(state_dict, SOURCE):
        if "max_exp_avg_sq" in moments:
            raise ValueError(f"{where(OURS, pid, 'max_exp_avg_sq')}: amsgrad, which bitsandbytes' Adam does not do")
        entry = {"step": int(step)}
        for n, key in enumerate(("exp_avg", "exp_avg_sq"), start=1):
            entry.update(_bnb_moment(moments[key], n, key == "exp_avg", min_8bit_size, where(OURS, pid, key)))
        state[pid] = entry
    return {"state": state, "param_groups": groups}


def _bnb_moment(value, n: int, signed: bool, min_8bit_size: int, at: str) -> dict:
    """``state{n}`` (and ``qmap{n}``, ``absmax{n}``) as bitsandbytes creates them for a blockwise 8-bit optimizer."""
    if value.numel() < min_8bit_size:
        return {f"state{n}": our_moment(value, at)}
    if isinstance(value, DTQ8bitTensor) and value.block_size == BLOCK_SIZE and value.signed == signed:
        value.check_fields()
        codes, absmax = value.codes.clone(), value.absmax.clone()  # the same codes and scales: exact
    else:
        codes, absmax = quantize_blockwise(our_moment(value, at), dynamic_map_values(signed), BLOCK_SIZE, not signed)
    qmap = create_dynamic_map(signed).to(codes.device)
    return {f"state{n}": codes.view(value.shape), f"qmap{n}": qmap, f"absmax{n}": absmax}
