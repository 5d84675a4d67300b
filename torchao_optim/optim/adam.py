"""Adam and AdamW with low-bit state: drop-in replacements for ``torch.optim.Adam`` / ``torch.optim.AdamW``."""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from torchao_optim.optim.base import LowBitOptimizer
from torchao_optim.optim.checks import as_float, check_bool, check_number, check_storage, number
from torchao_optim.optim.compiled_path import flat_aliases
from torchao_optim.optim.sharded import is_dtensor, like_param
from torchao_optim.rules import ADAM, ADAM_AMSGRAD, adam_coefficients, adam_update
from torchao_optim.state import QuantizedState

__all__ = [
    "Adam",
    "AdamW",
    "Adam8bit",
    "AdamW8bit",
    "AdamDTQ8bit",
    "Adam4bit",
    "AdamW4bit",
    "AdamFp8",
    "AdamWFp8",
    "dequantize_state_dict",
]


_SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def _check_hyperparams(lr, betas, eps, weight_decay, block_size=None, min_quant_size=0):
    if not number("lr", lr, tensor_ok=True) >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr!r}")
    check_number("epsilon value", eps)
    if 0.0 < number("epsilon value", eps, tensor_ok=True) < _SMALLEST_NORMAL:
        # the fused CUDA kernel takes the reciprocal of the denominator flushing subnormals to zero (one
        # instruction; a subnormal-safe division takes six): a subnormal eps would turn 0 / eps into 0 * inf = NaN
        raise ValueError(
            f"Invalid epsilon value: {eps!r} is positive but below float32's smallest normal "
            f"number, {_SMALLEST_NORMAL!r}: use 0 or a value at least that large"
        )
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        check_number(f"beta parameter at index {i}", beta, 0.0, 1.0)
    check_number("weight_decay value", weight_decay)
    check_storage(block_size, min_quant_size)


def _normalize_group(group) -> None:
    """Numpy scalars become Python floats, and one-element tensor betas, eps and weight_decay become floats
    (read once, as torch.optim's non-capturable paths do); a tensor lr stays a tensor, read every step."""
    for key in ("eps", "weight_decay"):
        as_float(group, key)
    group["betas"] = tuple(
        b if isinstance(b, (int, float)) else number("beta", b, tensor_ok=True) for b in group["betas"]
    )
    if not isinstance(group["lr"], (int, float, Tensor)):
        group["lr"] = number("lr", group["lr"])
    for key in ("amsgrad", "maximize", "decoupled_weight_decay"):
        check_bool(group, key)


