"""The optimizers every benchmark can run, in one table, and what the benchmarks measure them with.

``benchmark_step.py``, ``benchmark_convergence.py`` and ``benchmark_adam_8bit.py`` all build their optimizers
from :func:`optimizer_table`, so a newly registered state format shows up in all three with no benchmark
edit. Names:

- ``Adam``, ``AdamW``: ``torch.optim``'s (fp32 state, default implementation); ``AdamWTorchFused``,
  ``AdamWTorchForeach``: ``torch.optim.AdamW(fused=True)`` / ``(foreach=True)``;
- ``Adam-<format>``, ``AdamW-<format>``: ``torchao_optim.Adam/AdamW(state_format=<format>)`` for every
  registered format and ``none`` (fp32 state through our update), on the fused CUDA path where it applies;
  ``AdamWCompiled-<format>``: the same with ``fused=False`` (the per-parameter compiled path);
- our named optimizers: ``AdamW8bit``, ``AdamDTQ8bit``, ``AdamWDTQ8bit``, ``Adam4bit``, ``AdamW4bit``,
  ``AdamFp8``, ``AdamWFp8``; ``AdamW8bitSR``: ``AdamW8bit(bf16_stochastic_round=True)`` (for bf16 params);
- amsgrad: ``AdamW8bitAmsgrad`` (``AdamW8bit(amsgrad=True)``) beside ``AdamWAmsgradTorchFused`` and
  ``AdamWAmsgradTorchForeach`` (``torch.optim.AdamW(amsgrad=True, fused=True)`` / ``(foreach=True)``);
- peers, where installed: ``AdamBnb8bit``, ``AdamWBnb8bit`` (bitsandbytes), ``AdamWTorchao8bit``,
  ``AdamWTorchao4bit``, ``AdamWTorchaoFp8`` (torchao);
- the other rules, each beside its full-precision form: ``SGD`` (``torch.optim.SGD``, momentum 0.9), ``SGD8bit``,
  ``SGDTorchQuantized`` (``quantize_optimizer_state`` over ``torch.optim.SGD(foreach=True)``),
  ``AdamWTorchQuantized`` (the same over
  ``torch.optim.AdamW(foreach=True)``), ``Lion`` / ``Lion8bit`` (``Lion8bit(state_format="none")`` / default),
  ``Muon`` / ``Muon8bit`` (``Muon8bitCompiled``: ``fused=False``), ``Adagrad`` / ``Adagrad8bit`` and ``RMSprop`` /
  ``RMSprop8bit`` (momentum 0.9; torch's
  with ``foreach=True``), centered: ``RMSpropCentered`` / ``RMSpropCentered8bit`` (momentum 0.9) and
  ``RMSpropCenteredNoMomentum`` / ``RMSpropCenteredNoMomentum8bit``, ``AdEMAMix`` / ``AdEMAMix8bit``
  (``AdEMAMix8bit(state_format="none")`` / default, with its own betas), and bitsandbytes' ``SGDBnb8bit``,
  ``LionBnb8bit``, ``AdagradBnb8bit``, ``RMSpropBnb8bit`` and ``AdEMAMixBnb8bit``; ``Adafactor``
  (``torch.optim.Adafactor``, beside ``AdamW-factored``, whose second moment is Adafactor's). A benchmark hands
  every optimizer AdamW's learning rate; SGD's runs at 50x it and Lion's at a third (the Lion paper's advice, with
  weight decay 3x to keep ``lr * weight_decay``), Muon matches AdamW's update size
  (``adjust_lr_fn="match_rms_adamw"``), Adagrad's runs at 10x it, RMSprop's with momentum at a tenth (momentum
  amplifies its step tenfold), Adafactor's at :data:`ADAFACTOR_LR_SCALE` times it. The factor is the optimizer's
  ``lr_scale``, which :func:`set_lr` applies.

Older names stay accepted (:data:`ALIASES`: ``torch_fused``, ``ours_<format>``, ``bnb``, ...). A benchmark-only
module adds optimizers of its own with :func:`register_optimizer` (``benchmarks/fourbit_variants.py``).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# The benchmarks measure the checkout they belong to, whatever else is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchao_optim  # noqa: E402
from torchao_optim.optim.sharded import is_dtensor  # noqa: E402
from torchao_optim.state import QuantizedState  # noqa: E402

__all__ = [
    "OptimizerEntry",
    "optimizer_table",
    "register_optimizer",
    "resolve",
    "build",
    "missing_package",
    "state_nbytes",
    "state_bytes_per_element",
    "lr_at",
    "set_lr",
    "time_call",
    "timed",
    "wall_time",
    "ALIASES",
]


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer: ``make(params, lr, weight_decay, betas, eps, compile)`` builds it; ``requires`` names the
    package it needs (import name, pip name), None for torch and torchao_optim; ``state_format`` is ours only."""

    name: str
    description: str
    make: Callable[..., torch.optim.Optimizer]
    requires: tuple[str, str] | None = None
    state_format: str | None = None


