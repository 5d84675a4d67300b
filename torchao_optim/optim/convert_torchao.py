"""torchao's low-bit Adam/AdamW state_dicts to ours and back (used by
:func:`~torchao_optim.optim.convert.convert_state_dict`), and :func:`load_torchao_checkpoint`.

What torchao (read from 0.18.0, ``torchao.optim``; before 0.11 ``torchao.prototype.low_bit_optim``) keeps per
parameter: ``step`` (a 0-d fp32 tensor) and ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad),
each a plain tensor of the parameter's shape where the tensor has fewer than 4096 elements or is not whole blocks,
else a tensor subclass whose fields are:

- ``OptimState8bit``: ``codes`` (uint8, the parameter's shape; an index into ``qmap``), ``scale`` (fp32, one per
  block of ``block_size = codes.numel() // scale.numel()`` elements of the flat tensor, default 256), ``qmap``
  (256 fp32 values: the dynamic map, signed or not as ``signed`` says). A value is ``qmap[code] * scale``.
- ``OptimState4bit``: ``codes`` (uint8, flat, two codes a byte, the first element in the high nibble), ``scale``
  (blocks of ``codes.numel() * 2 // scale.numel()``, default 128), ``qmap`` (16 values: the 4-bit signed dynamic
  map, or ``linspace(0, 1, 17)[1:]`` unsigned), ``signed``, ``_shape``.
- ``OptimStateFp8``: ``codes`` (``float8_e4m3fn``, the parameter's shape), ``scale`` (block absmax / 448, blocks of
  256). A value is ``float(code) * scale``.

Groups hold ``lr`` (a 0-d tensor: torchao's step refuses a float), ``betas``, ``eps``, ``weight_decay``,
``amsgrad``. Whether weight decay is decoupled is the class's (``AdamW8bit`` or ``Adam8bit``), not the state_dict's.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from torchao_optim.optim.convert import (
    MOMENTS,
    OURS,
    SIGNED,
    codebook,
    dequantized,
    dtq8_or_float,
    float_state,
    group_hyperparams,
    group_ids,
    nibbles_high_first,
    our_entries,
    our_moment,
    plain_tensor,
    step_value,
    where,
)
from torchao_optim.optim.sharded import is_dtensor
from torchao_optim.state import DTQ8bitTensor

__all__ = ["load_torchao_checkpoint", "TorchaoState"]

SOURCE = "torchao"
KINDS = {"OptimState8bit": "8bit", "OptimState4bit": "4bit", "OptimStateFp8": "fp8"}
MODULES = {"8bit": "subclass_8bit", "4bit": "subclass_4bit", "fp8": "subclass_fp8"}
PACKAGES = ("torchao.optim", "torchao.prototype.low_bit_optim")  # where torchao kept them: now, and before 0.11
DEFAULT_BLOCK_SIZE = {"8bit": 256, "4bit": 128, "fp8": 256}
MIN_QUANT_SIZE = 4096  # torchao quantizes a state of at least this many elements, if they are whole blocks


# ---- reading torchao's states without torchao ------------------------------------------------------------


class TorchaoState(Tensor):
    """What :func:`load_torchao_checkpoint` reads where a checkpoint holds one of torchao's state classes: a tensor
    of the state's shape that holds the fields torchao saved (``codes``, ``scale``, ...) and supports no op.
    :func:`~torchao_optim.convert_state_dict` converts it like the torchao class it stands for."""

    kind: ClassVar[str] = ""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(
            f"{cls.__name__} only holds the fields of torchao's OptimState{cls.kind.capitalize()} read from a "
            f"checkpoint ({func} is not supported): convert the state_dict with convert_state_dict(sd, "
            f"source='torchao')"
        )

    def __repr__(self) -> str:
        fields = {k: (v.dtype, tuple(v.shape)) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        return f"{type(self).__name__}(shape={tuple(self.shape)}, {fields})"


class TorchaoState8bit(TorchaoState):
    kind = "8bit"


class TorchaoState4bit(TorchaoState):
    kind = "4bit"


class TorchaoStateFp8(TorchaoState):
    kind = "fp8"


_STAND_INS = {"8bit": TorchaoState8bit, "4bit": TorchaoState4bit, "fp8": TorchaoStateFp8}


def load_torchao_checkpoint(f, map_location: Any = "cpu") -> Any:
    """``torch.load(f, weights_only=True)`` of a checkpoint that holds torchao's low-bit optimizer states, with
    or without torchao installed: where torchao's classes are not registered as safe (torchao not imported), its
    ``OptimState8bit``/``4bit``/``Fp8`` are read as :class:`TorchaoState` objects that hold their fields, which
    :func:`~torchao_optim.convert_state_dict` converts. Nothing but tensors and those classes is unpickled."""
    known = set()
    for entry in torch.serialization.get_safe_globals():
        known.add(entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}")
    stand_ins = []
    for kind, module in MODULES.items():
        cls_name = next(name for name, k in KINDS.items() if k == kind)
        for package in PACKAGES:
            name = f"{package}.{module}.{cls_name}"
            if name not in known:
                stand_ins.append((_STAND_INS[kind], name))
    with torch.serialization.safe_globals(stand_ins):
        return torch.load(f, map_location=map_location, weights_only=True)


# ---- torchao to ours -------------------------------------------------------------------------------------


def _kind(value: Any) -> str | None:
    """ "8bit", "4bit" or "fp8" for torchao's state classes (live, or read by :func:`load_torchao_checkpoint`)."""
    if isinstance(value, TorchaoState):
        return value.kind
    cls = type(value)
    if cls.__module__.split(".")[0] == "torchao" and cls.__name__ in KINDS:
        return KINDS[cls.__name__]
    return None


