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

__all__ = ["adam_update"]


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor],
    step: torch.Tensor,
    lr: torch.Tensor,
    beta1: torch.Tensor,
    beta2: torch.Tensor,
    eps: torch.Tensor,
    weight_decay: torch.Tensor,
    *,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step on one parameter, in place.

    ``step`` is the 0-d step count before this step (incremented here); the hyperparameters are 0-d
    tensors so that changing them never recompiles.
    """
    step.add_(1)
    g = grad.float()
    if maximize:
        g = -g
    finite = torch.isfinite(g)
    g = torch.where(finite, g, 0.0)
    p = param.float()
    if decoupled_weight_decay:
        p_decayed = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
        p_decayed = p

    m = torch.where(finite, exp_avg.lerp(g, 1 - beta1), exp_avg)
    v = torch.where(finite, exp_avg_sq * beta2 + (1 - beta2) * g * g, exp_avg_sq)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if amsgrad:
        v = torch.maximum(max_exp_avg_sq, v)
        max_exp_avg_sq.copy_(v)

    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step).sqrt()
    denom = v.sqrt() / bias_correction2_sqrt + eps
    p_new = p_decayed - (lr / bias_correction1) * m / denom
    param.copy_(torch.where(finite, p_new, p))