def _torch(cls, **options):
    def make(params, lr, weight_decay, betas, eps, compile):
        return cls(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **options)

    return make


def _ours(cls, **options):
    def make(params, lr, weight_decay, betas, eps, compile):
        return cls(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, compile=compile, **options)

    return make


def _peer(module: str, class_name: str):
    def make(params, lr, weight_decay, betas, eps, compile):
        cls = getattr(importlib.import_module(module), class_name)
        return cls(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    return make


def _scaled(make_optimizer, scale: float):
    """A factory whose optimizer runs at ``scale`` times the benchmark's lr (weight decay divided by it)."""

    def make(params, lr, weight_decay, betas, eps, compile):
        optimizer = make_optimizer(params, lr * scale, weight_decay / scale, compile)
        optimizer.lr_scale = scale
        return optimizer

    return make


# torch.optim.Adafactor's lr is no step size: it steps by min(lr, 1 / sqrt(t)) times the parameter's RMS (at least
# 1e-3), its update's RMS clipped to 1. Swept on benchmark_convergence.py's small preset (benchmarks/README.md).
ADAFACTOR_LR_SCALE = 15.0


def _other_rules() -> list[OptimizerEntry]:
    """The one-state optimizers and ``quantize_optimizer_state``, each beside its full-precision form."""
    o, bnb = torchao_optim, ("bitsandbytes", "bitsandbytes")
    qos = o.quantize_optimizer_state

    def bnb_rule(class_name, **kw):
        return lambda ps, lr, wd, compile: getattr(importlib.import_module("bitsandbytes.optim"), class_name)(
            ps, lr=lr, weight_decay=wd, **kw
        )

    def muon(state_format, fused=None):
        def make(params, lr, weight_decay, betas, eps, compile):
            return o.Muon8bit(
                params,
                lr=lr,
                weight_decay=weight_decay,
                adjust_lr_fn="match_rms_adamw",
                state_format=state_format,
                compile=compile,
                fused=fused,
            )

        return make

    return [
        OptimizerEntry(
            "SGD",
            "torch.optim.SGD(momentum=0.9)",
            _scaled(lambda ps, lr, wd, c: torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=wd), 50),
        ),
        OptimizerEntry(
            "SGD8bit",
            "torchao_optim.SGD8bit(momentum=0.9)",
            _scaled(lambda ps, lr, wd, c: o.SGD8bit(ps, lr=lr, momentum=0.9, weight_decay=wd, compile=c), 50),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "SGDTorchQuantized",
            "quantize_optimizer_state(torch.optim.SGD(momentum=0.9, foreach=True))",
            _scaled(
                lambda ps, lr, wd, c: qos(torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=wd, foreach=True)), 50
            ),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "SGDBnb8bit",
            "bitsandbytes.optim.SGD8bit(momentum=0.9)",
            _scaled(bnb_rule("SGD8bit", momentum=0.9), 50),
            bnb,
        ),
        OptimizerEntry(
            "AdamWTorchQuantized",
            "quantize_optimizer_state(torch.optim.AdamW(foreach=True))",
            lambda ps, lr, weight_decay, betas, eps, compile: qos(
                torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, foreach=True)
            ),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "Lion",
            "torchao_optim.Lion8bit(state_format='none') (fp32 state)",
            _scaled(
                lambda ps, lr, wd, c: o.Lion8bit(ps, lr=lr, weight_decay=wd, state_format="none", compile=c), 1 / 3
            ),
            None,
            "none",
        ),
        OptimizerEntry(
            "Lion8bit",
            "torchao_optim.Lion8bit",
            _scaled(lambda ps, lr, wd, c: o.Lion8bit(ps, lr=lr, weight_decay=wd, compile=c), 1 / 3),
            None,
            "dtq8",
        ),
        OptimizerEntry("LionBnb8bit", "bitsandbytes.optim.Lion8bit", _scaled(bnb_rule("Lion8bit"), 1 / 3), bnb),
        OptimizerEntry("Muon", "torchao_optim.Muon8bit(state_format='none') (fp32 state)", muon("none"), None, "none"),
        OptimizerEntry("Muon8bit", "torchao_optim.Muon8bit", muon("dtq8"), None, "dtq8"),
        OptimizerEntry("Muon8bitCompiled", "torchao_optim.Muon8bit(fused=False)", muon("dtq8", False), None, "dtq8"),
        OptimizerEntry(
            "Adagrad",
            "torch.optim.Adagrad (foreach)",
            _scaled(lambda ps, lr, wd, c: torch.optim.Adagrad(ps, lr=lr, weight_decay=wd, foreach=True), 10),
        ),
        *(
            OptimizerEntry(
                name,
                f"torchao_optim.Adagrad8bit(state_format={fmt!r})",
                _scaled(
                    lambda ps, lr, wd, c, fmt=fmt: o.Adagrad8bit(
                        ps, lr=lr, weight_decay=wd, state_format=fmt, compile=c
                    ),
                    10,
                ),
                None,
                fmt,
            )
            for name, fmt in (("Adagrad8bit", "fp8"), ("Adagrad8bit-dtq8", "dtq8"))  # the default; the earlier one
        ),
        OptimizerEntry("AdagradBnb8bit", "bitsandbytes.optim.Adagrad8bit", _scaled(bnb_rule("Adagrad8bit"), 10), bnb),
        OptimizerEntry(
            "RMSprop",
            "torch.optim.RMSprop(momentum=0.9) (foreach)",
            _scaled(
                lambda ps, lr, wd, c: torch.optim.RMSprop(ps, lr=lr, momentum=0.9, weight_decay=wd, foreach=True), 0.1
            ),
        ),
        OptimizerEntry(
            "RMSprop8bit",
            "torchao_optim.RMSprop8bit(momentum=0.9)",
            _scaled(lambda ps, lr, wd, c: o.RMSprop8bit(ps, lr=lr, momentum=0.9, weight_decay=wd, compile=c), 0.1),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "RMSpropCentered",
            "torch.optim.RMSprop(momentum=0.9, centered=True) (foreach)",
            _scaled(
                lambda ps, lr, wd, c: torch.optim.RMSprop(
                    ps, lr=lr, momentum=0.9, centered=True, weight_decay=wd, foreach=True
                ),
                0.1,
            ),
        ),
        OptimizerEntry(
            "RMSpropCentered8bit",
            "torchao_optim.RMSprop8bit(momentum=0.9, centered=True)",
            _scaled(
                lambda ps, lr, wd, c: o.RMSprop8bit(ps, lr=lr, momentum=0.9, centered=True, weight_decay=wd, compile=c),
                0.1,
            ),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "RMSpropCenteredNoMomentum",
            "torch.optim.RMSprop(centered=True) (foreach)",
            _scaled(
                lambda ps, lr, wd, c: torch.optim.RMSprop(ps, lr=lr, centered=True, weight_decay=wd, foreach=True), 1
            ),
        ),
        OptimizerEntry(
            "RMSpropCenteredNoMomentum8bit",
            "torchao_optim.RMSprop8bit(centered=True)",
            _scaled(lambda ps, lr, wd, c: o.RMSprop8bit(ps, lr=lr, centered=True, weight_decay=wd, compile=c), 1),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "AdEMAMix",
            "torchao_optim.AdEMAMix8bit(state_format='none') (fp32 state)",
            lambda ps, lr, weight_decay, betas, eps, compile: o.AdEMAMix8bit(
                ps, lr=lr, weight_decay=weight_decay, eps=eps, state_format="none", compile=compile
            ),
            None,
            "none",
        ),
        OptimizerEntry(
            "AdEMAMix8bit",
            "torchao_optim.AdEMAMix8bit",
            lambda ps, lr, weight_decay, betas, eps, compile: o.AdEMAMix8bit(
                ps, lr=lr, weight_decay=weight_decay, eps=eps, compile=compile
            ),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "AdEMAMixBnb8bit",
            "bitsandbytes.optim.AdEMAMix8bit",
            lambda ps, lr, weight_decay, betas, eps, compile: importlib.import_module(
                "bitsandbytes.optim"
            ).AdEMAMix8bit(ps, lr=lr, weight_decay=weight_decay, eps=eps),
            bnb,
        ),
        OptimizerEntry(
            "RMSpropBnb8bit",
            "bitsandbytes.optim.RMSprop8bit(momentum=0.9)",
            _scaled(bnb_rule("RMSprop8bit", momentum=0.9), 0.1),
            bnb,
        ),
        OptimizerEntry(
            "Adafactor",
            f"torch.optim.Adafactor (factored second moment, no first moment; lr x{ADAFACTOR_LR_SCALE:g})",
            _scaled(lambda ps, lr, wd, c: torch.optim.Adafactor(ps, lr=lr, weight_decay=wd), ADAFACTOR_LR_SCALE),
        ),
    ]


