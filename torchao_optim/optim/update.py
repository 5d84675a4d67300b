"""The Adam/AdamW update rule, written once in plain tensor code that does not know the state's format.

The states may be plain fp32 tensors or any :class:`~torchao_optim.state.QuantizedState`: reading one
(``lerp``, ``mul``, ``where``) dequantizes it, ``copy_`` into it requantizes. Under ``torch.compile`` the
dequantize -> update -> requantize chain of one parameter fuses into one kernel.

Non-finite gradient elements are skipped: that element's parameter and states keep their values (up to
requantization of its block) and nothing else in its block changes. This is bitsandbytes' policy, except
that we keep the element's state rather than zeroing it.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["adam_update", "adam_coefficients", "COEFS"]


# Columns of the coefficient table both executors read, one row per parameter.
COEFS = ("step_size", "inv_bias_correction2_sqrt", "weight_decay", "beta1", "one_minus_beta1", "beta2",
         "one_minus_beta2", "eps")


def adam_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, decoupled_weight_decay: bool) -> torch.Tensor:
    """Adam's per-step coefficients for parameters at step counts ``step`` (any shape, already advanced).

    ``hyperparams`` is the group's ``(lr, beta1, beta2, eps, weight_decay)`` as a float64 tensor on the
    step's device. Returns fp32 ``step.shape + (8,)`` in the order of :data:`COEFS`: ``lr / (1 - beta1**t)``,
    ``1 / sqrt(1 - beta2**t)``, the weight-decay coefficient (``1 - lr * weight_decay`` for AdamW, the L2
    factor for Adam), then ``beta1, 1 - beta1, beta2, 1 - beta2, eps``.

    Computed once per group and step, in float64 like torch.optim's Python-float arithmetic (``1 - beta2``
    from an fp32 beta2 would be off by 1e-5 relative), and handed to either executor: the compiled
    per-element update and the fused kernel never evaluate a power per element, and a tensor lr on the
    device never needs a host sync.
    """
    t = step.to(torch.float64)
    lr, beta1, beta2, eps, weight_decay = hyperparams.unbind()
    wd = 1 - lr * weight_decay if decoupled_weight_decay else weight_decay
    consts = torch.stack([wd, beta1, 1 - beta1, beta2, 1 - beta2, eps])  # (6,)
    per_step = torch.stack([lr / (1 - beta1**t), (1 - beta2**t).rsqrt()], dim=-1)  # step.shape + (2,)
    return torch.cat([per_step, consts.expand(per_step.shape[:-1] + (6,))], dim=-1).to(torch.float32)


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
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step on one parameter, in place.

    ``coefs`` is this parameter's row of :func:`adam_coefficients` (fp32, (8,)): changing a hyperparameter
    changes data, never the compiled graph.
    """
    step_size, inv_bc2, wd, beta1, one_minus_beta1, beta2, one_minus_beta2, eps = coefs.unbind()
    g = grad.float()
    if maximize:
        g = -g
    finite = torch.isfinite(g)
    g = torch.where(finite, g, 0.0)
    p = param.float()
    if decoupled_weight_decay:
        p_decayed = p * wd
    else:
        g = g + wd * p
        p_decayed = p

    m = torch.where(finite, exp_avg + one_minus_beta1 * (g - exp_avg), exp_avg)
    v = torch.where(finite, exp_avg_sq * beta2 + one_minus_beta2 * g * g, exp_avg_sq)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if amsgrad:
        v = torch.maximum(max_exp_avg_sq, v)
        max_exp_avg_sq.copy_(v)

    denom = v.sqrt() * inv_bc2 + eps
    p_new = p_decayed - step_size * (m / denom)
    param.copy_(torch.where(finite, p_new, p))
