"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the rule's coefficients, its update
in plain tensor code, and :data:`LION`, the rule as the fused kernels take it: with the same update in Triton's
language (``lion_tile_update``) and in C.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the state may be plain or any format, non-finite
gradient elements are skipped, and so is an element whose new state would overflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, store_param, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

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


def lion_tile_update(p, g, s, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.lion.lion_update` on a tile (``s``: ``exp_avg``; no option): returns
    ``(p, s)``."""
    lr, wd_factor, one_minus_beta1, one_minus_beta2 = coefs
    finite = tl.abs(g) < float("inf")  # a non-finite gradient element is skipped (NaN is not < inf)
    g = tl.where(finite, g, 0.0)
    interp = s + one_minus_beta1 * (g - s)
    s_new = s + one_minus_beta2 * (g - s)
    ok = finite & (tl.abs(s_new) < float("inf")) & (tl.abs(interp) < float("inf"))
    s = tl.where(ok, s_new, s)
    sign = tl.where(interp > 0, 1.0, tl.where(interp < 0, -1.0, 0.0))
    p = tl.where(ok, p * wd_factor - lr * sign, p)
    return p, s


# Its element update in C (FusedRule.c_source), built into the C step by kernels/cpu.py.
_C_UPDATE = r"""
NOINLINE static void lion(float *restrict p, const float *restrict g_in, float *restrict s, int n, const float *c,
                          int option) {
    (void)option; /* no option */
    const float lr = c[0], wd_factor = c[1], omb1 = c[2], omb2 = c[3];
    for (int i = 0; i < n; i++) {
        float g = g_in[i], pi = p[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        float interp = s[i] + omb1 * (g - s[i]);
        float s_new = s[i] + omb2 * (g - s[i]);
        int ok = is_finite(s_new) ? (is_finite(interp) ? fin : 0) : 0; /* selects: & made GCC branch, 1.7x slower */
        s[i] = keep_if(ok, s_new, s[i]);
        float sign = interp > 0.0f ? 1.0f : 0.0f;
        sign = interp < 0.0f ? -1.0f : sign;
        p[i] = ok ? pi * wd_factor - lr * sign : pi;
    }
}
"""


LION = FusedRule(
    "lion",
    ("exp_avg",),
    (True,),
    LION_COEFS,
    lion_coefficients,
    triton_update=triton_jit(lion_tile_update),
    c_source=_C_UPDATE,
    c_name="lion",
)
