"""RMSprop with its averages and momentum buffer in a low-bit state format: a drop-in replacement for
``torch.optim.RMSprop``."""

from __future__ import annotations

from torch import Tensor
from torch.optim.optimizer import ParamsT

from torchao_optim.optim.base import LowBitOptimizer, storage_args
from torchao_optim.optim.checks import as_float, check_bool, check_number, check_storage, number
from torchao_optim.optim.compiled_path import flat_aliases
from torchao_optim.rules import (
    RMSPROP,
    RMSPROP_CENTERED,
    RMSPROP_CENTERED_MOMENTUM,
    RMSPROP_MOMENTUM,
    rmsprop_coefficients,
    rmsprop_update,
)

__all__ = ["RMSprop8bit"]


def _check(lr, alpha, eps, weight_decay, momentum) -> None:
    check_number("learning rate", lr)
    if not 0.0 <= number("alpha value", alpha) <= 1.0:
        raise ValueError(f"Invalid alpha value: {alpha!r} (the averages' decay, in [0, 1])")
    check_number("epsilon value", eps)
    check_number("weight_decay value", weight_decay)
    check_number("momentum value", momentum)


@storage_args(
    offload_state="keep GPU parameters' state in host memory, streamed through the fused CUDA kernels, as "
    ":class:`Adam` (not with ``centered=True``). Default: ``False``."
)
class RMSprop8bit(LowBitOptimizer):
    r"""``torch.optim.RMSprop`` with its states stored in a low-bit state format.

    .. code-block:: text

        g = grad (negated if maximize) + weight_decay * p
        v = alpha * v + (1 - alpha) * g * g                      (square_avg)
        a = alpha * a + (1 - alpha) * g                          (grad_avg, centered only)
        d = sqrt(v - a * a  if centered  else  v) + eps
        b = momentum * b + g / d;  p = p - lr * b                (momentum_buffer, momentum > 0 only)
        p = p - lr * g / d                                       (momentum 0)

    Each state is dequantized, updated in fp32 and requantized once per step: ``square_avg`` with the unsigned map
    (it is never negative), ``momentum_buffer`` and ``grad_avg`` with the signed one. Parameters below
    ``min_quant_size`` elements, and ``state_format="none"``, keep plain state. A non-finite gradient element, or
    one whose states would overflow, is skipped: its parameter and states keep their values.

    The fused kernels (Triton's on CUDA, the fused C step on the CPU) run a group with one state (momentum 0) or
    two (momentum > 0). ``centered=True`` adds ``grad_avg``: with momentum, three states; without, two; both run
    them. Centered, ``v - a * a`` below 0 (a
    rounding or quantization error: it is never negative in exact arithmetic) is taken as 0.

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float or Tensor, optional): learning rate. Default: ``1e-2``.
        alpha (float, optional): smoothing constant of the averages, in [0, 1]. Default: ``0.99``.
        eps (float, optional): added to the denominator. Default: ``1e-8``.
        weight_decay (float, optional): L2 penalty. Default: ``0``.
        momentum (float, optional): momentum factor. Default: ``0``.
        centered (bool, optional): normalize by the gradient's estimated variance. Default: ``False``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
    """

    STATE_KEYS = ("square_avg", "momentum_buffer", "grad_avg")
    UNSIGNED_STATE_KEYS = ("square_avg",)
    REQUIRED_GROUP_KEYS = ("params", "lr", "alpha", "eps", "weight_decay", "momentum", "centered")
    update_fn = staticmethod(rmsprop_update)

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
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
        _check(lr, alpha, eps, weight_decay, momentum)
        check_storage(block_size, min_quant_size)
        defaults = dict(
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
            maximize=maximize,
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
        for key in ("alpha", "eps", "weight_decay", "momentum"):
            as_float(group, key)
        for key in ("centered", "maximize"):
            check_bool(group, key)
        _check(group["lr"], group["alpha"], group["eps"], group["weight_decay"], group["momentum"])

    def _state_keys(self, group, p=None):
        return (
            ("square_avg",)
            + (("momentum_buffer",) if group["momentum"] > 0 else ())
            + (("grad_avg",) if group["centered"] else ())
        )

    def _hyperparam_values(self, group):
        """``(lr, alpha, eps, weight_decay, momentum)``: the input of :func:`rmsprop_coefficients`."""
        return (group["lr"], group["alpha"], group["eps"], group["weight_decay"], group["momentum"])

    def _coefficients(self, steps, hp, group):
        return rmsprop_coefficients(steps, hp)

    def _fused_rule(self, group):
        if group["centered"]:
            return RMSPROP_CENTERED_MOMENTUM if group["momentum"] > 0 else RMSPROP_CENTERED
        return RMSPROP_MOMENTUM if group["momentum"] > 0 else RMSPROP

    def _launch_flags(self, group):
        return dict(maximize=group["maximize"])

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key=None) -> None:
        keys = self._state_keys(group, p)
        states = [state[k] if k in keys else None for k in self.STATE_KEYS]
        with flat_aliases(p, p.grad, states) as (p, grad, (v, b, a)):
            self._update(p, grad, v, b, a, coefs, maximize=group["maximize"], round_key=round_key)
