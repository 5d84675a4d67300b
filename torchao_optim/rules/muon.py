"""Muon's elementwise half: its momentum and the direction to orthogonalize, in plain tensor code over a state of any
format, and :data:`MUON`, the same as the fused kernels take it (its element update in Triton's language and in C).

The orthogonalization mixes a whole matrix and runs after the kernels, on the direction they write
(:mod:`torchao_optim.optim.muon`): :data:`MUON`'s output is that direction, not the parameter
(``FusedRule.output``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, split_direction, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

__all__ = ["MUON", "MUON_COEFS", "muon_coefficients", "muon_momentum"]

MUON_COEFS = ("lr", "weight_decay_factor", "one_minus_momentum", "momentum")


def muon_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, nesterov: bool = False) -> torch.Tensor:
    """Muon's rows, float64 ``step.shape + (4,)`` (:data:`MUON_COEFS`), from ``(lr, momentum, weight_decay)``.
    ``nesterov`` (the rule's option) changes no row; the update does not depend on the step count."""
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
    not ``ok``, so that its parameter is left alone; so is an element whose direction overflows. The fused kernels
    compute the same (:data:`MUON`), the skipped elements written as NaN (:func:`split_direction`)."""
    _, _, one_minus_momentum, momentum = coefs.unbind()
    g, finite = finite_grad(grad, momentum_buffer.dtype, maximize)
    buf_new = momentum_buffer + one_minus_momentum * (g - momentum_buffer)
    ok = finite & torch.isfinite(buf_new)
    buf = torch.where(ok, buf_new, momentum_buffer)
    momentum_buffer.copy_(buf)
    direction = g + momentum * (buf - g) if nesterov else buf
    return split_direction(torch.where(ok, direction, float("nan")))


def muon_tile_update(p, g, s, coefs, NESTEROV: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.muon.muon_momentum` on a tile (``s``: the momentum buffer; ``p``, the direction's
    old values, is not read): returns ``(direction, s)``, the direction NaN where the element is skipped."""
    lr, wd_factor, one_minus_momentum, momentum = coefs
    finite = tl.abs(g) < float("inf")  # a non-finite gradient element is skipped (NaN is not < inf)
    g = tl.where(finite, g, 0.0)
    s_new = s + one_minus_momentum * (g - s)
    ok = finite & (tl.abs(s_new) < float("inf"))
    s = tl.where(ok, s_new, s)
    if NESTEROV:
        d = g + momentum * (s - g)
    else:
        d = s
    return tl.where(ok, d, float("nan")), s


# Its element update in C (FusedRule.c_source), built into the C step by kernels/cpu.py.
_C_UPDATE = r"""
static inline __attribute__((always_inline)) void muon_loop(float *restrict d, const float *restrict g_in,
                                                           float *restrict s, int n, const float *c, int nesterov) {
    const float omm = c[2], momentum = c[3];
    for (int i = 0; i < n; i++) {
        float g = g_in[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        float s_new = s[i] + omm * (g - s[i]);
        int ok = fin & is_finite(s_new);
        float si = keep_if(ok, s_new, s[i]);
        s[i] = si;
        float di = nesterov ? g + momentum * (si - g) : si;
        d[i] = ok ? di : __builtin_nanf("");
    }
}

ONE_STATE_BY_OPTION(muon, muon_loop)
"""


MUON = FusedRule(
    "muon",
    ("momentum_buffer",),
    (True,),
    MUON_COEFS,
    muon_coefficients,
    option="nesterov",
    triton_update=triton_jit(muon_tile_update),
    c_source=_C_UPDATE,
    c_name="muon",
    output="direction",
)
