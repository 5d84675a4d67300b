"""The update rules (Adam/AdamW, SGD, Lion, Muon's momentum), each written once in plain tensor code that does
not know the state's format.

The states may be plain fp32 tensors or any :class:`~torchao_optim.state.QuantizedState`: reading one
(``lerp``, ``mul``, ``where``) dequantizes it, ``copy_`` into it requantizes. Under ``torch.compile`` the
dequantize -> update -> requantize chain of one parameter fuses into one kernel.

Non-finite gradient elements are skipped: that element's parameter and states keep their values (up to
requantization of its block) and nothing else in its block changes. This is bitsandbytes' policy, except
that we keep the element's state rather than zeroing it. An element whose new ``m`` or ``v`` would overflow
the state's dtype (a finite gradient beyond about 5.8e20 in fp32) is skipped the same way.
"""
from __future__ import annotations

from typing import Optional

import torch

from torchao_optim.quant.rounding import stochastic_round_bf16

__all__ = [
    "adam_update", "adam_coefficients", "COEFS", "sgd_update", "sgd_coefficients", "SGD_COEFS", "lion_update",
    "lion_coefficients", "LION_COEFS", "muon_momentum", "muon_coefficients", "MUON_COEFS",
]


# Columns of the coefficient table both executors read, one row per parameter.
COEFS = ("step_size", "inv_bias_correction2_sqrt", "weight_decay", "one_minus_beta1", "beta2", "one_minus_beta2",
         "eps")


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


def finite_grad(grad: torch.Tensor, dtype: torch.dtype, maximize: bool):
    """``(g, finite)``: the gradient in ``dtype`` (negated with ``maximize``) with its non-finite elements set
    to 0, and where they were finite: every rule skips the others (parameter and state keep their values)."""
    g = grad.to(dtype)
    if maximize:
        g = -g
    finite = torch.isfinite(g)
    return torch.where(finite, g, 0.0), finite


def store_param(param: torch.Tensor, value: torch.Tensor, round_key: Optional[torch.Tensor]) -> None:
    """``param.copy_(value)``; a bf16 ``param`` with a ``round_key`` (int64 ``(key, element offset)``, see
    :mod:`torchao_optim.quant.rounding`) is written with stochastic rounding instead of round-to-nearest."""
    if round_key is not None and param.dtype == torch.bfloat16:
        value = stochastic_round_bf16(value.to(torch.float32), round_key[0], round_key[1])
    param.copy_(value)


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    coefs: torch.Tensor,
    *,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
    round_key: Optional[torch.Tensor] = None,
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

    denom = v.sqrt() * inv_bc2 + eps
    p_new = p_decayed - step_size * (m / denom)
    store_param(param, torch.where(ok, p_new, p), round_key)


# ---- the one-state rules: SGD with momentum, Lion, Muon's momentum ---------------------------------------
# Each has its coefficient function (float64, once per group and step, one row per parameter) and its update,
# in the same form as Adam's: the state may be plain or any format, non-finite gradient elements are skipped
# (parameter and state keep their values), and so is an element whose new state would overflow.

SGD_COEFS = ("lr", "weight_decay", "momentum", "grad_coef")


def sgd_coefficients(step: torch.Tensor, hyperparams: torch.Tensor) -> torch.Tensor:
    """SGD's rows, float64 ``step.shape + (4,)`` in the order of :data:`SGD_COEFS`, from the group's
    ``(lr, momentum, dampening, weight_decay)``. ``grad_coef`` is ``1 - dampening``, except at a parameter's
    first step, where torch.optim.SGD sets the buffer to the gradient itself (the buffer is zero then, so
    ``momentum * 0 + 1 * g`` is that, exactly)."""
    lr, momentum, dampening, weight_decay = hyperparams.unbind()
    first = step.to(torch.float64) <= 1
    grad_coef = torch.where(first, torch.ones_like(dampening), 1 - dampening)
    consts = torch.stack([lr, weight_decay, momentum]).expand(step.shape + (3,))
    return torch.cat([consts, grad_coef.unsqueeze(-1)], dim=-1)


def sgd_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    coefs: torch.Tensor,
    *,
    nesterov: bool,
    maximize: bool,
    round_key: Optional[torch.Tensor] = None,
) -> None:
    """One ``torch.optim.SGD`` step on one parameter, in place (``momentum_buffer`` None: momentum 0)."""
    lr, wd, momentum, grad_coef = coefs.unbind()
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    g, finite = finite_grad(grad, momentum_buffer.dtype if momentum_buffer is not None else p.dtype, maximize)
    g = g + (wd * p).to(g.dtype)
    ok = finite
    if momentum_buffer is not None:
        buf_new = momentum_buffer * momentum + grad_coef * g
        ok = finite & torch.isfinite(buf_new)
        buf = torch.where(ok, buf_new, momentum_buffer)
        momentum_buffer.copy_(buf)
        g = g + momentum * buf if nesterov else buf
    store_param(param, torch.where(ok, p - lr * g, p), round_key)


LION_COEFS = ("lr", "weight_decay_factor", "one_minus_beta1", "one_minus_beta2")


def lion_coefficients(step: torch.Tensor, hyperparams: torch.Tensor) -> torch.Tensor:
    """Lion's rows, float64 ``step.shape + (4,)`` (:data:`LION_COEFS`), from ``(lr, beta1, beta2, weight_decay)``:
    ``lr, 1 - lr * weight_decay, 1 - beta1, 1 - beta2``. Lion's update does not depend on the step count."""
    lr, beta1, beta2, weight_decay = hyperparams.unbind()
    return torch.stack([lr, 1 - lr * weight_decay, 1 - beta1, 1 - beta2]).expand(step.shape + (4,))


def lion_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    coefs: torch.Tensor,
    *,
    maximize: bool,
    round_key: Optional[torch.Tensor] = None,
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


MUON_COEFS = ("lr", "weight_decay_factor", "one_minus_momentum", "momentum")


def muon_coefficients(step: torch.Tensor, hyperparams: torch.Tensor) -> torch.Tensor:
    """Muon's rows, float64 ``step.shape + (4,)`` (:data:`MUON_COEFS`), from ``(lr, momentum, weight_decay)``."""
    lr, momentum, weight_decay = hyperparams.unbind()
    return torch.stack([lr, 1 - lr * weight_decay, 1 - momentum, momentum]).expand(step.shape + (4,))


def muon_momentum(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    coefs: torch.Tensor,
    *,
    nesterov: bool,
    maximize: bool,
):
    """Muon's elementwise half, in place on the buffer: ``B = B + (1 - mu) * (g - B)`` (torch.optim.Muon's
    ``lerp``), and the direction to orthogonalize, ``g + mu * (B - g)`` with nesterov, else ``B``. Returns
    ``(direction, ok)``: a non-finite gradient element (or an overflowing buffer) keeps its buffer, counts as 0
    in the direction (the orthogonalization mixes every element: one NaN would spread to all) and is marked
    not ``ok``, so that its parameter is left alone."""
    _, _, one_minus_momentum, momentum = coefs.unbind()
    g, finite = finite_grad(grad, momentum_buffer.dtype, maximize)
    buf_new = momentum_buffer + one_minus_momentum * (g - momentum_buffer)
    ok = finite & torch.isfinite(buf_new)
    buf = torch.where(ok, buf_new, momentum_buffer)
    momentum_buffer.copy_(buf)
    direction = g + momentum * (buf - g) if nesterov else buf
    return torch.where(ok, direction, 0.0), ok
