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
``benchmarks/benchmark_parity.py`` (numbers in ``benchmarks/README.md``). ``second_moment`` chooses the unsigned
one: ``"linear"`` (above) or ``"dynamic"``, the unsigned 4-bit dynamic tree map with ``never_zero`` (values down to
0.00325 of the absmax; a nonzero value never encodes to its zero level).

``"4bit_rank1"`` is the same format with the paper's rank-1 normalization for the second moment of tensors of
two or more dimensions: element ``(i, j)`` of the ``(rows, numel / rows)`` matrix is scaled by
``min(row_max[i], col_max[j])`` instead of its block's absmax, which adapts to rows and columns of outliers.
Its scales are not blockwise: both fused executors read them (``StateLayout.scale`` ``"rank1"``), each with a first
pass that finds the new row and column maxima before any code is written.

Sharded by rows (FSDP2's ``Shard(0)``), each rank holds whole rows: their row maxima are its own, but a column's
maximum spans every rank. Each rank's state stores its rows' codes and row maxima and the column maxima of the whole
tensor, which the step all-reduces before it requantizes (``optim/sharded_columns.py``): the same codes, row maxima
and column maxima as one process. A slice of rows (a checkpoint's resharding) keeps the column maxima it was
quantized with, so it is exactly those rows of the whole state.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from torchao_optim.quant import dynamic_map_values, pack_nibbles, quantize_nearest, unpack_nibbles
from torchao_optim.quant.blockwise import codebook_tensor, lifted_reciprocal
from torchao_optim.state.base import _OPS, QuantizedState, _copy_, _slice, _slice_bound, aten
from torchao_optim.state.codebook import CodebookState
from torchao_optim.state.layout import StateLayout
from torchao_optim.state.registry import register_state_format
from torchao_optim.state.rows import RowScaled, rows_per_dim0

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


@functools.cache
def balanced_map(kind: str = "quadratic") -> tuple[float, ...]:
    """16 signed values with both -1.0 and 1.0 and an exact 0: eight positive levels ``f(k / 8)`` and seven
    negative ``-f(k / 7)`` for ``k`` in 1.., with ``f`` the square (``kind="quadratic"``), the identity
    (``"linear"``) or a normal quantile scaled to end at 1 (``"normal"``). Either sign's largest magnitude is
    stored exactly: a map without -1.0 stores a block whose largest element is negative at its lowest level
    (``quadratic_map``: 0.766 of its absmax)."""

    def levels(n: int) -> list[float]:
        k = torch.arange(1, n + 1, dtype=torch.float64) / n
        if kind == "quadratic":
            v = k**2
        elif kind == "linear":
            v = k
        elif kind == "normal":  # quantiles of N(0, 1) from the median out to the 1/64 tail, scaled to end at 1
            q = torch.special.ndtri(0.5 + k * (0.5 - 1 / 64))
            v = q / q[-1]
        else:
            raise ValueError(f"balanced_map: kind must be 'quadratic', 'linear' or 'normal', got {kind!r}")
        return v.to(torch.float32).tolist()

    return tuple([-v for v in reversed(levels(7))] + [0.0] + levels(8))


@functools.cache
def square_map(bits: int = 4) -> tuple[float, ...]:
    """``((i + 1) / 2**bits)**2`` for ``i`` in ``0 .. 2**bits - 1``: for ``exp_avg_sq``, an even grid of its square
    root (what Adam divides by) on (0, 1], with no zero level: values down to 1/256 of the absmax at 4 bits."""
    return tuple(v**2 for v in linear_map_without_zero(bits))


_FIRST_MOMENT_MAPS = {
    "dynamic": lambda: dynamic_map_values(True, 3, 4),
    "quadratic": quadratic_map,
    "balanced": balanced_map,
    "balanced_linear": lambda: balanced_map("linear"),
    "balanced_normal": lambda: balanced_map("normal"),
}
# exp_avg_sq's codebook and whether it takes never_zero: the dynamic tree map has a zero level, which never_zero
# keeps any nonzero value from (it encodes to the smallest nonzero level, 0.00325 of its block's absmax instead)
_SECOND_MOMENT_MAPS = {
    "linear": lambda: (linear_map_without_zero(4), False),
    "dynamic": lambda: (dynamic_map_values(False, 3, 4), True),
    "square": lambda: (square_map(4), False),
}


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
    second_moment: ClassVar[str] = "linear"

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        if not isinstance(signed, bool):
            raise TypeError(f"{cls.__name__} needs signed=True (exp_avg) or signed=False (exp_avg_sq), got {signed!r}")
        return super()._attrs(block_size=block_size, signed=signed, **attrs)

    @classmethod
    def layout(cls, *, signed: bool, block_size: int, **_) -> StateLayout:
        # The linear map has no zero level for exp_avg_sq, so never_zero has nothing to lift there: 0 < v <
        # absmax/32 encodes to 1/16.
        if signed:
            codebook, never_zero = _FIRST_MOMENT_MAPS[cls.first_moment](), False
        else:
            codebook, never_zero = _SECOND_MOMENT_MAPS[cls.second_moment]()
        return StateLayout(
            codes="codes", scales="absmax", block_size=block_size, codebook=codebook, bits=4, never_zero=never_zero
        )


@register_state_format("4bit_rank1")
class FourBitRank1Tensor(RowScaled, FourBitTensor):
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
    rows_field = "row_marks"
    fused_scale = "rank1"  # both fused executors read its row and column maxima
    # Shard(0): every rank quantizes its own rows, with the column maxima all-reduced (shared_columns says how many)
    row_shardable = True
    # Shard(1): a row's maximum would span ranks as well as a column's (kept plain), and no slice of columns
    column_shardable = False
    # A row slice that does not end at the last row (rows [a:b] for DCP's resharding): its ``absmax`` is a view that
    # starts at row a's maximum and runs to the end of the column maxima, which start at this index. None: compact,
    # ``rows`` row maxima then the column maxima (every stored state, and every state compiled code sees).
    _col_start: int | None = None

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

    @classmethod
    def quantize_fields(cls, x, columns=None, **attrs):
        """As every format's; ``columns`` (rank-1 scales only): the column maxima to scale by, those of the whole
        tensor where ``x`` is a row shard of it (``shared_columns``), instead of ``x``'s own."""
        rows = attrs["rows"]
        if not rows:
            return super().quantize_fields(x, **attrs)
        layout = cls.layout_of(attrs)
        x = x.float()
        finite = torch.where(torch.isfinite(x), x.abs(), 0.0)
        # through the flat shape: reshaping the optimizer's (blocks, block_size) view straight to (rows, cols)
        # would guard on how the two divide, and compile a graph per row count after all
        matrix = finite.reshape(-1).view(rows, -1)  # (rows, cols)
        row_max = matrix.amax(dim=1)  # (rows,)
        col_max = matrix.amax(dim=0) if columns is None else columns  # (cols,)
        scale = _element_scales(row_max, col_max, x)
        lift, inv = lifted_reciprocal(scale)  # as quant.blockwise.normalize: a subnormal scale lifted
        y = x * lift * inv
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
        scale = _element_scales(*self.maxima(), values)
        return (values * scale).view(self.shape).to(dtype or self.dtype)

    def maxima(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row maxima, column maxima)`` of a rank-1 scaled state (``rows > 0``): views of ``absmax``."""
        start = self.rows if self._col_start is None else self._col_start
        return self.absmax[: self.rows], self.absmax[start:]

    # ---- row shards (FSDP2's Shard(0)): the column maxima of the whole tensor --------------------------------
    column_reduce = "max"

    @classmethod
    def column_stat(cls, x: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor:
        """The column maxima ``quantize_fields`` would take from ``x`` read as ``rows`` rows (fp32 ``(cols,)``); zeros
        for no rows (maxima are >= 0)."""
        if x is None or not rows:
            return torch.zeros(cols, dtype=torch.float32, device=None if x is None else x.device)
        finite = torch.where(torch.isfinite(x), x.float().abs(), 0.0)
        return finite.reshape(-1).view(rows, -1).amax(dim=0)

    def assign(self, value: torch.Tensor, columns: torch.Tensor | None = None) -> QuantizedState:
        """As every format's; with ``columns``, scaled by those column maxima (see ``quantize_fields``)."""
        if self._col_start is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: rows of a rank-1 normalized state (rows={self.rows}) cannot be "
                f"requantized on their own: their column maxima are those of every row; write the whole state"
            )
        return super().assign(value, columns if self.rows else None)

    def compact(self) -> FourBitRank1Tensor:
        """This state with its own ``absmax`` (``rows`` row maxima, then the column maxima): itself if it is
        compact, a copy if it is a row slice (``_col_start``)."""
        if self._col_start is None:
            return self
        row_max, col_max = self.maxima()
        fields = dict(self.fields(), codes=self.codes.clone(), absmax=torch.cat([row_max, col_max]))
        return type(self)(self.shape, self.dtype, **fields, **self.attrs())

    def _new(self, fields, shape=None, dtype=None):
        out = super()._new(fields, shape=shape, dtype=dtype)
        out._col_start = self._col_start  # a view (detach, alias, view) of a row slice is one too
        return out

    def check_fields(self) -> None:
        super(FourBitRank1Tensor, self.compact()).check_fields()

    def __reduce_ex__(self, protocol):
        return super(FourBitRank1Tensor, self.compact()).__reduce_ex__(protocol)


def _element_scales(row_max: torch.Tensor, col_max: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each element's rank-1 scale ``min(row_max[i], col_max[j])`` (element ``(i, j)`` of the row-major matrix of
    ``len(row_max)`` rows), in the shape of ``like``. The caller's element-wise math stays in its own shape and only
    this index goes through the matrix: under ``torch.compile``, taking every element through ``(rows, cols)`` and
    back made its index a nest of symbolic divisions. Through the flat shape, for the reason ``quantize_fields``
    gives."""
    return torch.minimum(row_max[:, None], col_max[None, :]).view(-1).view(like.shape)


def _rank1(t) -> bool:
    return isinstance(t, FourBitRank1Tensor) and bool(t.rows)


@FourBitRank1Tensor.implements_op([aten.slice.Tensor])
def _slice_rank1(func, args, kwargs):
    # rows of a row-sharded state (DCP's resharding, a single-process state split among ranks): the codes and row
    # maxima of those rows, and the column maxima of the whole, all views
    self = args[0]
    if not self.rows:
        return _slice(func, args, kwargs)
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1 :])[:4]
    dim = dim % self.dim()
    size = self.shape[0]
    start = _slice_bound(start, 0, size)
    end = max(start, _slice_bound(end, size, size))
    if dim != 0 or (step != 1 and end - start > 1):
        raise NotImplementedError(
            f"{type(self).__name__}: slicing is supported along dim 0 with step 1 only, got dim={dim}, step={step}"
        )
    if (start, end) == (0, size):
        return self._new(self.fields())
    shape = (end - start,) + tuple(self.shape[1:])
    if start == end:  # no rows: an empty state, which holds no scale
        return type(self).zeros(shape, device=self.device, dtype=self.dtype, **dict(self.attrs(), rows=0))
    k = rows_per_dim0(self)
    cols = self.numel() // self.rows
    first, last = start * k * cols, end * k * cols  # elements
    if first % 2:
        raise ValueError(
            f"{type(self).__name__}: rows [{start}:{end}] start at element {first}, within a byte of two 4-bit codes"
        )
    col_start = self.rows if self._col_start is None else self._col_start
    fields = dict(
        self.fields(),
        codes=self.codes[first // 2 : (last + 1) // 2],
        absmax=self.absmax[start * k :],
        row_marks=self.row_marks[start * k : end * k],
    )
    out = type(self)(shape, self.dtype, **fields, **dict(self.attrs(), rows=(end - start) * k))
    out._col_start = col_start - start * k
    return out


@FourBitRank1Tensor.implements_op([aten.copy_.default])
def _copy_rank1(func, args, kwargs):
    # into rows of a state (DCP loads a saved shard's rows into a view of the new one): codes, row maxima and the
    # (shared) column maxima, each through its view
    dst, src = args[0], args[1]
    slices = getattr(dst, "_col_start", None) is not None or getattr(src, "_col_start", None) is not None
    # (compact states, field by field: what compiled code's write-back of a mutated state takes)
    if slices and _rank1(dst) and _rank1(src) and dst.same_layout(src):
        dst.codes.copy_(src.codes)
        for mine, theirs in zip(dst.maxima(), src.maxima()):
            mine.copy_(theirs)
        return dst
    return _copy_(func, args, kwargs)


@FourBitRank1Tensor.implements_op([aten.clone.default, aten._to_copy.default])
def _copy_compact(func, args, kwargs):
    # a copy of a row slice is a state of its own: compact
    self = args[0]
    return _OPS[func](func, (self.compact(),) + tuple(args[1:]), kwargs)


@FourBitRank1Tensor.implements_op([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros_rank1(func, args, kwargs):
    # another shape: its rows follow from it, as for a new state
    self, size = args[0], args[1]
    attrs = self.attrs() if torch.Size(size) == self.shape else dict(self.attrs(), rows=None)
    return type(self).zeros(
        size, device=kwargs.get("device") or self.device, dtype=kwargs.get("dtype") or self.dtype, **attrs
    )


@FourBitRank1Tensor.implements_op([aten.constant_pad_nd.default])
def _pad_rank1(func, args, kwargs):
    # DTensor pads an uneven shard with zero rows before an all-gather (Shard(0) -> Replicate): zero row maxima,
    # which decode to 0 whatever the column maxima and count for none of them. An empty shard's state (rows=0)
    # pads as a blockwise one: the all-gather tells its zeros apart.
    self, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if not self.rows:
        return _OPS[func](func, args, kwargs)
    if value != 0 or any(pad[:-1]) or len(pad) != 2 * self.dim() or pad[-1] < 0:
        raise NotImplementedError(
            f"{type(self).__name__}: padding is supported with zeros after the last row only, "
            f"got pad={pad}, value={value}"
        )
    if not pad[-1]:
        return self
    self, after = self.compact(), pad[-1] * rows_per_dim0(self)
    row_max, col_max = self.maxima()
    codes = self.codes.new_zeros(after * (self.numel() // self.rows) // 2)
    fields = dict(codes=torch.cat([self.codes, codes]), absmax=torch.cat([row_max, row_max.new_zeros(after), col_max]))
    shape = (self.shape[0] + pad[-1],) + tuple(self.shape[1:])
    return type(self)(shape, self.dtype, **fields, **dict(self.attrs(), rows=self.rows + after))


@FourBitRank1Tensor.implements_op([aten.cat.default])
def _cat_rank1(func, args, kwargs):
    # rows of rank-1 states, one after another (each part's rows whole bytes of codes)
    tensors, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    parts = [t for t in tensors if t.numel()]
    if not parts or not all(_rank1(t) for t in parts):
        return _OPS[func](func, args, kwargs)
    if dim % parts[0].dim() != 0 or any(t.shape[1:] != parts[0].shape[1:] for t in parts):
        raise NotImplementedError(f"cat of rank-1 states is supported along dim 0 only, got dim={dim}")
    parts = [t.compact() for t in parts]
    if any(t.numel() % 2 for t in parts[:-1]):
        raise ValueError("cat of rank-1 states: a part of an odd number of elements would split a byte of codes")
    maxima = [t.maxima() for t in parts]
    # every part's column maxima are the whole tensor's (a part quantized on its own: its own; then their maximum
    # would not be what its codes were scaled by)
    if any(not torch.equal(m[1], maxima[0][1]) for m in maxima):
        raise ValueError("cat of rank-1 states: the parts were scaled by different column maxima")
    fields = dict(codes=torch.cat([t.codes for t in parts]), absmax=torch.cat([*(m[0] for m in maxima), maxima[0][1]]))
    shape = (sum(t.shape[0] for t in parts),) + tuple(parts[0].shape[1:])
    return type(parts[0])(shape, parts[0].dtype, **fields, **dict(parts[0].attrs(), rows=sum(t.rows for t in parts)))


if torch.distributed.is_available() and hasattr(torch.ops, "_c10d_functional"):
    _c10d = torch.ops._c10d_functional

    @FourBitRank1Tensor.implements_op([_c10d.all_gather_into_tensor.default])
    def _all_gather_rank1(func, args, kwargs):
        # DTensor.full_tensor() of a row-sharded state, each shard padded to the same rows: every shard's codes
        # and row maxima end to end, and the column maxima (the whole tensor's on every rank). An empty shard's
        # padding is a blockwise zero state, whose absmax has another length: the ranks first gather how each
        # shard is laid out (a few integers), then pad every absmax to the longest.
        self, group_size, group_name = args
        if self.signed:  # blockwise on every rank
            return _OPS[func](func, args, kwargs)
        self = self.compact()
        mine = torch.tensor([self.rows, self.absmax.numel()], dtype=torch.int64, device=self.absmax.device)
        layouts = _c10d.wait_tensor.default(func(mine, group_size, group_name)).view(group_size, 2).tolist()
        if not any(rows for rows, _ in layouts):  # a vector on every rank: blockwise
            return _OPS[func](func, args, kwargs)
        longest = max(n for _, n in layouts)
        absmax = torch.nn.functional.pad(self.absmax, (0, longest - self.absmax.numel()))
        codes = _c10d.wait_tensor.default(func(self.codes, group_size, group_name))
        absmax = _c10d.wait_tensor.default(func(absmax, group_size, group_name)).view(group_size, longest)
        rows = next(rows for rows, _ in layouts if rows)  # every shard holds as many rows, padding included
        row_maxes = [a[:r] if r else a.new_zeros(rows) for a, (r, _) in zip(absmax, layouts)]
        col_maxes = [a[r:n] for a, (r, n) in zip(absmax, layouts) if r]
        fields = dict(codes=codes, absmax=torch.cat([*row_maxes, torch.stack(col_maxes).amax(0)]))
        shape = (self.shape[0] * group_size,) + tuple(self.shape[1:])
        return type(self)(shape, self.dtype, **fields, **dict(self.attrs(), rows=rows * group_size))
