"""Triton building blocks that read and write one optimizer state held as a (BLOCK,) register tile.

Every state a :class:`~torchao_optim.state.layout.StateLayout` describes goes through these functions,
specialized at compile time by ``QUANT`` (codebook codes, or a plain fp32 tensor) and ``BITS`` (8, or 4
with two codes per byte). They compute exactly what :mod:`torchao_optim.quant.blockwise` and
:mod:`torchao_optim.quant.codec` compute (the same absmax, the same reciprocal, the same O(1) encoder
over the same tables), so the fused kernels and the compiled path store the same codes for the same
values. A tile is addressed by a scalar (its first element ``start`` and its block ``blk``) plus ``local``,
the offsets inside the tile (compile-time constants per thread: no per-element 64-bit arithmetic).
This module imports Triton; import it only where Triton is available.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torchao_optim.state.layout import SCALE_KINDS

TINY: tl.constexpr = tl.constexpr(2.0**-126)  # quant.blockwise.TINY
LIFT: tl.constexpr = tl.constexpr(2.0**64)
# A state's kind of scales, as the kernels' per-state SCALE constexprs carry it: its index in StateLayout's SCALE_KINDS,
# 0 (False) one scale per block, 1 (True) rank-1 maxima, FACTORED a factored state's row and column means
RANK1: tl.constexpr = tl.constexpr(SCALE_KINDS.index("rank1"))
FACTORED: tl.constexpr = tl.constexpr(SCALE_KINDS.index("factored"))


@triton.jit
def encode_grid(y, FLAT: tl.constexpr, PTX: tl.constexpr):
    """Codes (int32) of ``y`` for the even grid ``(i + 1) * 2**FLAT`` (``FLAT`` < 0; ``quant.codec.grid_bits``
    gives ``-FLAT``): ``ceil(y * 2**-FLAT - 1.5)``, at least 0, with no table. ``y * 2**-FLAT`` is exact, so
    contracting it and the subtraction into one FMA changes nothing. With PTX the conversion rounds up and
    saturates at 0 in one instruction. No clamp at the top: ``y <= 1`` (up to the rounding of ``1 / absmax``, far
    less than half a step) gives at most the last code."""
    scale = tl.full((), (127 - FLAT) << 23, tl.int32).to(tl.float32, bitcast=True)  # 2**-FLAT
    t = y * scale - 1.5
    if PTX:
        code = tl.inline_asm_elementwise(
            "cvt.rpi.sat.u32.f32 $0, $1;", "=r,f", [t], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        code = tl.maximum(tl.math.ceil(t), 0.0).to(tl.int32)
    return code


@triton.jit
def encode_high(y, level1, level2, SIGNED: tl.constexpr = True, FLAT: tl.constexpr = 0, PTX: tl.constexpr = False):
    """The codes of ``y`` (fp32 in [-1, 1], no NaN) in the top byte of int32 words whose other bits are not
    zero: torchao_optim.quant.codec.encode, in Triton (:func:`encode` shifts them down; an 8-bit store takes
    the top bytes as they are).

    ``level1`` is ``BucketTables.level1_by_bits()`` (indexed by the sign and exponent bits as they are) and
    ``level2`` is ``BucketTables.level2_keyed()``: the candidate code and the key from which the code is one
    more, in one 4-byte load. The key is ``y``'s mantissa with its bits flipped for ``y < 0`` (one
    exclusive-or with the sign spread over the word), so one addition decides for both signs. Not ``SIGNED``
    (a codebook without negative values, ``StateLayout.signed``): every negative ``y`` has one code whatever
    its key, the flip is left out (an instruction per element). ``FLAT``, not 0: ``level1`` is the one table
    of ``codec.flat_keyed`` and ``FLAT`` its shift (``level2`` is not read): one load instead of two, indexed
    by ``y``'s own top bits (the table's rows for ``y < 0`` are in the order of the unflipped bits), so that the
    index does not wait for the flip. ``FLAT`` below 0: an even grid's arithmetic code (:func:`encode_grid`; no
    table is read), shifted into the top byte.
    """
    if FLAT < 0:
        high = encode_grid(y, FLAT, PTX) << 24
    else:
        bits = (y + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 is +0.0: the rule says -0.0 encodes as 0.0
        if SIGNED:
            key = (bits ^ (bits >> 31)) & 0x7FFFFF
        else:
            key = bits & 0x7FFFFF
        if FLAT:
            # the index from y's own bits, apart from the key: a shift (an index from the flipped bits took a
            # LOP3 more: flip, then mask the key)
            packed = tl.load(level1 + (bits.to(tl.uint32, bitcast=True) >> FLAT).to(tl.int32))
        else:
            entry = tl.load(level1 + ((bits >> 23) & 511))  # sign and exponent
            packed = tl.load(level2 + ((entry >> 5) + (key >> (entry & 31))))
        # the entry is ((candidate + 1) << 24) - threshold: adding the key carries into the top byte exactly when
        # key >= threshold (no compare and select); the sum stays below 2**32 (the tables are built so)
        high = packed + key
    return high


@triton.jit
def encode(y, level1, level2, SIGNED: tl.constexpr = True, FLAT: tl.constexpr = 0, PTX: tl.constexpr = False):
    """Codes (int32) of ``y``: :func:`encode_high`'s top bytes (an even grid's straight from :func:`encode_grid`)."""
    if FLAT < 0:
        return encode_grid(y, FLAT, PTX)
    return (encode_high(y, level1, level2, SIGNED, FLAT).to(tl.uint32, bitcast=True) >> 24).to(tl.int32)


@triton.jit
def _top_bytes(words, PTX: tl.constexpr):
    """The top byte of each int32 of ``words``, as uint8. With PTX, four at a time by byte permutes, which
    gather the top bytes straight into the word an 8-bit store writes (shifting each down first, then packing,
    costs an instruction per element more)."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi; prmt.b32 lo, $1, $2, 0x7773; prmt.b32 hi, $3, $4, 0x7773; "
            "prmt.b32 $0, lo, hi, 0x5410; }",
            "=r,r,r,r,r",
            [words],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        )
    else:
        return (words.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)


