"""Muon's elementwise half (its momentum, in plain tensor code over a state of any format) and its coefficients.

No fused kernel runs Muon: its update orthogonalizes whole matrices (:mod:`torchao_optim.optim.muon`).
"""

from __future__ import annotations

import torch

from torchao_optim.rules.base import finite_grad

__all__ = ["MUON_COEFS", "muon_coefficients", "muon_momentum"]

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
