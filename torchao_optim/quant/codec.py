"""Encoding to any sorted codebook in O(1), written once for every executor.

**The rule.** A codebook is a sorted 1-D table ``T`` of at most 256 fp32 values. Its *decision boundaries*
are the fp32 midpoints ``B[i] = fl((T[i] + T[i+1]) / 2)``; a format may lift the boundary just above 0.0 to
0.0 itself (``never_zero``: a nonzero value never encodes to 0.0, which Adam's ``exp_avg_sq`` needs). The
code of a value ``y`` is the number of boundaries below it::

    code(y) = #{i : B[i] <  y}    if not y < 0     (ties go to the smaller magnitude:
    code(y) = #{i : B[i] <= y}    if y < 0          a value on a boundary takes the code nearer 0)

``-0.0`` counts as ``0.0``. :func:`encode_search` computes this with a binary search (the reference);
:func:`encode` and the fused CUDA kernel compute it in O(1) from :class:`BucketTables`, and all three agree
bit for bit.

**The O(1) encoder.** The fp32 bits of ``|y|`` (``y`` in [-1, 1]) are an exponent ``e`` and a mantissa.
For each sign and exponent, a first table gives an offset and a shift; ``offset + (mantissa >> shift)``
indexes a second table of candidate codes, one per *bucket* (a range of ``|y|`` sharing the exponent and
the top ``23 - shift`` mantissa bits). Each exponent gets just enough mantissa bits that no bucket holds
more than one boundary, so the code is the candidate ``c`` or ``c + 1``, decided by one comparison with
``B[c]``; the second table stores, beside each candidate, where in its bucket that comparison switches, so
that it is made on the low mantissa bits. Two small table loads and a few integer operations, whatever the
codebook.

**One load.** Giving every exponent the same number ``m`` of mantissa bits, the most any of them needs (3 for
the 4-bit codebooks, 6 and 7 for the dynamic 8-bit maps), makes the first table's offset a multiple of the index
and its shift a constant: the second table alone, ``512 << m`` entries indexed by the top ``9 + m`` bits of
``y`` (sign, exponent, and ``m`` mantissa bits), gives the code in one load
(:func:`flat_keyed`). The same buckets split finer, so the same codes; a larger table, of which a step reads
the few rows of the exponents its values have.

**No table.** A codebook that is the even grid ``(i + 1) / 2**k`` for ``i < 2**k`` (a linear map without a zero
level, as 4-bit ``exp_avg_sq``'s) has the boundaries ``(i + 1.5) / 2**k``, so the rule's code is
``min(max(ceil(y * 2**k - 1.5), 0), 2**k - 1)``. In fp32 that is exact: ``y * 2**k`` is, and subtracting 1.5
from it is wherever the result can reach 0 or above (:func:`grid_bits`; the fused kernels' encoder for such a
codebook: a multiply-add and a conversion that rounds up and saturates at 0, instead of a table load; ``y <= 1``
needs no clamp at the top).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "BucketTables",
    "bucket_tables",
    "decision_boundaries",
    "encode",
    "encode_search",
    "flat_keyed",
    "grid_bits",
    "nibble_pairs",
    "pack_nibbles",
    "unpack_nibbles",
]

_MANTISSA_BITS = 23
_MAX_BUCKET_BITS = 12  # per exponent; a codebook needing more has values closer than 2**-12 relative
_SHIFT_BITS = 5  # level-1 entry: (offset << 5) | shift


def _check_codebook(values: tuple[float, ...]) -> torch.Tensor:
    table = torch.tensor(values, dtype=torch.float32)
    if table.dim() != 1 or not 2 <= table.numel() <= 256:
        raise ValueError(f"a codebook has 2 to 256 values, got {table.numel()}")
    if not torch.isfinite(table).all() or table.abs().max() > 1.0:
        raise ValueError(
            f"codebook values must be finite and within [-1, 1], got min {table.min().item()}, max {table.max().item()}"
        )
    if not torch.all(table[1:] >= table[:-1]):
        raise ValueError("codebook values must be sorted in ascending order")
    return table


def decision_boundaries(values: tuple[float, ...], never_zero: bool = False) -> torch.Tensor:
    """The fp32 boundaries ``B`` (``len(values) - 1`` of them) of the rule in the module docstring."""
    table = _check_codebook(tuple(values))
    bounds = (table[1:] + table[:-1]) / 2
    if never_zero:
        zero = (table == 0).nonzero()
        if zero.numel() == 0 or zero[-1].item() == table.numel() - 1:
            raise ValueError("never_zero needs a codebook with 0.0 and a positive value above it")
        bounds[zero[-1].item()] = 0.0
    return bounds


def encode_search(y: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The reference encoder: binary search of ``bounds`` (int64 codes, same shape as ``y``)."""
    y = y.contiguous()
    return torch.where(y < 0, torch.bucketize(y, bounds, right=True), torch.bucketize(y, bounds, right=False))


