"""The rules' arithmetic as the Triton kernels take it: each rule's element update, and Adam's coefficients kernel.

A kernel family (``kernels/triton_momentum.py`` for one state, ``kernels/triton_adam.py`` for two) loads a tile,
hands the fp32 values to the rule's element update, a ``@triton.jit`` function it takes as a constexpr
(``FusedRule.triton_update``), and stores what it returns; the update is inlined, so the kernel compiles to the
same instructions as if the arithmetic were written in it. Each is the plain tensor update of its rule
(``rules/adam.py``, ``rules/sgd.py``, ``rules/lion.py``, ``rules/adagrad.py``, ``rules/rmsprop.py``) operation
for operation, on the gradient already negated
for ``maximize``. ``coefs`` is the tensor's row of its rule's coefficients (a tuple of scalars, loaded once per
program); ``OPTION`` the rule's one setting (``FusedRule.option``); ``PTX``: compiled to PTX, where inline PTX may
be used (Triton's interpreter runs the plain forms). This module imports Triton; import it only where Triton is.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents  # Triton >= 3.4 (torch >= 2.11 has 3.6)


@triton.jit
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
    # fast sqrt and division: the parameter may differ from the compiled path by an ulp or two of its update;
    # the states, which decide the codes, do not depend on them. denom is 0 or a normal number below 2**126
    # (sqrt of the smallest fp32 is 3.7e-23, of the largest 1.8e19; eps is 0 or normal, as Adam checks), where
    # the reciprocal that flushes subnormals flushes nothing: it is within one ulp, m * (1 / denom) within two,
    # with none of the rescaling div.approx or tl.fdiv's div.full add. Triton's interpreter runs no PTX.
    denom = tl.sqrt(v) * inv_bc2 + eps
    if PTX:
        ratio = m * tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [denom], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        ratio = tl.fdiv(m, denom)
    p = tl.where(ok, p_decayed - step_size * ratio, p)
    return p, m, v


@triton.jit
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


@triton.jit
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


@triton.jit
def sgd_tile_update(p, g, s, coefs, NESTEROV: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.sgd.sgd_update` on a tile (``s``: the momentum buffer): returns ``(p, s)``."""
    lr, wd, momentum, grad_coef = coefs
    finite = tl.abs(g) < float("inf")  # a non-finite gradient element is skipped (NaN is not < inf)
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    s_new = s * momentum + grad_coef * g
    ok = finite & (tl.abs(s_new) < float("inf"))
    s = tl.where(ok, s_new, s)
    if NESTEROV:
        d = g + momentum * s
    else:
        d = s
    p = tl.where(ok, p - lr * d, p)
    return p, s


@triton.jit
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


@triton.jit
def adagrad_tile_update(p, g, s, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.adagrad.adagrad_update` on a tile (``s``: ``sum``; no option): returns ``(p, s)``.
    The square root and the division round correctly (``sqrt_rn``, ``/``), as the compiled path's do."""
    clr, wd, eps, _ = coefs
    finite = tl.abs(g) < float("inf")  # a non-finite gradient element is skipped (NaN is not < inf)
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    s_new = s + g * g
    ok = finite & (tl.abs(s_new) < float("inf"))
    s = tl.where(ok, s_new, s)
    p = tl.where(ok, p - clr * g / (tl.sqrt_rn(s) + eps), p)
    return p, s


@triton.jit
def rmsprop_tile_update(p, g, s, coefs, OPTION: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.rmsprop.rmsprop_update` without momentum or centering on a tile (``s``:
    ``square_avg``; no option): returns ``(p, s)``."""
    lr, wd, one_minus_alpha, eps = coefs
    finite = tl.abs(g) < float("inf")
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    s_new = s + one_minus_alpha * (g * g - s)
    ok = finite & (tl.abs(s_new) < float("inf"))
    p = tl.where(ok, p - lr * g / (tl.sqrt_rn(s_new) + eps), p)
    s = tl.where(ok, s_new, s)
    return p, s


@triton.jit
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
