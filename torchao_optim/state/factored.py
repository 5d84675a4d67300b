"""Factored second moment (formats "factored" and "factored4"): Adafactor's row and column means for ``exp_avg_sq``.

After Shazeer & Stern, *Adafactor: Adaptive Learning Rates with Sublinear Memory Cost* (ICML 2018):

- a state that may be negative (``signed=True``: Adam's ``exp_avg``, SGD's momentum) keeps blockwise codes: those
  of ``"dtq8"`` (8-bit, blocks of 256) in ``"factored"``, those of ``"4bit"`` (4-bit, blocks of 128) in
  ``"factored4"``;
- a state that is never negative (``signed=False``: ``exp_avg_sq``, ``max_exp_avg_sq``, Adagrad's ``sum``,
  RMSprop's ``square_avg``) of a tensor of two or more dimensions, read as a ``(rows, numel / rows)`` matrix as
  ``"4bit_rank1"`` reads it (rows: the first dimension after any leading ones), keeps only its row means ``r``
  and its column means ``c`` (fp32), and stands for the rank-1 matrix with those means: element ``(i, j)`` is
  ``r[i] * c[j] / mean(c)`` (``mean(c)`` is the mean of every element, as is ``mean(r)``);
- a non-negative state of a vector (1-D, ``(1, n)``) or of a matrix of one row or one column keeps the blockwise
  codes of the unsigned state of ``"dtq8"`` (``"factored"``) or ``"4bit"`` (``"factored4"``): factors would
  take as many bytes as the values.

Writing a value into a factored state (the ``copy_`` at the end of every update) stores its row and column means.
Adam's new ``v = beta2 * v_old + (1 - beta2) * g * g``, with ``v_old`` the rank-1 matrix of the state, has row
means ``beta2 * r + (1 - beta2) * rowmean(g * g)``, since the row means of the rank-1 matrix are ``r`` (and its
column means ``c``): the stored factors are Adafactor's exponential moving averages of the row and column means of
``g * g``. The step itself divides by the whole new ``v`` (the factored one plus this step's ``g * g``), as the
update rules hand the value they computed to the parameter's update before it is stored.

A non-finite element counts as 0 in the means (the optimizers never store one: they skip such elements), and a
negative one as 0 (the state is never negative; ``from_float`` refuses negative input, as an unsigned codebook
does). An all-zero state decodes to zeros.

Bytes: ``4 * (rows + cols)`` per factored matrix, nothing per element; Adam's two states on TinyLlama-1.1B's
geometry: about 1.02 bytes per parameter with ``"factored"`` (the 8-bit ``exp_avg``) and 0.53 with
``"factored4"``, against 2.03 (``"dtq8"``) and 1.06 (``"4bit"``).

Fast path: a factored state has no :class:`StateLayout` (its scales are no blockwise absmax), so a parameter with
one takes the per-parameter compiled path; a parameter whose states are all blockwise (a vector; an optimizer whose
states are all signed) is fused as in ``"dtq8"`` or ``"4bit"``. Its column means span every row: a parameter
sharded by rows (FSDP2) keeps plain state (``row_shardable``), and a factored state cannot be sliced by rows.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from torchao_optim.state.base import _OPS, _slice_bound, aten
from torchao_optim.state.codebook import CodebookState
from torchao_optim.state.dtq8 import DTQ8bitTensor
from torchao_optim.state.fourbit import FourBitTensor
from torchao_optim.state.layout import StateLayout
from torchao_optim.state.registry import register_state_format
from torchao_optim.state.rows import RowScaled

__all__ = ["Factored4Tensor", "FactoredState", "FactoredTensor"]


class FactoredState(RowScaled, CodebookState):
    """Blockwise codes of ``blockwise_format``'s layout, or, for a non-negative state of a matrix, its row and
    column means (see the module's docstring). Subclasses name ``blockwise_format``.

    Fields: ``codes`` and ``absmax`` (the blockwise codes and scales; empty for a factored state), ``row_mean``
    (fp32, ``rows``) and ``col_mean`` (fp32, ``numel / rows``; both empty for a blockwise state). Attributes:
    ``signed``, ``block_size`` and ``rows`` (0: blockwise; else the matrix's rows, taken when the state is
    created, so that they survive the flat views the optimizer steps through). Flattened for ``torch.compile``
    the state carries ``rows`` only as the size of ``row_mean``, so one compiled graph serves every row count.
    """

    attr_fields = ("signed", "block_size", "rows")
    rows_field = "row_mean"
    min_rows = 2  # factors of a matrix of one row or column would take as many bytes as its values
    blockwise_format: ClassVar[type[CodebookState]]
    # Shard(0): a column's mean spans every rank's rows, and nothing reconciles it (rank-1 maxima are all-reduced,
    # optim/sharded_columns.py; means are not): a row-sharded parameter keeps plain state
    row_shardable = False
    column_shardable = False  # Shard(1): a row's mean would span ranks

    @classmethod
    def data_fields(cls) -> tuple[str, ...]:
        return super().data_fields() + ("row_mean", "col_mean")

    @classmethod
    def _attrs(cls, signed=None, **attrs):
        if not isinstance(signed, bool):
            raise TypeError(f"{cls.__name__} needs signed=True (exp_avg) or signed=False (exp_avg_sq), got {signed!r}")
        return super()._attrs(signed=signed, **attrs)

    @classmethod
    def layout(cls, *, signed: bool, block_size: int, **_) -> StateLayout:
        return cls.blockwise_format.layout(signed=signed, block_size=block_size)

    @classmethod
    def quantize_fields(cls, x, **attrs):
        rows = attrs["rows"]
        if not rows:
            empty = torch.zeros(0, device=x.device)
            return dict(super().quantize_fields(x, **attrs), row_mean=empty, col_mean=empty.clone())
        x = x.float()
        x = torch.where(torch.isfinite(x), x, 0.0).clamp_min(0.0)
        # through the flat shape: reshaping the optimizer's (blocks, block_size) view straight to (rows, cols) would
        # guard on how the two divide, and compile a graph per row count
        matrix = x.reshape(-1).view(rows, -1)  # (rows, cols)
        return dict(cls._no_codes(x.device), row_mean=matrix.mean(dim=1), col_mean=matrix.mean(dim=0))

    @classmethod
    def _no_codes(cls, device) -> dict[str, torch.Tensor]:
        return {"codes": torch.zeros(0, dtype=torch.uint8, device=device), "absmax": torch.zeros(0, device=device)}

    @classmethod
    def zeros_fields(cls, shape, device, **attrs):
        rows = attrs["rows"]
        if not rows:
            empty = torch.zeros(0, device=device)
            return dict(super().zeros_fields(shape, device, **attrs), row_mean=empty, col_mean=empty.clone())
        cols = torch.Size(shape).numel() // rows
        return dict(
            cls._no_codes(device), row_mean=torch.zeros(rows, device=device), col_mean=torch.zeros(cols, device=device)
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.rows:
            return super().dequantize(dtype)
        mean = self.col_mean.mean()  # of every element
        col = torch.where(mean > 0, self.col_mean / mean, 0.0)  # an all-zero state: zeros
        return (self.row_mean[:, None] * col[None, :]).view(-1).view(self.shape).to(dtype or self.dtype)

    def check_fields(self) -> None:
        super().check_fields()
        for name in ("row_mean", "col_mean"):
            got = getattr(self, name)
            bad = ~(torch.isfinite(got) & (got >= 0))
            if bad.any():
                i = int(bad.nonzero()[0])
                raise ValueError(
                    f"{type(self).__name__}.{name} must be finite and non-negative (a mean of a state that is never "
                    f"negative); entry {i} holds {got[i].item()}"
                )


def _factored(t) -> bool:
    return isinstance(t, FactoredState) and bool(t.rows)


@FactoredState.implements_op([aten.slice.Tensor])
def _slice_factored(func, args, kwargs):
    # a factored state's rows share its column means: all of them (a view, as DCP's narrow of a whole tensor) or none
    self = args[0]
    if _factored(self):
        dim, start, end = (list(args[1:]) + [0, None, None][len(args) - 1 :])[:3]
        size = self.shape[dim % self.dim()]
        if dim % self.dim() == 0 and (_slice_bound(start, 0, size), _slice_bound(end, size, size)) == (0, size):
            return self._new(self.fields())
        raise NotImplementedError(
            f"{type(self).__name__}: a factored state of shape {tuple(self.shape)} (rows={self.rows}) cannot be sliced "
            f"(dim={dim}, [{start}:{end}]): its column means are those of every row; dequantize it first"
        )
    return _OPS[func](func, args, kwargs)


@FactoredState.implements_op([aten.cat.default, aten.constant_pad_nd.default])
def _rows_of_factored(func, args, kwargs):
    # DTensor's gathers and pads of row shards: never a factored state (row_shardable is False)
    tensors = args[0] if func is aten.cat.default else [args[0]]
    if any(_factored(t) for t in tensors):
        raise NotImplementedError(
            f"{func}: a factored state (row and column means) cannot be concatenated or padded; dequantize it first"
        )
    return _OPS[func](func, args, kwargs)


@FactoredState.implements_op([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros_factored(func, args, kwargs):
    # another shape: its rows follow from it, as for a new state
    self, size = args[0], args[1]
    attrs = self.attrs() if torch.Size(size) == self.shape else dict(self.attrs(), rows=None)
    return type(self).zeros(
        size, device=kwargs.get("device") or self.device, dtype=kwargs.get("dtype") or self.dtype, **attrs
    )


if torch.distributed.is_available() and hasattr(torch.ops, "_c10d_functional"):

    @FactoredState.implements_op([torch.ops._c10d_functional.all_gather_into_tensor.default])
    def _all_gather_factored(func, args, kwargs):
        # a gather of row shards: never a factored state (row_shardable is False)
        if _factored(args[0]):
            raise NotImplementedError(f"{func}: a factored state is never sharded by rows; dequantize it first")
        return _OPS[func](func, args, kwargs)


@register_state_format("factored")
class FactoredTensor(FactoredState):
    """``"dtq8"``'s 8-bit codes (blocks of 256), and Adafactor's row and column means for a non-negative state of a
    matrix: :class:`FactoredState`."""

    blockwise_format = DTQ8bitTensor
    default_block_size = DTQ8bitTensor.default_block_size


@register_state_format("factored4")
class Factored4Tensor(FactoredState):
    """``"4bit"``'s 4-bit codes (blocks of 128), and Adafactor's row and column means for a non-negative state of a
    matrix: :class:`FactoredState`."""

    blockwise_format = FourBitTensor
    default_block_size = FourBitTensor.default_block_size
