"""The first pass of a plan whose states have rank-1 scales (``StateLayout.scale`` ``"rank1"``), on CUDA.

A rank-1 scaled state is encoded with the row and column maxima of its new values over the whole matrix, so those
maxima must be known before any of its codes is written. ``rank1_stats_kernel`` runs the rule's element update (the
same ``UPDATE`` the step kernel inlines) on a matrix's tiles of ``ROWS`` rows by ``COLS`` columns, each program a
strip of ``STRIP`` tiles down a column of tiles, stores nothing of it, and folds each rank-1 state's new magnitudes
into the maxima and each factored state's new values into fp64 row and column sums: one atomic per row of a tile, and
one per column of a strip (the strip's column statistics held in registers over its tiles). The
step kernel (:func:`~torchao_optim.kernels.triton_adam.adam_kernel`) then decodes with the old maxima or means,
encodes with the new maxima, and the plan stores the new statistics into the states last. Only what those states'
new values depend on is read here: the compiler drops the loads of the rest (Adam's ``exp_avg_sq`` needs only the
gradient and its own codes). :func:`normalize_columns_kernel` makes a factored state's columns over their mean before
this pass. A plan of two or three states whose only matrix scales are factored, over rows of whole step tiles, needs
no first pass: its step kernel takes the sums (``adam_kernel``'s ``FOLD``).

Elements are addressed one by one (row times ``cols`` plus column), each state decoded as ``triton_codec`` decodes
it: a code's value times its scale, the same product the step kernel takes. Where every row of the plan's matrices
starts a tile at 16-byte boundaries (``ALIGNED``) and the tile is read row by row (``ROWWISE``, rank-1 plans), a
program instead walks its strip one row at a time (:func:`_rows_of_strip`): each thread a run of :data:`RUN` columns
of every array, its 4-bit codes one word decoded in its registers, each row's maximum one warp reduction and one
atomic, the columns' maxima kept per thread until the strip's end. A 2-D tile there gave the gradient, the codes and
the decoded values different register layouts, and every element moved between them through shared memory.
This module imports Triton; import it only where Triton is available.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from torchao_optim.kernels.triton_adam import _load_row
from torchao_optim.kernels.triton_codec import FACTORED, RANK1, _decode_words, factored_part, tile_offsets

# Under ALIGNED, the elements a thread reads of a row of a tile: a run of RUN contiguous columns (16 bytes of fp32, 8
# of bf16, two bytes of 4-bit codes). Every access of the row is declared in runs of RUN, so that all take one register
# layout and nothing moves between threads (triton_codec.tile_offsets); a tile of COLS = 32 x RUN columns is then one
# run a thread of its one warp.
RUN = tl.constexpr(4)


# A program reads one small tile: few values a thread, so many programs an SM (larger tiles held so many registers
# that occupancy, not bandwidth, bounded the pass). Rank-1 maxima take a tile of 128 columns with one warp (reductions
# with no shared memory between warps), read row by row where the plan is ALIGNED; factored sums, whose decode is one
# product of two vectors, the tile of 8 x 128 with four warps. Each is the fastest of a sweep on an H100
# (benchmarks/README.md, "Rank-1 scales on the Triton kernels"): (rows, columns, warps) by a plan's kind of matrix
# scales. A rank-1 program walks a strip of 32 tiles of 4 rows down its column of tiles, its row loop unrolled 4 times
# (TinyLlama, bf16 parameters: 5.64 ms a step against 6.38 with tiles of 2 rows and 6.96 with 8, strips of 16 to 64
# within 1%); factored sums were slower in strips (9.42 ms with one tile, 9.67-10.10 with 4 or 16).
class StatsTile(NamedTuple):
    rows: int
    cols: int
    warps: int
    strip: int = 1  # tiles a program walks down a column of tiles, its column statistics kept in registers
    rowwise: bool = False  # where a plan is ALIGNED, a tile read row by row, one run of RUN columns a thread
    maxnreg: int | None = None  # the pass's register cap (None: the compiler's choice)
    grouped: bool = False  # under rowwise, a tile's rows' loads before their updates (else the compiler's order)


STATS_TILES = {"rank1": StatsTile(4, 128, 1, 32, rowwise=True), "factored": StatsTile(8, 128, 4)}


def stats_tile(scales) -> StatsTile:
    """The first pass's ``(rows, columns, warps)`` for a plan whose states' scale kinds are ``scales``: the rank-1
    tile where any state has rank-1 scales, else the factored one."""
    return STATS_TILES["rank1" if "rank1" in scales else "factored"]


@triton.jit
def _state_at(
    row,
    K: tl.constexpr,
    values,
    e,
    start,
    r,
    c,
    r_ok,
    c_ok,
    rows,
    mask,
    col_max,
    QUANT: tl.constexpr,
    BITS: tl.constexpr,
    QBLOCK: tl.constexpr,
    SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """The fp32 values of state ``K`` (its codes and scales at ``row[1 + 2K]``, ``row[2 + 2K]``: the tensor's row of the
    pointer table) at a tile's flat elements ``e`` (rows ``r``, columns ``c``: the tile's, as
    vectors; ``start``: each row's first element): a code's value (8-bit: the table's entry; 4-bit: the nibble's, the
    low word of the pair table's entry for the byte of that nibble alone, so that the 16 values read lie in one
    128-byte line) times its block's scale or its rank-1 scale (the tile's row maxima, and ``col_max``: its columns'
    maxima, loaded once a strip by :func:`_col_maxima`); a
    plain state's values as they are. ``ALIGNED``: a tile's row lies in one block and starts at a 16-byte boundary of
    every array, so a row's 4-bit codes are one load (half as many bytes as the tile has columns: the tile's shape is
    ``e``'s), split into nibbles in registers, and its block scale one load."""
    codes, scales = tl.load(row + 1 + 2 * K), tl.load(row + 2 + 2 * K)
    if QUANT and SCALE == FACTORED:  # the row means times the columns over their mean (triton_codec.factored_means)
        row_mean = tl.load(scales.to(tl.pointer_type(tl.float32)) + r, mask=r_ok, other=0.0)
        return row_mean[:, None] * tl.load(codes.to(tl.pointer_type(tl.float32)) + c, mask=c_ok, other=0.0)[None, :]
    elif QUANT:
        if BITS == 8:
            code_ptr = codes.to(tl.pointer_type(tl.uint8))
            if ALIGNED:
                code_ptr = tl.multiple_of(code_ptr, 16)
            code = tl.load(code_ptr + e, mask=mask, other=0).to(tl.int32)
            x = tl.load(values + code)
        elif ALIGNED:
            half = (start >> 1)[:, None] + tl.arange(0, e.shape[1] // 2)[None, :]
            byte = tl.load(tl.multiple_of(codes.to(tl.pointer_type(tl.uint8)), 16) + half, mask=r_ok[:, None], other=0)
            byte = byte.to(tl.int32)
            nibble = tl.reshape(tl.join(byte & 15, byte >> 4), e.shape)  # element 2k the low nibble of byte k
            x = tl.load(values.to(tl.pointer_type(tl.int32)) + 2 * nibble).to(tl.float32, bitcast=True)
        else:
            byte = tl.load(codes.to(tl.pointer_type(tl.uint8)) + (e >> 1), mask=mask, other=0).to(tl.int32)
            nibble = (byte >> ((e & 1) * 4).to(tl.int32)) & 15
            x = tl.load(values.to(tl.pointer_type(tl.int32)) + 2 * nibble).to(tl.float32, bitcast=True)
        maxima = scales.to(tl.pointer_type(tl.float32))
        if SCALE == RANK1:
            row_max = tl.load(maxima + r, mask=r_ok, other=1.0)
            scale = tl.minimum(row_max[:, None], col_max[None, :])
        elif ALIGNED:
            scale = tl.load(maxima + start // QBLOCK, mask=r_ok, other=1.0)[:, None]
        else:
            scale = tl.load(maxima + e // QBLOCK, mask=mask, other=1.0)
        return x * scale
    else:
        return tl.load(codes.to(tl.pointer_type(tl.float32)) + e, mask=mask, other=0.0)


@triton.jit
def _row_codes(codes, e, start, ok, QUANT: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr, MASKED: tl.constexpr):
    """The codes of a state on one row of an ALIGNED tile (``codes``: its address from the pointer table; ``e``: the
    row's elements, ``start`` (a multiple of 16 bytes of every array, inside one block) plus each thread's
    :data:`RUN` contiguous columns): 8-bit codes as int32, 4-bit ones as one two-byte word per :data:`RUN` elements, a
    plain state's values; none for a factored state (0). ``MASKED``: only where the scalar ``ok`` holds (0
    elsewhere)."""
    if QUANT and SCALE == FACTORED:
        return 0
    n_words: tl.constexpr = e.shape[0] // RUN
    if QUANT and BITS == 8:
        at = tl.multiple_of(codes.to(tl.pointer_type(tl.uint8)), 16) + e
    elif QUANT:
        words = tl.multiple_of(codes.to(tl.pointer_type(tl.uint16)), 8)
        at = words + start // RUN + tl.max_contiguous(tl.arange(0, n_words), 1)
    else:
        at = tl.multiple_of(codes.to(tl.pointer_type(tl.float32)), 16) + e
    if MASKED:
        raw = tl.load(at, mask=tl.full(at.shape, 1, tl.int1) & ok, other=0)
    else:
        raw = tl.load(at)
    if QUANT:
        raw = raw.to(tl.int32)
    return raw


@triton.jit
def _row_scale(
    scales, start, r, ok, QUANT: tl.constexpr, QBLOCK: tl.constexpr, SCALE: tl.constexpr, MASKED: tl.constexpr
):
    """The scalar scale of a state's row (:func:`_row_codes`'): its row mean (factored), its old row maximum (rank-1),
    its block's absmax, else 1 (unused)."""
    if not QUANT:
        return 1.0
    at = scales.to(tl.pointer_type(tl.float32))
    at = at + r if SCALE else at + start // QBLOCK
    return tl.load(at, mask=ok, other=1.0) if MASKED else tl.load(at)


@triton.jit
def _row_values(raw, values, QUANT: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr):
    """The code values of :func:`_row_codes`' codes (8-bit: the table's entries; 4-bit: decoded in the thread's
    registers, ``triton_codec._decode_words``); a plain state's values as they are; none for a factored state."""
    if QUANT and SCALE == FACTORED:
        return raw
    elif QUANT and BITS == 8:
        return tl.load(values + raw)
    elif QUANT:
        return _decode_words(raw, values, RUN)
    else:
        return raw


@triton.jit
def _row_scaled(x, scale, col, QUANT: tl.constexpr, SCALE: tl.constexpr):
    """A state's fp32 values on one row: its code values ``x`` times its row's ``scale`` (:func:`_row_scale`), the
    smaller of it and ``col`` (rank-1: the strip's column maxima), or a factored state's row mean times ``col`` (its
    columns over their mean); a plain state's ``x``."""
    if QUANT and SCALE == FACTORED:
        return scale * col
    elif QUANT and SCALE == RANK1:
        return x * tl.minimum(scale, col)
    elif QUANT:
        return x * scale
    else:
        return x


@triton.jit
def _row_state(
    codes,
    scales,
    values,
    e,
    start,
    r,
    col,
    QUANT: tl.constexpr,
    BITS: tl.constexpr,
    QBLOCK: tl.constexpr,
    SCALE: tl.constexpr,
):
    """A state's fp32 values on one row of an ALIGNED tile, as :func:`_state_at` reads them on a whole tile: its
    codes, their values, then its row's scale (one scalar load), ``col`` the strip's column maxima or columns over
    their mean (loaded once a strip)."""
    x = _row_values(_row_codes(codes, e, start, True, QUANT, BITS, SCALE, False), values, QUANT, BITS, SCALE)
    return _row_scaled(x, _row_scale(scales, start, r, True, QUANT, QBLOCK, SCALE, False), col, QUANT, SCALE)


@triton.jit
def _strip_columns(row, K: tl.constexpr, c, rows, cols, QUANT: tl.constexpr, SCALE: tl.constexpr):
    """What :func:`_row_state` takes of state ``K``'s columns at ``c``: its old column maxima (rank-1), its columns over
    their mean (factored: they follow its row means), else ones (unused)."""
    if QUANT and SCALE == FACTORED:
        return tl.load(tl.load(row + 1 + 2 * K).to(tl.pointer_type(tl.float32)) + c)
    else:
        return _col_maxima(row, K, c, c < cols, rows, QUANT, SCALE)


@triton.jit
def _fold_row(x, acc, new, r, ok, SCALE: tl.constexpr, MASKED: tl.constexpr):
    """:func:`_fold` on one row of an ALIGNED tile: the row's statistic one scalar atomic, the columns' kept per
    element in ``acc`` (no reduction across threads). ``MASKED``: only where the scalar ``ok`` holds."""
    mask = tl.full(x.shape, 1, tl.int1)
    if MASKED:
        mask = mask & ok
    at_ok = ok if MASKED else None
    if SCALE == FACTORED:
        v = factored_part(x, mask)
        tl.atomic_add(new.to(tl.pointer_type(tl.float64)) + r, tl.sum(v, axis=0), mask=at_ok, sem="relaxed")
        acc = acc + v
    else:
        bits = _magnitude_bits(x, mask)
        tl.atomic_max(new.to(tl.pointer_type(tl.int32)) + r, tl.max(bits, axis=0), mask=at_ok, sem="relaxed")
        acc = tl.maximum(acc, bits)
    return acc


@triton.jit
def _row_update(
    p,
    g,
    states,
    cf,
    accs,
    news,
    r,
    ok,
    UPDATE: tl.constexpr,
    OPTION: tl.constexpr,
    PTX: tl.constexpr,
    N_STATES: tl.constexpr,
    SCALES: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The rule's update on row ``r``'s values (parameter ``p``, gradient ``g``, ``states`` the first ``N_STATES`` of
    three), each rank-1 or factored state's new values (``SCALES``: each state's kind) folded into its statistics
    (:func:`_fold_row`: its row's at ``news``, its columns' into ``accs``, the strip's, returned)."""
    s0, s1, s2 = states
    acc0, acc1, acc2 = accs
    if N_STATES == 1:
        p, s0 = UPDATE(p, g, s0, cf, OPTION, PTX)
    elif N_STATES == 2:
        p, s0, s1 = UPDATE(p, g, s0, s1, cf, OPTION, PTX)
    else:
        p, s0, s1, s2 = UPDATE(p, g, s0, s1, s2, cf, OPTION, PTX)
        if SCALES[2]:
            acc2 = _fold_row(s2, acc2, news[2], r, ok, SCALES[2], MASKED)
    if N_STATES >= 2 and SCALES[1]:
        acc1 = _fold_row(s1, acc1, news[1], r, ok, SCALES[1], MASKED)
    if SCALES[0]:
        acc0 = _fold_row(s0, acc0, news[0], r, ok, SCALES[0], MASKED)
    return acc0, acc1, acc2


@triton.jit
def _col_maxima(row, K: tl.constexpr, c, c_ok, rows, QUANT: tl.constexpr, SCALE: tl.constexpr):
    """State ``K``'s old column maxima at columns ``c`` where its scales are rank-1 (else ones, unused)."""
    if QUANT and SCALE == RANK1:
        maxima = tl.load(row + 2 + 2 * K).to(tl.pointer_type(tl.float32))
        col_max = tl.load(maxima + rows + c, mask=c_ok, other=1.0)
    else:
        col_max = tl.full(c.shape, 1.0, tl.float32)
    return col_max


@triton.jit
def _magnitude_bits(x, mask):
    """What a rank-1 state's maxima count of its new values ``x``: ``where(mask & isfinite(x), |x|, 0)`` as int32
    patterns (non-negative floats order as their bits, so an integer maximum is theirs)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(mask & (bits < 0x7F800000), bits, 0)


@triton.jit
def _fold(x, mask, acc, new, r, r_ok, SCALE: tl.constexpr):
    """Fold a tile's new values of a state into its statistics: its rows' at ``new`` (one atomic per row) and its
    columns' into ``acc``, the strip's (returned; :func:`_fold_columns` stores them). Rank-1: the maxima of
    ``where(isfinite(x), |x|, 0)`` as int32 patterns (non-negative floats order as their bits); factored,
    ``where(isfinite(x) & (x > 0), x, 0)`` added in fp64. The order of the additions varies; an fp64 sum of fp32
    values rounds to the same fp32 mean whatever the order, but where the exact mean lies within the sum's rounding of
    an fp32 rounding boundary (state/factored.py)."""
    if SCALE == FACTORED:
        v = factored_part(x, mask)
        tl.atomic_add(new.to(tl.pointer_type(tl.float64)) + r, tl.sum(v, axis=1), mask=r_ok, sem="relaxed")
        acc = acc + tl.sum(v, axis=0)
    else:
        bits = _magnitude_bits(x, mask)
        tl.atomic_max(new.to(tl.pointer_type(tl.int32)) + r, tl.max(bits, axis=1), mask=r_ok, sem="relaxed")
        acc = tl.maximum(acc, tl.max(bits, axis=0))
    return acc


@triton.jit
def _fold_columns(acc, new, rows, c, c_ok, SCALE: tl.constexpr):
    """A strip's column statistics into a state's at ``new`` (after its rows'): one atomic per column."""
    if SCALE == FACTORED:
        tl.atomic_add(new.to(tl.pointer_type(tl.float64)) + rows + c, acc, mask=c_ok, sem="relaxed")
    elif SCALE:
        tl.atomic_max(new.to(tl.pointer_type(tl.int32)) + rows + c, acc, mask=c_ok, sem="relaxed")


@triton.jit
def _columns_zero(c, SCALE: tl.constexpr):
    """A strip's column statistics before its first tile: fp64 sums (factored) or int32 maxima (rank-1)."""
    if SCALE == FACTORED:
        acc = tl.zeros(c.shape, tl.float64)
    else:
        acc = tl.zeros(c.shape, tl.int32)
    return acc


@triton.jit
def _rows_of_strip(
    row,
    info,
    p_base,
    g_base,
    cf,
    s0_values,
    s1_values,
    s2_values,
    first_row,
    n_rows,
    rows,
    cols,
    c0,
    local,
    UPDATE: tl.constexpr,
    OPTION: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PTX: tl.constexpr,
    QBLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    N_STATES: tl.constexpr,
    S0_QUANT: tl.constexpr,
    S0_BITS: tl.constexpr,
    S0_SCALE: tl.constexpr,
    S1_QUANT: tl.constexpr,
    S1_BITS: tl.constexpr,
    S1_SCALE: tl.constexpr,
    S2_QUANT: tl.constexpr,
    S2_BITS: tl.constexpr,
    S2_SCALE: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """The ALIGNED strip of :func:`rank1_stats_kernel`: its ``n_rows`` rows from ``first_row``, at columns ``c0 +
    local`` (``local``: runs of :data:`RUN`; every column inside the matrix), each row a vector of the tile's columns,
    the loop unrolled ``ROWS`` times, or with ``GROUPED`` each ``ROWS`` rows' loads written before any of their updates
    (the compiler otherwise issues a row's loads only after the previous row's atomic, which it cannot tell apart from
    them). The columns' statistics stay per element in registers until the strip's end."""
    c = c0 + local
    col0 = _strip_columns(row, 0, c, rows, cols, S0_QUANT, S0_SCALE)
    col1 = _strip_columns(row, 1, c, rows, cols, S1_QUANT, S1_SCALE)
    col2 = _strip_columns(row, 2, c, rows, cols, S2_QUANT, S2_SCALE)
    acc0, acc1, acc2 = _columns_zero(c, S0_SCALE), _columns_zero(c, S1_SCALE), _columns_zero(c, S2_SCALE)
    # the states' addresses and their new statistics' (loaded once: in the loop, behind the atomics, they were loaded
    # again every row, and each row's loads waited on them)
    codes0, scales0, new0 = tl.load(row + 1), tl.load(row + 2), tl.load(info + 1)
    codes1, scales1, new1 = tl.load(row + 3), tl.load(row + 4), tl.load(info + 2)
    codes2, scales2, new2 = tl.load(row + 5), tl.load(row + 6), tl.load(info + 3)
    if GROUPED:  # each ROWS rows' loads first, then their decoding and updates (the last group masked)
        end = first_row + n_rows
        for r0 in tl.range(first_row, end, ROWS):
            group = ()
            for j in tl.static_range(ROWS):
                r = r0 + j
                ok = r < end
                start = r * cols + c0
                e = start + local
                mask = tl.full(e.shape, 1, tl.int1) & ok
                p = tl.load(p_base + e, mask=mask, other=0.0)
                g = tl.load(g_base + e, mask=mask, other=0.0)
                raw0 = _row_codes(codes0, e, start, ok, S0_QUANT, S0_BITS, S0_SCALE, True)
                raw1 = _row_codes(codes1, e, start, ok, S1_QUANT, S1_BITS, S1_SCALE, True) if N_STATES >= 2 else 0
                raw2 = _row_codes(codes2, e, start, ok, S2_QUANT, S2_BITS, S2_SCALE, True) if N_STATES == 3 else 0
                scale0 = _row_scale(scales0, start, r, ok, S0_QUANT, QBLOCK, S0_SCALE, True)
                scale1 = _row_scale(scales1, start, r, ok, S1_QUANT, QBLOCK, S1_SCALE, True) if N_STATES >= 2 else 1.0
                scale2 = _row_scale(scales2, start, r, ok, S2_QUANT, QBLOCK, S2_SCALE, True) if N_STATES == 3 else 1.0
                group = group + ((p, g, raw0, raw1, raw2, scale0, scale1, scale2),)
            for j in tl.static_range(ROWS):
                p, g, raw0, raw1, raw2, scale0, scale1, scale2 = group[j]
                g = g.to(tl.float32)
                if MAXIMIZE:
                    g = -g
                s0 = _row_values(raw0, s0_values, S0_QUANT, S0_BITS, S0_SCALE)
                s0 = _row_scaled(s0, scale0, col0, S0_QUANT, S0_SCALE)
                s1, s2 = 0.0, 0.0
                if N_STATES >= 2:
                    s1 = _row_values(raw1, s1_values, S1_QUANT, S1_BITS, S1_SCALE)
                    s1 = _row_scaled(s1, scale1, col1, S1_QUANT, S1_SCALE)
                if N_STATES == 3:
                    s2 = _row_values(raw2, s2_values, S2_QUANT, S2_BITS, S2_SCALE)
                    s2 = _row_scaled(s2, scale2, col2, S2_QUANT, S2_SCALE)
                acc0, acc1, acc2 = _row_update(
                    p.to(tl.float32), g, (s0, s1, s2), cf, (acc0, acc1, acc2), (new0, new1, new2), r0 + j,
                    r0 + j < end, UPDATE, OPTION, PTX, N_STATES, (S0_SCALE, S1_SCALE, S2_SCALE), True,
                )  # fmt: skip
    else:  # the loop unrolled ROWS times, in the compiler's order
        for r in tl.range(first_row, first_row + n_rows, loop_unroll_factor=ROWS):
            start = r * cols + c0
            e = start + local
            p = tl.load(p_base + e).to(tl.float32)
            g = tl.load(g_base + e).to(tl.float32)
            if MAXIMIZE:
                g = -g
            s0 = _row_state(codes0, scales0, s0_values, e, start, r, col0, S0_QUANT, S0_BITS, QBLOCK, S0_SCALE)
            s1, s2 = 0.0, 0.0
            if N_STATES >= 2:
                s1 = _row_state(codes1, scales1, s1_values, e, start, r, col1, S1_QUANT, S1_BITS, QBLOCK, S1_SCALE)
            if N_STATES == 3:
                s2 = _row_state(codes2, scales2, s2_values, e, start, r, col2, S2_QUANT, S2_BITS, QBLOCK, S2_SCALE)
            acc0, acc1, acc2 = _row_update(
                p, g, (s0, s1, s2), cf, (acc0, acc1, acc2), (new0, new1, new2), r, True, UPDATE, OPTION, PTX,
                N_STATES, (S0_SCALE, S1_SCALE, S2_SCALE), False,
            )  # fmt: skip
    c_ok = c < cols
    if S0_SCALE:
        _fold_columns(acc0, new0, rows, c, c_ok, S0_SCALE)
    if S1_SCALE:
        _fold_columns(acc1, new1, rows, c, c_ok, S1_SCALE)
    if S2_SCALE:
        _fold_columns(acc2, new2, rows, c, c_ok, S2_SCALE)


@triton.jit
def rank1_stats_kernel(
    ptrs,  # int64 (n_tensors, 1 + 2 * N_STATES): adam_kernel's (or momentum_kernel's) pointer table
    grad_ptrs,  # int64 (n_tensors,)
    numels,  # int64 (n_tensors,)
    coefs,  # fp32 (n_tensors, N_COEFS): the rule's coefficient rows, already written
    rank1,  # int64 (n_tensors, 1 + N_STATES): the matrix's rows, then each state's new maxima or sums (zeroed; 0:
    # blockwise)
    prog_tensor,  # int32 (n_programs,): which tensor each program reads
    prog_tile,  # int32 (n_programs,): the first tile of its strip (row-major over tiles of ROWS x COLS)
    s0_values,
    s1_values,
    s2_values,  # each state's decode table (kernels.tables.layout_tables; None past N_STATES)
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    UPDATE: tl.constexpr,
    OPTION: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address in the tables a multiple of 16 bytes, every row length of COLS, QBLOCK's
    ROWS: tl.constexpr,  # the tile (stats_tile)
    COLS: tl.constexpr,
    STRIP: tl.constexpr,  # tiles a program walks down its column of tiles
    ROWWISE: tl.constexpr,  # under ALIGNED, a tile read row by row (_row_state): COLS = 32 x RUN x warps
    N_STATES: tl.constexpr,
    N_COEFS: tl.constexpr,
    S0_QUANT: tl.constexpr,
    S0_BITS: tl.constexpr,
    S0_SCALE: tl.constexpr,
    S1_QUANT: tl.constexpr = False,
    S1_BITS: tl.constexpr = 8,
    S1_SCALE: tl.constexpr = 0,
    S2_QUANT: tl.constexpr = False,
    S2_BITS: tl.constexpr = 8,
    S2_SCALE: tl.constexpr = 0,
    GROUPED: tl.constexpr = False,  # under ROWWISE, each ROWS rows' loads first (StatsTile.grouped)
):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    first = tl.load(prog_tile + pid)  # the first of its strip's tiles
    row = ptrs + t * (1 + 2 * N_STATES)
    info = rank1 + t * (1 + N_STATES)
    rows = tl.load(info)
    cols = tl.load(numels + t) // rows
    per_row = tl.cdiv(cols, COLS)
    c = (first % per_row).to(tl.int64) * COLS + tl.arange(0, COLS)
    c_ok = c < cols
    p_base = tl.load(row).to(tl.pointer_type(PARAM_DTYPE))
    g_base = tl.load(grad_ptrs + t).to(tl.pointer_type(GRAD_DTYPE))
    if ALIGNED:  # a tile's row is then contiguous from a 16-byte boundary: its loads become vectors
        cols = tl.multiple_of(cols, COLS)
        p_base, g_base = tl.multiple_of(p_base, 16), tl.multiple_of(g_base, 16)
    cf = _load_row(coefs + t * N_COEFS, N_COEFS)
    row_tile = first // per_row
    if ALIGNED and ROWWISE:
        _rows_of_strip(
            row,
            info,
            p_base,
            g_base,
            cf,
            s0_values,
            s1_values,
            s2_values,
            row_tile * ROWS,
            tl.minimum(STRIP * ROWS, rows - row_tile * ROWS),
            rows,
            cols,
            (first % per_row).to(tl.int64) * COLS,
            tile_offsets(COLS, RUN),
            UPDATE,
            OPTION,
            MAXIMIZE,
            PTX,
            QBLOCK,
            ROWS,
            N_STATES,
            S0_QUANT,
            S0_BITS,
            S0_SCALE,
            S1_QUANT,
            S1_BITS,
            S1_SCALE,
            S2_QUANT,
            S2_BITS,
            S2_SCALE,
            GROUPED,
        )
        return
    col0 = _col_maxima(row, 0, c, c_ok, rows, S0_QUANT, S0_SCALE)
    col1 = _col_maxima(row, 1, c, c_ok, rows, S1_QUANT, S1_SCALE)
    col2 = _col_maxima(row, 2, c, c_ok, rows, S2_QUANT, S2_SCALE)
    acc0, acc1, acc2 = _columns_zero(c, S0_SCALE), _columns_zero(c, S1_SCALE), _columns_zero(c, S2_SCALE)
    for i in range(0, tl.minimum(STRIP, tl.cdiv(rows, ROWS) - row_tile)):  # the strip's tiles, none past the rows
        r = (row_tile + i).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        r_ok = r < rows
        mask = r_ok[:, None] & c_ok[None, :]
        start = r * cols + (first % per_row).to(tl.int64) * COLS
        e = start[:, None] + tl.arange(0, COLS)[None, :]
        p = tl.load(p_base + e, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_base + e, mask=mask, other=0.0).to(tl.float32)
        if MAXIMIZE:
            g = -g
        s0 = _state_at(
            row,
            0,
            s0_values,
            e,
            start,
            r,
            c,
            r_ok,
            c_ok,
            rows,
            mask,
            col0,
            S0_QUANT,
            S0_BITS,
            QBLOCK,
            S0_SCALE,
            ALIGNED,
        )
        if N_STATES == 1:
            p, s0 = UPDATE(p, g, s0, cf, OPTION, PTX)
        else:
            s1 = _state_at(
                row,
                1,
                s1_values,
                e,
                start,
                r,
                c,
                r_ok,
                c_ok,
                rows,
                mask,
                col1,
                S1_QUANT,
                S1_BITS,
                QBLOCK,
                S1_SCALE,
                ALIGNED,
            )
            if N_STATES == 2:
                p, s0, s1 = UPDATE(p, g, s0, s1, cf, OPTION, PTX)
            else:
                s2 = _state_at(
                    row,
                    2,
                    s2_values,
                    e,
                    start,
                    r,
                    c,
                    r_ok,
                    c_ok,
                    rows,
                    mask,
                    col2,
                    S2_QUANT,
                    S2_BITS,
                    QBLOCK,
                    S2_SCALE,
                    ALIGNED,
                )
                p, s0, s1, s2 = UPDATE(p, g, s0, s1, s2, cf, OPTION, PTX)
                if S2_SCALE:
                    acc2 = _fold(s2, mask, acc2, tl.load(info + 3), r, r_ok, S2_SCALE)
            if S1_SCALE:
                acc1 = _fold(s1, mask, acc1, tl.load(info + 2), r, r_ok, S1_SCALE)
        if S0_SCALE:
            acc0 = _fold(s0, mask, acc0, tl.load(info + 1), r, r_ok, S0_SCALE)
    if S0_SCALE:
        _fold_columns(acc0, tl.load(info + 1), rows, c, c_ok, S0_SCALE)
    if S1_SCALE:
        _fold_columns(acc1, tl.load(info + 2), rows, c, c_ok, S1_SCALE)
    if S2_SCALE:
        _fold_columns(acc2, tl.load(info + 3), rows, c, c_ok, S2_SCALE)


@triton.jit
def normalize_columns_kernel(
    columns,  # int64 (n, 3): a factored state's column means' address, the address of its columns over their mean,
    # its column count
    BLOCK: tl.constexpr,
):
    """One program per factored matrix: its column means over their mean (an fp64 sum over the columns, rounded to
    fp32; 0 where that mean is not positive), as the C step and ``FactoredState``'s dequantize make them."""
    entry = columns + tl.program_id(0) * 3
    src = tl.load(entry).to(tl.pointer_type(tl.float32))
    dst = tl.load(entry + 1).to(tl.pointer_type(tl.float32))
    n = tl.load(entry + 2)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        total += tl.load(src + at, mask=at < n, other=0.0).to(tl.float64)
    mean = (tl.sum(total, axis=0) / n.to(tl.float64)).to(tl.float32)
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        x = tl.load(src + at, mask=at < n, other=0.0)
        tl.store(dst + at, tl.where(mean > 0.0, tl.div_rn(x, tl.where(mean > 0.0, mean, 1.0)), 0.0), mask=at < n)


def stats_programs(numels, rows, tile_rows: int, tile_cols: int, strip: int = 1) -> tuple:
    """``(prog_tensor, prog_tile)`` (int32, on the CPU) of :func:`rank1_stats_kernel` over tensors of ``numels``
    elements read as ``rows`` rows each (lists of ints): every strip of ``strip`` tiles of ``tile_rows`` x
    ``tile_cols`` down a column of tiles of every matrix, one program each, by its first tile."""
    import torch

    tensors, tiles = [], []
    for t, (n, r) in enumerate(zip(numels, rows)):
        per_row = -(-(n // r) // tile_cols)
        strips = torch.arange(0, -(-r // tile_rows), strip, dtype=torch.int32)
        first = (strips[:, None] * per_row + torch.arange(per_row, dtype=torch.int32)[None, :]).reshape(-1)
        tensors.append(torch.full((len(first),), t, dtype=torch.int32))
        tiles.append(first)
    return torch.cat(tensors), torch.cat(tiles)
