"""4-bit state, two codes per byte, blocks of 128 (formats "4bit" and "4bit_rank1").

After Li et al., *Memory Efficient Optimizers with 4-bit States* (NeurIPS 2023):

- ``exp_avg`` (``signed=True``): a 16-value signed codebook (``first_moment``, a class attribute, below).
- ``exp_avg_sq`` (``signed=False``): the linear map without a zero level, ``(i + 1) / 16`` for ``i`` in
  0..15. With a zero level every value under half a step of its block's absmax would be stored as 0, and
  Adam's ``1 / sqrt(v)`` of it would explode (the paper's zero-point problem); without one such a value is
  stored as ``absmax / 16``, an overestimate that only shrinks its update.

0.5 byte of code plus 4/128 bytes of absmax per element: 1.06 bytes per parameter for Adam's two states.

``first_moment`` chooses the signed codebook: ``"dynamic"`` is the 4-bit dynamic tree map
(``create_dynamic_map(True, 3, 4)``: three decades, values down to 0.0055 of the absmax) that the paper and
torchao use; ``"quadratic"`` is ``±(k / 8)**2`` for ``k`` in 1..7, plus 0 and 1.0: denser than an even grid
near 0, with fewer levels wasted on the smallest decade. Which is the default, and why, is measured in
``benchmarks/benchmark_parity.py`` (numbers in ``benchmarks/README.md``).

``"4bit_rank1"`` is the same format with the paper's rank-1 normalization for the second moment of tensors of
two or more dimensions: element ``(i, j)`` of the ``(rows, numel / rows)`` matrix is scaled by
``min(row_max[i], col_max[j])`` instead of its block's absmax, which adapts to rows and columns of outliers.
Its scales are not blockwise, so the fused CUDA kernels (which read one absmax per block) do not take it:
its parameters take the per-parameter compiled path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import ClassVar

import torch

from torchao_optim.quant import dynamic_map_values, pack_nibbles, quantize_nearest, unpack_nibbles
from torchao_optim.quant.blockwise import TINY, codebook_tensor
from torchao_optim.state.base import QuantizedState, _slice, aten
from torchao_optim.state.codebook import CodebookState
from torchao_optim.state.layout import StateLayout
from torchao_optim.state.registry import register_state_format

__all__ = ["FourBitTensor", "FourBitRank1Tensor", "linear_map_without_zero", "quadratic_map"]


@functools.cache
def linear_map_without_zero(bits: int = 4) -> tuple[float, ...]:
    """``(i + 1) / 2**bits`` for ``i`` in ``0 .. 2**bits - 1``: an even grid on (0, 1] with no zero level."""
    return tuple(((torch.arange(2**bits, dtype=torch.float64) + 1) / 2**bits).to(torch.float32).tolist())


@functools.cache
def quadratic_map() -> tuple[float, ...]:
    """16 signed values: 0, 1.0 and ``±(k / 8)**2`` for ``k`` in 1..7 (no -1.0, as the dynamic map)."""
    positive = [(k / 8) ** 2 for k in range(1, 8)]
    return tuple([-v for v in reversed(positive)] + [0.0] + positive + [1.0])


_FIRST_MOMENT_MAPS = {"dynamic": lambda: dynamic_map_values(True, 3, 4), "quadratic": quadratic_map}


@register_state_format("4bit")
class FourBitTensor(CodebookState):
    """4-bit codes, two per byte (element ``2i`` in the low nibble), one fp32 absmax per block.

    Fields: ``codes`` (uint8, ``ceil(numel / 2)`` bytes), ``absmax`` (fp32, one per block of ``block_size``
    elements), ``signed`` (``True``: ``first_moment``'s codebook, for ``exp_avg``; ``False``: the linear map
    without zero, for ``exp_avg_sq``), ``block_size`` (default 128).
    """

    attr_fields = ("signed", "block_size")
    default_block_size = 128
    first_moment: ClassVar[str] = "quadratic"

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        if not isinstance(signed, bool):
            raise TypeError(f"{cls.__name__} needs signed=True (exp_avg) or signed=False (exp_avg_sq), got {signed!r}")
        return super()._attrs(block_size=block_size, signed=signed, **attrs)

    @classmethod
    def layout(cls, *, signed: bool, block_size: int, **_) -> StateLayout:
        # No zero level for exp_avg_sq, so never_zero has nothing to lift: 0 < v < absmax/32 encodes to 1/16.
        codebook = _FIRST_MOMENT_MAPS[cls.first_moment]() if signed else linear_map_without_zero(4)
        return StateLayout(codes="codes", scales="absmax", block_size=block_size, codebook=codebook, bits=4)


@register_state_format("4bit_rank1")
class FourBitRank1Tensor(FourBitTensor):
    """:class:`FourBitTensor` with rank-1 normalization of ``exp_avg_sq`` for tensors of two or more dims.

    One more attribute, ``rows``: 0 for blockwise scales (``exp_avg``, and 1-D tensors), else the number of
    rows of the ``(rows, numel / rows)`` matrix the tensor is read as (its first dimension after any leading
    dimensions of size one, taken when the tensor is created, so that it survives the flat views the optimizer
    steps through). With ``rows > 0``, ``absmax`` holds ``rows`` row maxima then ``numel / rows`` column maxima
    (fp32). Leading ones are no rows: a ``(1, 197, 768)`` position embedding is 197 rows of 768, and a ``(1, n)``
    tensor is a vector with blockwise scales (read as one row, each of its columns would need a scale of its
    own, four bytes per element, and its graph would be specialized to one row).

    ``rows`` is also held as a size: the field ``row_marks`` is ``rows`` zero bytes. Flattened for
    ``torch.compile`` the tensor carries ``rows`` that way only, not in its constant attributes, so one
    compiled graph serves every row count (a model's distinct layer widths would otherwise compile one each).
    """

    attr_fields = ("signed", "block_size", "rows")
    row_shardable = False  # a column's maximum spans every rank's rows

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        return super().tensor_fields() + ("row_marks",)

    def __init__(self, shape, dtype=torch.float32, **fields_and_attrs):
        if "row_marks" not in fields_and_attrs:  # derived from rows: quantize_fields leaves it out, as do checkpoints
            # saved before rows was also a size
            rows = fields_and_attrs.get("rows") or 0
            marks = torch.zeros(rows, dtype=torch.uint8, device=fields_and_attrs["codes"].device)
            fields_and_attrs = dict(fields_and_attrs, row_marks=marks)
        super().__init__(shape, dtype, **fields_and_attrs)

    def __tensor_flatten__(self):
        attrs = tuple((k, v) for k, v in self.attrs().items() if k != "rows")
        return list(self.tensor_fields()), (attrs, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        attrs, dtype = ctx
        return cls(outer_size, dtype, **inner, **dict(attrs), rows=inner["row_marks"].shape[0])

    @classmethod
    def layout_of(cls, attrs):
        return super().layout_of({k: v for k, v in attrs.items() if k != "rows"})

    @classmethod
    def _with_rows(cls, shape, attrs):
        if attrs.get("rows") is None:
            shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
            dims = list(shape)
            while dims and dims[0] == 1:
                dims.pop(0)
            matrix = attrs.get("signed") is False and len(dims) >= 2 and shape.numel() > 0
            attrs = dict(attrs, rows=dims[0] if matrix else 0)
        return attrs

    @classmethod
    def zeros(cls, shape: Sequence[int], **attrs) -> QuantizedState:
        return super().zeros(shape, **cls._with_rows(shape, attrs))

    @classmethod
    def from_float(cls, x: torch.Tensor, **attrs) -> QuantizedState:
        return super().from_float(x, **cls._with_rows(getattr(x, "shape", ()), attrs))

    @classmethod
    def _attrs(cls, rows=None, **attrs):
        return dict(super()._attrs(**attrs), rows=0 if rows is None else rows)

    @classmethod
    def matches_layout(cls, value: QuantizedState, *, signed: bool, block_size: int) -> bool:
        # rows follows from the shape, as for a new state of it
        expected = cls._attrs(**cls._with_rows(value.shape, dict(signed=signed, block_size=block_size)))
        return type(value) is cls and value.attrs() == expected

    @classmethod
    def check_attrs(cls, shape: Sequence[int], **attrs) -> None:
        super().check_attrs(shape, **attrs)
        rows, numel = attrs["rows"], torch.Size(shape).numel()
        if not isinstance(rows, int) or rows < 0 or (rows and (attrs["signed"] or numel % rows)):
            raise ValueError(
                f"{cls.__name__}: rows={rows!r} does not describe a tensor of {numel} elements with "
                f"signed={attrs['signed']} (0, or a divisor of numel for signed=False)"
            )

    def fast_path_layout(self) -> StateLayout | None:
        # rank-1 scales are per row and column, not per block: the fused kernels cannot read them
        return None if self.rows else super().fast_path_layout()

    @classmethod
    def quantize_fields(cls, x, **attrs):
        rows = attrs["rows"]
        if not rows:
            return super().quantize_fields(x, **attrs)
        layout = cls.layout_of(attrs)
        x = x.float()
        finite = torch.where(torch.isfinite(x), x.abs(), 0.0)
        # through the flat shape: reshaping the optimizer's (blocks, block_size) view straight to (rows, cols)
        # would guard on how the two divide, and compile a graph per row count after all
        matrix = finite.reshape(-1).view(rows, -1)  # (rows, cols)
        row_max, col_max = matrix.amax(dim=1), matrix.amax(dim=0)  # (rows,), (cols,)
        scale = _element_scales(row_max, col_max, x)
        lift = torch.where(scale < TINY, 2.0**64, 1.0)  # as quant.blockwise.normalize: a subnormal scale
        y = x * lift * (1.0 / torch.where(scale > 0, scale * lift, 1.0))
        y = torch.where(torch.isnan(y), 0.0, y).clamp(-1.0, 1.0).reshape(-1)
        codes = quantize_nearest(y, layout.codebook, layout.never_zero)
        return {layout.codes: pack_nibbles(codes), layout.scales: torch.cat([row_max, col_max])}

    @classmethod
    def zeros_fields(cls, shape, device, **attrs):
        fields = super().zeros_fields(shape, device, **attrs)
        rows = attrs["rows"]
        if rows:
            fields["absmax"] = torch.zeros(rows + torch.Size(shape).numel() // rows, device=device)
        fields["row_marks"] = torch.zeros(rows, dtype=torch.uint8, device=device)
        return fields

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.rows:
            return super().dequantize(dtype)
        layout = self.layout_of(self.attrs())
        numel = self.numel()
        codes = unpack_nibbles(self.codes, numel).to(torch.int64)
        values = codebook_tensor(layout.codebook, self.codes)[codes]
        scale = _element_scales(self.absmax[: self.rows], self.absmax[self.rows :], values)
        return (values * scale).view(self.shape).to(dtype or self.dtype)


def _element_scales(row_max: torch.Tensor, col_max: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each element's rank-1 scale ``min(row_max[i], col_max[j])`` (element ``(i, j)`` of the row-major matrix of
    ``len(row_max)`` rows), in the shape of ``like``. The caller's element-wise math stays in its own shape and only
    this index goes through the matrix: under ``torch.compile``, taking every element through ``(rows, cols)`` and
    back made its index a nest of symbolic divisions. Through the flat shape, for the reason ``quantize_fields``
    gives."""
    return torch.minimum(row_max[:, None], col_max[None, :]).view(-1).view(like.shape)


@FourBitRank1Tensor.implements_op([aten.slice.Tensor])
def _slice_rank1(func, args, kwargs):
    # row shards (FSDP-style chunking): a shard of a rank-1 state would need the column maxima of every row
    self = args[0]
    if self.rows:
        raise NotImplementedError(
            f"{type(self).__name__}: a rank-1 normalized state (rows={self.rows}) cannot be "
            f"sliced: its column maxima span every row; dequantize first"
        )
    return _slice(func, args, kwargs)
