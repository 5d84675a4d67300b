"""Low-bit state for optimizers we did not write: :func:`quantize_optimizer_state`.

A stock ``torch.optim`` optimizer's step updates its state with in-place ops (``lerp_``, ``mul_``,
``addcmul_``, ``_foreach_*``). A quantized state could implement each of them by dequantizing and
requantizing, but then a state is rounded once per op (``exp_avg_sq`` twice an AdamW step), the error
grows several-fold, and every ``_foreach_*`` op (``foreach=True``, the CUDA default) would need an
implementation of its own. Instead the optimizer's step is wrapped: a bounded chunk of parameters at a
time, each quantized state is dequantized to a plain fp32 tensor, the optimizer's own step runs over that
chunk only (its groups' ``params`` narrowed to the chunk), and each state is requantized once, into the
storage it came from. Any single-tensor or foreach step works unchanged; each state is rounded once per step,
as in our own optimizers; the extra memory is one fp32 copy of the chunk's states.

The optimizer keeps its class (the wrapper is a subclass made for it, so ``isinstance`` still holds),
``state_dict``/``load_state_dict``, lr schedulers, step hooks (run once per step, not per chunk) and
closures (evaluated once per step).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import Tensor

from torchao_optim.optim.compiled import CompiledOrEager
from torchao_optim.optim.compiled_path import alias, step_shape
from torchao_optim.state import QuantizedState, get_state_format

__all__ = ["quantize_optimizer_state", "UNSIGNED_STATE_KEYS", "SUPPORTED_OPTIMIZERS"]

# States that never hold a negative value, by the name torch.optim gives them: the unsigned map spends all
# its codes on [0, 1] (half the rounding error). Every other state (exp_avg, momentum_buffer, grad_avg, ...)
# may be negative and takes the signed map.
UNSIGNED_STATE_KEYS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf"})
# Tested, with their measured accuracy in docs/any-optimizer.md; others are accepted when their states are
# tensors of their parameter's shape updated by the step (and refused by the checks below otherwise).
SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad")
DEFAULT_CHUNK_NUMEL = 1 << 24  # elements per chunk: at most 64 MiB of fp32 per state kind held at once


def quantize_optimizer_state(
    optimizer: torch.optim.Optimizer,
    state_format: str = "dtq8",
    min_quant_size: int = 4096,
    *,
    block_size: int | None = None,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    compile: bool = True,
    format: str | None = None,
) -> torch.optim.Optimizer:
    """Make a stock ``torch.optim`` optimizer keep its state in a low-bit format; returns ``optimizer``.

    Works before the first step or after some (existing states are quantized at once). Every state tensor
    of a parameter's shape with at least ``min_quant_size`` elements is stored in ``state_format``: with the
    unsigned map where it cannot be negative (:data:`UNSIGNED_STATE_KEYS`), the signed map otherwise. Scalars
    (``step``) and small parameters' states stay as they are. Each step dequantizes the states of up to
    ``chunk_numel`` elements of parameters at a time (a larger parameter is a chunk of its own), runs the
    optimizer's own step on that chunk and requantizes them once: accuracy as our own 8-bit optimizers,
    foreach steps included.

    Refused with ``ValueError``: ``fused=True`` (the fused kernels keep fp32 state; use ``foreach=True`` or
    our fused ``torchao_optim.AdamW``), ``capturable=True`` and ``differentiable=True`` (the wrapped step
    allocates and is not differentiable through the quantization), an optimizer already converted, an
    unknown format.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (tested: Adam, AdamW, SGD, RMSprop, Adagrad).
        state_format (str): a registered state format (``torchao_optim.list_state_formats()``). Default:
            ``"dtq8"``.
        min_quant_size (int): parameters with fewer elements keep their state as it is. Default: ``4096``.
        block_size (int, optional): elements per quantization block; ``None``: the format's default.
        chunk_numel (int): elements of parameters whose states are held in fp32 at once. Default: ``2**24``.
        compile (bool): requantize each state with a compiled kernel (``torch.compile``, one graph per format
            configuration, a few seconds each on the first step; 17x faster than eager on a CPU, measured on a
            1M-element state); falls back to eager, with one warning, where compiling fails. Default: ``True``.
        format (str, optional): the former name of ``state_format``, accepted with a ``DeprecationWarning``.
    """
    if format is not None:
        warnings.warn(
            "quantize_optimizer_state(format=...) is deprecated: use state_format=, as every optimizer "
            "of the library names it",
            DeprecationWarning,
            stacklevel=2,
        )
        state_format = format
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"quantize_optimizer_state expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _QuantizedStep):
        raise ValueError(
            f"this {type(optimizer).__name__} already keeps quantized state ({optimizer._quantized_state['format']!r})"
        )
    if getattr(optimizer, "_quantized_state_native", False):
        raise ValueError(
            f"{type(optimizer).__name__} is one of torchao_optim's optimizers: its state is "
            f"quantized already (choose it with state_format=)"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "quantize_optimizer_state cannot run LBFGS: its step re-evaluates the closure over all "
            "parameters at once, and its state is a history of flat vectors, not per-parameter tensors"
        )
    fmt = get_state_format(state_format)  # ValueError naming the registered formats
    if not isinstance(min_quant_size, int) or isinstance(min_quant_size, bool) or min_quant_size < 0:
        raise ValueError(f"Invalid min_quant_size: {min_quant_size!r}")
    if not isinstance(chunk_numel, int) or isinstance(chunk_numel, bool) or chunk_numel <= 0:
        raise ValueError(f"Invalid chunk_numel: {chunk_numel!r} (a positive int)")
    for i, group in enumerate(optimizer.param_groups):
        _check_group(optimizer, group, i)
    fmt.check_attrs((fmt.default_block_size,), **fmt._attrs(signed=True, block_size=block_size))

    base = type(optimizer)
    optimizer._quantized_state = {
        "format": state_format,
        "min_quant_size": min_quant_size,
        "block_size": block_size,
        "chunk_numel": chunk_numel,
        "compile": bool(compile),
    }
    optimizer.__class__ = _subclass_for(base)
    optimizer._patch_step_function()  # step pre/post hooks around the whole (chunked) step
    step = optimizer.__dict__.get("step")
    if getattr(step, "_wrapped_by_lr_sched", False):
        # an lr scheduler made before the conversion wrapped the old class's step: wrap the new one
        optimizer.step = _scheduler_tracked(optimizer)
    optimizer.register_load_state_dict_post_hook(_quantize_all)
    _quantize_all(optimizer)
    return optimizer


def _check_group(optimizer, group: dict[str, Any], index: int) -> None:
    name = type(optimizer).__name__
    if group.get("state_format", "none") != "none":
        try:
            get_state_format(group["state_format"])
        except ValueError as err:
            raise ValueError(f"param group {index}: {err}") from None
    if group.get("fused"):
        raise ValueError(
            f"param group {index}: quantize_optimizer_state cannot run {name}(fused=True): its fused "
            f"kernel keeps fp32 state. Use {name}(..., foreach=True) (quantized state, one fp32 chunk "
            f"at a time), or torchao_optim.AdamW(fused=None), whose fused CUDA kernel reads quantized "
            f"state directly"
        )
    for key in ("capturable", "differentiable"):
        if group.get(key):
            raise ValueError(
                f"param group {index}: quantize_optimizer_state cannot run {name}({key}=True): the "
                f"quantized step allocates fp32 copies and requantizes"
                + (
                    ", which a CUDA graph cannot capture"
                    if key == "capturable"
                    else ", which autograd cannot differentiate"
                )
                + f"; pass {key}=False"
            )


@functools.cache
def _subclass_for(base: type) -> type:
    return type(
        base.__name__, (_QuantizedStep, base), {"__module__": base.__module__, "__qualname__": base.__qualname__}
    )


def _scheduler_tracked(optimizer):
    """What ``torch.optim.lr_scheduler`` puts on ``optimizer.step``: record the call, then step."""
    import weakref

    ref = weakref.ref(optimizer)

    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


def _raw_step(cls: type):
    """``cls.step`` without ``torch.optim``'s hook wrapper (the hooks run once, around the chunked step)."""
    step = cls.step
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


