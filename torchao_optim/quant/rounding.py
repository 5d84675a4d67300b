"""Stochastic rounding of fp32 values to bf16, reproducible and the same on every executor.

A bf16 parameter updated in fp32 and rounded to nearest loses every update below half its ulp (2**-8 of its
magnitude): a long run of small updates never moves it. Stochastic rounding rounds up with probability equal
to the fraction of an ulp the value lies above the lower bf16 neighbour, so the expected result is the fp32
value and small updates accumulate on average.

The random bits are a hash, not a generator: for parameter ``index`` (its position in the optimizer) at step
``step``, element ``i`` gets the top 16 bits of ``mix32(key ^ i)`` with ``key = mix32(mix32(index) ^ step)``.
So a run is reproducible, a resumed run rounds exactly as an uninterrupted one (the step is in the
checkpoint), no generator state needs saving, and the compiled path and the fused kernels
(:mod:`torchao_optim.kernels.triton_rounding`) draw the same bits. ``mix32`` is a xorshift-multiply hash
on 32-bit values; here it is computed in int64 with masks, with multipliers below 2**31 so no product
overflows; the kernels compute it in uint32, which wraps to the same values. Element indexes are taken
modulo 2**32.

The rounding itself works on the fp32 bit pattern: add the 16 random bits to it and keep the top 16 bits,
which are the bf16 pattern (no float conversion, so subnormals survive on every backend).
For a negative value the pattern's magnitude part grows just as for a positive one, so the rounding is away
from zero with the right probability either way; values already representable in bf16 are unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["MIX_MULTIPLIERS", "mix32", "rounding_key", "stochastic_round_bf16"]

MIX_MULTIPLIERS = (0x7FEB352D, 0x5BD1E995)  # odd, below 2**31
_MASK = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of int64 values in [0, 2**32), returned in the same range."""
    x = x ^ (x >> 16)
    x = (x * MIX_MULTIPLIERS[0]) & _MASK
    x = x ^ (x >> 15)
    x = (x * MIX_MULTIPLIERS[1]) & _MASK
    return x ^ (x >> 16)


def rounding_key(index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The per-(parameter, step) key (int64 in [0, 2**32)): ``index`` the parameter's position in the
    optimizer, ``step`` its step count (float or int tensor of integral values); any broadcastable shapes."""
    return mix32(mix32(index.to(torch.int64) & _MASK) ^ (step.to(torch.int64) & _MASK))


def stochastic_round_bf16(x: torch.Tensor, key: torch.Tensor, offset=0) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically with the random bits of ``key`` (0-d int64, see
    :func:`rounding_key`) for element ``offset + i`` of ``x`` in row-major order (``offset``: where ``x``
    starts in its whole parameter, for a shard). Unbiased: ``E[result] = x``."""
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape) + offset
    noise = (mix32(key ^ (index & _MASK)) >> 16).to(torch.int32)
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + noise) >> 16).to(torch.int16).view(torch.bfloat16)  # the top half is the bf16 pattern
