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

The means are sums in fp64 over the number of rows or columns, rounded to fp32 once: a sum of non-negative fp32
values in fp64 is within ``n * 2**-53`` of the exact one (relative), so how it is split up (over ranks, below) moves
an fp32 mean only where the exact mean lies that close to a rounding boundary.

Fast path: a factored state has no blockwise layout (``fast_path_layout()`` is ``None``: its scales are no blockwise
absmax), but ``fused_layout()`` gives a :class:`StateLayout` of its own kind (``scale="factored"``: the column means
named in place of codes, the row means in place of scales). Both fused executors read it
(``optim.fused.SCALES_READ``). On the CPU the C step decodes ``r[i] * c[j] / mean(c)``, runs the rule's update, folds
the new values' row and column sums in fp64 range by range (non-finite and negative values as 0) and stores the new
means last, the compiled path's bit for bit. On CUDA the plan makes each matrix's columns over their mean (the mean an
fp64 sum rounded to fp32, as the C step makes it) into a buffer the kernels read in place of codes; the first pass
(``kernels/triton_rank1.py``, as for rank-1 scales) runs the update and adds each tile's new values into fp64 row and
column sums with atomic additions (their order varies: a mean moves only where the exact one lies within the sum's
rounding of an fp32 rounding boundary, above); the step kernels decode a row mean times that column and write no
codes, and the plan stores each sum over its count as the new means last (in Triton's interpreter the compiled
path's bit for bit). A parameter whose states are all blockwise (a vector; an optimizer whose states are all signed)
is fused as in ``"dtq8"`` or ``"4bit"`` on both. A factored matrix sharded by rows (below) takes the per-parameter
path on either device: its column means span ranks.

Sharded by rows (FSDP2's ``Shard(0)``), each rank holds whole rows: their row means are its own, but a column's mean
spans every rank. Each rank's state stores its rows' means and the column means of the whole tensor, which the step
computes from the ranks' column sums and row counts, all-reduced (``optim/sharded_columns.py``): the state of one
process, bit for bit where the fp64 sums round alike (above). A slice of rows (a checkpoint's resharding) is a view
that keeps the whole tensor's column means; it cannot be requantized on its own. Sharded by columns (``Shard(1)``)
a row's mean would span ranks: such a parameter keeps plain state (``column_shardable``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from torchao_optim.state.base import _OPS, QuantizedState, _slice_bound, aten
from torchao_optim.state.codebook import CodebookState
from torchao_optim.state.dtq8 import DTQ8bitTensor
from torchao_optim.state.fourbit import FourBitTensor
from torchao_optim.state.layout import StateLayout
from torchao_optim.state.registry import register_state_format
from torchao_optim.state.rows import RowScaled, rows_per_dim0

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
    # Shard(0): every rank stores its own rows' means, and the column means of the whole tensor from the column sums
    # and row counts all-reduced (shared_columns says how many columns; optim/sharded_columns.py)
    row_shardable = True
    column_reduce = "sum"
    column_shardable = False  # Shard(1): a row's mean would span ranks
    # Rows of a larger state (a slice, for DCP's resharding): ``row_mean`` a view of some of its rows', ``col_mean``
    # its own (the whole tensor's), which requantizing these rows alone would overwrite with theirs
    _row_slice: bool = False
    # the fused kernels read a factored state's means (StateLayout.scale "factored"): the column means where a
    # blockwise state's codes are, the row means where its scales are
    fused_scale = "factored"
    fused_fields = {"codes": "col_mean", "scales": "row_mean"}

    def fused_layout(self) -> StateLayout | None:
        # a slice of rows cannot be written on its own (assign)
        return None if self._row_slice and self.rows else super().fused_layout()

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
    def quantize_fields(cls, x, columns=None, **attrs):
        """As every format's; ``columns`` (factored states only): the column sums (fp64) and, last, the row count of
        the whole tensor where ``x`` is a row shard of it (:meth:`column_stat`, summed over the shards), whose
        column means it takes instead of ``x``'s own."""
        rows = attrs["rows"]
        if not rows:
            empty = torch.zeros(0, device=x.device)
            return dict(super().quantize_fields(x, **attrs), row_mean=empty, col_mean=empty.clone())
        matrix = cls._matrix(x, rows)  # (rows, cols), fp64
        row_mean = matrix.sum(dim=1) / matrix.shape[1]
        # the same division either way: by the row count, exact in fp64
        col_mean = matrix.sum(dim=0) / rows if columns is None else columns[:-1] / columns[-1]
        return dict(cls._no_codes(x.device), row_mean=row_mean.float(), col_mean=col_mean.float())

    @staticmethod
    def _matrix(x, rows: int) -> torch.Tensor:
        """``x`` as the fp64 ``(rows, cols)`` matrix whose means are stored: non-finite and negative elements as 0."""
        x = x.float()
        x = torch.where(torch.isfinite(x), x, 0.0).clamp_min(0.0)
        # through the flat shape: reshaping the optimizer's (blocks, block_size) view straight to (rows, cols) would
        # guard on how the two divide, and compile a graph per row count
        return x.reshape(-1).view(rows, -1).double()

    @classmethod
    def column_stat(cls, x, rows: int, cols: int) -> torch.Tensor:
        """The column sums of ``x`` read as ``rows`` rows, then ``rows`` (fp64 ``(cols + 1,)``): summed over a tensor's
        row shards, its column sums and row count; zeros for no rows."""
        if x is None or not rows:
            return torch.zeros(cols + 1, dtype=torch.float64, device=None if x is None else x.device)
        matrix = cls._matrix(x, rows)
        return torch.cat([matrix.sum(dim=0), matrix.new_full((1,), rows)])

    def assign(self, value: torch.Tensor, columns: torch.Tensor | None = None) -> QuantizedState:
        """As every format's; with ``columns``, the column means of those sums and rows (see ``quantize_fields``)."""
        if self._row_slice and self.rows:
            raise NotImplementedError(
                f"{type(self).__name__}: rows of a factored state (rows={self.rows}) cannot be requantized on their "
                f"own: their column means are those of every row; write the whole state"
            )
        return super().assign(value, columns if self.rows else None)

    def compact(self) -> FactoredState:
        """This state with fields of its own: itself, or a copy if it is a slice of rows (``_row_slice``)."""
        if not self._row_slice:
            return self
        return type(self)(self.shape, self.dtype, **{k: v.clone() for k, v in self.fields().items()}, **self.attrs())

    def _new(self, fields, shape=None, dtype=None):
        out = super()._new(fields, shape=shape, dtype=dtype)
        out._row_slice = self._row_slice  # a view (detach, alias, view) of a slice of rows is one too
        return out

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
        # of every element: the fp64 sum over the columns, rounded once (as the fused kernels take it)
        mean = (self.col_mean.double().sum() / self.col_mean.numel()).float()
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


def _with_rows(self, shape, row_mean, col_mean, rows: int, row_slice: bool = False) -> FactoredState:
    """A factored state of ``shape`` like ``self`` with these means and ``rows``."""
    out = type(self)(
        shape,
        self.dtype,
        **self._no_codes(row_mean.device),
        row_mean=row_mean,
        col_mean=col_mean,
        **dict(self.attrs(), rows=rows),
    )
    out._row_slice = row_slice
    return out


@FactoredState.implements_op([aten.slice.Tensor])
def _slice_factored(func, args, kwargs):
    # rows of a row-sharded state (DCP's resharding, a single-process state split among ranks): those rows' means
    # and the column means of the whole, both views
    self = args[0]
    if not _factored(self):
        return _OPS[func](func, args, kwargs)
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1 :])[:4]
    dim = dim % self.dim()
    size = self.shape[0]
    start = _slice_bound(start, 0, size)
    end = max(start, _slice_bound(end, size, size))
    if dim != 0 or (step != 1 and end - start > 1):
        raise NotImplementedError(
            f"{type(self).__name__}: a factored state of shape {tuple(self.shape)} (rows={self.rows}) is sliced along "
            f"dim 0 with step 1 only, got dim={dim}, step={step}: a row's mean spans its columns"
        )
    if (start, end) == (0, size):
        return self._new(self.fields())
    shape = (end - start,) + tuple(self.shape[1:])
    if start == end:  # no rows: an empty state, which holds no mean
        return type(self).zeros(shape, device=self.device, dtype=self.dtype, **dict(self.attrs(), rows=0))
    k = rows_per_dim0(self)
    return _with_rows(self, shape, self.row_mean[start * k : end * k], self.col_mean, (end - start) * k, True)


@FactoredState.implements_op([aten.constant_pad_nd.default])
def _pad_factored(func, args, kwargs):
    # DTensor pads an uneven shard with zero rows before an all-gather (Shard(0) -> Replicate): zero row means,
    # which decode to 0 and leave the column means (the whole tensor's) as they are. An empty shard's state
    # (rows=0) pads as a blockwise one: the all-gather tells its zeros apart.
    self, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if not _factored(self):
        return _OPS[func](func, args, kwargs)
    if value != 0 or any(pad[:-1]) or len(pad) != 2 * self.dim() or pad[-1] < 0:
        raise NotImplementedError(
            f"{type(self).__name__}: padding is supported with zeros after the last row only, "
            f"got pad={pad}, value={value}"
        )
    if not pad[-1]:
        return self
    after = pad[-1] * rows_per_dim0(self)
    row_mean = torch.cat([self.row_mean, self.row_mean.new_zeros(after)])
    shape = (self.shape[0] + pad[-1],) + tuple(self.shape[1:])
    return _with_rows(self, shape, row_mean, self.col_mean.clone(), self.rows + after)


@FactoredState.implements_op([aten.cat.default])
def _cat_factored(func, args, kwargs):
    # rows of factored states, one after another, which share the column means of the whole tensor
    tensors, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    parts = [t for t in tensors if t.numel()]
    if not any(_factored(t) for t in parts):
        return _OPS[func](func, args, kwargs)
    if not all(_factored(t) for t in parts):
        raise NotImplementedError(
            f"{func}: a factored state (row and column means) can be concatenated with factored states only"
        )
    if dim % parts[0].dim() != 0 or any(t.shape[1:] != parts[0].shape[1:] for t in parts):
        raise NotImplementedError(f"cat of factored states is supported along dim 0 only, got dim={dim}")
    # every part's column means are the whole tensor's (a part quantized on its own has its own: joined to others,
    # it would stand for other values)
    if any(not torch.equal(t.col_mean, parts[0].col_mean) for t in parts):
        raise ValueError("cat of factored states: the parts hold different column means")
    shape = (sum(t.shape[0] for t in parts),) + tuple(parts[0].shape[1:])
    row_mean = torch.cat([t.row_mean for t in parts])
    return _with_rows(parts[0], shape, row_mean, parts[0].col_mean.clone(), sum(t.rows for t in parts))


@FactoredState.implements_op([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros_factored(func, args, kwargs):
    # another shape: its rows follow from it, as for a new state
    self, size = args[0], args[1]
    attrs = self.attrs() if torch.Size(size) == self.shape else dict(self.attrs(), rows=None)
    return type(self).zeros(
        size, device=kwargs.get("device") or self.device, dtype=kwargs.get("dtype") or self.dtype, **attrs
    )


if torch.distributed.is_available() and hasattr(torch.ops, "_c10d_functional"):
    _c10d = torch.ops._c10d_functional

    @FactoredState.implements_op([_c10d.all_gather_into_tensor.default])
    def _all_gather_factored(func, args, kwargs):
        # DTensor.full_tensor() of a row-sharded state, each shard padded to the same rows: every shard's row means
        # end to end, and the column means (the whole tensor's on every rank). An empty shard's padding is a
        # blockwise zero state, which holds no means: the ranks first gather how each shard is laid out (two
        # integers), then every shard's means, an empty one's as zeros.
        self, group_size, group_name = args
        if self.signed:  # blockwise on every rank
            return _OPS[func](func, args, kwargs)
        mine = torch.tensor([self.rows, self.col_mean.numel()], dtype=torch.int64, device=self.row_mean.device)
        layouts = _c10d.wait_tensor.default(func(mine, group_size, group_name)).view(group_size, 2).tolist()
        if not any(rows for rows, _ in layouts):  # a vector on every rank: blockwise
            return _OPS[func](func, args, kwargs)
        # every shard holds as many rows, padding included, and the same columns
        rows, cols = next((rows, cols) for rows, cols in layouts if rows)
        means = torch.cat([self.row_mean, self.col_mean]) if self.rows else self.row_mean.new_zeros(rows + cols)
        gathered = _c10d.wait_tensor.default(func(means, group_size, group_name)).view(group_size, rows + cols)
        first = next(i for i, (r, _) in enumerate(layouts) if r)
        row_mean = gathered[:, :rows].reshape(-1)
        shape = (self.shape[0] * group_size,) + tuple(self.shape[1:])
        return _with_rows(self, shape, row_mean, gathered[first, rows:].clone(), rows * group_size)


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