@dataclass(frozen=True)
class BucketTables:
    """The O(1) encoder's tables for one codebook (CPU tensors; :meth:`to` gives device copies).

    ``level1``: int32 (256,), index ``128 * (y < 0) + exponent``, entry ``(offset << 5) | shift``;
    ``level2``: uint8, the candidate code of each bucket; ``bounds``: fp32 (256,), ``B`` padded with +inf;
    ``level1_bits`` and ``level2_packed``: the same tables in the two-load form :func:`encode` and the fused
    CPU step read (:meth:`level1_by_bits`, :meth:`level2_with_bounds`); the fused CUDA kernels read
    ``level1_bits`` and :meth:`level2_keyed`, the same codes again.
    """

    level1: torch.Tensor
    level2: torch.Tensor
    bounds: torch.Tensor
    level1_bits: torch.Tensor
    level2_packed: torch.Tensor

    def level1_by_bits(self) -> torch.Tensor:
        """``level1`` indexed by the top 9 bits of ``y``'s fp32 pattern (sign and exponent, ``bits >> 23`` as
        unsigned): int32 (512,). Saves the sign arithmetic of the index; entries for exponents above 127
        (``|y| >= 2``, which never occurs) repeat exponent 127's."""
        return self.level1_bits

    def level2_with_bounds(self) -> torch.Tensor:
        """int32 per bucket: ``(low_plus << 8) | candidate``, where the code is ``candidate + 1`` for ``y >= 0``
        when the low ``shift`` bits of ``|y|`` are ``>= low_plus``, for ``y < 0`` when they are ``< low_plus``
        (``low_plus`` is one more than the low bits of the bucket's boundary, or a value that never switches).
        One 4-byte load where ``level2`` and ``bounds`` make two; same data, same codes."""
        return self.level2_packed

    def level2_keyed(self) -> torch.Tensor:
        """:meth:`level2_with_bounds` rearranged for an encoder that compares whole mantissas, with the same codes:
        int32 per bucket, ``((candidate + 1) << 24) - threshold`` (as uint32), indexed by ``offset + (key >>
        shift)`` where ``key`` is the mantissa of ``y`` (23 bits), with every bit flipped for ``y < 0``. The code
        is ``candidate + (key >= threshold)`` for both signs: flipping the bits reverses the order of a negative
        slice's buckets and of the mantissas inside each bucket, so "the low bits are below the switch point"
        becomes "the flipped key reaches the mirrored point". ``threshold`` is at most ``2**23`` (a bucket that
        never switches: every key is below it), so adding ``key`` to the entry carries into the top byte exactly
        when ``key >= threshold``, and the code is ``(entry + key) >> 24``. (A bucket whose candidate is the top
        code never switches, so the entry stays below ``2**32``.) Saves the encoder the low-bit mask, the sign
        test and the comparison."""
        return _level2_keyed(self.level1, self.level2_packed)

    def to(self, device) -> BucketTables:
        return BucketTables(
            *(t.to(device) for t in (self.level1, self.level2, self.bounds, self.level1_bits, self.level2_packed))
        )


