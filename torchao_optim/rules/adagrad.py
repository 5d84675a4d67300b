"""Adagrad (Duchi et al. 2011; ``torch.optim.Adagrad``): the rule's coefficients, its update in plain tensor code,
and :data:`ADAGRAD`, the rule as the fused kernels take it: with the same update in Triton's language
(``adagrad_tile_update``) and in C.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the state (``sum``, never negative: the unsigned
codebook) may be plain or any format, non-finite gradient elements are skipped (parameter and state keep their
values), and so is an element whose new sum would overflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, param_div, param_sqrt, sqrt_rn, store_param, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

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


def adagrad_tile_update(p, g, s, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.adagrad.adagrad_update` on a tile (``s``: ``sum``; no option): returns ``(p, s)``.
    In Triton's interpreter the square root and the division round correctly, as the compiled path's do; a GPU build
    takes fast ones (:func:`~torchao_optim.rules.base.param_sqrt`, ``param_div``): only the parameter depends on
    them."""
    clr, wd, eps, _ = coefs
    finite = tl.abs(g) < float("inf")  # a non-finite gradient element is skipped (NaN is not < inf)
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    s_new = s + g * g
    ok = finite & (tl.abs(s_new) < float("inf"))
    s = tl.where(ok, s_new, s)
    p = tl.where(ok, p - param_div(clr * g, param_sqrt(s, PTX) + eps, PTX), p)
    return p, s


# Its element update in C (FusedRule.c_source), built into the C step by kernels/cpu.py.
_C_UPDATE = r"""
NOINLINE static void adagrad(float *restrict p, const float *restrict g_in, float *restrict s, int n, const float *c,
                             int option) {
    (void)option; /* no option */
    const float clr = c[0], wd = c[1], eps = c[2];
    for (int i = 0; i < n; i++) {
        float g = g_in[i], pi = p[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        g = g + wd * pi;
        float s_new = s[i] + g * g;
        int ok = fin & is_finite(s_new);
        float si = keep_if(ok, s_new, s[i]);
        s[i] = si;
        p[i] = ok ? pi - clr * g / (sqrtf(si) + eps) : pi;
    }
}
"""


ADAGRAD = FusedRule(
    "adagrad",
    ("sum",),
    (False,),
    ADAGRAD_COEFS,
    adagrad_coefficients,
    triton_update=triton_jit(adagrad_tile_update, calls=(param_sqrt, param_div)),
    c_source=_C_UPDATE,
    c_name="adagrad",
)