def to_ours(state_dict: dict[str, Any]) -> dict[str, Any]:
    groups = []
    for i, group in enumerate(state_dict["param_groups"]):
        amsgrad = group.get("amsgrad", False)
        if not isinstance(amsgrad, bool):
            raise ValueError(f"{SOURCE} state_dict, param group {i}: amsgrad must be a bool, got {amsgrad!r}")
        groups.append(
            {**group_hyperparams(group, SOURCE, i), "amsgrad": amsgrad, "maximize": False, **group_ids(group)}
        )
    state = {}
    for pid, entry in state_dict["state"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"{where(SOURCE, pid)}: its state must be a dict, got {type(entry).__name__}")
        unknown = sorted(set(map(str, entry)) - {"step", *MOMENTS})
        if unknown:
            raise ValueError(
                f"{where(SOURCE, pid)}: unknown keys {unknown}; a torchao Adam state holds step, {list(MOMENTS)}"
            )
        if entry and any(k not in entry for k in ("step", "exp_avg", "exp_avg_sq")):
            raise ValueError(f"{where(SOURCE, pid)}: expected step, exp_avg and exp_avg_sq, got {sorted(entry)}")
        out = {"step": torch.tensor(step_value(entry["step"], where(SOURCE, pid, "step")))} if entry else {}
        for key in MOMENTS:
            if key in entry:
                out[key] = _moment(entry[key], SIGNED[key], where(SOURCE, pid, key))
        state[pid] = out
    return {"state": state, "param_groups": groups}


def _field(value: Any, name: str, at: str) -> Any:
    fields = vars(value)
    if name not in fields:
        raise ValueError(
            f"{at}: a torchao {type(value).__name__} without the field {name!r} (fields: {sorted(fields)}): "
            f"a layout other than torchao 0.18's"
        )
    return fields[name]


