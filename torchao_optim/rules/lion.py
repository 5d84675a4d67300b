"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the rule's coefficients, its update
in plain tensor code, and :data:`LION`, the rule as the fused kernels take it.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the state may be plain or any format, non-finite
gradient elements are skipped, and so is an element whose new state would overflow.
"""

from __future__ import annotations

import functools

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, store_param

__all__ = ["LION", "LION_COEFS", "lion_coefficients", "lion_update"]

LION_COEFS = ("lr", "weight_decay_factor", "one_minus_beta1", "one_minus_beta2")


def lion_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
    """Lion's rows, float64 ``step.shape + (4,)`` (:data:`LION_COEFS`), from ``(lr, beta1, beta2, weight_decay)``:
    ``lr, 1 - lr * weight_decay, 1 - beta1, 1 - beta2``. Lion's update does not depend on the step count, and
    Lion has no option (``option`` is taken as every rule's coefficient function takes one)."""
    lr, beta1, beta2, weight_decay = hyperparams.unbind()
    return torch.stack([lr, 1 - lr * weight_decay, 1 - beta1, 1 - beta2]).expand(step.shape + (4,))


def lion_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    coefs: torch.Tensor,
    *,
    maximize: bool,
    round_key: torch.Tensor | None = None,
) -> None:
    """One Lion step (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on one parameter:
    ``c = beta1 * m + (1 - beta1) * g;  p = p * (1 - lr * wd) - lr * sign(c);  m = beta2 * m + (1 - beta2) * g``."""
    lr, wd_factor, one_minus_beta1, one_minus_beta2 = coefs.unbind()
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    g, finite = finite_grad(grad, exp_avg.dtype, maximize)
    c = exp_avg + one_minus_beta1 * (g - exp_avg)
    m_new = exp_avg + one_minus_beta2 * (g - exp_avg)
    ok = finite & torch.isfinite(m_new) & torch.isfinite(c)
    exp_avg.copy_(torch.where(ok, m_new, exp_avg))
    store_param(param, torch.where(ok, p * wd_factor - lr * torch.sign(c), p), round_key)


@functools.cache  # imported once: a launch asks for it every step
def _triton_update():
    from torchao_optim.rules.triton_updates import lion_tile_update

    return lion_tile_update


LION = FusedRule(
    "lion", ("exp_avg",), (True,), LION_COEFS, lion_coefficients, triton_update=_triton_update, c_name="lion"
)
