"""The multi-tensor Adam/AdamW kernel on CUDA: one launch updates every tensor of a plan, whatever its shape.

A plan's tensors share a device, param and grad dtypes and a state layout per moment (8- or 4-bit codes of
one codebook, or plain fp32). The kernel takes a table of pointers (one row per tensor) and a map from
program to (tensor, first block); each program holds ``ROWS`` quantization blocks in registers, reads the
parameter, the gradient and both states once and writes them once. How a state is read and written is
``triton_codec``'s, specialized by constexpr: the kernel knows no format.

The arithmetic is :func:`torchao_optim.optim.update.adam_update`'s, with the per-step coefficients of
:func:`torchao_optim.optim.update.adam_coefficients` read from a device table (so a tensor lr needs no
host sync). This module imports Triton; import it only where Triton is available.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchao_optim.kernels.triton_codec import load_state, store_state

TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def adam_kernel(
    ptrs,  # int64 (n_tensors, 5): param, exp_avg codes (or fp32 values), its absmax, the same for exp_avg_sq
    grad_ptrs,  # int64 (n_tensors,)
    numels,  # int64 (n_tensors,)
    coefs,  # fp32 (n_tensors, 7): the columns of optim.update.COEFS
    prog_tensor,  # int32 (n_programs,): which tensor each program updates
    prog_block,  # int32 (n_programs,): its first block; a program updates ROWS consecutive blocks
    m_values, m_level1, m_level2,  # exp_avg's codebook and encoder tables (level2 with bounds)
    v_values, v_level1, v_level2,  # exp_avg_sq's
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
    M_QUANT: tl.constexpr, M_BITS: tl.constexpr, V_QUANT: tl.constexpr, V_BITS: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    row = ptrs + t * 5
    c = coefs + t * 7
    numel = tl.load(numels + t)
    first_block = tl.load(prog_block + pid).to(tl.int64)
    start = first_block * BLOCK
    # offsets inside the tile, from the program's first element: constants per thread
    local = tl.arange(0, ROWS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK)
    mask = local < numel - start
    row_mask = tl.arange(0, ROWS) * BLOCK < numel - start
    p_ptr = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE)) + start
    g_ptr = tl.load(grad_ptrs + t).to(tl.pointer_type(GRAD_DTYPE)) + start
    mc, ms, vc, vs = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)

    p = tl.load(p_ptr + local, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + local, mask=mask, other=0.0).to(tl.float32)
    m = load_state(mc, ms, start, first_block, local, mask, row_mask, m_values, M_QUANT, M_BITS, ROWS)
    v = load_state(vc, vs, start, first_block, local, mask, row_mask, v_values, V_QUANT, V_BITS, ROWS)
    step_size, inv_bc2, wd = tl.load(c + 0), tl.load(c + 1), tl.load(c + 2)
    one_minus_beta1, beta2, one_minus_beta2, eps = tl.load(c + 3), tl.load(c + 4), tl.load(c + 5), tl.load(c + 6)

    if MAXIMIZE:
        g = -g
    finite = tl.abs(g) < float("inf")  # a non-finite gradient element is skipped (NaN is not < inf)
    g = tl.where(finite, g, 0.0)
    if DECOUPLED:
        p_decayed = p * wd
    else:
        g = g + wd * p
        p_decayed = p
    m_new = m + one_minus_beta1 * (g - m)
    v_new = v * beta2 + one_minus_beta2 * g * g
    # an element whose new moment overflows is skipped too (adam_update says why)
    ok = finite & (tl.abs(m_new) < float("inf")) & (tl.abs(v_new) < float("inf"))
    m = tl.where(ok, m_new, m)
    v = tl.where(ok, v_new, v)
    # fast sqrt and division: the parameter may differ from the compiled path by an ulp of its update;
    # the states, which decide the codes, do not depend on them
    denom = tl.sqrt(v) * inv_bc2 + eps
    p = tl.where(ok, p_decayed - step_size * tl.fdiv(m, denom), p)

    tl.store(p_ptr + local, p.to(PARAM_DTYPE), mask=mask)
    store_state(m, mc, ms, start, first_block, local, mask, row_mask, m_level1, m_level2,
                M_QUANT, M_BITS, ROWS, BLOCK)
    store_state(v, vc, vs, start, first_block, local, mask, row_mask, v_level1, v_level2,
                V_QUANT, V_BITS, ROWS, BLOCK)
