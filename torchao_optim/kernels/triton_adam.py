"""Multi-tensor Triton kernels for the Adam/AdamW step on CUDA: one launch per parameter group.

``torch.compile`` already fuses one parameter's dequantize -> update -> requantize into one kernel; what it
cannot do cheaply is a group of parameters of many shapes in one launch. These kernels take a table of
pointers (one row per parameter) and a map from program to (parameter, block), so a whole group is one
launch whatever its shapes. Each program holds one quantization block in registers: it reads the
parameter, gradient and both codes once, and writes them once.

The math is the same as :func:`torchao_optim.optim.update.adam_update` (the compiled path, which every
format has); the nearest-code search is the arithmetic one of :func:`torchao_optim.quant.quantize_nearest`.
This module imports Triton; import it only where Triton and a CUDA device are available.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchao_optim.quant.dynamic_map import DynamicMapSpec

# Layout of a map's constant table (fp32): sorted values, magnitudes by rank, then per-decade constants.
TABLE_SIZE = 544
VAL = tl.constexpr(0)
MAG = tl.constexpr(256)
LOWER = tl.constexpr(512)
INV_STEP = tl.constexpr(520)
LAST = tl.constexpr(528)
FIRST = tl.constexpr(536)


def map_table(spec: DynamicMapSpec, device) -> torch.Tensor:
    """The constants the kernels need about one dynamic map, packed as above."""
    t = torch.zeros(TABLE_SIZE, dtype=torch.float32)
    for offset, values in ((VAL, spec.table), (MAG, spec.magnitudes), (LOWER, spec.lower),
                           (INV_STEP, spec.inv_step), (LAST, [c - 1 for c in spec.counts]), (FIRST, spec.first_rank)):
        offset = offset.value
        t[offset : offset + len(values)] = torch.tensor(values, dtype=torch.float32)
    return t.to(device)


@triton.jit
def _nearest_code(y, tab, NDEC: tl.constexpr, MAXRANK: tl.constexpr, ZERO: tl.constexpr, SIGNED: tl.constexpr):
    """Code of the 8-bit dynamic-map value nearest to each y in [-1, 1], with no table search.

    In decade d the map has n = 2**d (signed) or 2**(d+1) (unsigned) points at the midpoints of n equal
    steps, so in units of the step (``pos``) the points sit at k + 0.5 and the nearest one inside the decade
    is floor(pos). Only two neighbours outside the decade can be nearer: the top of the decade below
    (at pos -0.1, or 0.0 itself at pos -n/9 for the lowest decade), nearer when pos is under the midpoint
    between them; and 1.0 (at pos n in the top decade), nearer when pos >= n - 0.25. Decisions are made on
    the rounded ``pos``, so only values within fp32 rounding of a midpoint can round the other way.
    """
    C: tl.constexpr = 0 if SIGNED else 1
    a = tl.abs(y)
    d = tl.zeros(y.shape, dtype=tl.int32)
    for j in tl.static_range(1, NDEC):
        d += (a >= tl.load(tab + LOWER + j)).to(tl.int32)
    n_int = tl.full(y.shape, 1, tl.int32) << (d + C)
    n = n_int.to(tl.float32)
    pos = (a - tl.load(tab + LOWER + d)) * tl.load(tab + INV_STEP + d)
    k = tl.minimum(tl.maximum(tl.floor(pos), 0.0), n - 1.0).to(tl.int32)
    rank = n_int - C + k
    # the neighbour below: the decade below's top point, or 0.0 below the lowest decade
    lowest: tl.constexpr = (0.5 - (1.0 + C) / 9.0) / 2.0
    rank = tl.where(pos < tl.where(d == 0, lowest, 0.2), rank - 1, rank)
    # 1.0 above the top decade (the signed map has no -1.0)
    to_one = (d == NDEC - 1) & (pos >= n - 0.25)
    if SIGNED:
        to_one = to_one & (y >= 0)
    rank = tl.where(to_one, MAXRANK, rank)
    if SIGNED:
        rank = tl.where(y < 0, ZERO - rank, ZERO + rank)
    else:  # as quantize_nearest: a positive exp_avg_sq is never rounded to 0
        rank = tl.where((a > 0) & (rank == 0), 1, rank)
    return rank.to(tl.uint8)


@triton.jit
def _requantize(x, mask, tab, NDEC: tl.constexpr, MAXRANK: tl.constexpr, ZERO: tl.constexpr, SIGNED: tl.constexpr):
    """(codes, absmax) of blocks held in registers, one block per row of ``x`` (ROWS, BLOCK); absmax over
    finite values, NaN -> 0, Inf saturates."""
    finite = (x == x) & (tl.abs(x) != float("inf"))
    absmax = tl.max(tl.where(mask & finite, tl.abs(x), 0.0), axis=1)  # (ROWS,)
    y = x / tl.where(absmax > 0, absmax, 1.0)[:, None]
    y = tl.minimum(tl.maximum(tl.where(x == x, y, 0.0), -1.0), 1.0)
    return _nearest_code(y, tab, NDEC, MAXRANK, ZERO, SIGNED), absmax


@triton.jit
def _adam_math(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay,
               DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr):
    """adam_update's arithmetic on fp32 values; non-finite gradient elements are skipped."""
    if MAXIMIZE:
        g = -g
    finite = (g == g) & (tl.abs(g) != float("inf"))
    g = tl.where(finite, g, 0.0)
    if DECOUPLED:
        p_decayed = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
        p_decayed = p
    m_new = tl.where(finite, m + (1 - beta1) * (g - m), m)
    v_new = tl.where(finite, v * beta2 + (1 - beta2) * g * g, v)
    bias_correction1 = 1 - tl.exp2(step * tl.log2(beta1))
    bias_correction2_sqrt = tl.sqrt(1 - tl.exp2(step * tl.log2(beta2)))
    denom = tl.sqrt(v_new) / bias_correction2_sqrt + eps
    p_new = tl.where(finite, p_decayed - (lr / bias_correction1) * m_new / denom, p)
    return p_new, m_new, v_new


