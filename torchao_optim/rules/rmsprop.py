"""RMSprop (Hinton's lecture 6e; ``torch.optim.RMSprop``): the rule's coefficients, its update in plain tensor code,
and its fused rules, chosen by the group's momentum and centering: :data:`RMSPROP` (``square_avg`` alone, the
one-state kernels), :data:`RMSPROP_MOMENTUM` (``square_avg`` and ``momentum_buffer``, the two-state kernels) and,
centered (``grad_avg`` added), :data:`RMSPROP_CENTERED` (two states) and :data:`RMSPROP_CENTERED_MOMENTUM` (three),
each with its update in Triton's language and in C.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the states may be plain or any format
(``square_avg`` never negative: the unsigned codebook), non-finite gradient elements are skipped (parameter and
states keep their values), and so is an element whose new state would overflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, param_div, param_sqrt, sqrt_rn, store_param, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

__all__ = [
    "RMSPROP",
    "RMSPROP_MOMENTUM",
    "RMSPROP_CENTERED",
    "RMSPROP_CENTERED_MOMENTUM",
    "RMSPROP_COEFS",
    "RMSPROP_MOMENTUM_COEFS",
    "rmsprop_coefficients",
    "rmsprop_update",
]

# The compiled path's row; the one-state kernel reads the first four columns, the two-state kernels seven (the
# last two 0; centered without momentum, the C update reads the first four); centered with momentum, all five, as
# the three-state kernel does.
RMSPROP_COEFS = ("lr", "weight_decay", "one_minus_alpha", "eps", "momentum")
RMSPROP_MOMENTUM_COEFS = RMSPROP_COEFS + ("zero", "zero")


def rmsprop_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
    """RMSprop's rows, float64 ``step.shape + (5,)`` (:data:`RMSPROP_COEFS`), from the group's ``(lr, alpha, eps,
    weight_decay, momentum)``: ``lr, weight_decay, 1 - alpha, eps, momentum`` (``1 - alpha`` in float64, as
    torch.optim computes it from Python floats). RMSprop's update does not depend on the step count, and it has no
    option."""
    lr, alpha, eps, weight_decay, momentum = hyperparams.unbind()
    return torch.stack([lr, weight_decay, 1 - alpha, eps, momentum]).expand(step.shape + (5,))


def _no_momentum_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
    return rmsprop_coefficients(step, hyperparams)[..., :4]


def _two_state_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
    rows = rmsprop_coefficients(step, hyperparams)
    return torch.cat([rows, rows.new_zeros(rows.shape[:-1] + (2,))], dim=-1)


def rmsprop_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    square_avg: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    grad_avg: torch.Tensor | None,
    coefs: torch.Tensor,
    *,
    maximize: bool,
    round_key: torch.Tensor | None = None,
) -> None:
    """One ``torch.optim.RMSprop`` step on one parameter, in place (``momentum_buffer`` None: momentum 0;
    ``grad_avg`` None: not centered)::

        g = grad + weight_decay * p
        v = v + (1 - alpha) * (g * g - v)                (torch: alpha * v + (1 - alpha) * g * g)
        a = g_avg + (1 - alpha) * (g - g_avg)            (centered)
        d = sqrt(v - a * a  if centered  else  v) + eps
        b = momentum * b + g / d;  p = p - lr * b        (momentum > 0; else p = p - lr * g / d)

    ``v`` moves toward ``g * g`` by ``1 - alpha`` of the way, as ``grad_avg`` toward ``g``: the one-state kernel
    reads four coefficients, and this form needs ``1 - alpha`` only. Centered, ``v - a * a`` is never negative in
    exact arithmetic (``v`` averages the squares ``a`` averages the values of, with the same weights) but may be a
    rounding or quantization error below 0: it is taken as 0 there (torch.optim would take a NaN square root)."""
    lr, wd, one_minus_alpha, eps, momentum = coefs.unbind()[:5]
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    g, finite = finite_grad(grad, square_avg.dtype, maximize)
    g = g + (wd * p).to(g.dtype)
    v_new = square_avg + one_minus_alpha * (g * g - square_avg)
    ok = finite & torch.isfinite(v_new)
    if grad_avg is not None:
        a_new = grad_avg + one_minus_alpha * (g - grad_avg)
        ok = ok & torch.isfinite(a_new)
        denom = sqrt_rn((v_new - a_new * a_new).clamp_min(0)) + eps
    else:
        denom = sqrt_rn(v_new) + eps
    if momentum_buffer is not None:
        b_new = momentum_buffer * momentum + g / denom
        ok = ok & torch.isfinite(b_new)
        momentum_buffer.copy_(torch.where(ok, b_new, momentum_buffer))
        p_new = p - lr * b_new
    else:
        p_new = p - lr * g / denom
    # the skipped elements' new values (from a zeroed gradient, or overflowing) are thrown away
    square_avg.copy_(torch.where(ok, v_new, square_avg))
    if grad_avg is not None:
        grad_avg.copy_(torch.where(ok, a_new, grad_avg))
    store_param(param, torch.where(ok, p_new, p), round_key)


def rmsprop_tile_update(p, g, s, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.rmsprop.rmsprop_update` without momentum or centering on a tile (``s``:
    ``square_avg``; no option): returns ``(p, s)``."""
    lr, wd, one_minus_alpha, eps = coefs
    finite = tl.abs(g) < float("inf")
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    s_new = s + one_minus_alpha * (g * g - s)
    ok = finite & (tl.abs(s_new) < float("inf"))
    p = tl.where(ok, p - param_div(lr * g, param_sqrt(s_new, PTX) + eps, PTX), p)
    s = tl.where(ok, s_new, s)
    return p, s