def optimizer_table() -> dict[str, OptimizerEntry]:
    """Every optimizer a benchmark accepts, by name (see the module docstring), in a stable order."""
    entries = [
        OptimizerEntry("Adam", "torch.optim.Adam (fp32 state)", _torch(torch.optim.Adam)),
        OptimizerEntry("AdamW", "torch.optim.AdamW (fp32 state)", _torch(torch.optim.AdamW)),
        OptimizerEntry("AdamWTorchFused", "torch.optim.AdamW(fused=True)", _torch(torch.optim.AdamW, fused=True)),
        OptimizerEntry("AdamWTorchForeach", "torch.optim.AdamW(foreach=True)", _torch(torch.optim.AdamW, foreach=True)),
    ]
    named = {
        "AdamW8bit": "dtq8",
        "AdamDTQ8bit": "dtq8",
        "AdamWDTQ8bit": "dtq8",
        "Adam4bit": "4bit",
        "AdamW4bit": "4bit",
        "AdamFp8": "fp8",
        "AdamWFp8": "fp8",
    }
    for name, fmt in named.items():
        cls = torchao_optim.AdamW8bit if name == "AdamWDTQ8bit" else getattr(torchao_optim, name)
        entries.append(OptimizerEntry(name, f"torchao_optim.{cls.__name__} ({fmt} state)", _ours(cls), None, fmt))
    bnb = ("bitsandbytes", "bitsandbytes")
    entries += [
        OptimizerEntry("AdamBnb8bit", "bitsandbytes.optim.Adam8bit", _peer("bitsandbytes.optim", "Adam8bit"), bnb),
        OptimizerEntry("AdamWBnb8bit", "bitsandbytes.optim.AdamW8bit", _peer("bitsandbytes.optim", "AdamW8bit"), bnb),
    ]
    for suffix, class_name in (("8bit", "AdamW8bit"), ("4bit", "AdamW4bit"), ("Fp8", "AdamWFp8")):
        entries.append(
            OptimizerEntry(
                f"AdamWTorchao{suffix}",
                f"torchao.optim.{class_name}",
                _peer("torchao.optim", class_name),
                ("torchao", "torchao"),
            )
        )
    for fmt in torchao_optim.list_state_formats() + ["none"]:
        for cls in (torchao_optim.Adam, torchao_optim.AdamW):
            entries.append(
                OptimizerEntry(
                    f"{cls.__name__}-{fmt}",
                    f"torchao_optim.{cls.__name__}(state_format={fmt!r})",
                    _ours(cls, state_format=fmt),
                    None,
                    fmt,
                )
            )
        entries.append(
            OptimizerEntry(
                f"AdamWCompiled-{fmt}",
                f"torchao_optim.AdamW(state_format={fmt!r}, fused=False)",
                _ours(torchao_optim.AdamW, state_format=fmt, fused=False),
                None,
                fmt,
            )
        )
    entries.append(
        OptimizerEntry(
            "AdamW8bitSR",
            "torchao_optim.AdamW8bit(bf16_stochastic_round=True)",
            _ours(torchao_optim.AdamW8bit, bf16_stochastic_round=True),
            None,
            "dtq8",
        )
    )
    entries += [
        OptimizerEntry(
            "AdamW8bitAmsgrad",
            "torchao_optim.AdamW8bit(amsgrad=True)",
            _ours(torchao_optim.AdamW8bit, amsgrad=True),
            None,
            "dtq8",
        ),
        OptimizerEntry(
            "AdamWAmsgradTorchFused",
            "torch.optim.AdamW(amsgrad=True, fused=True)",
            _torch(torch.optim.AdamW, amsgrad=True, fused=True),
        ),
        OptimizerEntry(
            "AdamWAmsgradTorchForeach",
            "torch.optim.AdamW(amsgrad=True, foreach=True)",
            _torch(torch.optim.AdamW, amsgrad=True, foreach=True),
        ),
    ]
    entries += _other_rules()
    table = {e.name: e for e in entries}
    return table | _REGISTERED


