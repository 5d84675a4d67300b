"""Adagrad with its accumulated sum of squares in a low-bit state format: a drop-in replacement for
``torch.optim.Adagrad``."""

from __future__ import annotations

from torch import Tensor
from torch.optim.optimizer import ParamsT

from torchao_optim.optim.base import LowBitOptimizer, storage_args
from torchao_optim.optim.checks import as_float, check_bool, check_number, check_storage
from torchao_optim.optim.compiled_path import flat_aliases
from torchao_optim.rules import ADAGRAD, adagrad_coefficients, adagrad_update

__all__ = ["Adagrad8bit"]


def _check(lr, lr_decay, weight_decay, initial_accumulator_value, eps) -> None:
    check_number("learning rate", lr)
    check_number("lr_decay value", lr_decay, tensor_ok=False)
    check_number("weight_decay value", weight_decay)
    check_number("initial_accumulator_value value", initial_accumulator_value, tensor_ok=False)
    check_number("epsilon value", eps)


@storage_args()
class Adagrad8bit(LowBitOptimizer):
    r"""``torch.optim.Adagrad`` with its sum of squared gradients stored in a low-bit state format.

    .. code-block:: text

        g = grad (negated if maximize) + weight_decay * p
        clr = lr / (1 + (step - 1) * lr_decay)
        sum = sum + g * g                                   (sum starts at initial_accumulator_value)
        p = p - clr * g / (sqrt(sum) + eps)

    The sum is dequantized, updated in fp32 and requantized once per step (unsigned map: it is never negative).
    Parameters below ``min_quant_size`` elements, and ``state_format="none"``, keep plain state. A non-finite
    gradient element, or one whose sum would overflow, is skipped: its parameter and sum keep their values.
    torch.optim.Adagrad's sparse gradients are not taken.

    The default state format is ``"fp8"`` (the sum in an unsigned float of 4 exponent and 4 mantissa bits, one fp32
    scale per block), not ``"dtq8"``: the sum never decays, so each step's requantization error stays in it, and an
    element far below its block's maximum, where the dynamic tree map is coarse, drifts furthest. The float's
    relative precision is the same at every magnitude: on the convergence benchmark fp8 state ends within fp32
    Adagrad's seed range over four seeds, where ``"dtq8"`` does not (one seed of four stalled 0.5 above the others);
    benchmarks/README.md, "Other optimizers", has the figures.

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float or Tensor, optional): learning rate. Default: ``1e-2``.
        lr_decay (float, optional): learning rate decay. Default: ``0``.
        weight_decay (float, optional): L2 penalty. Default: ``0``.
        initial_accumulator_value (float, optional): the value every element of the sum starts from; a
            quantized sum holds it exactly. Not with ``offload_state``. Default: ``0``.
        eps (float, optional): added to the denominator. Default: ``1e-10``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
    """

    STATE_KEYS = ("sum",)
    UNSIGNED_STATE_KEYS = ("sum",)
    REQUIRED_GROUP_KEYS = ("params", "lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    update_fn = staticmethod(adagrad_update)

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        state_format: str = "fp8",
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
        _check(lr, lr_decay, weight_decay, initial_accumulator_value, eps)
        check_storage(block_size, min_quant_size)
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
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
        for key in ("lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            as_float(group, key)
        check_bool(group, "maximize")
        _check(group["lr"], group["lr_decay"], group["weight_decay"], group["initial_accumulator_value"], group["eps"])
        if self._offload_state and group["initial_accumulator_value"] != 0:
            # offloaded states are made as zeros in host memory by the step's planner (optim/offload.py)
            raise ValueError(
                f"Invalid initial_accumulator_value value: {group['initial_accumulator_value']!r} with "
                f"offload_state=True (offloaded state starts at 0)"
            )

    def _state_keys(self, group, p=None):
        return ("sum",)

    def _initial_state_value(self, group, key: str) -> float:
        return group["initial_accumulator_value"]

    def _hyperparam_values(self, group):
        """``(lr, lr_decay, eps, weight_decay)``: the input of :func:`adagrad_coefficients`."""
        return (group["lr"], group["lr_decay"], group["eps"], group["weight_decay"])

    def _coefficients(self, steps, hp, group):
        return adagrad_coefficients(steps, hp)

    def _fused_rule(self, group):
        return ADAGRAD

    def _launch_flags(self, group):
        return dict(maximize=group["maximize"])

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key=None) -> None:
        with flat_aliases(p, p.grad, [state["sum"]]) as (p, grad, (s,)):
            self._update(p, grad, s, coefs, maximize=group["maximize"], round_key=round_key)
