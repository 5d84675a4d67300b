"""The multi-tensor one-state kernel on CUDA (SGD with momentum, Lion, Adagrad, RMSprop): one launch per plan.

The twin of :mod:`torchao_optim.kernels.triton_adam` for rules that carry one state (SGD's momentum buffer,
Lion's ``exp_avg``): a plan's tensors share a device, param and grad dtypes and the state's layout; the kernel
takes a table of pointers (param, the state's codes or fp32 values, its scales: one row per tensor) and a map
from program to (tensor, first tile, number of tiles); each program walks its consecutive register tiles, and
reads and writes everything once. Reading and writing the state is ``triton_codec``'s, so the kernel knows no
format.

The arithmetic is the rule's: its element update, a ``@triton.jit`` function the kernel takes as the constexpr
``UPDATE`` (``FusedRule.triton_update``, written in the rule's file: ``rules.sgd.sgd_tile_update``,
``rules.lion.lion_tile_update``, ...), inlined where it is called, with the rule's setting ``OPTION`` (SGD's:
nesterov) and the tensor's row of the rule's coefficients, read from a device table (a tensor lr needs no host
sync). This module imports Triton; import it only where Triton is available.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torchao_optim.kernels.triton_adam import _codes_pointer, _round_key, as_fp32, load_values, store_param
from torchao_optim.kernels.triton_codec import load_codes, load_state, store_state, tile_offsets

N_COEFS = 4  # the columns of a tensor's coefficient row this kernel reads (a rule it runs has as many)


@triton.jit
def _momentum_tile(
    p_base,
    g_base,
    sc,
    ss,
    blk,
    local,
    n_valid,
    coefs,
    key,
    offset,
    s_values,
    s_level1,
    s_level2,
    PARAM_DTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    UPDATE: tl.constexpr,
    OPTION: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SR: tl.constexpr,
    S_QUANT: tl.constexpr,
    S_BITS: tl.constexpr,
    PTX: tl.constexpr,
    S_SIGNED: tl.constexpr,
    S_FLAT: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    WHOLE: tl.constexpr = False,
    S_SCALE: tl.constexpr = 0,
    rows=0,
    cols=0,
    s_new=0,
):
    """The update of tile ``blk`` (its first ``n_valid`` elements): loads, the rule's arithmetic (``UPDATE`` with its
    ``OPTION``), stores. ``coefs``: the tensor's four coefficients, loaded once per program. ``WHOLE``: the tile is
    whole (as in ``adam_kernel``'s loop: codes and bf16 values move in words). ``S_SCALE``: the state's scales are over
    ``rows`` rows of ``cols``: rank-1 (1), decoded with its maxima and encoded with the new ones at ``s_new``, or
    factored (2), decoded from its means, no codes written."""
    start = blk * BLOCK
    p = as_fp32(load_values(p_base, start, local, n_valid, PARAM_DTYPE, BLOCK, VEC, WHOLE), PARAM_DTYPE, WHOLE)
    g = as_fp32(load_values(g_base, start, local, n_valid, GRAD_DTYPE, BLOCK, VEC, WHOLE), GRAD_DTYPE, WHOLE)
    raw, scale = load_codes(
        sc, ss, start, blk, local, n_valid, S_QUANT, S_BITS, QBLOCK, BLOCK, VEC, WHOLE, S_SCALE, rows, cols
    )
    s = load_state(raw, scale, s_values, S_QUANT, S_BITS, QBLOCK, BLOCK, VEC, WHOLE, S_SCALE)

    if MAXIMIZE:
        g = -g
    p, s = UPDATE(p, g, s, coefs, OPTION, PTX)

    store_param(p_base, start, local, n_valid, p, key, offset, PARAM_DTYPE, SR, BLOCK, VEC, WHOLE, PTX)
    store_state(
        s,
        sc,
        s_new if S_SCALE else ss,
        start,
        blk,
        local,
        n_valid,
        s_level1,
        s_level2,
        S_QUANT,
        S_BITS,
        QBLOCK,
        BLOCK,
        VEC,
        PTX,
        S_SIGNED,
        S_FLAT,
        WHOLE,
        S_SCALE,
        rows,
        cols,
    )


@triton.jit
def momentum_kernel(
    ptrs,  # int64 (n_tensors, 3): param, the state's codes (or fp32 values), its absmax
    grad_ptrs,  # int64 (n_tensors,)
    numels,  # int64 (n_tensors,)
    coefs,  # fp32 (n_tensors, 4): the rule's coefficient rows (rules.sgd.SGD_COEFS, rules.lion.LION_COEFS)
    prog_tensor,  # int32 (n_programs,): which tensor each program updates
    prog_block,  # int32 (n_programs,): its first tile
    prog_tiles,  # int32 (n_programs,): how many consecutive tiles it updates (the tensor's end may come first)
    steps,  # fp32 (n_tensors,): the step counts, already advanced
    round_info,  # int64 (n_tensors, 2): position in the optimizer, element offset (read with SR only)
    s_values,
    s_level1,
    s_level2,  # the state's codebook and encoder tables (level1 by bits, level2 keyed)
    rank1,  # int64 (n_tensors, 2) with rank-1 scales (None without): the rows of the tensor's matrix, the new maxima
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    ALIGNED: tl.constexpr,
    UPDATE: tl.constexpr,  # the rule's element update (FusedRule.triton_update): (p, g, s, coefs, OPTION, PTX)
    OPTION: tl.constexpr,  # the rule's one setting (FusedRule.option; SGD's: nesterov)
    MAXIMIZE: tl.constexpr,
    SR: tl.constexpr,
    S_QUANT: tl.constexpr,
    S_BITS: tl.constexpr,
    PTX: tl.constexpr,
    S_SIGNED: tl.constexpr,
    S_FLAT: tl.constexpr = 0,  # the encoder's one-load shift (0: two loads; kernels.tables.flat_shift)
    S_SCALE: tl.constexpr = 0,  # the state's kind of scales (its index in SCALE_KINDS): 0 block, 1 rank-1, 2 factored
):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    row = ptrs + t * 3
    c = coefs + t * 4
    cf = (tl.load(c + 0), tl.load(c + 1), tl.load(c + 2), tl.load(c + 3))
    key, offset = _round_key(round_info, steps, t, SR)
    numel = tl.load(numels + t)
    first = tl.load(prog_block + pid).to(tl.int64)
    count = tl.load(prog_tiles + pid)
    n_full = tl.minimum((numel - first * BLOCK) // BLOCK, count)  # whole tiles, then at most one partial
    has_tail = (n_full < count) & (first * BLOCK + n_full * BLOCK < numel)
    local = tile_offsets(BLOCK, VEC)
    p_base = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE))
    g_base = tl.load(grad_ptrs + t).to(tl.pointer_type(GRAD_DTYPE))
    sc = _codes_pointer(tl.load(row + 1), S_QUANT, ALIGNED, S_SCALE)
    ss = tl.load(row + 2)
    if S_SCALE:  # as in adam_kernel
        rows = tl.load(rank1 + 2 * t)
        cols = numel // rows
        s_new = tl.load(rank1 + 2 * t + 1)
    else:
        rows, cols, s_new = 0, 0, 0
    if ALIGNED:  # as in adam_kernel: 16-byte aligned tables give vector loads and stores
        p_base, g_base = tl.multiple_of(p_base, 16), tl.multiple_of(g_base, 16)
    for i in range(0, n_full):
        _momentum_tile(
            p_base,
            g_base,
            sc,
            ss,
            first + i,
            local,
            BLOCK,
            cf,
            key,
            offset,
            s_values,
            s_level1,
            s_level2,
            PARAM_DTYPE,
            QBLOCK,
            BLOCK,
            VEC,
            UPDATE,
            OPTION,
            MAXIMIZE,
            SR,
            S_QUANT,
            S_BITS,
            PTX,
            S_SIGNED,
            S_FLAT,
            GRAD_DTYPE,
            True,
            S_SCALE,
            rows,
            cols,
            s_new,
        )
    if has_tail:
        blk = first + n_full
        _momentum_tile(
            p_base,
            g_base,
            sc,
            ss,
            blk,
            local,
            numel - blk * BLOCK,
            cf,
            key,
            offset,
            s_values,
            s_level1,
            s_level2,
            PARAM_DTYPE,
            QBLOCK,
            BLOCK,
            VEC,
            UPDATE,
            OPTION,
            MAXIMIZE,
            SR,
            S_QUANT,
            S_BITS,
            PTX,
            S_SIGNED,
            S_FLAT,
            GRAD_DTYPE,
            False,
            S_SCALE,
            rows,
            cols,
            s_new,
        )
