"""Triton building blocks that read and write one optimizer state held as a (ROWS, BLOCK) register tile.

Every state a :class:`~torchao_optim.state.layout.StateLayout` describes goes through these two functions,
specialized at compile time by ``QUANT`` (codebook codes, or a plain fp32 tensor) and ``BITS`` (8, or 4
with two codes per byte). They compute exactly what :mod:`torchao_optim.quant.blockwise` and
:mod:`torchao_optim.quant.codec` compute (the same absmax, the same reciprocal, the same O(1) encoder
over the same tables), so the fused kernels and the compiled path store the same codes for the same
values. Pointers arrive already advanced to the program's first element and block, and ``local`` holds
the tile's offsets from there (compile-time constants per thread: no per-element 64-bit arithmetic).
This module imports Triton; import it only where Triton is available.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def encode(y, level1, level2):
    """Codes (int32) of ``y`` (fp32 in [-1, 1], no NaN): torchao_optim.quant.codec.encode, in Triton.

    ``level2`` is ``BucketTables.level2_with_bounds()``: the candidate and where in the bucket the code
    switches, in one 4-byte load; the switch is decided on the low bits of ``|y|``.
    """
    neg = y < 0
    mag = tl.abs(y).to(tl.int32, bitcast=True)
    entry = tl.load(level1 + (mag >> 23) + tl.where(neg, 128, 0))
    shift = entry & 31
    packed = tl.load(level2 + (entry >> 5) + ((mag & 0x7FFFFF) >> shift))
    low = mag & ((1 << shift) - 1)
    low_plus = (packed >> 8) & 0xFFFFFF
    up = tl.where(neg, low < low_plus, low >= low_plus)
    return (packed & 255) + up.to(tl.int32)


@triton.jit
def load_state(codes, scales, start, first_block, local, mask, row_mask, values,
               QUANT: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr):
    """The state's fp32 values on the tile: ``local`` (ROWS, BLOCK) offsets from element ``start``, whose
    block is ``first_block``. ``codes``/``scales`` are the raw addresses from the pointer table."""
    if QUANT:
        if BITS == 8:
            code = tl.load(codes.to(tl.pointer_type(tl.uint8)) + start + local, mask=mask, other=0).to(tl.int32)
        else:  # element 2i in the low nibble of byte i, 2i + 1 in the high one
            byte = tl.load(codes.to(tl.pointer_type(tl.uint8)) + start // 2 + local // 2, mask=mask, other=0)
            code = (byte.to(tl.int32) >> ((local & 1) * 4)) & 15
        scale = tl.load(scales.to(tl.pointer_type(tl.float32)) + first_block + tl.arange(0, ROWS),
                        mask=row_mask, other=0.0)
        return tl.load(values + code) * scale[:, None]
    else:
        return tl.load(codes.to(tl.pointer_type(tl.float32)) + start + local, mask=mask, other=0.0)


@triton.jit
def store_state(x, codes, scales, start, first_block, local, mask, row_mask, level1, level2,
                QUANT: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Write ``x`` (ROWS, BLOCK fp32, one quantization block per row) back: the absmax of each row and the
    codes of ``x * (1 / absmax)``, or the plain values. ``x`` is finite: the update never produces a
    non-finite state (it skips such elements), so the compiled path's finiteness masks change nothing here."""
    if QUANT:
        absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)  # (ROWS,)
        inv = tl.div_rn(tl.full(absmax.shape, 1.0, tl.float32), tl.where(absmax > 0, absmax, 1.0))
        y = x * inv[:, None]
        code = encode(tl.minimum(tl.maximum(y, -1.0), 1.0), level1, level2)
        if BITS == 8:
            tl.store(codes.to(tl.pointer_type(tl.uint8)) + start + local, code.to(tl.uint8), mask=mask)
        else:
            # past the end of the tensor, the odd element's high nibble is 0, as quant.pack_nibbles writes it
            lo, hi = tl.split(tl.reshape(tl.where(mask, code, 0), (ROWS, BLOCK // 2, 2)))
            byte_local = tl.arange(0, ROWS)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
            byte_mask = tl.max(tl.reshape(mask.to(tl.int32), (ROWS, BLOCK // 2, 2)), axis=2) > 0
            tl.store(codes.to(tl.pointer_type(tl.uint8)) + start // 2 + byte_local, (lo | (hi << 4)).to(tl.uint8),
                     mask=byte_mask)
        tl.store(scales.to(tl.pointer_type(tl.float32)) + first_block + tl.arange(0, ROWS), absmax, mask=row_mask)
    else:
        tl.store(codes.to(tl.pointer_type(tl.float32)) + start + local, x, mask=mask)


@triton.jit
def _encode_kernel(y_ptr, out_ptr, n, level1, level2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, encode(y, level1, level2).to(tl.uint8), mask=mask)


def quantize_nearest_triton(y, codebook, never_zero: bool = False):
    """``torchao_optim.quant.quantize_nearest`` through the kernels' encoder (for tests): uint8 codes of ``y``
    (fp32 in [-1, 1], contiguous, on a device the kernels run on)."""
    import torch

    from torchao_optim.quant import bucket_tables

    tables = bucket_tables(tuple(codebook), never_zero)
    level1, level2 = tables.level1.to(y.device), tables.level2_with_bounds().to(y.device)
    out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    block = 1 << 16
    _encode_kernel[(triton.cdiv(y.numel(), block),)](y, out, y.numel(), level1, level2, BLOCK=block)
    return out
