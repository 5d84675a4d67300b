"""Adam and AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019): the rule's coefficients, its update in plain tensor
code that does not know the state's format, and :data:`ADAM`, the rule as the fused kernels take it: with the same
update in Triton's language (``adam_tile_update``, and Adam's coefficients kernel) and in C. With amsgrad,
:data:`ADAM_AMSGRAD` (a third state, ``max_exp_avg_sq``), with its update in Triton's language
(``adam_amsgrad_tile_update``, for the three-state form of the Triton kernel) and in C.

The states may be plain fp32 tensors or any :class:`~torchao_optim.state.QuantizedState`: reading one
(``lerp``, ``mul``, ``where``) dequantizes it, ``copy_`` into it requantizes. Under ``torch.compile`` the
dequantize -> update -> requantize chain of one parameter fuses into one kernel. An element whose new ``m`` or
``v`` would overflow the state's dtype (a finite gradient beyond about 5.8e20 in fp32) is skipped as a
non-finite gradient element is (:mod:`torchao_optim.rules.base`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, param_div, param_sqrt, sqrt_rn, store_param, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

__all__ = ["ADAM", "ADAM_AMSGRAD", "COEFS", "adam_coefficients", "adam_update"]


# Columns of the coefficient table both executors read, one row per parameter.
COEFS = ("step_size", "inv_bias_correction2_sqrt", "weight_decay", "one_minus_beta1", "beta2", "one_minus_beta2", "eps")


def adam_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, decoupled_weight_decay: bool) -> torch.Tensor:
    """Adam's per-step coefficients for parameters at step counts ``step`` (any shape, already advanced).

    ``hyperparams`` is the group's ``(lr, beta1, beta2, eps, weight_decay)`` as a float64 tensor on the
    step's device. Returns float64 ``step.shape + (7,)`` (executors take them in their compute dtype) in the
    order of :data:`COEFS`: ``lr / (1 - beta1**t)``,
    ``1 / sqrt(1 - beta2**t)``, the weight-decay coefficient (``1 - lr * weight_decay`` for AdamW, the L2
    factor for Adam), then ``1 - beta1, beta2, 1 - beta2, eps``.

    Computed once per group and step, in float64 like torch.optim's Python-float arithmetic (``1 - beta2``
    from an fp32 beta2 would be off by 1e-5 relative), and handed to either executor: the compiled
    per-element update and the fused kernel never evaluate a power per element, and a tensor lr on the
    device never needs a host sync.
    """
    t = step.to(torch.float64)
    lr, beta1, beta2, eps, weight_decay = hyperparams.unbind()
    wd = 1 - lr * weight_decay if decoupled_weight_decay else weight_decay
    consts = torch.stack([wd, 1 - beta1, beta2, 1 - beta2, eps])  # (5,)
    per_step = torch.stack([lr / (1 - beta1**t), (1 - beta2**t).rsqrt()], dim=-1)  # step.shape + (2,)
    return torch.cat([per_step, consts.expand(per_step.shape[:-1] + (5,))], dim=-1)


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    coefs: torch.Tensor,
    *,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
    round_key: torch.Tensor | None = None,
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step on one parameter, in place (``round_key``: see
    :func:`store_param`).

    ``coefs`` is this parameter's row of :func:`adam_coefficients` (7,), in the compute dtype: changing a
    hyperparameter changes data, never the compiled graph.
    """
    step_size, inv_bc2, wd, one_minus_beta1, beta2, one_minus_beta2, eps = coefs.unbind()
    # State arithmetic in the state's dtype (fp32, or fp64 for the plain state of fp64 parameters); the
    # parameter's arithmetic in fp32, or fp64 for fp64 parameters, so that no update smaller than an fp32
    # ulp of the parameter is lost.
    g, finite = finite_grad(grad, exp_avg.dtype, maximize)
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    if decoupled_weight_decay:
        p_decayed = p * wd
    else:
        g = g + (wd * p).to(g.dtype)
        p_decayed = p

    m_new = exp_avg + one_minus_beta1 * (g - exp_avg)
    # ((1 - beta2) * g) * g: finite for |g| up to sqrt(max / (1 - beta2)) (5.8e20 in fp32 with beta2 = 0.999)
    v_new = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    # An element whose new moment overflows is skipped as a non-finite gradient is. torch.optim would store
    # Inf there (and never move the element again); a quantized state cannot hold Inf, and the largest code
    # it would saturate to is the block's largest finite value: a small v under a huge m.
    ok = finite & torch.isfinite(m_new) & torch.isfinite(v_new)
    m = torch.where(ok, m_new, exp_avg)
    v = torch.where(ok, v_new, exp_avg_sq)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if amsgrad:
        v = torch.maximum(max_exp_avg_sq, v)
        max_exp_avg_sq.copy_(v)

    # The square root correctly rounded (sqrt_rn), as the compiled path and the fused C step take it, also when this
    # update runs eagerly (eager torch's vectorized one is an ulp off at some elements on AVX-512): the parameter is
    # then the same bits on every executor (a sharded parameter's eager step against one process's fused one), and
    # with L2 weight decay the next gradient, so the states, depend on it
    denom = sqrt_rn(v) * inv_bc2 + eps
    p_new = p_decayed - step_size * (m / denom)
    store_param(param, torch.where(ok, p_new, p), round_key)


