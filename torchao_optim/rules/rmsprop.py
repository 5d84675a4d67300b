"""RMSprop (Hinton's lecture 6e; ``torch.optim.RMSprop``): the rule's coefficients, its update in plain tensor code,
and its two fused rules, chosen by the group's momentum: :data:`RMSPROP` (``square_avg`` alone, the one-state
kernels) and :data:`RMSPROP_MOMENTUM` (``square_avg`` and ``momentum_buffer``, the two-state kernels).
``centered=True`` adds a third state (``grad_avg``), which no fused kernel carries: it runs on the compiled path.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the states may be plain or any format
(``square_avg`` never negative: the unsigned codebook), non-finite gradient elements are skipped (parameter and
states keep their values), and so is an element whose new state would overflow.
"""

from __future__ import annotations

import functools

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, sqrt_rn, store_param

__all__ = [
    "RMSPROP",
    "RMSPROP_MOMENTUM",
    "RMSPROP_COEFS",
    "RMSPROP_MOMENTUM_COEFS",
    "rmsprop_coefficients",
    "rmsprop_update",
]

# The compiled path's row; the one-state kernel reads the first four columns, the two-state kernel seven (the
# last two 0).
RMSPROP_COEFS = ("lr", "weight_decay", "one_minus_alpha", "eps", "momentum")
RMSPROP_MOMENTUM_COEFS = RMSPROP_COEFS + ("zero", "zero")


def rmsprop_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
    """RMSprop's rows, float64 ``step.shape + (5,)`` (:data:`RMSPROP_COEFS`), from the group's ``(lr, alpha, eps,
    weight_decay, momentum)``: ``lr, weight_decay, 1 - alpha, eps, momentum`` (``1 - alpha`` in float64, as
    torch.optim computes it from Python floats). RMSprop's update does not depend on the step count, and it has no
    option."""
    lr, alpha, eps, weight_decay, momentum = hyperparams.unbind()
    return torch.stack([lr, weight_decay, 1 - alpha, eps, momentum]).expand(step.shape + (5,))


def _one_state_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, option: bool = False) -> torch.Tensor:
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


@functools.cache  # imported once: a launch asks for it every step
def _triton_update():
    from torchao_optim.rules.triton_updates import rmsprop_tile_update

    return rmsprop_tile_update


@functools.cache
def _triton_momentum_update():
    from torchao_optim.rules.triton_updates import rmsprop_momentum_tile_update

    return rmsprop_momentum_tile_update


RMSPROP = FusedRule(
    "rmsprop",
    ("square_avg",),
    (False,),
    RMSPROP_COEFS[:4],
    _one_state_coefficients,
    triton_update=_triton_update,
    c_name="rmsprop",
)
RMSPROP_MOMENTUM = FusedRule(
    "rmsprop_momentum",
    ("square_avg", "momentum_buffer"),
    (False, True),
    RMSPROP_MOMENTUM_COEFS,
    _two_state_coefficients,
    triton_update=_triton_momentum_update,
    c_name="rmsprop_momentum",
)
