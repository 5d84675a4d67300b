"""Argument checks: what a constructor, a param group or a gradient must be, refused by name otherwise.

Numbers are read as torch.optim reads them (ints, floats, numpy scalars and, where torch.optim takes one, a
one-element tensor); everything else is a ValueError naming the argument and the value.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import Tensor

from torchao_optim.optim.fused import fused_available, triton_refusal
from torchao_optim.optim.sharded import is_dtensor
from torchao_optim.state import get_state_format

__all__ = [
    "as_float",
    "check_bool",
    "check_grad",
    "check_group",
    "check_number",
    "check_offload",
    "check_storage",
    "check_torch_keywords",
    "check_unique",
    "number",
]


def number(name, value, tensor_ok=False):
    """``value`` as a Python float: ints, floats, numpy scalars and (where torch.optim takes one) a one-element
    tensor; anything else is a ValueError naming it."""
    if isinstance(value, Tensor):
        if not tensor_ok or value.numel() != 1 or value.is_complex():
            raise ValueError(
                f"Invalid {name}: a tensor {name} must be real with exactly one element, got "
                f"shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        return float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid {name}: {value!r} (a real number)")
    return float(value)


def check_number(name: str, value, low: float = 0.0, high: float | None = None, tensor_ok=True) -> None:
    """ValueError naming ``name`` unless ``low <= value`` (and ``value < high``)."""
    x = number(name, value, tensor_ok=tensor_ok)
    if not (x >= low and (high is None or x < high)):
        raise ValueError(f"Invalid {name}: {value!r}")


def check_storage(block_size, min_quant_size) -> None:
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0):
        raise ValueError(f"Invalid block_size: {block_size!r} (a positive int, or None for the format's default)")
    if not isinstance(min_quant_size, int) or isinstance(min_quant_size, bool) or min_quant_size < 0:
        raise ValueError(f"Invalid min_quant_size: {min_quant_size!r}")


def as_float(group, key: str) -> None:
    """Numpy scalars and one-element tensors in ``group[key]`` become Python floats (read once, as torch.optim's
    non-capturable paths do)."""
    if not isinstance(group[key], (int, float)) or isinstance(group[key], bool):
        group[key] = number(key, group[key], tensor_ok=True)


def check_bool(group, key: str) -> None:
    if not isinstance(group[key], bool):
        raise ValueError(f"Invalid {key}: {group[key]!r} (True or False)")


def check_unique(group) -> None:
    """ValueError naming a parameter that ``group`` lists more than once (its positions, name and shape): it would
    be stepped twice per step, and on the fused path by two threads at once, racing on its state."""
    first: dict[int, int] = {}
    for i, p in enumerate(group["params"]):
        if first.setdefault(id(p), i) != i:
            positions = [j for j, q in enumerate(group["params"]) if q is p]
            names = group.get("param_names")
            name = f" ({names[positions[0]]!r})" if names and len(names) > positions[0] else ""
            raise ValueError(
                f"the parameter{name} of shape {tuple(p.shape)} is listed {len(positions)} times, at "
                f"positions {positions}, so each step would update it {len(positions)} times: list "
                f"each parameter once"
            )


def check_torch_keywords(name: str, foreach, capturable, differentiable, fused) -> None:
    """torch.optim's implementation keywords: what we can honour is accepted, the rest refused by name.

    ``foreach`` picks torch.optim's implementation and never its numbers: ours are chosen by ``fused`` and
    ``compile``, so any value is accepted. ``capturable=True`` is honoured where the step can be captured in a
    CUDA graph: the fused CUDA path. ``differentiable=True`` is refused: quantization is not differentiable.
    """
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"Invalid foreach: {foreach!r} (None, True or False)")
    if not isinstance(capturable, bool) or not isinstance(differentiable, bool):
        raise ValueError(f"Invalid capturable or differentiable: {capturable!r}, {differentiable!r} (True or False)")
    if differentiable:
        raise ValueError(
            f"{name}(differentiable=True) is not supported: the step requantizes its state, which "
            f"autograd cannot differentiate; use the torch.optim optimizer with differentiable=True"
        )
    if capturable:
        if fused is False:
            raise ValueError(f"{name}(capturable=True) needs the fused CUDA path, which fused=False turns off")
        if not fused_available("cuda"):
            raise ValueError(
                f"{name}(capturable=True) needs the fused CUDA path (Triton and a CUDA device): only "
                f"its step can be captured in a CUDA graph"
            )


def check_offload(name: str, offload_state, fused, capturable) -> None:
    """``offload_state=True`` streams state through the fused CUDA kernels: refused by name where they cannot run."""
    if not isinstance(offload_state, bool):
        raise ValueError(f"Invalid offload_state: {offload_state!r} (True or False)")
    if not offload_state:
        return
    if fused is False:
        raise ValueError(
            f"{name}(offload_state=True) streams the state through the fused CUDA path, which fused=False turns off"
        )
    if capturable:
        raise ValueError(
            f"{name}(offload_state=True, capturable=True) is not supported: the offloaded step "
            f"orders its copies with events on side streams, which a CUDA graph of the step would "
            f"freeze; choose one"
        )
    if not fused_available("cuda") and not (fused and fused_available("cpu")):
        raise ValueError(
            f"{name}(offload_state=True) needs the fused CUDA path (Triton and a CUDA device): the "
            f"state is streamed through the GPU's fused kernels"
        )


def check_grad(name: str, p: Tensor, grad: Tensor) -> None:
    """RuntimeError unless ``grad`` can be ``p``'s gradient on our paths: dense, real, laid out like ``p``."""
    if is_dtensor(p) != is_dtensor(grad) or (is_dtensor(p) and grad.placements != p.placements):
        raise RuntimeError(
            f"{name}: a parameter of type {type(p).__name__} with placements "
            f"{getattr(p, 'placements', None)} has a gradient of type {type(grad).__name__} "
            f"with placements {getattr(grad, 'placements', None)}; they must match"
        )
    if grad.is_sparse:
        raise RuntimeError(f"{name} does not support sparse gradients")
    if grad.is_complex() or p.is_complex():
        raise RuntimeError(f"{name} does not support complex parameters or gradients")


