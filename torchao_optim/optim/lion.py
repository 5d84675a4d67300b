"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with its one state in low bits."""

from __future__ import annotations

from torch import Tensor
from torch.optim.optimizer import ParamsT

from torchao_optim.optim.base import LowBitOptimizer, storage_args
from torchao_optim.optim.checks import as_float, check_bool, check_number, check_storage
from torchao_optim.optim.compiled_path import flat_aliases
from torchao_optim.rules import LION, lion_coefficients, lion_update

__all__ = ["Lion8bit"]


def _check(lr, betas, weight_decay) -> None:
    check_number("learning rate", lr)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        check_number(f"beta parameter at index {i}", beta, 0.0, 1.0)
    check_number("weight_decay value", weight_decay)


@storage_args()
class Lion8bit(LowBitOptimizer):
    r"""Lion with its momentum ``m`` stored in a low-bit state format (the paper's update, decoupled decay):

    .. code-block:: text

        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * weight_decay) - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    ``m`` is dequantized, updated in fp32 and requantized once per step (signed map). Lion moves every
    element by ``lr`` (its sign), so it usually wants an lr 3-10x smaller than AdamW's and a weight decay as
    much larger (the paper's advice). A non-finite gradient element is skipped.

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float or Tensor, optional): learning rate. Default: ``1e-4``.
        betas (Tuple[float, float], optional): ``(beta1, beta2)``. Default: ``(0.9, 0.99)``.
        weight_decay (float, optional): decoupled weight decay. Default: ``0``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
    """

    STATE_KEYS = ("exp_avg",)
    REQUIRED_GROUP_KEYS = ("params", "lr", "betas", "weight_decay")
    update_fn = staticmethod(lion_update)

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
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
        _check(lr, betas, weight_decay)
        check_storage(block_size, min_quant_size)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            weight_decay=weight_decay,
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
        _check(group["lr"], group["betas"], group["weight_decay"])
        as_float(group, "weight_decay")
        group["betas"] = tuple(float(b) if not isinstance(b, float) else b for b in group["betas"])
        check_bool(group, "maximize")

    def _state_keys(self, group, p=None):
        return ("exp_avg",)

    def _hyperparam_values(self, group):
        return (group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"])

    def _coefficients(self, steps, hp, group):
        return lion_coefficients(steps, hp)

    def _fused_rule(self, group):
        return LION

    def _launch_flags(self, group):
        return dict(maximize=group["maximize"])

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key=None) -> None:
        with flat_aliases(p, p.grad, [state["exp_avg"]]) as (p, grad, (m,)):
            self._update(p, grad, m, coefs, maximize=group["maximize"], round_key=round_key)