class Adam(LowBitOptimizer):
    r"""Adam with its two moment buffers stored in a low-bit state format.

    The algorithm is ``torch.optim.Adam``'s (``torch.optim.AdamW``'s with ``decoupled_weight_decay=True``):

    .. code-block:: text

        g = grad (negated if maximize);  g += weight_decay * p  (Adam)  |  p *= 1 - lr * weight_decay  (AdamW)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g          (v_max = max(v_max, v) with amsgrad)
        p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    ``m`` and ``v`` are dequantized, updated in fp32 and requantized once per step; for each parameter
    ``torch.compile`` fuses that into one kernel. Parameters with fewer than ``min_quant_size`` elements,
    and with ``state_format="none"``, keep plain state: fp32, or fp64 for fp64 parameters, whose update is
    fp64 in any case. A non-finite gradient element, or one whose new ``m`` or ``v`` would overflow, is
    skipped: its parameter and state keep their values, and no other element is affected.

    Parameters sharded with FSDP2 (DTensors) get DTensor states laid out like them, quantized per local shard
    with blocks that never cross a row, so that layouts do not depend on the mesh (docs/distributed.md).

    ``load_state_dict`` and ``add_param_group`` check everything before they change anything (see
    :mod:`torchao_optim.optim.checkpoint`); copies (``copy.deepcopy``, pickle, ``torch.save``) step like
    the original.

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float or Tensor, optional): learning rate; may change every step (schedulers, or assigning
            ``group["lr"]``) without recompiling. Default: ``1e-3``.
        betas (Tuple[float, float], optional): coefficients of the running averages. Default: ``(0.9, 0.999)``.
        eps (float, optional): added to the denominator. Default: ``1e-8``.
        weight_decay (float, optional): L2 penalty (Adam) or decoupled decay (AdamW). Default: ``0``.
        amsgrad (bool, optional): keep the maximum of ``v`` (``max_exp_avg_sq``, same format). Default: ``False``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
        state_format (str, optional): a registered format name (see ``list_state_formats()``) or ``"none"``
            for fp32 state. Default: ``"dtq8"``.
        block_size (int, optional): elements per quantization block; ``None`` takes the format's default.
        min_quant_size (int, optional): smaller parameters keep fp32 state. Default: ``4096``.
        compile (bool, optional): fuse each update with ``torch.compile``; falls back to eager mode, with one
            warning, where compiling is impossible. Default: ``True``.
        fused (bool, optional): update each parameter group with one multi-tensor call per device, dtype and
            set of state layouts: every format with a ``fast_path_layout()``, and fp32 state: a Triton launch
            on CUDA, the fused C step on the CPU (built on first use; without a C compiler CPU parameters take
            the compiled path, with one warning); amsgrad's third state included. Other parameters take the
            per-parameter compiled path. ``None`` and ``True`` use it wherever it runs; ``True`` with
            ``TRITON_INTERPRET=1`` set runs the Triton kernels on the CPU in Triton's interpreter instead
            (slow: for testing); ``False`` turns it off. Default: ``None``.
        decoupled_weight_decay (bool, optional): AdamW's weight decay. Default: ``False``.
        foreach (bool, optional): accepted for torch.optim compatibility; it selects torch.optim's
            implementation, never its numbers, and ours is chosen by ``fused`` and ``compile``. Default: ``None``.
        capturable (bool, optional): the step can be captured in a CUDA graph: needs every parameter on the
            fused CUDA path (else ``ValueError``); give a tensor ``lr`` on the device to change it between
            replays. Default: ``False``.
        differentiable (bool, optional): ``True`` is refused (``ValueError``): quantization is not
            differentiable. Default: ``False``.
        bf16_stochastic_round (bool, optional): bf16 parameters are updated in fp32 and written back with
            stochastic rounding (unbiased, so updates below half a bf16 ulp accumulate on average instead of
            being lost), on the fused and the compiled path alike; the random bits are a hash of (the
            parameter's position in the optimizer, its step, the element), so runs are reproducible and a
            resumed run rounds as an uninterrupted one. Other dtypes are unaffected. Default: ``False``.
        offload_state (bool, optional): keep the state of GPU parameters in page-locked host memory, in its
            low-bit form, and stream it through the fused CUDA kernels in chunks, overlapped with the update
            (GPU memory: two chunks; PCIe traffic: the state's bytes, both ways). Needs the fused path for
            every GPU parameter (``ValueError`` naming one it does not cover); not with ``capturable`` or
            DTensor parameters. ``state_dict()`` waits for the copies; read ``optimizer.state`` directly
            only after ``torch.cuda.synchronize()``. See docs/bigger-models.md. Default: ``False``.
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    UNSIGNED_STATE_KEYS = ("exp_avg_sq", "max_exp_avg_sq")
    REQUIRED_GROUP_KEYS = ("params", "lr", "betas", "eps", "weight_decay")
    STORAGE_KEYS = ("state_format", "block_size", "min_quant_size", "decoupled_weight_decay")
    update_fn = staticmethod(adam_update)

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        state_format: str = "dtq8",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        compile: bool = True,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        bf16_stochastic_round: bool = False,
        offload_state: bool = False,
    ) -> None:
        _check_hyperparams(lr, betas, eps, weight_decay, block_size, min_quant_size)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            state_format=state_format,
            block_size=block_size,
            min_quant_size=min_quant_size,
        )
        super().__init__(
            params,
            defaults,
            compile=compile,
            fused=fused,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            bf16_stochastic_round=bf16_stochastic_round,
            offload_state=offload_state,
        )

    def _check_hyperparams(self, group) -> None:
        _check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        _normalize_group(group)

    def _state_keys(self, group, p=None):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _hyperparam_values(self, group):
        """``(lr, beta1, beta2, eps, weight_decay)``: the input of :func:`adam_coefficients`."""
        return (group["lr"], group["betas"][0], group["betas"][1], group["eps"], group["weight_decay"])

    def _coefficients(self, steps, hp, group):
        return adam_coefficients(steps, hp, group["decoupled_weight_decay"])  # (n, 7) float64

    def _fused_rule(self, group):
        return ADAM_AMSGRAD if group["amsgrad"] else ADAM

    def _launch_flags(self, group):
        return dict(decoupled=group["decoupled_weight_decay"], maximize=group["maximize"])

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key=None) -> None:
        """One parameter on the compiled path, with its row of :func:`adam_coefficients`."""
        with flat_aliases(p, p.grad, [state.get(k) for k in self.STATE_KEYS]) as (p, grad, states):
            self._update(
                p,
                grad,
                *states,
                coefs,
                decoupled_weight_decay=group["decoupled_weight_decay"],
                amsgrad=group["amsgrad"],
                maximize=group["maximize"],
                round_key=round_key,
            )


class AdamW(Adam):
    __doc__ = (
        (
            "AdamW: :class:`Adam` with decoupled weight decay (``torch.optim.AdamW``); ``weight_decay`` defaults to "
            "``1e-2``.\n"
            + re.sub(
                r"\n        decoupled_weight_decay \(bool, optional\):[^\n]*", "", Adam.__doc__.split("\n", 1)[1]
            ).replace("Default: ``0``.", "Default: ``1e-2``.", 1)
        )
        if Adam.__doc__  # python -OO strips docstrings
        else None
    )

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        state_format: str = "dtq8",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        compile: bool = True,
        fused: bool | None = None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        bf16_stochastic_round: bool = False,
        offload_state: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            state_format=state_format,
            block_size=block_size,
            min_quant_size=min_quant_size,
            compile=compile,
            fused=fused,
            decoupled_weight_decay=True,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            bf16_stochastic_round=bf16_stochastic_round,
            offload_state=offload_state,
        )


def with_state_format(base: type, name: str, state_format: str, what: str) -> type:
    """The one way a variant is named: ``base`` with ``state_format`` fixed (``AdamW8bit`` is ``AdamW`` with
    ``state_format="dtq8"``). Its arguments, signature and docstring are ``base``'s without ``state_format``."""

    def __init__(self, params, *args, **kwargs):
        if "state_format" in kwargs:
            raise TypeError(f"{name} always uses state_format={state_format!r}; use {base.__name__} to choose one")
        base.__init__(self, params, *args, state_format=state_format, **kwargs)

    signature = inspect.signature(base.__init__)
    __init__.__signature__ = signature.replace(
        parameters=[v for k, v in signature.parameters.items() if k != "state_format"]
    )
    # base's docstring, its first line and its state_format argument replaced
    body = (base.__doc__ or "").split("\n", 1)[1] if "\n" in (base.__doc__ or "") else ""
    body = re.sub(r"\n        state_format \(str, optional\):.*?(?=\n        \w+ \()", "", body, flags=re.S)
    doc = f"{base.__name__} with {what} (``state_format={state_format!r}``).\n{body}"
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__, "__qualname__": name})