# Optimizers added by benchmark-only modules (register_optimizer), after the built-in ones.
_REGISTERED: dict[str, OptimizerEntry] = {}


def register_optimizer(entry: OptimizerEntry) -> OptimizerEntry:
    """Add ``entry`` to :func:`optimizer_table`, so that every benchmark accepts its name. Registering a name again
    replaces the entry (a module loaded twice); a built-in name is refused (ValueError naming it)."""
    if not isinstance(entry, OptimizerEntry):
        raise TypeError(f"register_optimizer expects an OptimizerEntry, got {entry!r}")
    if entry.name not in _REGISTERED and (entry.name in optimizer_table() or entry.name in ALIASES):
        raise ValueError(f"optimizer name {entry.name!r} is built in; register a variant under another name")
    _REGISTERED[entry.name] = entry
    return entry


def adamw_variant(class_name: str, rule_name: str, update: Callable, tile_update: Callable, doc: str) -> type:
    """A subclass of ``torchao_optim.AdamW``, named ``class_name``, whose element update is ``update`` on the compiled
    path (Adam's arguments) and ``tile_update`` on the fused Triton kernels (a function of Adam's tile arguments that
    may call ``rules.adam.adam_tile_update``): Adam's two states and coefficients, no amsgrad. For the benchmark-only
    candidates of the 4-bit study (``normalized_momentum.py``, ``clipped_momentum.py``)."""
    from torchao_optim.rules import adam
    from torchao_optim.rules.base import FusedRule, triton_jit

    rule = FusedRule(
        rule_name,
        ("exp_avg", "exp_avg_sq"),
        (True, False),
        adam.COEFS,
        adam.adam_coefficients,
        option="decoupled",
        triton_update=triton_jit(tile_update, calls=(adam.adam_tile_update,)),
        triton_coefficients=adam.ADAM.triton_coefficients,
    )

    class Variant(torchao_optim.AdamW):
        update_fn = staticmethod(update)

        def _fused_rule(self, group):
            if group["amsgrad"]:
                raise ValueError(f"the {rule_name} variant does not take amsgrad")
            return rule

    Variant.__name__ = Variant.__qualname__ = class_name
    Variant.__doc__ = doc
    Variant.rule = rule
    return Variant


