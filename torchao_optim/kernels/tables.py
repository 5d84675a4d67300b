"""A layout's codebook as the fused kernels read it: decode values and encoder tables, on the kernels' device.

:mod:`torchao_optim.quant.codec` builds the encoder's forms (``BucketTables``, ``flat_keyed``, ``grid_bits``,
``nibble_pairs``) for any codebook and knows no kernel. Which form each kernel family reads is the kernels'
choice, made here: the Triton kernels decode 4-bit codes a byte at a time and take their encoder as a constexpr
(``FLAT``: one table load, two, or an even grid's arithmetic); the C step takes the one-load table where the codebook
allows it, else the two-level tables with bounds.
The tables are built once per (codebook, device, executor) and kept.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from torchao_optim.quant import bucket_tables
from torchao_optim.quant.codec import flat_keyed, grid_bits, nibble_pairs

__all__ = [
    "CPU_FLAT_MAX_BITS",
    "FLAT_MAX_BITS",
    "layout_tables",
    "decode_table",
    "flat_shift",
    "codebook_flat_shift",
    "encoder_tables",
]

# The encoder in one table load (codec.flat_keyed) for a codebook whose exponents need at most this many mantissa
# bits each (a table of 512 << bits int32); two loads for the others (0: always two). The 4-bit codebooks need 3, the
# dynamic 8-bit maps 7 (256 KB, of which a step reads the rows of the exponents its values have). Measured on an H200
# with benchmarks/tune_fused.py, TinyLlama geometry (figures in benchmarks/README.md): 4-bit bf16 12% faster
# (with the byte-pair decode), dtq8 bf16 6% (ViT-B too); fp32 parameters, at their floor already, unchanged.
FLAT_MAX_BITS = 7
# The same limit for the fused C step, whose one-load encoder is a gather of 16 lanes, with a handful of integer
# operations in place of the two-load form's twenty or so (cpu_step.c); measured in benchmarks/README.md ("CPU").
CPU_FLAT_MAX_BITS = 7


def layout_tables(layout, device, executor: str) -> tuple[Tensor, ...]:
    """(decode values, level1, level2) of a layout's codebook on ``device``, in the form ``executor``'s kernels
    read; placeholders for plain fp32 state."""
    if not layout.quantized:
        return (placeholder(device),) * 3
    return (decode_table(layout, device, executor),) + encoder_tables(
        layout.codebook, layout.never_zero, device, executor, flat_shift(layout, executor)
    )


@functools.cache
def decode_table(layout, device, executor: str) -> Tensor:
    """The codebook as fp32, padded with zeros to ``2**bits`` values (a kernel may load the whole table at once,
    the fused CPU step's 4-bit decode does); the padding is never a code's value. The Triton kernels decode
    4-bit codes a byte at a time: the values of both nibbles of every byte (``codec.nibble_pairs``)."""
    values = torch.zeros(2**layout.bits, dtype=torch.float32)
    values[: len(layout.codebook)] = torch.tensor(layout.codebook, dtype=torch.float32)
    if layout.bits == 4 and executor == "triton":
        values = nibble_pairs(values)
    return values.to(device)


def flat_shift(layout, executor: str) -> int:
    """The form of a layout's encoder for ``executor``'s kernels: the Triton kernels' ``FLAT`` constexpr
    (:func:`codebook_flat_shift`); for the fused C step, the shift of its one-load encoder where the codebook needs at
    most :data:`CPU_FLAT_MAX_BITS` mantissa bits per exponent, else 0 (two loads; the C step has no arithmetic grid
    form); 0 for plain fp32 state and the compiled path."""
    if not layout.quantized or executor not in ("triton", "cpu"):
        return 0
    if executor == "cpu":
        return codebook_flat_shift(layout.codebook, layout.never_zero, CPU_FLAT_MAX_BITS, grid=False)
    return codebook_flat_shift(layout.codebook, layout.never_zero, FLAT_MAX_BITS)


def codebook_flat_shift(codebook, never_zero: bool, max_bits: int, grid: bool = True) -> int:
    """The form of a codebook's encoder in the Triton kernels (their ``FLAT`` constexpr): ``-k`` for the even grid
    ``(i + 1) / 2**k`` (``codec.grid_bits``: arithmetic, no table; unless not ``grid``), else the shift of its
    one-load encoder where it needs at most ``max_bits`` mantissa bits per exponent, else 0 (two loads)."""
    k = grid_bits(tuple(codebook), bool(never_zero)) if grid else 0
    if k:
        return -k
    one = flat_keyed(tuple(codebook), never_zero, max_bits) if max_bits else None
    return 0 if one is None else one[1]


@functools.cache
def encoder_tables(codebook, never_zero: bool, device, executor: str, shift: int) -> tuple[Tensor, Tensor]:
    """The encoder's tables of a codebook in the form ``executor``'s kernels read: codec.BucketTables.level1_by_bits,
    and level2_keyed (Triton) or level2_with_bounds (the C step); with ``shift`` (:func:`flat_shift`), the one table
    of codec.flat_keyed, twice (the Triton kernels read the first); below 0 (an even grid's arithmetic encoder),
    placeholders."""
    if shift < 0:
        return placeholder(device), placeholder(device)
    if shift:
        table = flat_keyed(codebook, never_zero, 23 - shift)[0].to(device)
        return table, table
    t = bucket_tables(codebook, never_zero)
    level2 = t.level2_keyed() if executor == "triton" else t.level2_with_bounds()
    return t.level1_by_bits().to(device), level2.to(device)


@functools.cache
def placeholder(device) -> Tensor:
    """A one-element fp32 tensor on ``device``: a table argument a kernel never reads (a plain state's)."""
    return torch.zeros(1, dtype=torch.float32, device=device)
