"""Fp8Tensor: 8-bit floating-point codes with one fp32 absmax per block (format "fp8").

A float8 number is a sign, an exponent and a mantissa: its relative precision is the same at every magnitude
(3 mantissa bits for e4m3, 2 for e5m2), where the dynamic tree map spends its bits unevenly across decades.
Scaled so that a block's absmax is the format's largest finite value, the finite float8 values form a sorted
codebook within [-1, 1], so this is a :class:`CodebookState` like any other: decoding is one table load,
encoding the O(1) encoder with the project's tie rule (ties toward zero, where a float8 cast rounds half to
even), and the fused CUDA path follows from the layout.

- ``exp_avg`` (``signed=True``): e4m3 (``torch.float8_e4m3fn``): 253 distinct finite values (two NaN patterns,
  and -0.0 equals 0.0). A code is the value's rank in the sorted codebook; :meth:`Fp8Tensor.float8_bits` gives
  the real ``float8_e4m3fn`` bit patterns.
- ``exp_avg_sq`` (``signed=False``): never negative, so a sign bit is wasted. The default spends it on the
  mantissa: an unsigned 8-bit float with 4 exponent and 4 mantissa bits (``"e4m4"``; every pattern finite,
  subnormals as in IEEE 754), whose codes are its own bit patterns. Measured on the parity case
  (``benchmarks/benchmark_parity.py``), its error is lower than with e4m3 (the signed format's positive half,
  whose codes are exactly the ``float8_e4m3fn`` bit patterns) and than with e5m2 (wider range, one mantissa
  bit less): see ``benchmarks/README.md``. ``second_moment`` (a class attribute) selects one of the three.

``never_zero`` holds for ``exp_avg_sq``: a positive value never encodes to 0.0 (Adam divides by its square
root). Blocks of 256; 1 + 4/256 = 1.016 bytes per element, as ``"dtq8"``.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from torchao_optim.state.codebook import CodebookState
from torchao_optim.state.layout import StateLayout
from torchao_optim.state.registry import register_state_format

__all__ = ["Fp8Tensor", "float8_codebook"]

_TORCH_FLOAT8 = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
# e4m3 codes: ranks 0..125 are the negatives from -448 up (bit patterns 0xFE down to 0x81), rank 126 is 0.0,
# ranks 127..252 the positives (0x01 up to 0x7E)
_E4M3_NEGATIVES = 126


def _unsigned_minifloat(exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    """Every value of an unsigned float of ``exponent_bits + mantissa_bits`` bits (all patterns finite,
    subnormals for exponent 0), in bit-pattern order, which is ascending. The bias only scales the values,
    and the codebook is normalized by its largest value, so it is left out."""
    bits = torch.arange(2 ** (exponent_bits + mantissa_bits), dtype=torch.float64)
    exponent, mantissa = torch.div(bits, 2**mantissa_bits, rounding_mode="floor"), bits % 2**mantissa_bits
    fraction = mantissa / 2**mantissa_bits
    return torch.where(exponent == 0, fraction * 2.0, (1 + fraction) * 2.0**exponent)


@functools.cache
def float8_codebook(kind: str, signed: bool) -> tuple[float, ...]:
    """The sorted finite values of an 8-bit float, divided by the largest: a codebook within [-1, 1].

    Args:
        kind (str): ``"e4m3"`` (``torch.float8_e4m3fn``), ``"e5m2"`` (``torch.float8_e5m2``) or ``"e4m4"``
            (unsigned: 4 exponent and 4 mantissa bits, no sign; ``signed=False`` only).
        signed (bool): both signs (253 values for e4m3, 247 for e5m2), or the values >= 0 only.
    """
    if kind == "e4m4":
        if signed:
            raise ValueError("the e4m4 float8 codebook has no sign bit: it takes signed=False only")
        values = _unsigned_minifloat(4, 4)
    elif kind in _TORCH_FLOAT8:
        patterns = torch.arange(256, dtype=torch.int16).to(torch.uint8)
        values = patterns.view(getattr(torch, _TORCH_FLOAT8[kind])).to(torch.float64)
        values = torch.unique(values[torch.isfinite(values)]) + 0.0  # sorted; -0.0 and 0.0 are one value, 0.0
        if not signed:
            values = values[values >= 0]
    else:
        raise ValueError(f"unknown float8 kind {kind!r}; choose 'e4m3', 'e5m2' or 'e4m4'")
    return tuple((values / values.abs().max()).to(torch.float32).tolist())


@register_state_format("fp8")
class Fp8Tensor(CodebookState):
    """8-bit float codes, one fp32 absmax per block.

    Fields: ``codes`` (uint8, flat, one per element: the rank of its value in the sorted codebook),
    ``absmax`` (fp32, one per block of ``block_size`` elements; the last block may be short), ``signed``
    (``True``: e4m3 for ``exp_avg``; ``False``: ``second_moment``'s kind for ``exp_avg_sq``), ``block_size``
    (default 256). A stored value is ``codebook[code] * absmax``: the float8 value times ``absmax`` over the
    kind's largest finite value (448 for e4m3).
    """

    attr_fields = ("signed", "block_size")
    default_block_size = 256
    first_moment: ClassVar[str] = "e4m3"
    second_moment: ClassVar[str] = "e4m4"

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        if not isinstance(signed, bool):
            raise TypeError(f"{cls.__name__} needs signed=True (exp_avg) or signed=False (exp_avg_sq), got {signed!r}")
        return super()._attrs(block_size=block_size, signed=signed, **attrs)

    @classmethod
    def layout(cls, *, signed: bool, block_size: int) -> StateLayout:
        kind = cls.first_moment if signed else cls.second_moment
        return StateLayout(
            codes="codes",
            scales="absmax",
            block_size=block_size,
            codebook=float8_codebook(kind, signed),
            never_zero=not signed,
        )

    def float8_bits(self) -> torch.Tensor:
        """The codes as the bit patterns of ``torch.float8_e4m3fn`` (uint8, flat), for a tensor whose kind is
        e4m3: an element's value is ``bits.view(torch.float8_e4m3fn).float() / 448`` times its block's absmax."""
        kind = self.first_moment if self.signed else self.second_moment
        if kind != "e4m3":
            raise ValueError(f"float8_bits: this tensor's codes are {kind}, not e4m3")
        if not self.signed:  # the positive half in order: ranks are the bit patterns
            return self.codes.clone()
        rank = self.codes.to(torch.int16)
        bits = torch.where(rank < _E4M3_NEGATIVES, 0xFE - rank, rank - _E4M3_NEGATIVES)
        return bits.to(torch.uint8)