def rmsprop_momentum_tile_update(p, g, v, b, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.rmsprop.rmsprop_update` with momentum, not centered, on a tile (``v``:
    ``square_avg``, ``b``: ``momentum_buffer``; no option): returns ``(p, v, b)``."""
    lr, wd, one_minus_alpha, eps, momentum, _, _ = coefs
    finite = tl.abs(g) < float("inf")
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    v_new = v + one_minus_alpha * (g * g - v)
    b_new = b * momentum + g / (tl.sqrt_rn(v_new) + eps)
    ok = finite & (tl.abs(v_new) < float("inf")) & (tl.abs(b_new) < float("inf"))
    v = tl.where(ok, v_new, v)
    b = tl.where(ok, b_new, b)
    p = tl.where(ok, p - lr * b_new, p)
    return p, v, b


def _centered_start(p, g, v, a, wd, one_minus_alpha, eps, FAST: tl.constexpr):
    """The centered tile updates' common start: the gradient (a non-finite element as 0, plus the L2 term), whether it
    was finite, the new ``square_avg`` and ``grad_avg``, and the denominator ``sqrt(max(v - a * a, 0)) + eps`` (its
    square root fast with ``FAST``, where only the parameter depends on it; else correctly rounded)."""
    finite = tl.abs(g) < float("inf")
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    v_new = v + one_minus_alpha * (g * g - v)
    a_new = a + one_minus_alpha * (g - a)
    var = v_new - a_new * a_new
    denom = param_sqrt(tl.where(var < 0.0, 0.0, var), FAST) + eps  # clamp_min(0): NaN stays NaN
    return g, finite, v_new, a_new, denom


def rmsprop_centered_tile_update(p, g, v, a, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.rmsprop.rmsprop_update` centered, without momentum, on a tile (``v``: ``square_avg``,
    ``a``: ``grad_avg``; the two-state kernel's seven coefficients, the last three unused; no option): returns
    ``(p, v, a)``, from the same fp32 operations in the same order as the plain update and the C update (a GPU build's
    square root and division fast: only the parameter depends on them)."""
    lr, wd, one_minus_alpha, eps, _, _, _ = coefs
    g, finite, v_new, a_new, denom = _centered_start(p, g, v, a, wd, one_minus_alpha, eps, PTX)
    ok = finite & (tl.abs(v_new) < float("inf")) & (tl.abs(a_new) < float("inf"))
    p = tl.where(ok, p - param_div(lr * g, denom, PTX), p)
    v = tl.where(ok, v_new, v)
    a = tl.where(ok, a_new, a)
    return p, v, a


def rmsprop_centered_momentum_tile_update(p, g, v, b, a, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.rmsprop.rmsprop_update` centered, with momentum, on a tile (``v``: ``square_avg``,
    ``b``: ``momentum_buffer``, ``a``: ``grad_avg``; no option): returns ``(p, v, b, a)``, from the same fp32
    operations in the same order as the plain update and the C update (the square root correctly rounded)."""
    lr, wd, one_minus_alpha, eps, momentum = coefs
    g, finite, v_new, a_new, denom = _centered_start(p, g, v, a, wd, one_minus_alpha, eps, False)
    b_new = b * momentum + g / denom
    ok = finite & (tl.abs(v_new) < float("inf")) & (tl.abs(a_new) < float("inf")) & (tl.abs(b_new) < float("inf"))
    v = tl.where(ok, v_new, v)
    b = tl.where(ok, b_new, b)
    a = tl.where(ok, a_new, a)
    p = tl.where(ok, p - lr * b_new, p)
    return p, v, b, a


# Their element updates in C (FusedRule.c_source), built into the C step by kernels/cpu.py: one loop, which each
# rule's function inlines with its own constant flags, so that each compiles to the loop of its own arithmetic. The
# four rules share this source (the C step takes a source its rules share once).
_C_UPDATE = r"""
static inline __attribute__((always_inline)) void rmsprop_loop(float *restrict p, const float *restrict g_in,
                                                              float *restrict v, float *restrict b, float *restrict a,
                                                              int n, const float *c, int centered, int with_momentum) {
    const float lr = c[0], wd = c[1], oma = c[2], eps = c[3], momentum = with_momentum ? c[4] : 0.0f;
    for (int i = 0; i < n; i++) {
        float g = g_in[i], pi = p[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        g = g + wd * pi;
        float v_new = v[i] + oma * (g * g - v[i]);
        int ok = fin & is_finite(v_new);
        float a_new = 0.0f, denom;
        if (centered) {
            a_new = a[i] + oma * (g - a[i]);
            ok = ok & is_finite(a_new);
            float var = v_new - a_new * a_new;
            denom = sqrtf(var < 0.0f ? 0.0f : var) + eps; /* clamp_min(0): NaN stays NaN */
        } else {
            denom = sqrtf(v_new) + eps;
        }
        float b_new = 0.0f, p_new;
        if (with_momentum) {
            b_new = b[i] * momentum + g / denom;
            ok = ok & is_finite(b_new);
            p_new = pi - lr * b_new;
        } else {
            p_new = pi - lr * g / denom;
        }
        v[i] = keep_if(ok, v_new, v[i]);
        if (with_momentum) b[i] = keep_if(ok, b_new, b[i]);
        if (centered) a[i] = keep_if(ok, a_new, a[i]);
        p[i] = ok ? p_new : pi;
    }
}

/* no option: each takes option as the table's form does */
NOINLINE static void rmsprop(float *restrict p, const float *restrict g, float *restrict v, int n, const float *c,
                             int option) {
    (void)option;
    rmsprop_loop(p, g, v, v, v, n, c, 0, 0);
}

NOINLINE static void rmsprop_momentum(float *restrict p, const float *restrict g, float *restrict v,
                                      float *restrict b, int n, const float *c, int option) {
    (void)option;
    rmsprop_loop(p, g, v, b, v, n, c, 0, 1);
}

NOINLINE static void rmsprop_centered(float *restrict p, const float *restrict g, float *restrict v,
                                      float *restrict a, int n, const float *c, int option) {
    (void)option;
    rmsprop_loop(p, g, v, v, a, n, c, 1, 0);
}

NOINLINE static void rmsprop_centered_momentum(float *restrict p, const float *restrict g, float *restrict v,
                                               float *restrict b, float *restrict a, int n, const float *c,
                                               int option) {
    (void)option;
    rmsprop_loop(p, g, v, b, a, n, c, 1, 1);
}
"""

RMSPROP = FusedRule(
    "rmsprop",
    ("square_avg",),
    (False,),
    RMSPROP_COEFS[:4],
    _no_momentum_coefficients,
    triton_update=triton_jit(rmsprop_tile_update, calls=(param_sqrt, param_div)),
    c_source=_C_UPDATE,
    c_name="rmsprop",
)
RMSPROP_MOMENTUM = FusedRule(
    "rmsprop_momentum",
    ("square_avg", "momentum_buffer"),
    (False, True),
    RMSPROP_MOMENTUM_COEFS,
    _two_state_coefficients,
    triton_update=triton_jit(rmsprop_momentum_tile_update),
    c_source=_C_UPDATE,
    c_name="rmsprop_momentum",
)
RMSPROP_CENTERED = FusedRule(
    "rmsprop_centered",
    ("square_avg", "grad_avg"),
    (False, True),
    RMSPROP_MOMENTUM_COEFS,
    _two_state_coefficients,
    triton_update=triton_jit(rmsprop_centered_tile_update, calls=(_centered_start, param_sqrt, param_div)),
    c_source=_C_UPDATE,
    c_name="rmsprop_centered",
)
RMSPROP_CENTERED_MOMENTUM = FusedRule(
    "rmsprop_centered_momentum",
    ("square_avg", "momentum_buffer", "grad_avg"),
    (False, True, True),
    RMSPROP_COEFS,
    rmsprop_coefficients,
    triton_update=triton_jit(rmsprop_centered_momentum_tile_update, calls=(_centered_start, param_sqrt)),
    c_source=_C_UPDATE,
    c_name="rmsprop_centered_momentum",
)
