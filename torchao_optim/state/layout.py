"""StateLayout: how a format's bytes are laid out, as data the fused engine can read.

A format that can describe itself this way returns a :class:`StateLayout` from ``fast_path_layout()``; the
planner and the CUDA kernels read only this description (and the inner tensors it names), never the
format's class, so a format written after the kernels takes the fused path with no kernel edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["PLAIN_FP32", "SCALE_KINDS", "PlainLayout", "StateLayout"]

SCALE_KINDS = ("block", "rank1", "factored")  # what a StateLayout's scales hold (StateLayout.scale)


@dataclass(frozen=True)
class StateLayout:
    """Blockwise absmax quantization to a sorted codebook.

    Attributes:
        codes (str): name of the elementwise inner tensor holding the codes (uint8, flat).
        scales (str): name of the blockwise inner tensor holding one fp32 absmax per block.
        block_size (int): elements per block; the last block may be short.
        codebook (Tuple[float, ...]): the sorted values a code stands for, within [-1, 1];
            at most ``2**bits`` of them.
        bits (int): 8 (one code per byte) or 4 (two per byte: element ``2i`` in the low nibble).
        never_zero (bool): a nonzero value never encodes to the codebook's 0.0 (``exp_avg_sq``: Adam
            divides by its square root). See :mod:`torchao_optim.quant.codec` for the encoding rule.
        scale (str): what ``scales`` holds. ``"block"``: one absmax per block. ``"rank1"``: the tensor read as the
            row-major ``(rows, numel / rows)`` matrix of its ``rows`` attribute, ``rows`` row maxima then the column
            maxima of the absolute values, element ``(r, c)`` scaled by the smaller of its row's and its column's (the
            4-bit optimizers paper's rank-1 normalization). ``"factored"``: no codes; the tensor read as the matrix of
            its ``rows`` attribute is the rank-1 matrix of its row means (``scales``, fp32, ``rows``) and column means
            (``codes``, fp32, ``numel / rows``), element ``(r, c)`` being ``row[r] * (col[c] / mean(col))``
            (Adafactor's factored second moment, ``state/factored.py``); the codebook is then unused. A format gives
            these layouts from ``fused_layout()``; the kinds each fused executor reads are ``optim.fused.SCALES_READ``'s
            (both read all three), ``block_size`` then being only the size of the pieces they work in.
    """

    codes: str
    scales: str
    block_size: int
    codebook: tuple[float, ...]
    bits: int = 8
    never_zero: bool = False
    scale: str = "block"
    quantized: ClassVar[bool] = True

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"StateLayout.bits must be 8 or 4, got {self.bits!r}")
        if not 2 <= len(self.codebook) <= 2**self.bits:
            raise ValueError(f"a {self.bits}-bit codebook has 2 to {2**self.bits} values, got {len(self.codebook)}")
        if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size % 2:
            raise ValueError(f"StateLayout.block_size must be a positive even int, got {self.block_size!r}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"StateLayout.scale must be one of {SCALE_KINDS}, got {self.scale!r}")

    @property
    def signed(self) -> bool:
        """Whether the codebook holds a negative value. Without one, every negative input encodes to one code
        (the smallest, or the smallest nonzero with ``never_zero``), whatever its mantissa: the fused kernels'
        encoder then skips the sign's part of its key."""
        return self.codebook[0] < 0

    def code_bytes(self, numel: int) -> int:
        """Bytes of codes for ``numel`` elements."""
        return numel if self.bits == 8 else (numel + 1) // 2


@dataclass(frozen=True)
class PlainLayout:
    """A state kept as a plain contiguous fp32 tensor, as the fused kernels read it: one value per element, no codes
    and no scales. The one instance, :data:`PLAIN_FP32`, stands beside the :class:`StateLayout` of quantized
    states wherever the planner and the kernels take a state's layout."""

    quantized: ClassVar[bool] = False
    bits: ClassVar[int] = 32
    block_size: ClassVar[None] = None
    scale: ClassVar[str] = "block"

    def __repr__(self) -> str:
        return "PLAIN_FP32"


PLAIN_FP32 = PlainLayout()