def adam_tile_update(p, g, m, v, coefs, DECOUPLED: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.adam.adam_update` on a tile: returns ``(p, m, v)``."""
    step_size, inv_bc2, wd, one_minus_beta1, beta2, one_minus_beta2, eps = coefs
    if DECOUPLED:
        p_decayed = p * wd
    else:
        g = g + wd * p
        p_decayed = p
    m_new = m + one_minus_beta1 * (g - m)
    v_new = v * beta2 + one_minus_beta2 * g * g
    # Skipped, as adam_update skips them: a non-finite gradient element, and an element whose new moment
    # overflows. One test finds both: for a gradient element of +-inf or NaN, ((1 - beta2) * g) * g is +inf or
    # NaN whatever beta2 is, and so is v_new (NaN is not < inf). The skipped elements' m_new, v_new and
    # parameter are computed from the unsanitized gradient and thrown away.
    ok = (tl.abs(m_new) < float("inf")) & (tl.abs(v_new) < float("inf"))
    m = tl.where(ok, m_new, m)
    v = tl.where(ok, v_new, v)
    # fast sqrt and division on a GPU build: the parameter may differ from the compiled path by an ulp or two of its
    # update; the states, which decide the codes, do not depend on them (eps is 0 or normal, as Adam checks)
    denom = param_sqrt(v, PTX) * inv_bc2 + eps
    p = tl.where(ok, p_decayed - step_size * param_div(m, denom, PTX), p)
    return p, m, v


def adam_amsgrad_tile_update(p, g, m, v, vmax, coefs, DECOUPLED: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.adam.adam_update` with amsgrad on a tile (``vmax``: ``max_exp_avg_sq``): returns
    ``(p, m, v, vmax)``. The same fp32 operations in the same order as the plain update and the C update, so that in
    Triton's interpreter, where the square root and the division round correctly, the parameter too is theirs, bit
    for bit; a GPU build takes :func:`adam_tile_update`'s fast ones (:func:`~torchao_optim.rules.base.param_sqrt`,
    ``param_div``): only the parameter depends on them."""
    step_size, inv_bc2, wd, one_minus_beta1, beta2, one_minus_beta2, eps = coefs
    finite = tl.abs(g) < float("inf")
    g = tl.where(finite, g, 0.0)
    if DECOUPLED:
        p_decayed = p * wd
    else:
        g = g + wd * p
        p_decayed = p
    m_new = m + one_minus_beta1 * (g - m)
    v_new = v * beta2 + one_minus_beta2 * g * g
    ok = finite & (tl.abs(m_new) < float("inf")) & (tl.abs(v_new) < float("inf"))
    m = tl.where(ok, m_new, m)
    v = tl.where(ok, v_new, v)
    # the maximum of the old maximum and v, a skipped element's too (both finite), as the C update takes it
    vmax = tl.where(vmax < v, v, vmax)
    denom = param_sqrt(vmax, PTX) * inv_bc2 + eps
    p = tl.where(ok, p_decayed - step_size * param_div(m, denom, PTX), p)
    return p, m, v, vmax


def _pow(base, t):
    """``base ** t`` in fp64 for integer-valued ``t`` in [0, 2**32), by squaring: within a few fp64 ulps."""
    e = t.to(tl.int64)
    result = tl.full(t.shape, 1.0, tl.float64)
    b = tl.full(t.shape, 1.0, tl.float64) * base
    for _ in tl.static_range(32):
        result = tl.where((e & 1) != 0, result * b, result)
        b = b * b
        e = e >> 1
    return result


def adam_coefs_kernel(
    steps, hyperparams, coefs, n, DECOUPLED: tl.constexpr, N_POW2: tl.constexpr, PDL: tl.constexpr = False
):
    """``steps += 1`` and ``coefs = adam_coefficients(steps, hyperparams, DECOUPLED)`` in fp32, for ``n`` tensors
    (one program). ``hyperparams``: fp64 (lr, beta1, beta2, eps, weight_decay). ``PDL``: the update kernel that
    follows may start now (programmatic dependent launch); it waits for these results where it reads them."""
    if PDL:
        gdc_launch_dependents()
    i = tl.arange(0, N_POW2)
    mask = i < n
    step = tl.load(steps + i, mask=mask, other=0.0) + 1.0
    tl.store(steps + i, step, mask=mask)
    t = step.to(tl.float64)
    lr, beta1, beta2 = tl.load(hyperparams + 0), tl.load(hyperparams + 1), tl.load(hyperparams + 2)
    eps, weight_decay = tl.load(hyperparams + 3), tl.load(hyperparams + 4)
    if DECOUPLED:
        wd = 1.0 - lr * weight_decay
    else:
        wd = weight_decay
    step_size = lr / (1.0 - _pow(beta1, t))
    inv_bc2 = 1.0 / tl.sqrt(1.0 - _pow(beta2, t))  # fp64 sqrt is correctly rounded
    row = coefs + i * 7
    zero = tl.zeros(t.shape, tl.float64)
    tl.store(row + 0, step_size.to(tl.float32), mask=mask)
    tl.store(row + 1, inv_bc2.to(tl.float32), mask=mask)
    tl.store(row + 2, (zero + wd).to(tl.float32), mask=mask)
    tl.store(row + 3, (zero + (1.0 - beta1)).to(tl.float32), mask=mask)
    tl.store(row + 4, (zero + beta2).to(tl.float32), mask=mask)
    tl.store(row + 5, (zero + (1.0 - beta2)).to(tl.float32), mask=mask)
    tl.store(row + 6, (zero + eps).to(tl.float32), mask=mask)


# Its element updates in C (FusedRule.c_source), built into the C step by kernels/cpu.py: one loop, which Adam's
# function and amsgrad's inline (amsgrad's with decoupled a constant: a branch on it inside the loop would be a
# blend); the two rules share this source (the C step takes a source its rules share once).
_C_UPDATE = r"""
static inline __attribute__((always_inline)) void adam_loop(float *restrict p, const float *restrict g_in,
                                                           float *restrict m, float *restrict v, float *restrict vmax,
                                                           int n, const float *c, int decoupled, int amsgrad) {
    const float step_size = c[0], inv_bc2 = c[1], wd = c[2], omb1 = c[3], beta2 = c[4], omb2 = c[5], eps = c[6];
    for (int i = 0; i < n; i++) {
        float g = g_in[i], pi = p[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        float p_decayed = pi;
        if (decoupled) p_decayed = pi * wd;
        else g = g + wd * pi;
        float m_new = m[i] + omb1 * (g - m[i]);
        float v_new = v[i] * beta2 + omb2 * g * g;
        int ok = fin & is_finite(m_new) & is_finite(v_new);
        float mi = keep_if(ok, m_new, m[i]), vi = keep_if(ok, v_new, v[i]);
        m[i] = mi;
        v[i] = vi;
        if (amsgrad) {
            /* torch.maximum of the old maximum and v, a skipped element's too (both finite and >= 0): an integer
               maximum of their patterns, which order as the values do (sign bits cleared: a -0.0 counts as 0). A float
               select here let the compiler take the square root and the division of both operands (NaN rules keep it
               from being a maximum), twice the cost of the update */
            uint32_t old_top = bits_of(vmax[i]) & 0x7FFFFFFFu, new_top = bits_of(vi) & 0x7FFFFFFFu;
            float top = float_of(old_top > new_top ? old_top : new_top);
            vmax[i] = top;
            vi = top;
        }
        float denom = sqrtf(vi) * inv_bc2 + eps;
        float p_new = p_decayed - step_size * (mi / denom);
        p[i] = ok ? p_new : pi;
    }
}

NOINLINE static void adam(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, int n,
                          const float *c, int decoupled) {
    adam_loop(p, g, m, v, v, n, c, decoupled, 0);
}

NOINLINE static void adam_amsgrad(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                                  float *restrict vmax, int n, const float *c, int decoupled) {
    if (decoupled) adam_loop(p, g, m, v, vmax, n, c, 1, 1);
    else adam_loop(p, g, m, v, vmax, n, c, 0, 1);
}
"""

ADAM = FusedRule(
    "adam",
    ("exp_avg", "exp_avg_sq"),
    (True, False),
    COEFS,
    adam_coefficients,
    option="decoupled",
    triton_update=triton_jit(adam_tile_update, calls=(param_sqrt, param_div)),
    triton_coefficients=triton_jit(
        adam_coefs_kernel, calls=(_pow,), imports=("triton.language.extra.cuda.gdc_launch_dependents",)
    ),
    c_source=_C_UPDATE,
    c_name="adam",
)
ADAM_AMSGRAD = FusedRule(
    "adam_amsgrad",
    ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    (True, False, False),
    COEFS,
    adam_coefficients,
    option="decoupled",
    triton_update=triton_jit(adam_amsgrad_tile_update, calls=(param_sqrt, param_div)),
    c_source=_C_UPDATE,
    c_name="adam_amsgrad",
)