# byte permutes that take the top byte (encode_high's words) or the low byte (an even grid's codes) of two words
# into the low two bytes of one
_SELECT: tl.constexpr = tl.constexpr(("0x7773", "0x7740"))


@triton.jit
def _nibbles(lo, hi, FLAT: tl.constexpr):
    """Bytes of two 4-bit codes each from :func:`encode_high`'s words (an even grid's codes as they are): ``lo``'s
    code in the low nibble, ``hi``'s in the high one, each byte in an int32."""
    if FLAT < 0:
        return lo | (hi << 4)
    else:
        return ((lo.to(tl.uint32, bitcast=True) >> 24) | ((hi.to(tl.uint32, bitcast=True) >> 20) & 0xF0)).to(tl.int32)


@triton.jit
def _pack_words(y, level1, level2, SIGNED: tl.constexpr, FLAT: tl.constexpr, PTX: tl.constexpr, VEC: tl.constexpr):
    """The 4-bit code words of a (BLOCK,) tile ``y`` (``VEC // 2`` bytes, one per run of ``VEC`` elements, each
    thread its own): the inverse of :func:`_decode_words`. With PTX, byte permutes gather the codes (the top byte
    of :func:`encode_high`'s words, the low byte of an even grid's codes) of the low nibbles into one word and
    those of the high nibbles into another, and one shifted add joins them (codes are below 16: no carries)."""
    if FLAT < 0:
        words = encode_grid(y, FLAT, PTX)
    else:
        words = encode_high(y, level1, level2, SIGNED, FLAT)
    if VEC == 4:  # element 2k + j: byte k, nibble j
        c0, c1 = tl.split(tl.reshape(words, (y.shape[0] // 4, 2, 2)))  # nibble j = 0, 1: (C, 2) over k
        a0, a1 = tl.split(c0)
        b0, b1 = tl.split(c1)
        if PTX:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 l, h; prmt.b32 l, $1, $3, "
                + _SELECT[FLAT < 0]
                + "; prmt.b32 h, $2, $4, "
                + _SELECT[FLAT < 0]
                + "; shl.b32 h, h, 4; add.u32 $0, l, h; }",
                "=r,r,r,r,r",
                [a0, b0, a1, b1],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:
            out = _nibbles(a0, b0, FLAT) | (_nibbles(a1, b1, FLAT) << 8)
        return out.to(tl.uint16)
    else:  # element 4 * k1 + 2 * k0 + j: byte 2 * k1 + k0, nibble j
        c0, c1 = tl.split(tl.reshape(words, (y.shape[0] // 8, 2, 2, 2)))
        c00, c01 = tl.split(c0)
        c10, c11 = tl.split(c1)
        a0, a2 = tl.split(c00)
        a1, a3 = tl.split(c01)
        b0, b2 = tl.split(c10)
        b1, b3 = tl.split(c11)
        if PTX:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 p, q, l, h; prmt.b32 p, $1, $3, "
                + _SELECT[FLAT < 0]
                + "; prmt.b32 q, $5, $7, "
                + _SELECT[FLAT < 0]
                + "; prmt.b32 l, p, q, 0x5410; prmt.b32 p, $2, $4, "
                + _SELECT[FLAT < 0]
                + "; prmt.b32 q, $6, $8, "
                + _SELECT[FLAT < 0]
                + "; prmt.b32 h, p, q, 0x5410; shl.b32 h, h, 4; "
                "add.u32 $0, l, h; }",
                "=r,r,r,r,r,r,r,r,r",
                [a0, b0, a1, b1, a2, b2, a3, b3],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:
            out = (
                _nibbles(a0, b0, FLAT)
                | (_nibbles(a1, b1, FLAT) << 8)
                | (_nibbles(a2, b2, FLAT) << 16)
                | (_nibbles(a3, b3, FLAT) << 24)
            )
        return out.to(tl.uint32, bitcast=True)


@triton.jit
def tile_offsets(N: tl.constexpr, VEC: tl.constexpr):
    """``tl.arange(0, N)``, known to the compiler as runs of only ``VEC`` contiguous offsets.

    Triton gives each memory access a register layout from the contiguity it can prove: as many elements per
    thread as one 16-byte vector holds. A tile's parameter, gradient and codes differ in width, so each would
    get a layout of its own and every element would be moved between them (shuffles, or shared memory and a
    barrier). Offsets in runs of ``VEC`` (16 bytes of the parameter dtype) give every access the parameter's
    layout, in which a thread's 8-bit codes are those of its own elements."""
    r = tl.arange(0, N)
    if VEC >= N:
        return r
    return (r // VEC) * VEC + r % VEC


@triton.jit
def _by_block(x, QBLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """A (BLOCK,) tile as (BLOCK // QBLOCK, QBLOCK): one row per quantization block. In the tile's layout a
    thread's elements are runs inside one row, so this moves no data."""
    return tl.reshape(x, (BLOCK // QBLOCK, QBLOCK))


@triton.jit
def whole_mask(n_valid, N: tl.constexpr):
    """The mask of an access of ``N`` lanes to a tile that is whole (``n_valid`` > 0) or absent: one predicate, so
    the access stays a vector whatever its width."""
    return tl.full((N,), n_valid, tl.int32) > 0


@triton.jit
def _row_col(start, local, cols, BLOCK: tl.constexpr):
    """Row and column (int32) of elements ``start + local`` in the row-major matrix of ``cols`` columns: one division
    per tile, and per element a compare where a row is at least a tile long (a tile then ends at most one row
    further on), else a division."""
    r0 = start // cols
    c = (start - r0 * cols).to(tl.int32) + local
    n = cols.to(tl.int32)
    if n >= BLOCK:
        wrap = (c >= n).to(tl.int32)
    else:
        wrap = c // n
    return r0.to(tl.int32) + wrap, c - wrap * n


@triton.jit
def rank1_scales(maxima, rows, cols, start, local, n_valid, BLOCK: tl.constexpr):
    """Rank-1 scales (``StateLayout.scale`` ``"rank1"``) of elements ``start + local`` (the first ``n_valid`` exist;
    1.0 past them) of a matrix of ``rows`` rows of ``cols``: ``min(row maximum, column maximum)`` from ``maxima``
    (fp32: the row maxima, then the column maxima), as ``FourBitRank1Tensor`` takes them. The maxima are a few KB
    per matrix: these loads are cache hits."""
    r, c = _row_col(start, local, cols, BLOCK)
    m = maxima.to(tl.pointer_type(tl.float32))
    mask = local < n_valid
    return tl.minimum(tl.load(m + r, mask=mask, other=1.0), tl.load(m + rows + c, mask=mask, other=1.0))


@triton.jit
def _row_and_columns(m, rows, cols, row, start, local, n_valid, BLOCK: tl.constexpr, ROW_TILE: tl.constexpr):
    """The entries of ``m`` (fp32: a matrix's row statistics, then its columns') of a tile that is whole or absent
    (``n_valid`` 0) and lies in row ``row``, which the caller knows: its row's (one scalar load) and its columns' (one
    contiguous run), with no division per element. ``ROW_TILE`` 2: the columns' start at a 16-byte boundary (every
    address aligned, and ``rows`` a multiple of 4), so that the run's loads are vectors."""
    first = (start - row * cols).to(tl.int32)
    at_row = tl.load(m + row, mask=n_valid > 0, other=1.0)
    columns = m + rows + first
    if ROW_TILE == 2:
        columns = tl.multiple_of(columns, 16)
    return at_row, tl.load(columns + local, mask=whole_mask(n_valid, BLOCK), other=1.0)


@triton.jit
def rank1_row_scales(maxima, rows, cols, row, start, local, n_valid, BLOCK: tl.constexpr, ROW_TILE: tl.constexpr):
    """:func:`rank1_scales` of a tile that is whole or absent and lies in row ``row`` (:func:`_row_and_columns`)."""
    row_max, col_max = _row_and_columns(
        maxima.to(tl.pointer_type(tl.float32)), rows, cols, row, start, local, n_valid, BLOCK, ROW_TILE
    )
    return tl.minimum(row_max, col_max)


@triton.jit
def rank1_row_normalized(
    x, maxima, rows, cols, row, start, local, n_valid, BLOCK: tl.constexpr, ROW_TILE: tl.constexpr
):
    """``x`` over its rank-1 scales, on a tile that is whole or absent and lies in row ``row``, bit for bit as
    :func:`store_state` divides on any tile: ``(x * lift) * (1 / (scale * lift))``, the scale the smaller of the row's
    and the column's maxima. The reciprocal depends on the scale alone, so it is the one of whichever maximum is the
    smaller, read from the reciprocals the plan stores after the maxima (``FusedPlan.rank1_inverses``: ``rows + cols``
    further on) instead of taken per element."""
    m = maxima.to(tl.pointer_type(tl.float32))
    row_max, col_max = _row_and_columns(m, rows, cols, row, start, local, n_valid, BLOCK, ROW_TILE)
    row_inv, col_inv = _row_and_columns(m + rows + cols, rows, cols, row, start, local, n_valid, BLOCK, ROW_TILE)
    lift = tl.where(tl.minimum(row_max, col_max) < TINY, LIFT, 1.0)
    return (x * lift) * tl.where(row_max <= col_max, row_inv, col_inv)


@triton.jit
def factored_means(
    row_means, columns, cols, start, local, n_valid, BLOCK: tl.constexpr, ROW_TILE: tl.constexpr = False, row=0
):
    """The two factors of a factored state's values (``StateLayout.scale`` ``"factored"``) at elements ``start +
    local`` (the first ``n_valid`` exist; 0 past them) of a matrix of ``cols`` columns: ``(row_means[r], columns[c])``,
    ``columns`` being its column means over their mean (made once per step, as the C step makes them); their product
    is the value ``FactoredState``'s dequantize takes, and :func:`load_state` takes it. Kept apart until then, so that a
    prefetched tile's product is not taken (and waited for) at its load. ``ROW_TILE``: the tile is whole or absent
    (``n_valid`` 0: a prefetch past the strip's end, which reads nothing) and lies in row ``row``, which the caller
    knows: its row mean is one scalar load, its columns one vector, and no division is made (a 64-bit one is a call
    and a branch in the loop, and the branch keeps ptxas from moving the next tile's code unpacking past this
    tile's update)."""
    if ROW_TILE:  # the tile's first column a multiple of BLOCK: with an aligned ``columns`` (as the kernels declare
        # it where the plan's addresses are) a vector per run of a thread's elements, under one predicate
        x = tl.load(row_means.to(tl.pointer_type(tl.float32)) + row, mask=n_valid > 0, other=0.0)
        first = tl.multiple_of((start - row * cols).to(tl.int32), BLOCK)
        return x, tl.load(
            columns.to(tl.pointer_type(tl.float32)) + first + local, mask=whole_mask(n_valid, BLOCK), other=0.0
        )
    else:
        r, c = _row_col(start, local, cols, BLOCK)
        x = tl.load(row_means.to(tl.pointer_type(tl.float32)) + r, mask=local < n_valid, other=0.0)
        return x, tl.load(columns.to(tl.pointer_type(tl.float32)) + c, mask=local < n_valid, other=0.0)


@triton.jit
def factored_part(x, mask):
    """What a factored state's sums count of its new values ``x``: ``where(mask & isfinite(x) & (x > 0), x, 0)``, in
    fp64 (as ``FactoredState`` and the C step add them)."""
    return tl.where(mask & (x > 0.0) & (x <= 3.4028234663852886e38), x, 0.0).to(tl.float64)


@triton.jit
def _code_words(codes, blk, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """The addresses of tile ``blk``'s 4-bit codes as ``BLOCK // VEC`` words of ``VEC // 2`` bytes, the codes of a
    run of ``VEC`` elements each, known to the compiler as contiguous one at a time: each thread then loads and
    stores the word of its own run of elements (as :func:`tile_offsets` keeps a thread's elements its own)."""
    if VEC == 8:
        words = codes.to(tl.pointer_type(tl.uint32))
    else:
        tl.static_assert(VEC == 4)
        words = codes.to(tl.pointer_type(tl.uint16))
    return words + blk * (BLOCK // VEC) + tl.max_contiguous(tl.arange(0, BLOCK // VEC), 1)


@triton.jit
def _nibble_values(word, K: tl.constexpr, values):
    """The values (fp32) of the two codes in byte ``K`` of ``word``, from ``values`` as ``quant.codec.nibble_pairs``
    lays it out: one 8-byte load."""
    pair = tl.load(values.to(tl.pointer_type(tl.int64)) + ((word >> (8 * K)) & 255))
    return pair.to(tl.int32).to(tl.float32, bitcast=True), (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _decode_words(word, values, VEC: tl.constexpr):
    """The (BLOCK,) values of a tile's 4-bit code words (``VEC // 2`` bytes each, one per run of ``VEC`` elements).
    Each thread decodes its own words; the joins place the values in its registers in element order (the newest
    axis of a join is the innermost), so nothing moves between threads."""
    a0, b0 = _nibble_values(word, 0, values)
    a1, b1 = _nibble_values(word, 1, values)
    if VEC == 4:  # element 2k + j: byte k, nibble j
        x = tl.join(tl.join(a0, a1), tl.join(b0, b1))
    else:
        a2, b2 = _nibble_values(word, 2, values)
        a3, b3 = _nibble_values(word, 3, values)
        # element 4 * k1 + 2 * k0 + j: byte 2 * k1 + k0, nibble j
        x = tl.join(tl.join(tl.join(a0, a2), tl.join(a1, a3)), tl.join(tl.join(b0, b2), tl.join(b1, b3)))
    return tl.reshape(x, (word.shape[0] * VEC,))


@triton.jit
def load_codes(
    codes,
    scales,
    start,
    blk,
    local,
    n_valid,
    QUANT: tl.constexpr,
    BITS: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    WHOLE: tl.constexpr = False,
    SCALE: tl.constexpr = 0,
    rows=0,
    cols=0,
    ROW_TILE: tl.constexpr = False,
    row=0,
):
    """The raw contents of one state on tile ``blk``: ``local`` (BLOCK,) offsets from element ``start``, of
    which the first ``n_valid`` exist; the tile holds ``BLOCK // QBLOCK`` quantization blocks. Returns (the code
    bytes as loaded, the blocks' scales: a scalar for one block, else one per block), or (fp32 values, 0.0)
    for a plain state. ``codes``/``scales`` are the addresses from the pointer table; ``local`` is
    ``tile_offsets(BLOCK, VEC)``. Loading is split from decoding (:func:`load_state`) so a kernel can issue
    the next tile's loads before it computes this one; nothing here reads the loaded bytes, so nothing waits
    for them before the tile is decoded. Masks are ``offset < n_valid``: when ``n_valid`` is the whole tile or
    nothing, they are one predicate for the tile and the loads stay vectors. ``WHOLE`` (the caller knows
    ``n_valid`` is the whole tile or nothing): 4-bit codes come as one word per run of ``VEC`` elements
    (``VEC // 2`` bytes, a thread's own), not byte by byte (a byte mask ``2 * offset < n_valid`` is a predicate
    per byte to Triton), and are decoded and stored so (:func:`load_state`, :func:`store_state`). ``SCALE``: the
    state's scales are over a matrix of ``rows`` rows of ``cols`` (its kind's index in ``SCALE_KINDS``): 1, rank-1
    scales (``scales``: its maxima), the scales returned each element's (:func:`rank1_scales`); :data:`FACTORED`, a
    factored state, no codes (``codes``: its columns over their mean, ``scales``: its row means): returns its row
    means and its columns, whose product :func:`load_state` takes (:func:`factored_means`). ``ROW_TILE``: the tile is
    whole (or absent) and in row ``row``, so that a row's statistic is one load and the columns' a contiguous run."""
    # one return, after the branches (only the constant conditions' branch is compiled): Triton unifies the types of
    # a function's returns, and a factored state's are not the codes'
    if QUANT and SCALE == FACTORED:  # no codes: the values are the row mean times the column's
        raw, scale = factored_means(scales, codes, cols, start, local, n_valid, BLOCK, ROW_TILE, row)
    elif QUANT:
        if BITS == 8:
            raw = tl.load(codes.to(tl.pointer_type(tl.uint8)) + start + local, mask=local < n_valid, other=0)
        elif WHOLE:  # one word per run of VEC elements, a thread's own
            raw = tl.load(_code_words(codes, blk, BLOCK, VEC), mask=whole_mask(n_valid, BLOCK // VEC), other=0)
        else:  # BLOCK // 2 bytes: element 2i in the low nibble of byte i, 2i + 1 in the high one
            half = tile_offsets(BLOCK // 2, VEC // 2)  # a thread's bytes are those of its own elements
            raw = tl.load(codes.to(tl.pointer_type(tl.uint8)) + start // 2 + half, mask=2 * half < n_valid, other=0)
        raw = raw.to(tl.int32)
        if SCALE == RANK1 and ROW_TILE:
            scale = rank1_row_scales(scales, rows, cols, row, start, local, n_valid, BLOCK, ROW_TILE)
        elif SCALE == RANK1:
            scale = rank1_scales(scales, rows, cols, start, local, n_valid, BLOCK)
        elif QBLOCK == BLOCK:
            scale = tl.load(scales.to(tl.pointer_type(tl.float32)) + blk, mask=n_valid > 0, other=0.0)
        else:
            scales = scales.to(tl.pointer_type(tl.float32))
            which = tl.arange(0, BLOCK // QBLOCK)
            scale = tl.load(scales + blk * (BLOCK // QBLOCK) + which, mask=which * QBLOCK < n_valid, other=0.0)
    else:
        raw = tl.load(codes.to(tl.pointer_type(tl.float32)) + start + local, mask=local < n_valid, other=0.0)
        scale = 0.0
    return raw, scale


@triton.jit
def load_state(
    raw,
    scale,
    values,
    QUANT: tl.constexpr,
    BITS: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr = 0,
    WHOLE: tl.constexpr = False,
    SCALE: tl.constexpr = 0,
):
    """The state's fp32 values from what :func:`load_codes` returned: one table load per element, or with 4-bit
    codes one 8-byte load per code byte, from ``values`` as ``quant.codec.nibble_pairs`` lays it out (both of its
    elements' values: the low nibble's in the low word). ``VEC``, ``WHOLE`` and ``SCALE``: :func:`load_codes`'."""
    if QUANT and SCALE == FACTORED:  # raw: the row means, scale: the columns (factored_means)
        return raw * scale
    elif QUANT:
        if BITS == 8:
            x = tl.load(values + raw)
        elif WHOLE:
            x = _decode_words(raw, values, VEC)
        else:
            pair = tl.load(values.to(tl.pointer_type(tl.int64)) + raw)
            x = tl.interleave(pair.to(tl.int32), (pair >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
        if SCALE == RANK1 or QBLOCK == BLOCK:  # a scale per element, or one for the tile
            x = x * scale
        else:  # (an early return would not spare this branch's compilation for a scalar scale)
            x = tl.reshape(_by_block(x, QBLOCK, BLOCK) * scale[:, None], (BLOCK,))
        return x
    else:
        return raw


@triton.jit
def store_state(
    x,
    codes,
    scales,
    start,
    blk,
    local,
    n_valid,
    level1,
    level2,
    QUANT: tl.constexpr,
    BITS: tl.constexpr,
    QBLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    PTX: tl.constexpr,
    SIGNED: tl.constexpr,
    FLAT: tl.constexpr = 0,
    WHOLE: tl.constexpr = False,
    SCALE: tl.constexpr = 0,
    rows=0,
    cols=0,
    ROW_TILE: tl.constexpr = False,
    row=0,
):
    """Write ``x`` (BLOCK fp32: tile ``blk`` from element ``start``, ``BLOCK // QBLOCK`` quantization blocks;
    the first ``n_valid`` elements exist) back: each block's absmax and the codes of ``x * (1 / absmax)``, or
    the plain values. ``x`` is finite: the update never produces a non-finite state (it skips such elements),
    so the compiled path's finiteness masks change nothing here. ``SCALE`` ``RANK1`` (rank-1 scales over a matrix of
    ``rows`` rows of ``cols``): ``scales`` are the new maxima, already taken over the whole matrix's new values (a first
    pass, :mod:`~torchao_optim.kernels.triton_rank1`); only the codes of ``x`` over each element's scale are
    written. ``ROW_TILE`` and ``row``: :func:`load_codes`'; a rank-1 state's tile then takes the reciprocals of the new
    maxima stored after them (:func:`rank1_row_normalized`)."""
    mask = local < n_valid
    if QUANT and SCALE == FACTORED:
        pass  # no codes; the new means come from the first pass's sums, stored once every tile has decoded
    elif QUANT:
        magnitude = tl.where(mask, tl.abs(x), 0.0)
        # A subnormal absmax's reciprocal overflows: such a block and its absmax are multiplied by 2**64 first
        # (exact), as quant.blockwise.normalize does. One block per tile: a branch, taken only by such a block,
        # so other tiles pay nothing. Several: the factor is per block, 1 for all others (a branch there would
        # hold both paths in registers: 9 more).
        if SCALE == RANK1 and ROW_TILE:
            y = rank1_row_normalized(x, scales, rows, cols, row, start, local, n_valid, BLOCK, ROW_TILE)
        elif SCALE == RANK1:  # as FourBitRank1Tensor.quantize_fields, per element; |x| is at most its scale
            scale = rank1_scales(scales, rows, cols, start, local, n_valid, BLOCK)
            lift = tl.where(scale < TINY, LIFT, 1.0)
            y = (x * lift) * tl.div_rn(1.0, tl.where(scale > 0, scale * lift, 1.0))
        elif QBLOCK == BLOCK:
            absmax = tl.max(magnitude, axis=0)
            if absmax < TINY:
                y = (x * LIFT) * tl.div_rn(1.0, tl.where(absmax > 0, absmax * LIFT, 1.0))
            else:
                y = x * tl.div_rn(1.0, absmax)
        else:
            absmax = tl.max(_by_block(magnitude, QBLOCK, BLOCK), axis=1)
            lift = tl.where(absmax < TINY, LIFT, 1.0)
            inv = tl.div_rn(1.0, tl.where(absmax > 0, absmax * lift, 1.0))
            y = tl.reshape(_by_block(x, QBLOCK, BLOCK) * lift[:, None] * inv[:, None], (BLOCK,))
        # |y| <= 1 up to the rounding of 1 / absmax, and the tables' exponent-127 buckets, [1, 2), hold the
        # top code: no clamp needed
        if BITS == 8:
            tl.store(
                codes.to(tl.pointer_type(tl.uint8)) + start + local,
                _top_bytes(encode_high(y, level1, level2, SIGNED, FLAT, PTX), PTX),
                mask=mask,
            )
        elif WHOLE:
            tl.store(
                _code_words(codes, blk, BLOCK, VEC),
                _pack_words(y, level1, level2, SIGNED, FLAT, PTX, VEC),
                mask=whole_mask(n_valid, BLOCK // VEC),
            )
        else:
            code = encode(y, level1, level2, SIGNED, FLAT, PTX)
            # past the end of the tensor, the odd element's high nibble is 0, as quant.pack_nibbles writes it
            lo, hi = tl.split(tl.reshape(tl.where(mask, code, 0), (BLOCK // 2, 2)))
            half = tile_offsets(BLOCK // 2, VEC // 2)
            tl.store(
                codes.to(tl.pointer_type(tl.uint8)) + start // 2 + half,
                (lo | (hi << 4)).to(tl.uint8),
                mask=2 * half < n_valid,
            )
        scales = scales.to(tl.pointer_type(tl.float32))
        if SCALE == RANK1:
            pass  # the maxima are stored once every tile has decoded with the old ones
        elif QBLOCK == BLOCK:
            tl.store(scales + blk, absmax)
        else:  # each thread holds its own block's absmax (the reduction's layout): one store per block, with no
            # shuffles to gather every block's into every thread first
            rows = tl.arange(0, BLOCK // QBLOCK)
            tl.store(scales + blk * (BLOCK // QBLOCK) + rows, absmax, mask=rows * QBLOCK < n_valid)
    else:
        tl.store(codes.to(tl.pointer_type(tl.float32)) + start + local, x, mask=mask)


@triton.jit
def _encode_kernel(
    y_ptr, out_ptr, n, level1, level2, BLOCK: tl.constexpr, SIGNED: tl.constexpr, FLAT: tl.constexpr, PTX: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, encode(y, level1, level2, SIGNED, FLAT, PTX).to(tl.uint8), mask=mask)


def quantize_nearest_triton(y, codebook, never_zero: bool = False, flat_max_bits: int | None = None, grid: bool = True):
    """``torchao_optim.quant.quantize_nearest`` through the kernels' encoder (for tests): uint8 codes of ``y``
    (fp32 in [-1, 1], contiguous, on a device the kernels run on), specialized as the fused kernels are for the
    codebook's sign (``StateLayout.signed``) and its encoder's form: an even grid's arithmetic (unless not
    ``grid``), else, where ``quant.codec.flat_keyed(..., flat_max_bits)`` has a one-load form for the codebook,
    that form (``None``: the kernels' limit, ``kernels.tables.FLAT_MAX_BITS``; 0: always two loads)."""
    import torch

    from torchao_optim.kernels import triton_interpreter
    from torchao_optim.kernels.tables import FLAT_MAX_BITS, codebook_flat_shift, encoder_tables

    codebook = tuple(codebook)
    shift = codebook_flat_shift(codebook, never_zero, FLAT_MAX_BITS if flat_max_bits is None else flat_max_bits, grid)
    level1, level2 = encoder_tables(codebook, never_zero, y.device, "triton", shift)
    out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    block = 1 << 16
    _encode_kernel[(triton.cdiv(y.numel(), block),)](
        y,
        out,
        y.numel(),
        level1,
        level2,
        BLOCK=block,
        SIGNED=min(codebook) < 0,
        FLAT=shift,
        PTX=not triton_interpreter(),
    )
    return out
