"""AdEMAMix (Pagliardini et al. 2024) with its three states in a low-bit state format: bitsandbytes' ``AdEMAMix8bit``
hyperparameters and defaults."""

from __future__ import annotations

import math

from torch import Tensor
from torch.optim.optimizer import ParamsT

from torchao_optim.optim.base import LowBitOptimizer, storage_args
from torchao_optim.optim.checks import as_float, check_bool, check_number, check_storage, number
from torchao_optim.optim.compiled_path import flat_aliases
from torchao_optim.rules import ADEMAMIX, ademamix_coefficients, ademamix_update

__all__ = ["AdEMAMix8bit"]


def _check_steps(name: str, value) -> None:
    if value is None:
        return
    x = number(name, value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"Invalid {name}: {value!r} (a positive number of steps, or None for no scheduler)")


def _check(lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay) -> None:
    check_number("learning rate", lr)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 3):
        raise ValueError(f"betas must be a triple (beta1, beta2, beta3), got {betas!r}")
    for i, beta in enumerate(betas):
        check_number(f"beta parameter at index {i}", beta, 0.0, 1.0)
    check_number("alpha value", alpha)
    _check_steps("t_alpha", t_alpha)
    _check_steps("t_beta3", t_beta3)
    if t_beta3 is not None and not (number("beta1", betas[0], tensor_ok=True) > 0 and number("beta3", betas[2]) > 0):
        # the scheduler interpolates between log(beta1) and log(beta3)
        raise ValueError(
            f"Invalid betas: {tuple(betas)!r} with t_beta3={t_beta3!r} (its scheduler needs beta1 > 0 and beta3 > 0)"
        )
    check_number("epsilon value", eps)
    check_number("weight_decay value", weight_decay)


@storage_args(
    fused="as :class:`Adam`'s: the fused C step on the CPU; on CUDA no fused kernel runs AdEMAMix yet, so its "
    "parameters take the compiled path there whatever its value. Default: ``None``.",
    capturable="needs every parameter on the fused CUDA path, which AdEMAMix does not have yet: ``True`` raises "
    "``ValueError`` at the first step. Default: ``False``.",
    offload_state="refused (``ValueError``): offloaded state streams through the fused CUDA kernels. Default: "
    "``False``.",
)
class AdEMAMix8bit(LowBitOptimizer):
    r"""AdEMAMix (Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older") with its
    three states stored in a low-bit state format; bitsandbytes' ``AdEMAMix8bit`` hyperparameters and defaults.

    .. code-block:: text

        g = grad (negated if maximize)
        m1 = beta1 * m1 + (1 - beta1) * g                     (exp_avg)
        m2 = beta3(t) * m2 + (1 - beta3(t)) * g               (exp_avg_slow)
        nu = beta2 * nu + (1 - beta2) * g * g                 (exp_avg_sq)
        p = p - lr * ((m1 / (1 - beta1**t) + alpha(t) * m2) / (sqrt(nu) / sqrt(1 - beta2**t) + eps)
                      + weight_decay * p)

    ``alpha(t) = min(t * alpha / t_alpha, alpha)`` warms alpha up over ``t_alpha`` steps, and ``beta3(t) =
    min(exp(ln(beta1) ln(beta3) / ((1 - t/t_beta3) ln(beta3) + (t/t_beta3) ln(beta1))), beta3)`` takes beta3 from
    beta1 to its final value over ``t_beta3`` steps (the paper's schedulers; ``None``: none). ``m2`` is not bias
    corrected (as in the paper and bitsandbytes). Each state is dequantized, updated in fp32 and requantized once
    per step: ``exp_avg_sq`` with the unsigned map, the two EMAs with the signed one. Parameters below
    ``min_quant_size`` elements, and ``state_format="none"``, keep plain state. A non-finite gradient element, or
    one whose states would overflow, is skipped: its parameter and states keep their values.

    Three states, which the fused kernels run: the Triton kernel's three-state form on CUDA, the fused C step on the
    CPU (the compiled path's codes, bit for bit; in Triton's interpreter the Triton kernel stores the C step's).

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float or Tensor, optional): learning rate. Default: ``1e-3``.
        betas (Tuple[float, float, float], optional): decay of the fast EMA, of the squared gradients' EMA and of
            the slow EMA, each in [0, 1). Default: ``(0.9, 0.999, 0.9999)``.
        alpha (float, optional): weight of the slow EMA in the update. Default: ``5.0``.
        t_alpha (int, optional): steps of alpha's linear warm-up; ``None``: none. Default: ``None``.
        t_beta3 (int, optional): steps of beta3's warm-up from beta1; ``None``: none. Default: ``None``.
        eps (float, optional): added to the denominator. Default: ``1e-8``.
        weight_decay (float, optional): decoupled weight decay. Default: ``1e-2``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
    """

    STATE_KEYS = ("exp_avg", "exp_avg_slow", "exp_avg_sq")
    UNSIGNED_STATE_KEYS = ("exp_avg_sq",)
    REQUIRED_GROUP_KEYS = ("params", "lr", "betas", "alpha", "t_alpha", "t_beta3", "eps", "weight_decay")
    update_fn = staticmethod(ademamix_update)

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
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
        _check(lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay)
        check_storage(block_size, min_quant_size)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            alpha=alpha,
            t_alpha=t_alpha,
            t_beta3=t_beta3,
            eps=eps,
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
        for key in ("alpha", "eps", "weight_decay"):
            as_float(group, key)
        check_bool(group, "maximize")
        if isinstance(group["betas"], (tuple, list)):
            group["betas"] = tuple(
                b if isinstance(b, (int, float)) else number("beta", b, tensor_ok=True) for b in group["betas"]
            )
        _check(
            group["lr"],
            group["betas"],
            group["alpha"],
            group["t_alpha"],
            group["t_beta3"],
            group["eps"],
            group["weight_decay"],
        )

    def _state_keys(self, group, p=None):
        return self.STATE_KEYS

    def _hyperparam_values(self, group):
        """``(lr, beta1, beta2, beta3, alpha, t_alpha, t_beta3, eps, weight_decay)``, a missing scheduler's
        length 0: the input of :func:`ademamix_coefficients`."""
        beta1, beta2, beta3 = group["betas"]
        t_alpha, t_beta3 = (group[k] or 0 for k in ("t_alpha", "t_beta3"))
        return (group["lr"], beta1, beta2, beta3, group["alpha"], t_alpha, t_beta3, group["eps"], group["weight_decay"])

    def _coefficients(self, steps, hp, group):
        return ademamix_coefficients(steps, hp)

    def _fused_rule(self, group):
        return ADEMAMIX

    def _launch_flags(self, group):
        return dict(maximize=group["maximize"])

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key=None) -> None:
        with flat_aliases(p, p.grad, [state[k] for k in self.STATE_KEYS]) as (p, grad, (m1, m2, nu)):
            self._update(p, grad, m1, m2, nu, coefs, maximize=group["maximize"], round_key=round_key)
