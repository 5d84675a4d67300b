"""AdEMAMix (Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older"): the rule's
coefficients and its update in plain tensor code.

Three states: ``exp_avg`` (the fast EMA ``m1``, signed), ``exp_avg_slow`` (the slow EMA ``m2``, signed) and
``exp_avg_sq`` (``nu``, never negative: the unsigned codebook). Bias correction as bitsandbytes' AdEMAMix applies it:
``m1`` and ``nu`` are corrected, ``m2`` is not (the paper's Algorithm 1 does the same). Weight decay is decoupled.
The paper's schedulers enter as per-step coefficients: alpha warms up linearly over ``t_alpha`` steps, and beta3 rises
from beta1 to its final value over ``t_beta3`` steps along the paper's curve, which keeps the slow EMA's half-life
growing linearly.

Non-finite gradient elements are skipped as by every rule (:mod:`torchao_optim.rules.base`), and so is an element
whose new state would overflow. :data:`ADEMAMIX` is the rule as the fused kernels take it, with its update in Triton's
language (``ademamix_tile_update``, for the three-state form of the Triton kernel) and in C.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, param_div, param_sqrt, store_param, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

__all__ = ["ADEMAMIX", "ADEMAMIX_COEFS", "ademamix_coefficients", "ademamix_update"]

ADEMAMIX_COEFS = (
    "lr",
    "inv_bias_correction1",
    "inv_bias_correction2_sqrt",
    "alpha",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "one_minus_beta3",
    "eps",
    "decay",
)


def ademamix_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
    """AdEMAMix's rows, float64 ``step.shape + (10,)`` (:data:`ADEMAMIX_COEFS`), from advanced step counts ``t``
    (1 on the first step) and the group's ``(lr, beta1, beta2, beta3, alpha, t_alpha, t_beta3, eps,
    weight_decay)``, where ``t_alpha`` or ``t_beta3`` 0 means no scheduler:

    - ``1 / (1 - beta1**t)`` and ``1 / sqrt(1 - beta2**t)``: the bias corrections of ``m1`` and ``nu``;
    - ``alpha(t) = min(t * alpha / t_alpha, alpha)``;
    - ``beta3(t) = min(exp(ln(beta1) ln(beta3) / ((1 - t/t_beta3) ln(beta3) + (t/t_beta3) ln(beta1))), beta3)``,
      beta1 at ``t = 0`` and beta3 from ``t = t_beta3`` on; its ``1 - beta3(t)`` is the column;
    - ``1 - lr * weight_decay``: the decoupled decay factor.

    AdEMAMix has no option."""
    t = step.to(torch.float64)
    lr, beta1, beta2, beta3, alpha, t_alpha, t_beta3, eps, weight_decay = hyperparams.unbind()
    alpha_t = torch.where(t_alpha > 0, torch.minimum(t * alpha / t_alpha, alpha), alpha)
    ln1, ln3 = beta1.log(), beta3.log()
    s = t / t_beta3
    scheduled = torch.minimum(torch.exp(ln1 * ln3 / ((1 - s) * ln3 + s * ln1)), beta3)
    # where(): the unscheduled branch's log(0) of a beta1 = 0 never reaches the row
    beta3_t = torch.where(t_beta3 > 0, scheduled, beta3)
    columns = [lr, 1 / (1 - beta1**t), (1 - beta2**t).rsqrt(), alpha_t, 1 - beta1, beta2, 1 - beta2, 1 - beta3_t]
    columns += [eps, 1 - lr * weight_decay]
    return torch.stack(torch.broadcast_tensors(*columns), dim=-1)


def ademamix_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_slow: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    coefs: torch.Tensor,
    *,
    maximize: bool,
    round_key: torch.Tensor | None = None,
) -> None:
    """One AdEMAMix step on one parameter, in place, with its row of :func:`ademamix_coefficients`::

        m1 = m1 + (1 - beta1) * (g - m1)
        m2 = m2 + (1 - beta3(t)) * (g - m2)
        nu = beta2 * nu + (1 - beta2) * g * g
        p = p * (1 - lr * weight_decay)
            - lr * (m1 / (1 - beta1**t) + alpha(t) * m2) / (sqrt(nu) / sqrt(1 - beta2**t) + eps)

    State arithmetic in the states' dtype, the parameter's in fp32 (fp64 for fp64 parameters), as Adam's."""
    lr, inv_bc1, inv_bc2, alpha, one_minus_beta1, beta2, one_minus_beta2, one_minus_beta3, eps, decay = coefs.unbind()
    g, finite = finite_grad(grad, exp_avg.dtype, maximize)
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    m1_new = exp_avg + one_minus_beta1 * (g - exp_avg)
    m2_new = exp_avg_slow + one_minus_beta3 * (g - exp_avg_slow)
    nu_new = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    ok = finite & torch.isfinite(m1_new) & torch.isfinite(m2_new) & torch.isfinite(nu_new)
    m1 = torch.where(ok, m1_new, exp_avg)
    m2 = torch.where(ok, m2_new, exp_avg_slow)
    nu = torch.where(ok, nu_new, exp_avg_sq)
    exp_avg.copy_(m1)
    exp_avg_slow.copy_(m2)
    exp_avg_sq.copy_(nu)
    denom = nu.sqrt() * inv_bc2 + eps
    p_new = p * decay - lr * ((m1 * inv_bc1 + alpha * m2) / denom)
    store_param(param, torch.where(ok, p_new, p), round_key)