def register_ours(table: dict[str, str], cls: type, what: str, **options) -> None:
    """Register ``cls`` (a torchao_optim optimizer) under each name of ``table`` with that name's state format."""
    for name, fmt in table.items():
        register_optimizer(
            OptimizerEntry(
                name, f"{cls.__name__}, {fmt} state, {what}", _ours(cls, state_format=fmt, **options), None, fmt
            )
        )


# Names the benchmarks used before they shared this table: still accepted.
ALIASES = {
    "torch_fused": "AdamWTorchFused",
    "torch_foreach": "AdamWTorchForeach",
    "bnb": "AdamWBnb8bit",
    "bnb_8bit": "AdamWBnb8bit",
    "torchao": "AdamWTorchao8bit",
    "torchao_8bit": "AdamWTorchao8bit",
    "torchao_4bit": "AdamWTorchao4bit",
    "torchao_fp8": "AdamWTorchaoFp8",
    "torch_sgd_foreach": "SGD",
    "ours_sgd8bit": "SGD8bit",
    "ours_lion_fp32": "Lion",
    "ours_lion8bit": "Lion8bit",
    "torch_foreach_quantized": "AdamWTorchQuantized",
    "AdamW-qos": "AdamWTorchQuantized",
    "SGD-qos": "SGDTorchQuantized",
    "bnb_sgd8bit": "SGDBnb8bit",
    "bnb_lion8bit": "LionBnb8bit",
    "bnb-SGD8bit": "SGDBnb8bit",
    "bnb-Lion8bit": "LionBnb8bit",
}


