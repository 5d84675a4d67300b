"""The multi-tensor two-state kernel on CUDA (Adam/AdamW): one launch updates every tensor of a plan, whatever its
shape.

A plan's tensors share a device, param and grad dtypes and a state layout per moment (8- or 4-bit codes of
one codebook, or plain fp32). ``adam_kernel`` takes a table of pointers (one row per tensor) and a map from
program to (tensor, first tile, number of tiles: ``optim.fused.program_map``); each program walks its
consecutive ``BLOCK``-element register tiles of its tensor, each ``BLOCK // QBLOCK`` quantization blocks (one
for 8-bit blocks of 256, two for 4-bit blocks of 128: fixed costs per tile, the loop's and the reductions', are
shared by 8 elements per thread), reading the parameter, the gradient and both states once and writing them
once. With ``PREFETCH`` the loads of the next tile are issued before the current tile is computed, so a program
keeps memory requests in flight while it decodes, updates and encodes. How a state is read and written is
``triton_codec``'s, specialized by constexpr: the kernel knows no format. A factored state (``"factored"``) is read
as its old row and column means and writes no codes; with ``FOLD`` its new values are added into its row and column
sums here, each program walking a strip of tiles down the rows (``optim.fused.strip_map``), so no first pass reads
the gradient before the step (:mod:`~torchao_optim.kernels.triton_rank1` is that pass, for the other plans).

The arithmetic is the rule's: its element update, a ``@triton.jit`` function the kernel takes as the constexpr
``UPDATE`` (``FusedRule.triton_update``, written in the rule's file: Adam's is ``rules.adam.adam_tile_update``),
inlined where it is called, with the rule's setting ``OPTION`` (Adam's: decoupled weight decay). The coefficient rows
it reads are the rule's, written before the launch (Adam's by ``rules.adam.adam_coefs_kernel``, in one small launch).
This module imports Triton; import it only where Triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # Triton >= 3.4 (torch >= 2.11 has 3.6)

from torchao_optim.kernels.triton_codec import (
    FACTORED,
    factored_part,
    load_codes,
    load_state,
    store_state,
    tile_offsets,
    whole_mask,
)
from torchao_optim.kernels.triton_rounding import rounding_key, stochastic_round_bf16

TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
N_COEFS = 7  # the columns of a tensor's coefficient row this kernel reads (a rule it runs has as many)


@triton.jit
def _pairs(base, start, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """The addresses of a tile's 16-bit values (from element ``start``) as 32-bit words of two, each thread's its own
    (runs of ``VEC // 2`` words, as :func:`tile_offsets` gives it runs of ``VEC`` elements)."""
    return base.to(tl.pointer_type(tl.int32)) + (start // BLOCK) * (BLOCK // 2) + tile_offsets(BLOCK // 2, VEC // 2)


@triton.jit
def load_values(
    base,
    start,
    local,
    n_valid,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    WHOLE: tl.constexpr = False,
):
    """A tile of a parameter or gradient of ``DTYPE`` as loaded (its first ``n_valid`` elements): elements, or for
    a whole tile (``WHOLE``) of bf16 values words of two, one per pair of the thread's own elements (element ``2i``
    in the low half): a word's halves become fp32 with a shift and a mask, where a bf16 element alone takes a
    byte permute more. :func:`as_fp32` converts them."""
    if WHOLE and DTYPE == tl.bfloat16:
        return tl.load(_pairs(base, start, BLOCK, VEC), mask=whole_mask(n_valid, BLOCK // 2), other=0)
    else:
        return tl.load(base + start + local, mask=local < n_valid, other=0.0)


@triton.jit
def as_fp32(raw, DTYPE: tl.constexpr, WHOLE: tl.constexpr = False):
    """:func:`load_values`' tile as fp32 values."""
    if WHOLE and DTYPE == tl.bfloat16:
        return tl.interleave((raw << 16).to(tl.float32, bitcast=True), (raw & -65536).to(tl.float32, bitcast=True))
    else:
        return raw.to(tl.float32)


@triton.jit
def store_param(
    p_base,
    start,
    local,
    n_valid,
    p,
    key,
    offset,
    PARAM_DTYPE: tl.constexpr,
    SR: tl.constexpr,
    BLOCK: tl.constexpr = 0,
    VEC: tl.constexpr = 0,
    WHOLE: tl.constexpr = False,
    PTX: tl.constexpr = False,
):
    """Write a tile's fp32 parameter values: rounded to nearest, or (``SR``, bf16 parameters) stochastically
    with ``key`` for elements ``offset + start + local`` of the whole parameter. Rounded to nearest, a whole
    tile of bf16 values is written in words of two, each one conversion (:func:`load_values`)."""
    if SR:
        value = stochastic_round_bf16(p, key, offset + start + local)
        tl.store(p_base + start + local, value, mask=local < n_valid)
    elif WHOLE and PARAM_DTYPE == tl.bfloat16:
        lo, hi = tl.split(tl.reshape(p, (BLOCK // 2, 2)))
        if PTX:
            word = tl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            word = (lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (
                hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
            )
        tl.store(_pairs(p_base, start, BLOCK, VEC), word, mask=whole_mask(n_valid, BLOCK // 2))
    else:
        tl.store(p_base + start + local, p.to(PARAM_DTYPE), mask=local < n_valid)


@triton.jit
def _round_key(round_info, steps, t, SR: tl.constexpr):
    """Tensor ``t``'s rounding key and element offset (zeros without ``SR``); ``steps`` already advanced."""
    if SR:
        key = rounding_key(tl.load(round_info + 2 * t), tl.load(steps + t))
        offset = tl.load(round_info + 2 * t + 1)
    else:
        key = tl.full((), 0, tl.uint32)
        offset = tl.full((), 0, tl.int64)
    return key, offset


@triton.jit
def _codes_pointer(address, QUANT: tl.constexpr, ALIGNED: tl.constexpr, SCALE: tl.constexpr = 0):
    """A state's codes (uint8), or its fp32 values (a plain state; a factored one's columns, ``SCALE``), as a typed
    pointer, declared 16-byte aligned where the plan's addresses are (``ALIGNED``). The hint is set here, on the
    cast itself: a hint on the value this function returns would be lost when the call is inlined. With it, a
    thread's 4-bit codes are the bytes of its own elements, loaded as one vector (without it, a byte per lane and a
    shuffle into place), and a factored state's columns a vector per run of a thread's elements."""
    if QUANT and SCALE != FACTORED:
        ptr = address.to(tl.pointer_type(tl.uint8))
    else:
        ptr = address.to(tl.pointer_type(tl.float32))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _opaque(codes, QUANT: tl.constexpr, PTX: tl.constexpr):
    """Codes (int32) hidden from LLVM behind an empty inline PTX move, which ptxas removes. Codes loaded for the
    next tile are held across the loop's back edge; knowing they are bytes, LLVM would hold them in 16-bit
    registers and mask them again where they are decoded: two instructions per element. Triton's interpreter
    runs no PTX."""
    if QUANT and PTX and codes.dtype == tl.int32:  # a factored state's "codes" are its row means (fp32)
        codes = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [codes], dtype=tl.int32, is_pure=True, pack=1)
    return codes


@triton.jit
def _load_tile(
    p_base,
    g_base,
    mc,
    ms,
    vc,
    vs,
    blk,
    local,
    n_valid,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    M_QUANT: tl.constexpr,
    M_BITS: tl.constexpr,
    V_QUANT: tl.constexpr,
    V_BITS: tl.constexpr,
    PTX: tl.constexpr,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    WHOLE: tl.constexpr = False,
    wc=None,
    ws=None,
    N_STATES: tl.constexpr = 2,
    W_QUANT: tl.constexpr = False,
    W_BITS: tl.constexpr = 8,
    M_SCALE: tl.constexpr = 0,
    V_SCALE: tl.constexpr = 0,
    W_SCALE: tl.constexpr = 0,
    rows=0,
    cols=0,
    ROW_TILE: tl.constexpr = False,
    row=0,
):
    """The raw inputs of tile ``blk`` (its first ``n_valid`` elements): param, grad, and each state's codes and scales
    (or fp32 values); with ``N_STATES`` 3, the third state's too (from ``wc`` and ``ws``). ``WHOLE``: ``n_valid`` is the
    whole tile or nothing (``triton_codec.load_codes``). A state whose scales are over the whole matrix (``M_SCALE``,
    ...: 1 rank-1, 2 factored, their index in ``SCALE_KINDS``) reads the tensor as ``rows`` rows of ``cols``; its scales
    (a factored state: its values) are each element's. ``ROW_TILE``: the tile is whole and lies in row ``row``."""
    start = blk * BLOCK
    p = load_values(p_base, start, local, n_valid, PARAM_DTYPE, BLOCK, VEC, WHOLE)
    g = load_values(g_base, start, local, n_valid, GRAD_DTYPE, BLOCK, VEC, WHOLE)
    m_raw, m_scale = load_codes(
        mc,
        ms,
        start,
        blk,
        local,
        n_valid,
        M_QUANT,
        M_BITS,
        QBLOCK,
        BLOCK,
        VEC,
        WHOLE,
        M_SCALE,
        rows,
        cols,
        ROW_TILE,
        row,
    )
    v_raw, v_scale = load_codes(
        vc,
        vs,
        start,
        blk,
        local,
        n_valid,
        V_QUANT,
        V_BITS,
        QBLOCK,
        BLOCK,
        VEC,
        WHOLE,
        V_SCALE,
        rows,
        cols,
        ROW_TILE,
        row,
    )
    if N_STATES == 3:
        w_raw, w_scale = load_codes(
            wc,
            ws,
            start,
            blk,
            local,
            n_valid,
            W_QUANT,
            W_BITS,
            QBLOCK,
            BLOCK,
            VEC,
            WHOLE,
            W_SCALE,
            rows,
            cols,
            ROW_TILE,
            row,
        )
        return (
            p,
            g,
            _opaque(m_raw, M_QUANT, PTX),
            m_scale,
            _opaque(v_raw, V_QUANT, PTX),
            v_scale,
            _opaque(w_raw, W_QUANT, PTX),
            w_scale,
        )
    else:
        return p, g, _opaque(m_raw, M_QUANT, PTX), m_scale, _opaque(v_raw, V_QUANT, PTX), v_scale


@triton.jit
def _load_row(c, N: tl.constexpr):
    """A tensor's row of ``N`` coefficients as a tuple, loaded once per program (:func:`_load_coefs`' for any
    number: the three-state kernel reads its rule's)."""
    row = ()
    for i in tl.static_range(N):
        row = row + (tl.load(c + i),)
    return row


@triton.jit
def _load_coefs(c):
    """A tensor's row of coefficients, loaded once per program (a load in the tile loop is issued every tile:
    the compiler cannot move it past the loop's stores)."""
    return (
        tl.load(c + 0),
        tl.load(c + 1),
        tl.load(c + 2),
        tl.load(c + 3),
        tl.load(c + 4),
        tl.load(c + 5),
        tl.load(c + 6),
    )


@triton.jit
def _update_tile(
    tile,
    p_base,
    mc,
    ms,
    vc,
    vs,
    blk,
    local,
    n_valid,
    coefs,
    key,
    offset,
    m_values,
    m_level1,
    m_level2,
    v_values,
    v_level1,
    v_level2,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    UPDATE: tl.constexpr,
    OPTION: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PTX: tl.constexpr,
    SR: tl.constexpr,
    M_QUANT: tl.constexpr,
    M_BITS: tl.constexpr,
    V_QUANT: tl.constexpr,
    V_BITS: tl.constexpr,
    M_SIGNED: tl.constexpr,
    V_SIGNED: tl.constexpr,
    M_FLAT: tl.constexpr,
    V_FLAT: tl.constexpr,
    WHOLE: tl.constexpr = False,
    wc=None,
    ws=None,
    w_values=None,
    w_level1=None,
    w_level2=None,
    N_STATES: tl.constexpr = 2,
    W_QUANT: tl.constexpr = False,
    W_BITS: tl.constexpr = 8,
    W_SIGNED: tl.constexpr = True,
    W_FLAT: tl.constexpr = 0,
    M_SCALE: tl.constexpr = 0,
    V_SCALE: tl.constexpr = 0,
    W_SCALE: tl.constexpr = 0,
    rows=0,
    cols=0,
    m_new=0,
    v_new=0,
    w_new=0,
    ROW_TILE: tl.constexpr = False,
    row=0,
):
    """The rule's update (``UPDATE`` with its ``OPTION``) of one loaded tile, and its stores. ``coefs``: the tensor's
    coefficients (:func:`_load_coefs`, :func:`_load_row`). With ``N_STATES`` 3, the third state's too (the ``w``
    arguments, as the first two states' ``m`` and ``v``). A state with rank-1 scales is encoded with its new maxima
    (``m_new``, ...: :func:`_load_tile`'s scales were the old ones). Returns the new states' fp32 values ``(m, v, w)``
    (with two states, ``v`` in the third place), which a factored state's sums take."""
    if N_STATES == 3:
        p, g, m_raw, m_scale, v_raw, v_scale, w_raw, w_scale = tile
    else:
        p, g, m_raw, m_scale, v_raw, v_scale = tile
    start = blk * BLOCK
    p = as_fp32(p, PARAM_DTYPE, WHOLE)
    g = as_fp32(g, GRAD_DTYPE, WHOLE)
    m = load_state(m_raw, m_scale, m_values, M_QUANT, M_BITS, QBLOCK, BLOCK, VEC, WHOLE, M_SCALE)
    v = load_state(v_raw, v_scale, v_values, V_QUANT, V_BITS, QBLOCK, BLOCK, VEC, WHOLE, V_SCALE)
    if N_STATES == 3:
        w = load_state(w_raw, w_scale, w_values, W_QUANT, W_BITS, QBLOCK, BLOCK, VEC, WHOLE, W_SCALE)

    if MAXIMIZE:
        g = -g
    if N_STATES == 3:
        p, m, v, w = UPDATE(p, g, m, v, w, coefs, OPTION, PTX)
    else:
        p, m, v = UPDATE(p, g, m, v, coefs, OPTION, PTX)

    store_param(p_base, start, local, n_valid, p, key, offset, PARAM_DTYPE, SR, BLOCK, VEC, WHOLE, PTX)
    store_state(
        m,
        mc,
        m_new if M_SCALE else ms,
        start,
        blk,
        local,
        n_valid,
        m_level1,
        m_level2,
        M_QUANT,
        M_BITS,
        QBLOCK,
        BLOCK,
        VEC,
        PTX,
        M_SIGNED,
        M_FLAT,
        WHOLE,
        M_SCALE,
        rows,
        cols,
        ROW_TILE,
        row,
    )
    store_state(
        v,
        vc,
        v_new if V_SCALE else vs,
        start,
        blk,
        local,
        n_valid,
        v_level1,
        v_level2,
        V_QUANT,
        V_BITS,
        QBLOCK,
        BLOCK,
        VEC,
        PTX,
        V_SIGNED,
        V_FLAT,
        WHOLE,
        V_SCALE,
        rows,
        cols,
        ROW_TILE,
        row,
    )
    if N_STATES == 3:
        store_state(
            w,
            wc,
            w_new if W_SCALE else ws,
            start,
            blk,
            local,
            n_valid,
            w_level1,
            w_level2,
            W_QUANT,
            W_BITS,
            QBLOCK,
            BLOCK,
            VEC,
            PTX,
            W_SIGNED,
            W_FLAT,
            WHOLE,
            W_SCALE,
            rows,
            cols,
            ROW_TILE,
            row,
        )
    third = v
    if N_STATES == 3:
        third = w
    return m, v, third


@triton.jit
def _fold_row(x, sums, row, columns, BLOCK: tl.constexpr):
    """A factored state's new values ``x`` of one whole tile, inside row ``row``, into its fp64 sums (``sums``: the
    rows', then the columns'): the tile's total into its row's, one atomic addition; its elements into ``columns``,
    the program's running sums of its tiles' columns (:func:`_fold_columns` adds them once, after the last)."""
    v = factored_part(x, tl.arange(0, BLOCK) < BLOCK)
    tl.atomic_add(sums.to(tl.pointer_type(tl.float64)) + row, tl.sum(v, axis=0), sem="relaxed")
    return columns + v


@triton.jit
def _fold_columns(columns, sums, rows, c):
    """A program's column sums (:func:`_fold_row`) into the state's, at columns ``c``: one atomic addition each."""
    tl.atomic_add(sums.to(tl.pointer_type(tl.float64)) + rows + c, columns, sem="relaxed")


@triton.jit
def adam_kernel(
    ptrs,  # int64 (n_tensors, 1 + 2 * N_STATES): param, exp_avg codes (or fp32 values), its absmax, the same for
    # exp_avg_sq (and for the third state)
    grad_ptrs,  # int64 (n_tensors,)
    numels,  # int64 (n_tensors,)
    coefs,  # fp32 (n_tensors, 7, or N_COEFS with three states): the rule's coefficient rows (Adam's: rules.adam.COEFS)
    prog_tensor,  # int32 (n_programs,): which tensor each program updates
    prog_block,  # int32 (n_programs,): its first tile
    prog_tiles,  # int32 (n_programs,): how many consecutive tiles it updates (the tensor's end may come first)
    steps,  # fp32 (n_tensors,): the step counts, already advanced (by the rule's coefficients kernel)
    round_info,  # int64 (n_tensors, 2): position in the optimizer, element offset (read with SR only)
    m_values,
    m_level1,
    m_level2,  # exp_avg's decode table and encoder tables (kernels.tables.layout_tables)
    v_values,
    v_level1,
    v_level2,  # exp_avg_sq's
    w_values,
    w_level1,
    w_level2,  # the third state's (None with two states)
    rank1,  # int64 (n_tensors, 1 + N_STATES) with a state of scales over the matrix (None without): the rows of the
    # tensor's matrix, then each state's new maxima or sums (triton_rank1.rank1_stats_kernel's; 0 for a blockwise state)
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    PREFETCH: tl.constexpr,
    ALIGNED: tl.constexpr,
    UPDATE: tl.constexpr,  # the rule's element update (FusedRule.triton_update): (p, g, m, v, coefs, OPTION, PTX),
    # with three states (p, g, m, v, w, coefs, OPTION, PTX)
    OPTION: tl.constexpr,  # the rule's one setting (FusedRule.option; Adam's: decoupled weight decay)
    MAXIMIZE: tl.constexpr,
    PTX: tl.constexpr,
    SR: tl.constexpr,
    M_QUANT: tl.constexpr,
    M_BITS: tl.constexpr,
    V_QUANT: tl.constexpr,
    V_BITS: tl.constexpr,
    M_SIGNED: tl.constexpr,
    V_SIGNED: tl.constexpr,  # whether each codebook holds a negative value
    M_FLAT: tl.constexpr = 0,
    V_FLAT: tl.constexpr = 0,  # each encoder's one-load shift (kernels.tables.flat_shift)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the kernel before it (SM 9.0 and later)
    N_STATES: tl.constexpr = 2,  # 2, or 3: a third state, read and written as the first two
    N_COEFS: tl.constexpr = 7,  # the columns of a coefficient row with three states (the rule's; two states: 7)
    W_QUANT: tl.constexpr = False,
    W_BITS: tl.constexpr = 8,
    W_SIGNED: tl.constexpr = True,
    W_FLAT: tl.constexpr = 0,  # the third state's, as M_QUANT, M_BITS, M_SIGNED and M_FLAT
    M_SCALE: tl.constexpr = 0,
    V_SCALE: tl.constexpr = 0,
    W_SCALE: tl.constexpr = 0,  # each state's kind of scales (its index in SCALE_KINDS): 0 block, 1 rank-1, 2 factored
    FOLD: tl.constexpr = False,  # factored states' sums taken here, no first pass: each program walks a strip of whole
    # tiles down its matrix's rows, its tiles cols // BLOCK apart (optim.fused.strip_map), none of them partial
    ROW_TILES: tl.constexpr = 0,  # 1: every matrix's rows are whole tiles (a plan of rank-1 scales): each tile's row
    # is followed along the program's run, and its rank-1 scales are a row's maximum and a run of columns' maxima; 2:
    # also every row count a multiple of 4 (with ALIGNED, a run of columns' maxima is then read as vectors)
):
    # With PDL this kernel may start before the one before it in the stream has finished (the coefficients kernel,
    # or the previous plan's update): what that kernel writes, the coefficients and the step counts, is read only
    # after gdc_wait; the tensors read before it are this plan's own, which no earlier kernel of the step writes.
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    row = ptrs + t * (1 + 2 * N_STATES)
    numel = tl.load(numels + t)
    first = tl.load(prog_block + pid).to(tl.int64)
    count = tl.load(prog_tiles + pid)
    # the program's tiles: n_full whole tiles, then at most one partial tile (a tensor's last)
    n_full = tl.minimum((numel - first * BLOCK) // BLOCK, count)
    local = tile_offsets(BLOCK, VEC)  # offsets inside the tile: constants per thread
    p_base = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE))
    g_base = tl.load(grad_ptrs + t).to(tl.pointer_type(GRAD_DTYPE))
    mc, ms, vc, vs = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    mc, vc = _codes_pointer(mc, M_QUANT, ALIGNED, M_SCALE), _codes_pointer(vc, V_QUANT, ALIGNED, V_SCALE)
    if N_STATES == 3:
        wc, ws = _codes_pointer(tl.load(row + 5), W_QUANT, ALIGNED, W_SCALE), tl.load(row + 6)
    else:
        wc, ws = None, None
    if M_SCALE or V_SCALE or W_SCALE:  # the tensor as a matrix, and the new maxima its rank-1 states are encoded with
        info = rank1 + t * (1 + N_STATES)
        rows = tl.load(info)
        cols = numel // rows
        m_new, v_new = tl.load(info + 1), tl.load(info + 2)
        w_new = tl.load(info + 3) if N_STATES == 3 else 0
    else:
        rows, cols, m_new, v_new, w_new = 0, 0, 0, 0, 0
    if ALIGNED:  # every address in the tables is a multiple of 16 bytes: loads and stores can be vectors
        p_base, g_base = tl.multiple_of(p_base, 16), tl.multiple_of(g_base, 16)
    if FOLD:  # a strip down the rows: its tiles a row apart; each factored state's column sums held over the loop
        stride = cols // BLOCK
        row0 = first // stride  # the strip's first row: tile i lies in row row0 + i
        if M_SCALE == FACTORED:
            m_cols = tl.zeros((BLOCK,), tl.float64)
        if V_SCALE == FACTORED:
            v_cols = tl.zeros((BLOCK,), tl.float64)
        if W_SCALE == FACTORED:
            w_cols = tl.zeros((BLOCK,), tl.float64)
    else:
        stride, row0 = 1, 0
    if ROW_TILES:  # the current tile's row and its place in the row (one division a program, none a tile)
        per_row = (cols // BLOCK).to(tl.int32)
        cur_row = first.to(tl.int32) // per_row
        cur_j = first.to(tl.int32) - cur_row * per_row
        first_row = cur_row
    else:
        first_row = row0
    # Whole tiles have n_valid BLOCK or 0: their masks are one predicate for the tile, and loads and stores
    # stay vectors (WHOLE: 4-bit codes and bf16 values move in words of a thread's own elements).
    if PREFETCH:
        nxt = _load_tile(
            p_base,
            g_base,
            mc,
            ms,
            vc,
            vs,
            first,
            local,
            tl.where(n_full > 0, BLOCK, 0),
            QBLOCK,
            BLOCK,
            VEC,
            M_QUANT,
            M_BITS,
            V_QUANT,
            V_BITS,
            PTX,
            PARAM_DTYPE,
            GRAD_DTYPE,
            True,
            wc=wc,
            ws=ws,
            N_STATES=N_STATES,
            W_QUANT=W_QUANT,
            W_BITS=W_BITS,
            M_SCALE=M_SCALE,
            V_SCALE=V_SCALE,
            W_SCALE=W_SCALE,
            rows=rows,
            cols=cols,
            ROW_TILE=FOLD + ROW_TILES,
            row=first_row,
        )
    if PDL:
        gdc_wait()
    if N_STATES == 3:
        cf = _load_row(coefs + t * N_COEFS, N_COEFS)
    else:
        cf = _load_coefs(coefs + t * 7)
    key, offset = _round_key(round_info, steps, t, SR)
    for i in range(0, n_full):
        blk = first + i * stride
        if PREFETCH:
            tile = nxt
            more = tl.where(n_full - i > 1, BLOCK, 0)  # the next tile is whole and this program's
            if ROW_TILES:
                ahead = cur_row + (cur_j + 1 == per_row).to(tl.int32)
            else:
                ahead = row0 + i + 1
            nxt = _load_tile(
                p_base,
                g_base,
                mc,
                ms,
                vc,
                vs,
                blk + stride,
                local,
                more,
                QBLOCK,
                BLOCK,
                VEC,
                M_QUANT,
                M_BITS,
                V_QUANT,
                V_BITS,
                PTX,
                PARAM_DTYPE,
                GRAD_DTYPE,
                True,
                wc=wc,
                ws=ws,
                N_STATES=N_STATES,
                W_QUANT=W_QUANT,
                W_BITS=W_BITS,
                M_SCALE=M_SCALE,
                V_SCALE=V_SCALE,
                W_SCALE=W_SCALE,
                rows=rows,
                cols=cols,
                ROW_TILE=FOLD + ROW_TILES,
                row=ahead,
            )
        else:
            tile = _load_tile(
                p_base,
                g_base,
                mc,
                ms,
                vc,
                vs,
                blk,
                local,
                BLOCK,
                QBLOCK,
                BLOCK,
                VEC,
                M_QUANT,
                M_BITS,
                V_QUANT,
                V_BITS,
                PTX,
                PARAM_DTYPE,
                GRAD_DTYPE,
                True,
                wc=wc,
                ws=ws,
                N_STATES=N_STATES,
                W_QUANT=W_QUANT,
                W_BITS=W_BITS,
                M_SCALE=M_SCALE,
                V_SCALE=V_SCALE,
                W_SCALE=W_SCALE,
                rows=rows,
                cols=cols,
                ROW_TILE=FOLD + ROW_TILES,
                row=cur_row if ROW_TILES else row0 + i,
            )
        new = _update_tile(
            tile,
            p_base,
            mc,
            ms,
            vc,
            vs,
            blk,
            local,
            BLOCK,
            cf,
            key,
            offset,
            m_values,
            m_level1,
            m_level2,
            v_values,
            v_level1,
            v_level2,
            PARAM_DTYPE,
            GRAD_DTYPE,
            QBLOCK,
            BLOCK,
            VEC,
            UPDATE,
            OPTION,
            MAXIMIZE,
            PTX,
            SR,
            M_QUANT,
            M_BITS,
            V_QUANT,
            V_BITS,
            M_SIGNED,
            V_SIGNED,
            M_FLAT,
            V_FLAT,
            True,
            wc=wc,
            ws=ws,
            w_values=w_values,
            w_level1=w_level1,
            w_level2=w_level2,
            N_STATES=N_STATES,
            W_QUANT=W_QUANT,
            W_BITS=W_BITS,
            M_SCALE=M_SCALE,
            V_SCALE=V_SCALE,
            W_SCALE=W_SCALE,
            rows=rows,
            cols=cols,
            W_SIGNED=W_SIGNED,
            W_FLAT=W_FLAT,
            m_new=m_new,
            v_new=v_new,
            w_new=w_new,
            ROW_TILE=ROW_TILES,
            row=cur_row if ROW_TILES else 0,
        )
        if ROW_TILES:
            cur_row = cur_row + (cur_j + 1 == per_row).to(tl.int32)
            cur_j = tl.where(cur_j + 1 == per_row, 0, cur_j + 1)
        if FOLD:
            r = row0 + i
            if M_SCALE == FACTORED:
                m_cols = _fold_row(new[0], m_new, r, m_cols, BLOCK)
            if V_SCALE == FACTORED:
                v_cols = _fold_row(new[1], v_new, r, v_cols, BLOCK)
            if W_SCALE == FACTORED:
                w_cols = _fold_row(new[2], w_new, r, w_cols, BLOCK)
    if FOLD:
        c = (first * BLOCK) % cols + local
        if M_SCALE == FACTORED:
            _fold_columns(m_cols, m_new, rows, c)
        if V_SCALE == FACTORED:
            _fold_columns(v_cols, v_new, rows, c)
        if W_SCALE == FACTORED:
            _fold_columns(w_cols, w_new, rows, c)
    # decided after the loop, so that no predicate is held across it (ptxas may keep one in local memory); with FOLD
    # every tile is whole (n_full == count)
    if (n_full < count) & (first * BLOCK + n_full * BLOCK < numel):
        blk = first + n_full
        n_valid = numel - blk * BLOCK
        tile = _load_tile(
            p_base,
            g_base,
            mc,
            ms,
            vc,
            vs,
            blk,
            local,
            n_valid,
            QBLOCK,
            BLOCK,
            VEC,
            M_QUANT,
            M_BITS,
            V_QUANT,
            V_BITS,
            PTX,
            PARAM_DTYPE,
            GRAD_DTYPE,
            wc=wc,
            ws=ws,
            N_STATES=N_STATES,
            W_QUANT=W_QUANT,
            W_BITS=W_BITS,
            M_SCALE=M_SCALE,
            V_SCALE=V_SCALE,
            W_SCALE=W_SCALE,
            rows=rows,
            cols=cols,
        )
        _update_tile(
            tile,
            p_base,
            mc,
            ms,
            vc,
            vs,
            blk,
            local,
            n_valid,
            cf,
            key,
            offset,
            m_values,
            m_level1,
            m_level2,
            v_values,
            v_level1,
            v_level2,
            PARAM_DTYPE,
            GRAD_DTYPE,
            QBLOCK,
            BLOCK,
            VEC,
            UPDATE,
            OPTION,
            MAXIMIZE,
            PTX,
            SR,
            M_QUANT,
            M_BITS,
            V_QUANT,
            V_BITS,
            M_SIGNED,
            V_SIGNED,
            M_FLAT,
            V_FLAT,
            wc=wc,
            ws=ws,
            w_values=w_values,
            w_level1=w_level1,
            w_level2=w_level2,
            N_STATES=N_STATES,
            W_QUANT=W_QUANT,
            W_BITS=W_BITS,
            M_SCALE=M_SCALE,
            V_SCALE=V_SCALE,
            W_SCALE=W_SCALE,
            rows=rows,
            cols=cols,
            W_SIGNED=W_SIGNED,
            W_FLAT=W_FLAT,
            m_new=m_new,
            v_new=v_new,
            w_new=w_new,
        )