class _QuantizedStep:
    """Mixed in before a stock optimizer class by :func:`quantize_optimizer_state`."""

    _quantized_state: dict[str, Any]

    def __reduce_ex__(self, protocol):
        # pickle and copy.deepcopy: rebuilt from the stock class, then converted again (the state stays quantized)
        state = self.__getstate__()
        state["_quantized_state"] = self._quantized_state
        return (_rebuild, (type(self).__mro__[2], state))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            _check_group(self, self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        """The optimizer's own step, a chunk of parameters at a time over fp32 copies of their states."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            _check_group(self, group, i)  # a group may have been edited since
        raw = _raw_step(type(self).__mro__[2])
        groups = self.param_groups
        all_params = [g["params"] for g in groups]
        limit = self._quantized_state["chunk_numel"]
        try:
            for g in groups:
                g["params"] = []
            for group, params in zip(groups, all_params):
                with_grad = [p for p in params if p.grad is not None]
                for chunk in _chunks(with_grad, limit):
                    group["params"] = chunk
                    held = self._dequantize(chunk)
                    try:
                        raw(self)
                    finally:
                        self._requantize(group, chunk, held)
                group["params"] = []
        finally:
            for g, params in zip(groups, all_params):
                g["params"] = params
        return loss

    def _dequantize(self, params: list[Tensor]) -> dict[tuple, QuantizedState]:
        """Replace the quantized states of ``params`` by fp32 tensors; return the quantized ones by (param, key)."""
        held = {}
        for p in params:
            state = self.state.get(p)
            for key, value in (state or {}).items():
                if isinstance(value, QuantizedState):
                    held[(p, key)] = value
                    state[key] = value.dequantize(value.dtype)  # the dtype the step saw before
        return held

    def _requantize(self, group, params: list[Tensor], held: dict[tuple, QuantizedState]) -> None:
        """Write the fp32 states of ``params`` back: into the quantized tensor each came from (one rounding), or,
        for a state the step just created, into a new one."""
        for p in params:
            state = self.state.get(p)
            for key, value in list((state or {}).items()):
                q = held.get((p, key))
                if q is not None:
                    if value is not q:
                        _write(q, value, self._quantized_state.get("compile", True))
                    state[key] = q
                else:
                    _quantize_one(self, group, p, state, key)


def _rebuild(base: type, state: dict[str, Any]):
    state = dict(state)
    options = state.pop("_quantized_state")
    optimizer = base.__new__(base)
    optimizer.__setstate__(state)
    optimizer._quantized_state = options
    optimizer.__class__ = _subclass_for(base)
    optimizer._patch_step_function()
    optimizer.register_load_state_dict_post_hook(_quantize_all)
    return optimizer


def _requantize_into(q: QuantizedState, value: Tensor) -> None:
    q.copy_(value)


_REQUANTIZE = CompiledOrEager(_requantize_into)


def _write(q: QuantizedState, value: Tensor, compile: bool) -> None:
    """Requantize ``value`` into ``q``'s storage: compiled (one fused kernel, one graph for every size: both are
    aliased to the compiled path's ``(n_blocks, block_size)`` or flat shape), or eagerly."""
    if not compile or not _REQUANTIZE.enabled or not value.is_contiguous() or value.shape != q.shape:
        q.copy_(value)
        return
    shape = step_shape(value, [q])
    _REQUANTIZE(alias(q, shape), alias(value, shape))


def _chunks(params: list[Tensor], limit: int) -> list[list[Tensor]]:
    out, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > limit:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        out.append(current)
    return out


def _storage(optimizer, group) -> tuple:
    """(format name, min_quant_size, block_size) for ``group``: its own ``state_format``, ``min_quant_size`` and
    ``block_size`` where it has them (:func:`torchao_optim.overrides` groups), else the conversion's."""
    opts = optimizer._quantized_state
    return (
        group.get("state_format", opts["format"]),
        group.get("min_quant_size", opts["min_quant_size"]),
        group.get("block_size", opts["block_size"]),
    )


def _quantize_one(optimizer, group, p: Tensor, state: dict[str, Any], key: str) -> None:
    """Quantize ``state[key]`` in place of the plain tensor if it is one this optimizer stores quantized."""
    value = state[key]
    format_name, min_quant_size, block_size = _storage(optimizer, group)
    if (
        type(value) is not Tensor
        or not value.is_floating_point()
        or value.shape != p.shape
        or format_name == "none"
        or value.numel() < max(min_quant_size, 1)
        or value.dtype == torch.float64
    ):
        return
    fmt = get_state_format(format_name)
    signed = key not in UNSIGNED_STATE_KEYS
    try:
        fmt.check_attrs(p.shape, **fmt._attrs(signed=signed, block_size=block_size))
    except ValueError:
        return  # the format cannot store this shape: keep plain state
    dtype = value.dtype
    value = value.detach().to(torch.float32)
    if not signed:
        value = value.clamp_min(0)  # -0.0 and rounding never make a sum of squares negative; NaN stays NaN
    # the format derives what follows from the shape (4bit_rank1's rows), as for the optimizers' own states
    state[key] = fmt.from_float(value, signed=signed, block_size=block_size).to(dtype=dtype)


def _quantize_all(optimizer) -> None:
    """Quantize every state that should be (after the conversion, and after ``load_state_dict``)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            for key in list(state or {}):
                _quantize_one(optimizer, group, p, state, key)