def ademamix_tile_update(p, g, m1, m2, nu, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.ademamix.ademamix_update` on a tile (``m1``, ``m2``, ``nu``: ``exp_avg``,
    ``exp_avg_slow``, ``exp_avg_sq``; no option): returns ``(p, m1, m2, nu)``. The same fp32 operations in the same
    order as the plain update and the C update, so that in Triton's interpreter, where the square root and the
    division round correctly, the parameter too is theirs, bit for bit; a GPU build takes fast ones
    (:func:`~torchao_optim.rules.base.param_sqrt`, ``param_div``): only the parameter depends on them."""
    lr, inv_bc1, inv_bc2, alpha, one_minus_beta1, beta2, one_minus_beta2, one_minus_beta3, eps, decay = coefs
    finite = tl.abs(g) < float("inf")
    g = tl.where(finite, g, 0.0)
    m1_new = m1 + one_minus_beta1 * (g - m1)
    m2_new = m2 + one_minus_beta3 * (g - m2)
    nu_new = nu * beta2 + one_minus_beta2 * g * g
    ok = finite & (tl.abs(m1_new) < float("inf")) & (tl.abs(m2_new) < float("inf")) & (tl.abs(nu_new) < float("inf"))
    m1 = tl.where(ok, m1_new, m1)
    m2 = tl.where(ok, m2_new, m2)
    nu = tl.where(ok, nu_new, nu)
    denom = param_sqrt(nu, PTX) * inv_bc2 + eps
    p = tl.where(ok, p * decay - lr * param_div(m1 * inv_bc1 + alpha * m2, denom, PTX), p)
    return p, m1, m2, nu


# Its element update in C (FusedRule.c_source), built into the C step by kernels/cpu.py.
_C_UPDATE = r"""
NOINLINE static void ademamix(float *restrict p, const float *restrict g_in, float *restrict m1, float *restrict m2,
                              float *restrict nu, int n, const float *c, int option) {
    (void)option; /* no option */
    const float lr = c[0], inv_bc1 = c[1], inv_bc2 = c[2], alpha = c[3], omb1 = c[4], beta2 = c[5], omb2 = c[6],
                omb3 = c[7], eps = c[8], decay = c[9];
    for (int i = 0; i < n; i++) {
        float g = g_in[i], pi = p[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        float m1_new = m1[i] + omb1 * (g - m1[i]);
        float m2_new = m2[i] + omb3 * (g - m2[i]);
        float nu_new = nu[i] * beta2 + omb2 * g * g;
        int ok = fin & is_finite(m1_new) & is_finite(m2_new) & is_finite(nu_new);
        float a = keep_if(ok, m1_new, m1[i]), b = keep_if(ok, m2_new, m2[i]), v = keep_if(ok, nu_new, nu[i]);
        m1[i] = a;
        m2[i] = b;
        nu[i] = v;
        float denom = sqrtf(v) * inv_bc2 + eps;
        float p_new = pi * decay - lr * ((a * inv_bc1 + alpha * b) / denom);
        p[i] = ok ? p_new : pi;
    }
}
"""


ADEMAMIX = FusedRule(
    "ademamix",
    ("exp_avg", "exp_avg_slow", "exp_avg_sq"),
    (True, True, False),
    ADEMAMIX_COEFS,
    ademamix_coefficients,
    triton_update=triton_jit(ademamix_tile_update, calls=(param_sqrt, param_div)),
    c_source=_C_UPDATE,
    c_name="ademamix",
)