Adam8bit = with_state_format(Adam, "Adam8bit", "dtq8", "the 8-bit dynamic tree state (blocks of 256)")
AdamW8bit = with_state_format(AdamW, "AdamW8bit", "dtq8", "the 8-bit dynamic tree state (blocks of 256)")
AdamDTQ8bit = Adam8bit
Adam4bit = with_state_format(Adam, "Adam4bit", "4bit", "4-bit state (blocks of 128)")
AdamW4bit = with_state_format(AdamW, "AdamW4bit", "4bit", "4-bit state (blocks of 128)")
AdamFp8 = with_state_format(Adam, "AdamFp8", "fp8", "8-bit float state (blocks of 256)")
AdamWFp8 = with_state_format(AdamW, "AdamWFp8", "fp8", "8-bit float state (blocks of 256)")


def dequantize_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of an optimizer ``state_dict`` with every quantized state dequantized to fp32, loadable by
    ``torch.optim.Adam``/``AdamW`` (our private group keys are dropped); a DTensor state (FSDP2) stays a DTensor
    laid out the same way, over its dequantized local shard."""
    ours = {"state_format", "block_size", "min_quant_size"}

    def plain(v):
        if is_dtensor(v) and isinstance(v.to_local(), QuantizedState):  # FSDP2: each rank's rows
            return like_param(v, v.to_local().dequantize(torch.float32))
        return v.dequantize(torch.float32) if isinstance(v, QuantizedState) else v

    state = {idx: {k: plain(v) for k, v in s.items()} for idx, s in state_dict["state"].items()}
    groups = [{k: v for k, v in g.items() if k not in ours} for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}
