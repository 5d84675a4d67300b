"""What every format whose non-negative matrices keep per-row and per-column numbers shares (``"4bit_rank1"``'s
row and column maxima, ``"factored"``'s row and column means): which rows a state of a shape has, carried as the
attribute ``rows``, and everything that follows from it being taken from the shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from torchao_optim.state.layout import StateLayout

__all__ = ["RowScaled", "matrix_rows", "rows_per_dim0"]


def matrix_rows(shape: Sequence[int], signed: bool | None, min_rows: int = 1) -> int:
    """The rows of the ``(rows, numel / rows)`` matrix a non-negative state of ``shape`` is read as: its first
    dimension after any leading ones (a ``(1, 197, 768)`` position embedding is 197 rows of 768). 0, for blockwise
    scales, where the state may be negative, has fewer than two dimensions besides leading ones (a ``(1, n)`` tensor
    is a vector), is empty, or has fewer than ``min_rows`` rows or columns."""
    shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    dims = list(shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    if signed is not False or len(dims) < 2 or shape.numel() == 0:
        return 0
    rows = dims[0]
    return rows if rows >= min_rows and shape.numel() // rows >= min_rows else 0


class RowScaled:
    """Mixin, before the format's base class: the attribute ``rows`` (0: blockwise scales), taken from the shape
    when a state is created (so it survives the flat views the optimizer steps through), and held as the size of
    the field ``rows_field`` too: flattened for ``torch.compile`` a state carries ``rows`` that way only, not in its
    constant attributes, so one compiled graph serves every row count. Such a state has no blockwise layout: the fused
    kernels that read its kind of scales (``fused_scale``, in its ``fused_layout()``) take it, the others leave it to
    the per-parameter compiled path; a blockwise one (``rows`` 0) is fused as its base format's."""

    rows_field: ClassVar[str]
    min_rows: ClassVar[int] = 1  # the fewest rows and columns a matrix of row scales has (else blockwise)

    @classmethod
    def _attrs(cls, rows=None, **attrs):
        return dict(super()._attrs(**attrs), rows=0 if rows is None else rows)

    @classmethod
    def layout_of(cls, attrs):
        return super().layout_of({k: v for k, v in attrs.items() if k != "rows"})

    @classmethod
    def _with_rows(cls, shape, attrs):
        if attrs.get("rows") is not None:
            return attrs
        return dict(attrs, rows=matrix_rows(shape, attrs.get("signed"), cls.min_rows))

    @classmethod
    def zeros(cls, shape: Sequence[int], **attrs):
        return super().zeros(shape, **cls._with_rows(shape, attrs))

    @classmethod
    def from_float(cls, x: torch.Tensor, **attrs):
        return super().from_float(x, **cls._with_rows(getattr(x, "shape", ()), attrs))

    @classmethod
    def matches_layout(cls, value, *, signed: bool, block_size: int, **attrs) -> bool:
        # rows follows from the shape, as for a new state of it (or from the whole tensor's, for a row shard's)
        expected = cls._attrs(**cls._with_rows(value.shape, dict(signed=signed, block_size=block_size, **attrs)))
        return type(value) is cls and value.attrs() == expected

    @classmethod
    def check_attrs(cls, shape: Sequence[int], **attrs) -> None:
        # any row count that divides the elements: a row shard of a matrix (FSDP2) may hold fewer than min_rows rows
        super().check_attrs(shape, **attrs)
        rows, numel = attrs["rows"], torch.Size(shape).numel()
        if not isinstance(rows, int) or rows < 0 or (rows and (attrs["signed"] or numel % rows)):
            raise ValueError(
                f"{cls.__name__}: rows={rows!r} does not describe a tensor of {numel} elements with "
                f"signed={attrs['signed']} (0, or a divisor of numel for signed=False)"
            )

    # ---- row shards (FSDP2's Shard(0)): the column statistics of the whole tensor --------------------------------
    @classmethod
    def shared_columns(cls, shape: Sequence[int], **attrs) -> int:
        """How many column statistics a state of global ``shape`` shares across its row shards: its columns, for a
        state with rows (``signed=False``, two or more dimensions besides leading ones); else 0."""
        rows = cls._with_rows(shape, {"signed": attrs.get("signed")})["rows"]
        return torch.Size(shape).numel() // rows if rows else 0

    @classmethod
    def shard_attrs(cls, shape: Sequence[int], local_shape: Sequence[int], **attrs) -> dict:
        """The attributes of the state of a row shard of ``local_shape`` of a tensor of global ``shape``: its rows
        are rows of the whole tensor's matrix, whatever its own shape says (a shard of one row is no vector)."""
        cols = cls.shared_columns(shape, **attrs)
        return dict(attrs, rows=torch.Size(local_shape).numel() // cols if cols else 0)

    def __tensor_flatten__(self):
        attrs = tuple((k, v) for k, v in self.attrs().items() if k != "rows")
        return list(self.tensor_fields()), (attrs, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        attrs, dtype = ctx
        return cls(outer_size, dtype, **inner, **dict(attrs), rows=inner[cls.rows_field].shape[0])

    # the StateLayout.scale of a state with rows, for the fused kernels that read it (fused_layout); None: none do
    fused_scale: ClassVar[str | None] = None
    # the fields that layout names in place of the base format's (its "codes" and "scales")
    fused_fields: ClassVar[dict[str, str]] = {}

    def fast_path_layout(self) -> StateLayout | None:
        # scales per row and column are no blockwise absmax
        return None if self.rows else super().fast_path_layout()

    def fused_layout(self) -> StateLayout | None:
        if not self.rows:
            return self.fast_path_layout()
        if self.fused_scale is None:
            return None
        return dataclasses.replace(self.layout_of(self.attrs()), scale=self.fused_scale, **self.fused_fields)


def rows_per_dim0(state) -> int:
    """How many rows of the ``(rows, cols)`` matrix one index of dim 0 of ``state`` holds: 1, or all of them where
    dim 0 is one of the leading dimensions of size one (a ``(1, 197, 768)`` position embedding)."""
    if not state.shape or state.shape[0] == 0 or state.rows % state.shape[0]:
        raise ValueError(
            f"{type(state).__name__}: dim 0 of shape {tuple(state.shape)} does not split its {state.rows} rows evenly"
        )
    return state.rows // state.shape[0]
