"""The Adam/AdamW update rule, written once in plain tensor code that does not know the state's format.

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

__all__ = ["adam_update", "adam_step_scalars"]


def adam_step_scalars(step: torch.Tensor, lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor):
    """Advance the 0-d step count and return Adam's per-step scalars ``(lr / (1 - beta1**t),
    sqrt(1 - beta2**t))`` as 0-d tensors.

    Kept out of the compiled per-element update: fused into it, a compiler may evaluate these powers once
    per element (inductor's C++ backend does), which costs more than the rest of the update.
    """
    step.add_(1)
    return lr / (1 - beta1**step), (1 - beta2**step).sqrt()


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    lr: torch.Tensor,
    beta1: torch.Tensor,
    beta2: torch.Tensor,
    eps: torch.Tensor,
    weight_decay: torch.Tensor,
    step_size: torch.Tensor,
    bias_correction2_sqrt: torch.Tensor,
    *,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step on one parameter, in place.

    The hyperparameters and the step's scalars (from :func:`adam_step_scalars`) are 0-d tensors, so that
    changing them never recompiles.
    """
    # State arithmetic in the state's dtype (fp32, or fp64 for the plain state of fp64 parameters); the
    # parameter's arithmetic in fp32, or fp64 for fp64 parameters, so that no update smaller than an fp32
    # ulp of the parameter is lost.
    g = grad.to(exp_avg.dtype)
    if maximize:
        g = -g
    finite = torch.isfinite(g)
    g = torch.where(finite, g, 0.0)
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    if decoupled_weight_decay:
        p_decayed = p * (1 - lr * weight_decay)
    else:
        g = g + (weight_decay * p).to(g.dtype)
        p_decayed = p

    m_new = exp_avg.lerp(g, 1 - beta1)
    # ((1 - beta2) * g) * g: finite for |g| up to sqrt(max / (1 - beta2)) (5.8e20 in fp32 with beta2 = 0.999)
    v_new = exp_avg_sq * beta2 + (1 - beta2) * g * g
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

    denom = v.sqrt() / bias_correction2_sqrt + eps
    p_new = p_decayed - step_size * m / denom
    param.copy_(torch.where(ok, p_new, p))