def _level1_by_bits(level1: torch.Tensor) -> torch.Tensor:
    out = torch.empty(512, dtype=torch.int32)
    for negative in (0, 1):
        by_exponent = level1[128 * negative : 128 * negative + 128]
        out[256 * negative : 256 * negative + 128] = by_exponent
        out[256 * negative + 128 : 256 * negative + 256] = by_exponent[127]
    return out


def _level2_with_bounds(level1: torch.Tensor, level2: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    level1 = level1.to(torch.int64)
    out = torch.empty(level2.numel(), dtype=torch.int64)
    for negative in (0, 1):
        for exponent in range(128):
            entry = int(level1[128 * negative + exponent])
            offset, shift = entry >> _SHIFT_BITS, entry & 31
            n = 1 << (_MANTISSA_BITS - shift)
            code = level2[offset : offset + n].to(torch.int64)
            base = (exponent << _MANTISSA_BITS) | (torch.arange(n, dtype=torch.int64) << shift)
            top = base + (1 << shift) - 1
            bound = bounds[code]
            bmag = bound.abs().view(torch.int32).to(torch.int64)
            inside = (bmag >= base) & (bmag <= top) & torch.isfinite(bound)
            if negative:  # y >= b  <=>  |y| <= |b|, for b <= 0 inside the bucket; else never
                low_plus = torch.where(inside & (bound <= 0), bmag - base + 1, 0)
            else:  # y > b  <=>  |y| > |b|, for b >= 0 inside the bucket; else never
                low_plus = torch.where(inside & (bound >= 0), bmag - base + 1, 1 << shift)
            out[offset : offset + n] = (low_plus << 8) | code
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _level2_keyed(level1: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    level1, packed = level1.to(torch.int64).cpu(), packed.to(torch.int64).cpu() & 0xFFFFFFFF
    out = torch.empty_like(packed)
    for negative in (0, 1):
        for exponent in range(128):
            entry = int(level1[128 * negative + exponent])
            offset, shift = entry >> _SHIFT_BITS, entry & 31
            n = 1 << (_MANTISSA_BITS - shift)
            entries = packed[offset : offset + n]
            candidate, low_plus = entries & 255, (entries >> 8) & 0xFFFFFF
            bucket = torch.arange(n, dtype=torch.int64)
            if negative:  # key = mantissa ^ 0x7FFFFF: bucket n-1-b, low bits (1 << shift) - 1 - low
                key_bucket, threshold = n - 1 - bucket, (1 << shift) - low_plus
            else:
                key_bucket, threshold = bucket, low_plus
            out[offset + key_bucket] = ((candidate + 1) << 24) - ((key_bucket << shift) + threshold)
    if not bool(((out > 0) & (out < 2**32)).all()):  # a top-code bucket that switches would carry past 32 bits
        raise AssertionError("level2_keyed: an entry does not fit in 32 bits")
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _bucket_ends(exponent: int, bucket_bits: int, negative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest and largest ``y`` of every bucket of one exponent and sign (fp32, ascending in ``y``)."""
    shift = _MANTISSA_BITS - bucket_bits
    k = torch.arange(1 << bucket_bits, dtype=torch.int64)
    lo = (exponent << _MANTISSA_BITS) | (k << shift)
    hi = lo | ((1 << shift) - 1)
    lo_mag = lo.to(torch.int32).view(torch.float32)
    hi_mag = hi.to(torch.int32).view(torch.float32)
    if negative:
        return -hi_mag, -lo_mag
    return lo_mag, hi_mag


def _build_tables(values: tuple[float, ...], never_zero: bool, min_bits: int = 0) -> BucketTables:
    """The tables, each exponent given the fewest mantissa bits (at least ``min_bits``) that separate its
    boundaries."""
    bounds = decision_boundaries(values, never_zero)
    level1 = torch.zeros(256, dtype=torch.int64)
    level2 = []
    offset = 0
    for negative in (False, True):
        for exponent in range(128):
            for bits in range(min_bits, _MAX_BUCKET_BITS + 1):
                first, last = _bucket_ends(exponent, bits, negative)
                lo_code, hi_code = encode_search(first, bounds), encode_search(last, bounds)
                if bool((hi_code - lo_code <= 1).all()):
                    break
            else:
                raise ValueError(
                    f"codebook values are too close together near {first[0].item():.3g} for the O(1) encoder "
                    f"({_MAX_BUCKET_BITS} mantissa bits per exponent)"
                )
            # candidate: the code of the bucket's smallest y (for negatives, its largest magnitude)
            level2.append(lo_code.to(torch.uint8))
            level1[128 * negative + exponent] = (offset << _SHIFT_BITS) | (_MANTISSA_BITS - bits)
            offset += 1 << bits
    padded_bounds = torch.full((256,), float("inf"))
    padded_bounds[: len(values) - 1] = bounds
    level1, level2 = level1.to(torch.int32), torch.cat(level2)
    return BucketTables(
        level1, level2, padded_bounds, _level1_by_bits(level1), _level2_with_bounds(level1, level2, padded_bounds)
    )


_TABLES: dict[tuple, BucketTables] = {}
_LISTS: dict[tuple, tuple] = {}  # the same tables as Python lists, to rebuild them under tracing


def bucket_tables(values: tuple[float, ...], never_zero: bool = False, device=None, like=None) -> BucketTables:
    """The tables of :func:`encode` for one codebook, built once and cached per device.

    Raises ``ValueError`` for a codebook whose values are too close together for 12 mantissa bits per
    exponent to separate its boundaries. Code being traced (``torch.compile``, or ``like`` a fake or
    functional tensor) gets fresh copies, which become constants of the graph: a cached tensor must never be
    created under a tracing mode. So the tables must already have been built eagerly (a format builds them
    when its first tensor is created).
    """
    if like is not None:
        device = like.device
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (tuple(values), bool(never_zero))
    cpu = _TABLES.get(key)
    tracing = torch.compiler.is_compiling() or (like is not None and type(like) is not torch.Tensor)
    if tracing:
        if cpu is None:
            raise RuntimeError(
                "bucket_tables: the codebook's tables were not built before tracing; create a "
                "tensor of the format eagerly first"
            )
        dtypes = (torch.int32, torch.uint8, torch.float32, torch.int32, torch.int32)
        return BucketTables(
            *(torch.tensor(values, dtype=dtype, device=device) for values, dtype in zip(_LISTS[key], dtypes))
        )
    if cpu is None:
        cpu = _TABLES[key] = _build_tables(tuple(values), bool(never_zero))
        _LISTS[key] = tuple(
            t.tolist() for t in (cpu.level1, cpu.level2, cpu.bounds, cpu.level1_bits, cpu.level2_packed)
        )
    return _on_device(key, device)


@functools.cache
def _on_device(key: tuple, device: torch.device) -> BucketTables:
    return _TABLES[key].to(device)


def flat_keyed(
    values: tuple[float, ...], never_zero: bool = False, max_bits: int = _MAX_BUCKET_BITS
) -> tuple[torch.Tensor, int] | None:
    """The encoder in one table load, for a codebook whose exponents each need at most ``max_bits`` mantissa
    bits; else None. Returns (``table``, ``shift``): int32 ``(512 << m,)`` with ``m = 23 - shift`` the most bits
    any exponent needs. For ``b``, ``y``'s fp32 bits, and ``f``, the same with the 23 mantissa bits flipped where
    ``y < 0``, the code is ``(table[b >> shift] + (f & 0x7FFFFF)) >> 24`` (unsigned shifts): the entries are
    those of :meth:`BucketTables.level2_keyed` for tables built with ``m`` bits for every exponent, the row of
    ``(sign, exponent)`` at ``(256 * sign + exponent) << m`` (exponents above 127, ``|y| >= 2``, which never
    occurs, repeat exponent 127's), a negative row in reverse: indexed by the bits as they are, not flipped, so
    that the index does not wait for the flip. For a codebook without negative values the flip may be left out,
    as for the two-load form (``f = b``; its rows are not reversed): every negative ``y`` has one code."""
    values = tuple(float(v) for v in values)
    standard = bucket_tables(values, never_zero)
    m = int((_MANTISSA_BITS - (standard.level1 & 31)).max())
    return _flat_table(values, bool(never_zero), m) if m <= max_bits else None


@functools.cache
def _flat_table(values: tuple[float, ...], never_zero: bool, m: int) -> tuple[torch.Tensor, int]:
    rows = _build_tables(values, never_zero, min_bits=m).level2_keyed().view(2, 128, 1 << m)
    if min(values) < 0:  # indexed by y's own mantissa bits: for y < 0 the keyed rows' order (flipped bits) reversed
        rows = torch.stack([rows[0], rows[1].flip(-1)])
    table = torch.cat([rows, rows[:, 127:].expand(2, 128, 1 << m)], dim=1).reshape(-1).contiguous()
    return table, _MANTISSA_BITS - m


@functools.cache
def grid_bits(values: tuple[float, ...], never_zero: bool = False) -> int:
    """``k`` where the codebook is the even grid ``(i + 1) / 2**k``, ``i < 2**k`` (``k`` from 1 to 8), else 0. Its
    boundaries are then ``(i + 1.5) / 2**k``, exact in fp32, and its code arithmetic (module docstring, "No
    table"): ``y * 2**k`` is exact, and for ``a = y * 2**k >= 0.75`` so is ``a - 1.5`` (1.5 is a multiple of
    ``a``'s unit in the last place, and the difference is smaller than ``a``); below that, and for ``y < 0``, the
    code is 0 whatever the rounding. Such a codebook has no zero level, so none with ``never_zero`` is one. Plain
    Python, no tensor: it may run while ``torch.compile`` traces the code that calls it."""
    n = len(values)
    k = n.bit_length() - 1
    if never_zero or n < 2 or n != 1 << k or k > 8:
        return 0
    return k if all(float(v) == (i + 1) / n for i, v in enumerate(values)) else 0


def encode(y: torch.Tensor, tables: BucketTables) -> torch.Tensor:
    """The code (uint8) of each ``y`` (fp32 in [-1, 1], no NaN) by the rule of the module docstring, in O(1):
    two table loads (:meth:`BucketTables.level1_by_bits`, :meth:`BucketTables.level2_with_bounds`) and
    integer operations, the fused kernels' encoder written in tensor ops.

    Plain tensor code: eager, and under ``torch.compile`` (the tables become constants of the graph). Indexes
    are int32: inductor's C++ backend turns each table load into a scalar loop over the vector's lanes, and
    int64 indexes double the work of building them.
    """
    bits = torch.where(y == 0, 0.0, y).view(torch.int32)  # -0.0 encodes as 0.0
    top = (bits >> _MANTISSA_BITS) & 511  # sign and exponent
    entry = tables.level1_bits[top]
    shift = entry & 31
    packed = tables.level2_packed[(entry >> _SHIFT_BITS) + ((bits & 0x7FFFFF) >> shift)]
    low = bits & ((1 << shift) - 1)
    up = (low >= ((packed >> 8) & 0xFFFFFF)).to(torch.int32) ^ (top >> 8)
    return ((packed & 255) + up).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (flat, values < 16) two per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high
    one; an odd count leaves the last high nibble 0. Returns uint8 of ``ceil(n / 2)`` bytes."""
    codes = codes.reshape(-1).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def nibble_pairs(values: torch.Tensor) -> torch.Tensor:
    """The values of both elements of every code byte of :func:`pack_nibbles`: fp32 ``(256, 2)``, row ``b`` is
    ``(values[b & 15], values[b >> 4])``, for ``values`` a 16-entry decode table. One 8-byte load decodes a byte."""
    byte = torch.arange(256)
    return torch.stack([values[byte & 15], values[byte >> 4]], dim=1).to(torch.float32).contiguous()


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``numel`` uint8 codes."""
    pairs = torch.stack([packed & 15, packed >> 4], dim=-1)  # (n_bytes, 2)
    return pairs.reshape(-1)[:numel]
