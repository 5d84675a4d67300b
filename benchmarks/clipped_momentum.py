"""AdamW whose decoded ``exp_avg`` is held to Adam's own bound before each step: a candidate for closing 4-bit
state's gap to fp32 AdamW (benchmarks/README.md, "Language-model quality on a GPU").

The bound: with ``beta1**2 < beta2``, Adam's exact moments satisfy ``|m| <= C * sqrt(v)`` at every step and element,
``C = (1 - beta1) / sqrt((1 - beta2) * (1 - beta1**2 / beta2))`` (1.165 for betas (0.9, 0.95), 7.27 for (0.9,
0.999)). By Cauchy-Schwarz on the two recursions: if ``|m| <= C sqrt(v)``, then ``|beta1 m + (1 - beta1) g| <=
beta1 C sqrt(v) + (1 - beta1) |g| <= sqrt(beta1**2 C**2 / beta2 + (1 - beta1)**2 / (1 - beta2)) * sqrt(beta2 v + (1
- beta2) g**2)``, and the first root is ``C``; both moments start at 0. So the update ``m / sqrt(v)`` of exact state
is never larger than ``C`` (before bias correction).

Quantized state breaks it where it hurts: a block-wise code's error is a share of its *block's* absmax, and Adam
divides ``exp_avg``'s error by the element's own ``sqrt(exp_avg_sq)``, so an element whose second moment is small
beside its block's (one row of an attention output projection spans heads of different scales) can take a step made
mostly of ``exp_avg``'s rounding error. Clamping the decoded ``exp_avg`` to ``[-C sqrt(v), C sqrt(v)]``, with ``v``
the decoded ``exp_avg_sq``, removes any error beyond what exact state could hold; by the recursion above the new
moments then keep the bound, so nothing else changes. The more accurate the decoded ``exp_avg_sq`` (rank-1 scales,
the square map), the tighter the clamp: the variants pair it with those.

Same state bytes as the format's; the codes, blocks and fused kernels are the format's own. Loaded by
``benchmark_convergence.py --formats_from benchmarks/clipped_momentum.py`` (or ``state_error.py``), it registers,
for the benchmark only, this optimizer with the state formats of :data:`VARIANTS`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import fourbit_variants  # noqa: E402,F401  (registers the variant formats VARIANTS names)
import optimizers  # noqa: E402

from torchao_optim.rules.adam import adam_tile_update, adam_update  # noqa: E402
from torchao_optim.rules.base import sqrt_rn  # noqa: E402

if TYPE_CHECKING:
    import triton.language as tl


def moment_bound(one_minus_beta1: torch.Tensor, beta2: torch.Tensor) -> torch.Tensor:
    """``C`` of this module's docstring from the coefficient row's ``1 - beta1`` and ``beta2`` (tensors); infinite
    (no clamp) where ``beta1**2 >= beta2``."""
    beta1 = 1 - one_minus_beta1
    room = 1 - beta1 * beta1 / beta2
    c = one_minus_beta1 / ((1 - beta2) * room.clamp_min(1e-30)).sqrt()
    return torch.where(room > 0, c, torch.inf)


def clipped_update(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    max_exp_avg_sq,
    coefs,
    *,
    amsgrad,
    **options,
):
    """The compiled path's update (plain tensor code, any state format): Adam's, on ``exp_avg`` clamped to
    ``C * sqrt(exp_avg_sq)`` as decoded. ``options``: ``adam_update``'s."""
    if amsgrad:
        raise ValueError("the clipped-momentum variant does not take amsgrad")
    v = exp_avg_sq * 1.0
    bound = moment_bound(coefs[3].double(), coefs[4].double()).to(v.dtype) * sqrt_rn(v)
    m = torch.minimum(torch.maximum(exp_avg * 1.0, -bound), bound)
    adam_update(param, grad, m, v, None, coefs, amsgrad=False, **options)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


def clipped_tile_update(p, g, m, v, coefs, DECOUPLED: tl.constexpr, PTX: tl.constexpr):
    """:func:`clipped_update` on a tile of the two-state Triton kernel, around Adam's own tile update: returns
    ``(p, m, v)``."""
    step_size, inv_bc2, wd, one_minus_beta1, beta2, one_minus_beta2, eps = coefs
    beta1 = 1.0 - one_minus_beta1
    room = 1.0 - beta1 * beta1 / beta2
    c = tl.where(room > 0, one_minus_beta1 / tl.sqrt_rn(one_minus_beta2 * tl.maximum(room, 1e-30)), float("inf"))
    bound = c * tl.sqrt_rn(v)
    m = tl.minimum(tl.maximum(m, -bound), bound)
    return adam_tile_update(p, g, m, v, coefs, DECOUPLED, PTX)


AdamWClipped = optimizers.adamw_variant(
    "AdamWClipped",
    "adam_clipped",
    clipped_update,
    clipped_tile_update,
    "``torchao_optim.AdamW`` with the decoded ``exp_avg`` held to Adam's bound (this module's docstring).",
)


VARIANTS = {
    "AdamW4bit-clip": "4bit",
    "AdamW4bit-clip-rank1": "4bit_rank1",
    "AdamW4bit-clip-vsq": "4bit_vsq",
    "AdamW4bit-clip-dyn": "4bit_dyn",
    "AdamW8bit-clip": "dtq8",
}

optimizers.register_ours(VARIANTS, AdamWClipped, "exp_avg held to Adam's bound C sqrt(exp_avg_sq)")
