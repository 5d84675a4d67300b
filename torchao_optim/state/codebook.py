"""CodebookState: a format that is blockwise absmax quantization to a sorted codebook, declared as data.

A subclass names its inner tensors and says, from its attributes, which :class:`StateLayout` it stores
(``layout(**attrs)``); quantizing, dequantizing, zeros and the fused CUDA path all follow from that
description. ``DTQ8bitTensor`` is one such format; a new codebook format is a dozen lines.
"""

from __future__ import annotations

import functools

import torch

from torchao_optim.quant import bucket_tables, dequantize_blockwise, n_blocks, quantize_blockwise
from torchao_optim.state.base import QuantizedState
from torchao_optim.state.layout import StateLayout

__all__ = ["CodebookState"]


@functools.cache
def _zero_code(codebook: tuple[float, ...]) -> int:
    # the code of 0.0: the number of decision boundaries below 0 (a midpoint's sign survives fp32 rounding,
    # and a boundary lifted by never_zero is 0.0 itself, not below it)
    return sum(1 for a, b in zip(codebook, codebook[1:]) if a + b < 0)


_LAYOUTS: dict[tuple, StateLayout] = {}


class CodebookState(QuantizedState):
    """Base of the codebook formats: implement ``layout(**attrs)``; the rest is derived.

    The inner tensors are the layout's ``codes`` (elementwise; for 4-bit codes, two per byte) and
    ``scales`` (blockwise, fp32 absmax) fields.
    """

    elementwise_fields = ("codes",)
    blockwise_fields = ("absmax",)
    column_shardable = True  # one scale per block; dequantize reads compact() fields

    @classmethod
    def layout(cls, **attrs) -> StateLayout:
        raise NotImplementedError(f"{cls.__name__} must implement layout(**attrs)")

    @classmethod
    def layout_of(cls, attrs) -> StateLayout:
        """``layout(**attrs)``, computed once per (format, attributes): compiled code reads the cached
        description and never traces how a format builds its codebook."""
        key = (cls, tuple(sorted(attrs.items())))
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _LAYOUTS[key] = cls.layout(**attrs)
        return layout

    def fast_path_layout(self) -> StateLayout | None:
        return self.layout_of(self.attrs())

    @classmethod
    def check_attrs(cls, shape, **attrs) -> None:
        super().check_attrs(shape, **attrs)
        layout = cls.layout_of(attrs)
        # Build the encoder's tables now, eagerly: compiled code uses them as constants. A codebook the O(1)
        # encoder cannot separate raises ValueError here, naming where.
        bucket_tables(layout.codebook, layout.never_zero)

    @classmethod
    def check_values(cls, x, **attrs):
        layout = cls.layout_of(attrs)
        if min(layout.codebook) >= 0:
            negative = x < 0
            if negative.any():
                described = ", ".join(f"{k}={v!r}" for k, v in attrs.items())
                raise ValueError(
                    f"{cls.__name__} with {described} stores values >= 0 only (its codebook has no "
                    f"negative values); got {int(negative.sum())} negative values, the smallest "
                    f"{x.min().item()}"
                )

    @classmethod
    def quantize_fields(cls, x, **attrs):
        layout = cls.layout_of(attrs)
        codes, absmax = quantize_blockwise(x, layout.codebook, layout.block_size, layout.never_zero, layout.bits)
        return {layout.codes: codes, layout.scales: absmax}

    @classmethod
    def zeros_fields(cls, shape, device, **attrs):
        layout = cls.layout_of(attrs)
        numel = torch.Size(shape).numel()
        zero = _zero_code(layout.codebook)
        byte = zero if layout.bits == 8 else zero | (zero << 4)
        return {
            layout.codes: torch.full((layout.code_bytes(numel),), byte, dtype=torch.uint8, device=device),
            layout.scales: torch.zeros(n_blocks(numel, layout.block_size), device=device),
        }

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        self = self.compact()  # a slice of columns: its codes and scales in row-major order
        layout = self.fast_path_layout()
        return dequantize_blockwise(
            getattr(self, layout.codes),
            getattr(self, layout.scales),
            layout.codebook,
            layout.block_size,
            self.shape,
            dtype or self.dtype,
            layout.bits,
        )