@triton.jit
def adam_dtq8_kernel(
    ptrs,  # int64 (n_tensors, 5): param, exp_avg codes, exp_avg absmax, exp_avg_sq codes, exp_avg_sq absmax
    grad_ptrs,  # int64 (n_tensors,)
    numels,  # int64 (n_tensors,)
    steps,  # fp32 (n_tensors,): steps taken before this one
    prog_tensor,  # int32 (n_programs,): which tensor each program updates
    prog_block,  # int32 (n_programs,): its first block; a program updates ROWS consecutive blocks
    tab_s,  # fp32 constants of the signed map (exp_avg)
    tab_u,  # fp32 constants of the unsigned map (exp_avg_sq)
    lr, beta1, beta2, eps, weight_decay,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
    S_NDEC: tl.constexpr, S_MAXRANK: tl.constexpr, S_ZERO: tl.constexpr,
    U_NDEC: tl.constexpr, U_MAXRANK: tl.constexpr, U_ZERO: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    row = ptrs + t * 5
    p_ptr = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE))
    g_ptr = tl.load(grad_ptrs + t).to(tl.pointer_type(GRAD_DTYPE))
    mc_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
    ma_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    vc_ptr = tl.load(row + 3).to(tl.pointer_type(tl.uint8))
    va_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    numel = tl.load(numels + t)
    blocks = tl.load(prog_block + pid).to(tl.int64) + tl.arange(0, ROWS)  # (ROWS,)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK)
    mask = offs < numel
    row_mask = blocks * BLOCK < numel

    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m_scale = tl.load(ma_ptr + blocks, mask=row_mask, other=0.0)[:, None]
    v_scale = tl.load(va_ptr + blocks, mask=row_mask, other=0.0)[:, None]
    m = tl.load(tab_s + VAL + tl.load(mc_ptr + offs, mask=mask, other=S_ZERO).to(tl.int32)) * m_scale
    v = tl.load(tab_u + VAL + tl.load(vc_ptr + offs, mask=mask, other=U_ZERO).to(tl.int32)) * v_scale
    step = tl.load(steps + t) + 1.0
    p, m, v = _adam_math(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, DECOUPLED, MAXIMIZE)

    m_codes, m_absmax = _requantize(m, mask, tab_s, S_NDEC, S_MAXRANK, S_ZERO, True)
    v_codes, v_absmax = _requantize(v, mask, tab_u, U_NDEC, U_MAXRANK, U_ZERO, False)
    tl.store(p_ptr + offs, p.to(PARAM_DTYPE), mask=mask)
    tl.store(mc_ptr + offs, m_codes, mask=mask)
    tl.store(vc_ptr + offs, v_codes, mask=mask)
    tl.store(ma_ptr + blocks, m_absmax, mask=row_mask)
    tl.store(va_ptr + blocks, v_absmax, mask=row_mask)


@triton.jit
def adam_fp32_kernel(
    ptrs,  # int64 (n_tensors, 3): param, exp_avg, exp_avg_sq (fp32 states)
    grad_ptrs,  # int64 (n_tensors,)
    numels, steps, prog_tensor, prog_block,
    lr, beta1, beta2, eps, weight_decay,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
    DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    blk = tl.load(prog_block + pid).to(tl.int64)
    row = ptrs + t * 3
    p_ptr = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE))
    g_ptr = tl.load(grad_ptrs + t).to(tl.pointer_type(GRAD_DTYPE))
    m_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    step = tl.load(steps + t) + 1.0
    p, m, v = _adam_math(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, DECOUPLED, MAXIMIZE)
    tl.store(p_ptr + offs, p.to(PARAM_DTYPE), mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