def _moment(value: Any, signed: bool, at: str):
    if is_dtensor(value):
        plain_tensor(value, at)  # raises, naming what to do
    kind = _kind(value)
    if kind is None:
        if isinstance(value, Tensor) and type(value) is not Tensor:
            cls = type(value)
            raise ValueError(
                f"{at} is a {cls.__module__}.{cls.__qualname__}, which is none of torchao's "
                f"{sorted(KINDS)} (torchao 0.18's layouts)"
            )
        return float_state(plain_tensor(value, at), at)
    if kind != "fp8" and _field(value, "signed", at) is not signed:
        raise ValueError(f"{at}: a torchao state with signed={_field(value, 'signed', at)!r}; this key's is {signed}")
    codes = plain_tensor(_field(value, "codes", at), f"{at}.codes")
    if kind == "4bit":
        shape = torch.Size(_field(value, "_shape", at))
    else:
        shape = codes.shape
    numel = math.prod(shape)
    scale = plain_tensor(_field(value, "scale", at), f"{at}.scale")
    want = {"8bit": (torch.uint8, numel), "4bit": (torch.uint8, numel // 2), "fp8": (torch.float8_e4m3fn, numel)}[kind]
    if codes.dtype != want[0] or codes.numel() != want[1] or (kind == "4bit" and (codes.dim() != 1 or numel % 2)):
        raise ValueError(
            f"{at}.codes: a torchao {kind} state of shape {tuple(shape)} has {want[0]} codes of {want[1]} "
            f"elements, got {codes.dtype} of shape {tuple(codes.shape)}"
        )
    if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() == 0 or numel % scale.numel():
        raise ValueError(
            f"{at}.scale: expected a float32 vector with one scale per block of the {numel} elements, got "
            f"{scale.dtype} of shape {tuple(scale.shape)}"
        )
    block_size = numel // scale.numel()
    if kind == "fp8":
        blocks = codes.reshape(-1).float().view(-1, block_size) * scale[:, None]  # (n_blocks, block_size)
        return blocks.view(shape)
    table = codebook(_field(value, "qmap", at), 256 if kind == "8bit" else 16, f"{at}.qmap")
    if kind == "8bit":
        return dtq8_or_float(codes, table, scale, block_size, shape, signed)
    return dequantized(nibbles_high_first(codes, numel), table, scale, block_size, shape)


# ---- ours to torchao -------------------------------------------------------------------------------------


def _torchao_class(kind: str):
    for package in PACKAGES:
        try:
            module = __import__(f"{package}.{MODULES[kind]}", fromlist=["_"])
        except ImportError:
            continue
        return getattr(module, next(name for name, k in KINDS.items() if k == kind))
    raise ImportError(
        "convert_state_dict(..., target='torchao') builds torchao's own state classes, and torchao is not "
        "importable: install torchao (the conversion is tested with 0.18.0)"
    )


def from_ours(state_dict: dict[str, Any], fmt: str | None, block_size: int | None) -> dict[str, Any]:
    if fmt not in MODULES:
        raise ValueError(f"target='torchao' needs torchao_format, one of {sorted(MODULES)}: got {fmt!r}")
    block_size = DEFAULT_BLOCK_SIZE[fmt] if block_size is None else block_size
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even int, got {block_size!r}")
    groups = []
    for i, group in enumerate(state_dict["param_groups"]):
        if group.get("maximize", False):
            raise ValueError(f"{OURS} state_dict, param group {i} has maximize=True, which torchao's Adam does not do")
        hp = group_hyperparams(group, OURS, i)
        hp["lr"] = torch.tensor(hp["lr"], dtype=torch.float32)  # torchao's step refuses a float lr
        groups.append({**hp, "amsgrad": bool(group.get("amsgrad", False)), **group_ids(group)})
    entries = list(our_entries(state_dict, SOURCE))  # everything checked before torchao is needed
    cls = _torchao_class(fmt)
    state = {}
    for pid, step, moments in entries:
        entry: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.float32)}
        for key, value in moments.items():
            entry[key] = _torchao_moment(cls, fmt, block_size, value, SIGNED[key], where(OURS, pid, key))
        state[pid] = entry
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def _torchao_moment(cls, fmt: str, block_size: int, value, signed: bool, at: str):
    numel = value.numel()
    if numel < MIN_QUANT_SIZE or numel % block_size:
        return our_moment(value, at)  # torchao keeps such a state plain
    shape, device = tuple(value.shape), value.device
    if fmt == "fp8":
        out = cls.zeros(shape, block_size, device)
    else:
        out = cls.zeros(shape, signed, block_size, device)
    if fmt == "8bit" and isinstance(value, DTQ8bitTensor) and value.block_size == block_size and value.signed == signed:
        value.check_fields()
        out.codes.copy_(value.codes.view(shape))  # the same codes, in the same map: exact
        out.scale.copy_(value.absmax)
    else:
        out.copy_(our_moment(value, at))  # torchao's own quantizer
    return out
