"""Stochastic rounding to bf16 in Triton: :mod:`torchao_optim.quant.rounding`'s hash and rounding, bit for bit.

The hash runs in uint32, whose products wrap modulo 2**32 to the values the torch version computes in int64
with masks. This module imports Triton; import it only where Triton is available.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    """``quant.rounding.mix32`` on uint32 values."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def rounding_key(index, step):
    """``quant.rounding.rounding_key`` (uint32) of a parameter's position and its (fp32) step count."""
    return mix32(mix32(index.to(tl.uint32)) ^ step.to(tl.int64).to(tl.uint32))


@triton.jit
def stochastic_round_bf16(x, key, index):
    """``x`` (fp32) rounded to bf16 with ``key``'s random bits for elements ``index`` (int64, row-major)."""
    noise = (mix32(key ^ index.to(tl.uint32)) >> 16).to(tl.int32)
    bits = x.to(tl.int32, bitcast=True)
    # the top half of the pattern is the bf16 pattern: no float conversion (which could flush subnormals)
    return ((bits + noise) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, param_index, steps, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = rounding_key(param_index, tl.load(steps))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, stochastic_round_bf16(x, key, offs), mask=mask)


def stochastic_round_bf16_triton(x, param_index: int, step):
    """``quant.rounding.stochastic_round_bf16(x, rounding_key(param_index, step))`` through the kernels' code
    (for tests): ``x`` fp32 contiguous, ``step`` a one-element fp32 tensor, both on a device the kernels run on."""
    import torch

    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    block = 1 << 14
    _round_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), param_index, step, BLOCK=block)
    return out