def resolve(name: str) -> str | None:
    """The table's name for ``name`` (itself, an alias, or ``ours_<format>[_compiled]``), None if unknown."""
    table = optimizer_table()
    if name in table:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if name.startswith("ours_"):  # ours_<format>, ours_<format>_compiled
        fmt = name[len("ours_") :]
        if f"AdamW-{fmt}" in table:
            return f"AdamW-{fmt}"
        if f"AdamWCompiled-{fmt.removesuffix('_compiled')}" in table and fmt.endswith("_compiled"):
            return f"AdamWCompiled-{fmt.removesuffix('_compiled')}"
    return None


def missing_package(name: str) -> tuple[str, str] | None:
    """(import name, pip name) of the package optimizer ``name`` needs and cannot import, else None."""
    entry = optimizer_table()[resolve(name)]
    if entry.requires is None:
        return None
    try:
        importlib.import_module(entry.requires[0])
    except Exception:  # ImportError, or a broken native library
        return entry.requires
    return None


def build(
    name: str,
    params: Iterable,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    compile: bool = True,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (or an alias) over ``params``; ``compile`` applies to torchao_optim's only."""
    resolved = resolve(name)
    if resolved is None:
        raise ValueError(f"unknown optimizer {name!r}")
    return optimizer_table()[resolved].make(
        params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, compile=compile
    )


# ---- what a benchmark measures ----------------------------------------------------------------------------


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (a DTensor's local shard: what this rank holds), tensor
    subclasses counted by their inner tensors, each storage counted once (torchao's subclasses, for instance, may share
    a code table)."""
    seen = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if is_dtensor(t):  # FSDP2: this rank's shard
            add(t.to_local())
        elif isinstance(t, QuantizedState):
            for inner in t.fields().values():
                add(inner)
        elif type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # another library's subclass
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        else:
            key = (t.device, t.data_ptr(), t.numel(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()

    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return total


def state_bytes_per_element(state_format: str, shape: Sequence[int]) -> tuple[float, float]:
    """Bytes of (``exp_avg``, ``exp_avg_sq``) per element for a parameter of ``shape`` in ``state_format``,
    from the format's own tensors (created on the meta device): codes and scales, whatever the format."""
    fmt = torchao_optim.get_state_format(state_format)
    numel = math.prod(shape)
    out = []
    for signed in (True, False):
        state = fmt.zeros(tuple(shape), signed=signed, device="meta")
        out.append(sum(t.numel() * t.element_size() for t in state.fields().values()) / numel)
    return out[0], out[1]


def lr_at(step: int, peak: float, warmup: int, total: int, final_frac: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps (0-based ``step``), then a cosine decay to
    ``final_frac * peak`` at ``total``. A pure function of its arguments."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Assign the step's learning rate, a Python float, to every group, times the optimizer's ``lr_scale`` where
    it has one. (torchao's optimizers keep ``lr`` as a tensor and reject a float, so theirs is filled in place.)"""
    lr = lr * getattr(optimizer, "lr_scale", 1.0)
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def time_call(fn: Callable[[], object], device: str) -> float:
    """Seconds ``fn()`` takes: CUDA events on a GPU (device time, from an idle GPU: the host's time before
    ``fn``'s first kernel counts; :func:`timed` can leave it out), the wall clock elsewhere."""
    return timed(fn, device)[0]


_SLEEP_CYCLES_PER_S: list[float] = []


def _gpu_cycles_per_second() -> float:
    """Clock cycles per second of ``torch.cuda._sleep``'s spin: measured on first use, and measured again by
    :func:`timed` whenever a spin ran shorter than asked (the GPU's clock rose since)."""
    if not _SLEEP_CYCLES_PER_S:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # the first call loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S.append(cycles / (start.elapsed_time(end) / 1e3))
    return _SLEEP_CYCLES_PER_S[-1]


def timed(fn: Callable[[], object], device: str, spin_s: float = 0.0) -> tuple[float, float]:
    """``(device seconds, host seconds)`` of ``fn()``. On a GPU the device time is taken with CUDA events around
    ``fn``; with ``spin_s`` a spin of the GPU (``torch.cuda._sleep``) of that long is queued first, so that the host
    queues ``fn``'s work before the start event is reached: ``fn``'s own time on the device, as in a training loop
    where the step is queued behind backward's kernels. The spin counts clock cycles, and an idle GPU's clock is a
    fraction of its clock under load: a spin that ran shorter than the host's time, which would let the host's time
    count, is timed too, and the measurement is taken again with the spin's rate as measured then (at most three
    times; if the host is slower than ``spin_s`` its excess counts, as it would stall that loop). Without
    ``spin_s`` the GPU is idle when ``fn`` is called, and the host's time before ``fn``'s first kernel counts. The
    host time is the wall time of the call itself. Elsewhere both are the wall time."""
    if not str(device).startswith("cuda"):
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        return t, t
    spin_start, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    for _attempt in range(3):
        if spin_s:
            cycles = int(_gpu_cycles_per_second() * min(spin_s, 0.2))
            spin_start.record()
            torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        if not spin_s:
            break
        spun = spin_start.elapsed_time(start) / 1e3
        if spun >= min(host, spin_s):
            break
        _SLEEP_CYCLES_PER_S.append(cycles / spun)  # the clock rose: the same spin takes fewer seconds now
    return start.elapsed_time(end) / 1e3, host


def wall_time(fn: Callable[[], object], device: str) -> float:
    """Seconds from calling ``fn()`` until the device has finished its work: host time included (a first step's
    compilation, for instance)."""
    t0 = time.perf_counter()
    fn()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def names(available_only: bool = False) -> list[str]:
    """The table's names; with ``available_only``, those whose package imports."""
    return [n for n in optimizer_table() if not available_only or missing_package(n) is None]