def check_group(optimizer, group: dict[str, Any], index: int) -> None:
    """ValueError, naming param group ``index``, unless ``group`` holds valid hyperparameters (the optimizer's
    ``_check_hyperparams``, which normalizes numbers in place), storage settings and parameters."""
    name = type(optimizer).__name__
    try:
        optimizer._check_hyperparams(group)
        check_unique(group)
        check_bool(group, "bf16_stochastic_round")
        check_storage(group["block_size"], group["min_quant_size"])
        if group["state_format"] != "none":
            get_state_format(group["state_format"])  # raises ValueError naming the registered formats
        if optimizer._offload_state and optimizer._state_keys(group):
            rule = optimizer._fused_rule(group)
            why = optimizer._unfused_reason(group) if rule is None else triton_refusal(rule)
            if why is not None:
                raise ValueError(
                    f"offload_state=True needs the fused CUDA path, which no kernel gives this group's settings ({why})"
                )
    except ValueError as err:
        raise ValueError(f"param group {index}: {err}") from None
    if group["state_format"] != "none":
        build_format_tables(group)
    for p in group["params"]:
        if p.is_complex():
            raise ValueError(f"{name} does not support complex parameters (got {p.dtype})")
        if not p.is_floating_point():
            raise ValueError(f"{name} optimizes floating-point parameters, got {p.dtype}")


def build_format_tables(group) -> None:
    """Create a small tensor of the group's format, signed and unsigned, so that its codebook tables exist
    before any step: a step traced by torch.compile creates its states while compiling, where tables can no
    longer be built (quant/codec.py)."""
    fmt = get_state_format(group["state_format"])
    block_size = group["block_size"] or fmt.default_block_size
    for signed in (True, False):
        try:
            fmt.zeros((block_size,), signed=signed, block_size=block_size)
        except ValueError:
            pass  # the format refuses this shape; its tables are built with its first state
