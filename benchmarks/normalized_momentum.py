"""AdamW whose first state holds ``exp_avg / (sqrt(exp_avg_sq) + eps)`` instead of ``exp_avg``: a candidate for
closing 4-bit state's gap to fp32 AdamW (benchmarks/README.md, "Language-model quality on a GPU").

Why: a block-wise code's error is a share of its block's absmax, and Adam divides ``exp_avg``'s error by the
element's own ``sqrt(exp_avg_sq)``; in a block whose elements' scales differ widely (one row of an attention output
projection spans heads of different scales), the small-scale elements' steps are mostly that error. Stored
normalized, every element's value is about its own step's size (at most about 1.2 with betas (0.9, 0.95)), so the
error of each step is a share of the block's largest *step*, not of its largest moment.

The rule: at each step ``exp_avg`` is decoded as ``r * (sqrt(v) + eps)`` from the stored ``r`` and ``v`` (the
decoded ``exp_avg_sq`` the element's ``r`` was normalized by last step, up to the rounding of ``v``'s code), Adam's
update runs as usual, and ``r = exp_avg / (sqrt(v) + eps)`` is stored with the new ``v``. Same state bytes as the
format's; every other part (codes, blocks, fused kernels) is the format's own.

Measured (benchmarks/README.md): with 4-bit codes it trains worse than ``"4bit"``, on ``gpt350m`` with every
``exp_avg_sq`` format tried and on the CPU main job with every ``exp_avg`` map tried and with ``r`` taken over the
rounded ``exp_avg_sq`` (:class:`AdamWNormalizedRounded`); with 8-bit codes it trains like fp32. The library does not
use it.

Loaded by ``benchmark_convergence.py --formats_from benchmarks/normalized_momentum.py``, it registers, for the
benchmark only, this optimizer with the state formats of :data:`VARIANTS` (the library's, and variants from
``fourbit_variants.py``), and the rounded one with those of :data:`ROUNDED`. The state's ``exp_avg`` is ``r``, not
the moment: a checkpoint of these optimizers is not a torch.optim one.
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


def normalized_update(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    max_exp_avg_sq,
    coefs,
    *,
    amsgrad,
    rounded=False,
    **options,
):
    """The compiled path's update (plain tensor code, any state format); ``exp_avg`` holds ``r``. ``rounded``: ``r``
    is taken over the square root of ``exp_avg_sq`` as its new code decodes (written first and read back), the value
    the next step rebuilds ``exp_avg`` with, instead of the value before rounding. ``options``: ``adam_update``'s."""
    if amsgrad:
        raise ValueError("the normalized-momentum variant does not take amsgrad")
    eps = coefs[6]
    v = exp_avg_sq * 1.0
    m = exp_avg * (sqrt_rn(v) + eps)
    # Adam's own update on the rebuilt moment: m and v become the new moments (a skipped element's stay)
    adam_update(param, grad, m, v, None, coefs, amsgrad=False, **options)
    exp_avg_sq.copy_(v)
    scale = sqrt_rn(exp_avg_sq * 1.0 if rounded else v) + eps
    exp_avg.copy_(torch.where(scale > 0, m / scale, 0.0))


def normalized_tile_update(p, g, r, v, coefs, DECOUPLED: tl.constexpr, PTX: tl.constexpr):
    """:func:`normalized_update` on a tile of the two-state Triton kernel, around Adam's own tile update: returns
    ``(p, r, v)``."""
    step_size, inv_bc2, wd, one_minus_beta1, beta2, one_minus_beta2, eps = coefs
    m = r * (tl.sqrt_rn(v) + eps)
    p, m, v = adam_tile_update(p, g, m, v, coefs, DECOUPLED, PTX)
    scale = tl.sqrt_rn(v) + eps
    r = tl.where(scale > 0, m / scale, 0.0)
    return p, r, v


AdamWNormalized = optimizers.adamw_variant(
    "AdamWNormalized",
    "adam_normalized",
    normalized_update,
    normalized_tile_update,
    "``torchao_optim.AdamW`` with ``exp_avg`` stored normalized (this module's docstring).",
)


def rounded_normalized_update(*args, **kwargs):
    """:func:`normalized_update` with ``rounded=True``."""
    return normalized_update(*args, rounded=True, **kwargs)


class AdamWNormalizedRounded(AdamWNormalized):
    """:class:`AdamWNormalized` with ``r`` taken over the rounded ``exp_avg_sq`` (:func:`normalized_update`), so that
    the next step rebuilds ``exp_avg`` with the same square root it was divided by. The fused kernels encode
    ``exp_avg_sq`` after the element update, so this variant takes the compiled path (``fused=False``)."""

    update_fn = staticmethod(rounded_normalized_update)

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, fused=False, **kwargs)


VARIANTS = {
    "AdamW4bit-nm": "4bit",
    "AdamW4bit-nm-lin": "4bit_lin",
    "AdamW4bit-nm-bal": "4bit_bal",
    "AdamW4bit-nm-vsq": "4bit_vsq",
    "AdamW4bit-nm-lin-vsq": "4bit_lin_vsq",
    "AdamW4bit-nm-vdyn": "4bit_vdyn",
    "AdamW4bit-nm-rank1": "4bit_rank1",
    "AdamW4bit-nm-v8": "m4v8",  # the ratio's codes as "4bit"'s exp_avg, exp_avg_sq on the 8-bit map (compiled path)
    "AdamW8bit-nm": "dtq8",
}
ROUNDED = {"AdamW4bit-nmq": "4bit", "AdamW4bit-nmq-vsq": "4bit_vsq"}  # AdamWNormalizedRounded, compiled path

optimizers.register_ours(VARIANTS, AdamWNormalized, "exp_avg stored over sqrt(exp_avg_sq)")
optimizers.register_ours(
    ROUNDED, AdamWNormalizedRounded, "exp_avg stored over the rounded sqrt(exp_avg_sq) (compiled path)"
)
