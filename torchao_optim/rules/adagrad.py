"""Adagrad (Duchi et al. 2011; ``torch.optim.Adagrad``): the rule's coefficients, its update in plain tensor code,
and :data:`ADAGRAD`, the rule as the fused kernels take it.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the state (``sum``, never negative: the unsigned
codebook) may be plain or any format, non-finite gradient elements are skipped (parameter and state keep their
values), and so is an element whose new sum would overflow.
"""

from __future__ import annotations

import functools

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, sqrt_rn, store_param

__all__ = ["ADAGRAD", "ADAGRAD_COEFS", "adagrad_coefficients", "adagrad_update"]

# The one-state kernel reads four columns; Adagrad needs three, and the fourth is 0.
ADAGRAD_COEFS = ("clr", "weight_decay", "eps", "zero")


def adagrad_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
    """Adagrad's rows, float64 ``step.shape + (4,)`` (:data:`ADAGRAD_COEFS`), from the group's ``(lr, lr_decay, eps,
    weight_decay)`` and advanced step counts: ``clr = lr / (1 + (step - 1) * lr_decay)`` (torch.optim.Adagrad's, in
    float64 as its Python-float arithmetic), then ``weight_decay, eps, 0``. Adagrad has no option."""
    lr, lr_decay, eps, weight_decay = hyperparams.unbind()
    t = step.to(torch.float64)
    clr = lr / (1 + (t - 1) * lr_decay)
    consts = torch.stack([weight_decay, eps, torch.zeros_like(eps)]).expand(step.shape + (3,))
    return torch.cat([clr.unsqueeze(-1), consts], dim=-1)


def adagrad_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state_sum: torch.Tensor,
    coefs: torch.Tensor,
    *,
    maximize: bool,
    round_key: torch.Tensor | None = None,
) -> None:
    """One ``torch.optim.Adagrad`` step on one parameter, in place:
    ``g = grad + weight_decay * p;  sum = sum + g * g;  p = p - clr * g / (sqrt(sum) + eps)``."""
    clr, wd, eps, _ = coefs.unbind()
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    g, finite = finite_grad(grad, state_sum.dtype, maximize)
    g = g + (wd * p).to(g.dtype)
    s_new = state_sum + g * g
    ok = finite & torch.isfinite(s_new)
    s = torch.where(ok, s_new, state_sum)
    state_sum.copy_(s)
    p_new = p - clr * g / (sqrt_rn(s) + eps)
    store_param(param, torch.where(ok, p_new, p), round_key)


@functools.cache  # imported once: a launch asks for it every step
def _triton_update():
    from torchao_optim.rules.triton_updates import adagrad_tile_update

    return adagrad_tile_update


ADAGRAD = FusedRule(
    "adagrad", ("sum",), (False,), ADAGRAD_COEFS, adagrad_coefficients, triton_update=_triton_update, c_name="adagrad"
)
