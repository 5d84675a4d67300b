"""SGD with its momentum buffer in a low-bit state format: a drop-in replacement for ``torch.optim.SGD``."""

from __future__ import annotations

from torch import Tensor
from torch.optim.optimizer import ParamsT

from torchao_optim.optim.base import LowBitOptimizer, storage_args
from torchao_optim.optim.checks import as_float, check_bool, check_number, check_storage
from torchao_optim.optim.compiled_path import flat_aliases
from torchao_optim.rules import SGD, sgd_coefficients, sgd_update

__all__ = ["SGD8bit"]


def _check(lr, momentum, dampening, weight_decay, nesterov) -> None:
    check_number("learning rate", lr)
    check_number("momentum value", momentum)
    check_number("dampening", dampening, tensor_ok=False)
    check_number("weight_decay value", weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"Nesterov momentum requires a momentum and zero dampening, got momentum={momentum!r}, "
            f"dampening={dampening!r}"
        )


@storage_args()
class SGD8bit(LowBitOptimizer):
    r"""``torch.optim.SGD`` with its momentum buffer stored in a low-bit state format.

    .. code-block:: text

        g = grad (negated if maximize) + weight_decay * p
        b = g at the first step, else momentum * b + (1 - dampening) * g
        p -= lr * (g + momentum * b  if nesterov  else  b)       (p -= lr * g when momentum is 0: no state)

    The buffer is dequantized, updated in fp32 and requantized once per step (signed map). Parameters below
    ``min_quant_size`` elements, and ``state_format="none"``, keep plain state. A non-finite gradient element,
    or one whose buffer would overflow, is skipped: its parameter and buffer keep their values.

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float or Tensor, optional): learning rate. Default: ``1e-3``.
        momentum (float, optional): momentum factor. Default: ``0``.
        dampening (float, optional): dampening for momentum. Default: ``0``.
        weight_decay (float, optional): L2 penalty. Default: ``0``.
        nesterov (bool, optional): Nesterov momentum. Default: ``False``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
    """

    STATE_KEYS = ("momentum_buffer",)
    REQUIRED_GROUP_KEYS = ("params", "lr", "momentum", "dampening", "weight_decay", "nesterov")
    STEP_OPTIONAL = True
    update_fn = staticmethod(sgd_update)

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
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
        _check(lr, momentum, dampening, weight_decay, nesterov)
        check_storage(block_size, min_quant_size)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
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
        for key in ("momentum", "dampening", "weight_decay"):
            as_float(group, key)
        for key in ("nesterov", "maximize"):
            check_bool(group, key)
        _check(group["lr"], group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"])

    def _state_keys(self, group, p=None):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _hyperparam_values(self, group):
        return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"])

    def _coefficients(self, steps, hp, group):
        return sgd_coefficients(steps, hp)

    def _fused_rule(self, group):
        return SGD if group["momentum"] != 0 else None

    def _launch_flags(self, group):
        return dict(maximize=group["maximize"], nesterov=group["nesterov"])

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key=None) -> None:
        buf = state.get("momentum_buffer") if group["momentum"] != 0 else None
        with flat_aliases(p, p.grad, [buf]) as (p, grad, (buf,)):
            self._update(
                p, grad, buf, coefs, nesterov=group["nesterov"], maximize=group["maximize"], round_key=round_key
            )
