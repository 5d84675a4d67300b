"""QuantizedState: the base class of every low-bit optimizer-state format, and its shared aten-op table.

A format is a wrapper tensor subclass that looks like a float tensor of the parameter's shape and stores
something smaller. It declares its structure as data:

- ``elementwise_fields``: flat inner tensors with one entry per element, in the outer tensor's
  (row-major) element order (codes); flat whatever the outer shape, so reshaping never touches them;
- ``blockwise_fields``: inner 1-D tensors with one entry per block of ``block_size`` elements (absmax);
- ``attr_fields``: plain Python attributes (``signed``, ``block_size``, ...);

and implements three things: ``quantize_fields(x, **attrs)`` (a float tensor to its inner tensors),
``dequantize(dtype)`` and, optionally, ``zeros_fields(shape, device, **attrs)``. Flattening for
``torch.compile``, the repr, pickling and every aten op below derive from that declaration.

The op table: out-of-place ops dequantize their quantized arguments and return plain tensors; in-place
ops on a quantized tensor compute in float and requantize once (``copy_`` into it included). Anything else
raises ``NotImplementedError`` naming the op (docs/state_formats.md, "Adding an op").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch._prims_common import infer_size
from torch.utils._pytree import tree_map

from torchao_optim.quant.blockwise import n_blocks

if TYPE_CHECKING:
    from torchao_optim.state.layout import StateLayout

aten = torch.ops.aten

__all__ = ["QuantizedState", "implements"]

_OPS: dict[Any, Callable] = {}


def implements(ops: Sequence[Any]):
    """Register ``fn(func, args, kwargs)`` as the implementation of each aten overload in ``ops``.

    Used at module level it fills the table every format shares; a format that needs a different
    implementation of an op registers its own with ``Format.implements_op``.
    """

    def decorator(fn):
        for op in ops:
            _OPS[op] = fn
        return fn

    return decorator


def _dequantize_all(tree):
    return tree_map(lambda t: t.dequantize() if isinstance(t, QuantizedState) else t, tree)


def _out_of_place(func):
    """aten.mul_.Tensor -> aten.mul.Tensor"""
    packet = getattr(aten, func._schema.name.split("::")[1].rstrip("_"))
    return getattr(packet, func._overloadname)


class QuantizedState(torch.Tensor):
    """Base of the low-bit state formats. See the module docstring for what a format declares."""

    format_name: ClassVar[str] = ""
    elementwise_fields: ClassVar[tuple[str, ...]] = ()
    blockwise_fields: ClassVar[tuple[str, ...]] = ()
    attr_fields: ClassVar[tuple[str, ...]] = ("block_size",)
    default_block_size: ClassVar[int] = 256
    # Whether a row-sharded parameter (FSDP2) may keep its state in this format, quantized per local shard: true
    # where every scale covers one block, so that whole blocks of rows give the codes of the whole tensor.
    row_shardable: ClassVar[bool] = True
    # Whether a column-sharded parameter (tensor parallelism's Shard(1)) may keep its state in this format, and a
    # state be sliced by columns (DCP's resharding): true where the inner tensors are ``elementwise_fields`` and
    # ``blockwise_fields`` only, every scale covers one block of one row, and ``dequantize`` reads its inner tensors
    # through ``compact()`` (a slice of columns holds strided views of them, one row of them per row).
    column_shardable: ClassVar[bool] = False
    _format_ops: ClassVar[dict[Any, Callable]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._format_ops = {}
        # torch.load(weights_only=True) must be able to rebuild every format.
        torch.serialization.add_safe_globals([cls])

    @classmethod
    def implements_op(cls, ops: Sequence[Any]) -> Callable:
        """Like :func:`implements`, for this format (and its subclasses) only."""

        def decorator(fn):
            for op in ops:
                cls._format_ops[op] = fn
            return fn

        return decorator

    @classmethod
    def data_fields(cls) -> tuple[str, ...]:
        """The inner tensors that hold the state's values: the per-element ones, then the per-block ones."""
        return cls.elementwise_fields + cls.blockwise_fields

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        """Every inner tensor: :meth:`data_fields`, and any a format adds beside them. Those carry a size, not
        values (``FourBitRank1Tensor.row_marks``): :meth:`assign` and ``zero_`` leave them as they are."""
        return cls.data_fields()

    @staticmethod
    def __new__(cls, shape, dtype=torch.float32, **fields_and_attrs):
        first = fields_and_attrs[cls.tensor_fields()[0]]
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=dtype, device=first.device, requires_grad=False
        )

    def __init__(self, shape, dtype=torch.float32, **fields_and_attrs):
        for name in self.tensor_fields() + self.attr_fields:
            setattr(self, name, fields_and_attrs[name])

    # ---- what a format implements --------------------------------------------------------------------
    @classmethod
    def quantize_fields(cls, x: torch.Tensor, **attrs) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{cls.__name__} must implement quantize_fields")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement dequantize")

    def fast_path_layout(self) -> StateLayout | None:
        """The :class:`~torchao_optim.state.layout.StateLayout` the fused CUDA engine reads, or None if this
        format cannot be described that way (it then takes the compiled path)."""
        return None

    def fused_layout(self) -> StateLayout | None:
        """The layout the fused planner reads: :meth:`fast_path_layout`, or where a format's scales are not blockwise
        but of a kind some fused kernels read (``StateLayout.scale``, e.g. ``"rank1"``), a layout saying so. The rest
        of the library reads :meth:`fast_path_layout`, whose blockwise scales it may take for granted."""
        return self.fast_path_layout()

    @classmethod
    def zeros_fields(cls, shape: Sequence[int], device: torch.device | str | None, **attrs) -> dict[str, torch.Tensor]:
        return cls.quantize_fields(torch.zeros(shape, device=device), **attrs)

    @classmethod
    def check_attrs(cls, shape: Sequence[int], **attrs) -> None:
        """Raise ValueError if a tensor of ``shape`` cannot be stored with ``attrs``."""
        block_size = attrs.get("block_size")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"{cls.__name__}: block_size must be a positive int, got {block_size!r}")

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def _attrs(cls, block_size=None, **attrs):
        attrs["block_size"] = cls.default_block_size if block_size is None else block_size
        return attrs

    @classmethod
    def zeros(
        cls,
        shape: Sequence[int],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        **attrs,
    ) -> QuantizedState:
        """A quantized tensor of zeros of ``shape``, dequantizing to ``dtype``."""
        shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
        attrs = cls._attrs(**attrs)
        cls.check_attrs(shape, **attrs)
        _check_float_dtype(cls, dtype)
        return cls(shape, dtype, **cls.zeros_fields(shape, device, **attrs), **attrs)

    @classmethod
    def matches_layout(cls, value: QuantizedState, *, signed: bool, block_size: int, **attrs) -> bool:
        """Whether ``value`` (a state loaded from a checkpoint, of the parameter's shape) is laid out exactly as this
        format stores a new state for an optimizer that asks for ``signed`` and ``block_size`` (and ``attrs``: those
        :meth:`shard_attrs` adds for a row shard): then its codes are kept as they are (exact resume); otherwise it
        is dequantized and quantized anew. The default compares the attributes; a format whose attributes also
        follow from the shape (a scale per row, not per block of ``block_size``) overrides it, and must, or each
        load requantizes its states."""
        return type(value) is cls and value.attrs() == cls._attrs(signed=signed, block_size=block_size, **attrs)

    # ---- row shards (FSDP2's Shard(0)) -------------------------------------------------------------------
    @classmethod
    def shared_columns(cls, shape: Sequence[int], **attrs) -> int:
        """How many per-column statistics every row shard of a state of global ``shape`` shares with the others
        (all-reduced by the step: ``optim/sharded_columns.py``). 0, the default: every scale covers one block of
        one row, and a shard's state depends on its rows alone."""
        return 0

    # How the row shards' column statistics (:meth:`column_stat`) combine: "max" (rank-1's column maxima) or "sum"
    # (a factored state's column sums, with its row count)
    column_reduce: ClassVar[str] = "max"

    @classmethod
    def column_stat(cls, x: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor:
        """A row shard's own statistic of its ``cols`` columns, ``x`` read as ``rows`` rows of them, which the step
        combines over every row shard with :attr:`column_reduce` and hands to :meth:`assign` as ``columns``; ``x``
        None: a shard with no rows, whose statistic the reduction ignores. For a format with :meth:`shared_columns`."""
        raise NotImplementedError(f"{cls.__name__} shares no column statistics across row shards (shared_columns)")

    @classmethod
    def shard_attrs(cls, shape: Sequence[int], local_shape: Sequence[int], **attrs) -> dict:
        """The attributes of the state of a row shard of ``local_shape`` of a tensor of global ``shape``, from
        those of the whole tensor's (``signed``, ``block_size``): the same, by default."""
        return attrs

    @classmethod
    def check_values(cls, x: torch.Tensor, **attrs) -> None:
        """Raise ValueError if ``x`` holds values these ``attrs`` cannot represent (called by ``from_float``;
        an unsigned format refuses negative values rather than storing their magnitude)."""

    @classmethod
    def from_float(cls, x: torch.Tensor, **attrs) -> QuantizedState:
        """Quantize a float tensor (any layout); the result dequantizes to ``x.dtype``."""
        if not isinstance(x, torch.Tensor) or isinstance(x, QuantizedState):
            raise TypeError(f"{cls.__name__}.from_float expects a plain float tensor, got {type(x).__name__}")
        _check_float_dtype(cls, x.dtype)
        attrs = cls._attrs(**attrs)
        cls.check_attrs(x.shape, **attrs)
        cls.check_values(x.detach(), **attrs)
        return cls(x.shape, x.dtype, **cls.quantize_fields(x.detach(), **attrs), **attrs)

    def check_fields(self) -> None:
        """Raise ValueError unless the inner tensors are exactly what this format creates for this shape and
        these attributes (type, dtype, shape, one device that holds data) and every floating scale
        (``blockwise_fields``) is finite and non-negative. Run on anything that comes from outside, such as a
        checkpoint: the aten ops trust the layout and would read past a truncated field."""
        name = type(self).__name__
        _check_float_dtype(type(self), self.dtype)
        self.check_attrs(self.shape, **self.attrs())
        expected = self.zeros_fields(self.shape, torch.device("meta"), **self.attrs())
        for field, want in expected.items():
            got = getattr(self, field, None)
            if type(got) is not torch.Tensor:
                raise ValueError(f"{name}.{field} must be a plain tensor, got {type(got).__name__}")
            if got.dtype != want.dtype or got.shape != want.shape:
                raise ValueError(
                    f"{name}.{field} of a tensor of shape {tuple(self.shape)} with {self.attrs()} "
                    f"must be {want.dtype} of shape {tuple(want.shape)}, got {got.dtype} of shape "
                    f"{tuple(got.shape)}"
                )
            if got.device != self.device or got.device.type == "meta":
                raise ValueError(
                    f"{name}.{field} is on {got.device}; every field must hold data on the "
                    f"tensor's device ({self.device})"
                )
            if field in self.blockwise_fields and got.is_floating_point():
                bad = ~(torch.isfinite(got) & (got >= 0))
                if bad.any():
                    i = int(bad.nonzero()[0])
                    raise ValueError(
                        f"{name}.{field} must be finite and non-negative (a scale per block); "
                        f"block {i} holds {got[i].item()}"
                    )

    def is_compact(self) -> bool:
        """Whether every inner tensor is flat (not a slice of columns: see :meth:`compact`)."""
        return all(inner.dim() <= 1 for inner in self.fields().values())

    def compact(self) -> QuantizedState:
        """This state with flat inner tensors in row-major element order: itself, or a copy where it is a slice of
        columns (``state[:, a:b]``, whose inner tensors are strided views of its parent's, one row per row)."""
        if self.is_compact():
            return self
        return self._new({k: v.clone(memory_format=torch.contiguous_format).view(-1) for k, v in self.fields().items()})

    def share_memory_(self) -> QuantizedState:
        """Move every inner tensor to shared memory (``torch.multiprocessing``, Hogwild training); in place."""
        # The wrapper itself has no storage of its own to share.
        for inner in self.fields().values():
            inner.share_memory_()
        return self

    def is_shared(self) -> bool:
        return all(inner.is_shared() for inner in self.fields().values())

    def _new(self, fields: dict[str, torch.Tensor], shape=None, dtype=None):
        return type(self)(
            self.shape if shape is None else shape,
            self.dtype if dtype is None else dtype,
            **fields,
            **self.attrs(),
        )

    def attrs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.attr_fields}

    def fields(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_fields()}

    def same_layout(self, other: QuantizedState) -> bool:
        return type(other) is type(self) and other.shape == self.shape and other.attrs() == self.attrs()

    def assign(self, value: torch.Tensor, columns: torch.Tensor | None = None) -> QuantizedState:
        """Requantize ``value`` (broadcast to this shape) into this tensor's storage, in place. ``columns``: the column
        statistics of the whole tensor, where this state is a row shard of it (:meth:`column_stat`, reduced over
        every shard), which the format's ``quantize_fields`` then takes instead of ``value``'s own."""
        value = value.expand(self.shape) if value.shape != self.shape else value
        extra = {} if columns is None else {"columns": columns}
        new = self.quantize_fields(value, **extra, **self.attrs())
        for name in self.data_fields():  # the other fields hold sizes, which requantizing does not change
            inner = getattr(self, name)
            inner.copy_(new[name].view(inner.shape))  # (a slice of columns: through its strided views)
        return self

    # ---- torch.compile, pickling, repr ---------------------------------------------------------------
    def __tensor_flatten__(self):
        return list(self.tensor_fields()), (tuple(self.attrs().items()), self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        attrs, dtype = ctx
        return cls(outer_size, dtype, **inner, **dict(attrs))

    def __reduce_ex__(self, protocol):
        this = self.compact()  # a slice of columns pickles as a state of its own
        return (_rebuild, (type(this), tuple(this.shape), this.dtype, this.fields(), this.attrs()))

    def _stable_hash_for_caching(self) -> str:
        # The compile caches' key (AOTAutograd's, which hands over inductor's graph): everything that decides a
        # compiled graph (format, attributes, outer shape, stride and dtype, each inner tensor's dtype and shape),
        # never the data. Leaving out the shape let a graph compiled for one shape be handed to another.
        fields = self.fields()
        inner = ",".join(f"{k}:{v.dtype}{tuple(v.shape)}" for k, v in fields.items())
        key = (
            f"{type(self).__module__}.{type(self).__qualname__}({self.attrs()},{tuple(self.shape)},"
            f"{tuple(self.stride())},{self.dtype},{self.device.type},{inner})"
        )
        # Traced with symbolic sizes, the key names sizes by symbol, and a cache hit re-checks only the guards on
        # the graph's size arguments: the symbols of the outer shape. A size that only an inner tensor has (the
        # row count of 4bit_rank1, the length of its row and column maxima; the block count of a flat state) is
        # no argument, so a graph specialized on it (rows equal to the block count) would be handed to every
        # state with the same symbols. Such a key also names every size by its value.
        outer = _symbols(tuple(self.shape) + tuple(self.stride()))
        if any(not _symbols(tuple(v.shape)) <= outer for v in fields.values()):
            sizes = [_hint(tuple(self.shape))] + [_hint(tuple(v.shape)) for v in fields.values()]
            key += f" sizes {sizes}"
        return key

    def __repr__(self):
        attrs = "".join(f", {k}={v!r}" for k, v in self.attrs().items())
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}{attrs})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for klass in cls.__mro__:
            impl = klass.__dict__.get("_format_ops", {}).get(func)
            if impl is not None:
                return impl(func, args, kwargs)
        impl = _OPS.get(func) or _OPS_BY_NAME.get(str(func))
        if impl is None:
            raise NotImplementedError(
                f"{cls.__name__} does not implement {func}. Dequantize first (x.dequantize()), or add the op "
                f"to the op table: see docs/state_formats.md, 'Adding an op'."
            )
        return impl(func, args, kwargs)


def _symbols(sizes) -> set:
    """The free symbols of the symbolic sizes among ``sizes`` (none for plain ints)."""
    return set().union(*(s.node.expr.free_symbols for s in sizes if isinstance(s, torch.SymInt)))


def _hint(sizes) -> tuple:
    """``sizes`` with each symbolic size replaced by the value it was traced with (no guard is added)."""
    return tuple(s.node.hint if isinstance(s, torch.SymInt) else s for s in sizes)


def _rebuild(cls, shape, dtype, fields, attrs):
    return cls(shape, dtype, **fields, **attrs)


torch.serialization.add_safe_globals([_rebuild])


def _check_float_dtype(cls, dtype):
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{cls.__name__} dequantizes to float32, float16 or bfloat16, not {dtype}")


# ---- the shared op table ---------------------------------------------------------------------------

_MATH_OPS = [
    aten.lerp.Scalar,
    aten.lerp.Tensor,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.add.Tensor,
    aten.add.Scalar,
    aten.sub.Tensor,
    aten.sub.Scalar,
    aten.addcmul.default,
    aten.addcdiv.default,
    aten.sqrt.default,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.maximum.default,
    aten.neg.default,
    aten.abs.default,
    aten.where.self,
]
# Ops registered by a module on import, so named rather than referenced (filled below).
_OPS_BY_NAME: dict[str, Callable] = {}
_INPLACE_OPS = [
    aten.lerp_.Scalar,
    aten.lerp_.Tensor,
    aten.mul_.Tensor,
    aten.mul_.Scalar,
    aten.add_.Tensor,
    aten.add_.Scalar,
    aten.sub_.Tensor,
    aten.sub_.Scalar,
    aten.addcmul_.default,
    aten.addcdiv_.default,
    aten.sqrt_.default,
    aten.div_.Tensor,
    aten.div_.Scalar,
    aten.neg_.default,
]


@implements(_MATH_OPS + [aten.equal.default])
def _math(func, args, kwargs):
    # The Adam update (where: non-finite gradients keep the old state), torch.optim's single-tensor loops;
    # equal is needed by tests and state comparisons.
    return func(*_dequantize_all(args), **_dequantize_all(kwargs))


# registered by inductor on import: compiled lerp_ decomposes to it
_OPS_BY_NAME["prims.fma.default"] = _math


@implements(_INPLACE_OPS)
def _math_inplace(func, args, kwargs):
    # torch.optim.Adam/AdamW(foreach=False) and SGD(momentum) update their state with these.
    self = args[0]
    if isinstance(self, QuantizedState):
        out = _out_of_place(func)(self.dequantize(), *_dequantize_all(args[1:]), **_dequantize_all(kwargs))
        return self.assign(out)
    return func(self, *_dequantize_all(args[1:]), **_dequantize_all(kwargs))


@implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    # The requantizing write at the end of every update; also load_state_dict and DCP loads.
    dst, src = args[0], args[1]
    if isinstance(dst, QuantizedState):
        if dst.same_layout(src):
            # field by field, in row-major element order (either may be a slice of columns: strided views)
            for name, inner in dst.fields().items():
                inner.copy_(getattr(src, name).reshape(inner.shape))
            return dst
        src = src.dequantize() if isinstance(src, QuantizedState) else src
        return dst.assign(src.to(dst.device))
    return dst.copy_(src.dequantize(), **kwargs)


@implements([aten.zero_.default])
def _zero_(func, args, kwargs):
    # optimizer resets and SGD's momentum buffers
    self = args[0]
    zeros = self.zeros_fields(self.shape, self.device, **self.attrs())
    for name in self.data_fields():  # as assign: the other fields hold sizes
        inner = getattr(self, name)
        inner.copy_(zeros[name].view(inner.shape))
    return self


@implements([aten.zeros_like.default, aten.empty_like.default])
def _zeros_like(func, args, kwargs):
    # torch.optim creates state buffers with torch.zeros_like(state) when the state is ours
    self = args[0]
    return type(self).zeros(
        self.shape,
        device=kwargs.get("device") or self.device,
        dtype=kwargs.get("dtype") or self.dtype,
        **self.attrs(),
    )


@implements([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros(func, args, kwargs):
    # Tensor.new_zeros(size) keeps the format: needed by DCP and by state initialisers
    self, size = args[0], args[1]
    return type(self).zeros(
        size, device=kwargs.get("device") or self.device, dtype=kwargs.get("dtype") or self.dtype, **self.attrs()
    )


@implements([aten.clone.default])
def _clone(func, args, kwargs):
    # copy.deepcopy of an optimizer state_dict, checkpoint snapshots; a copy of a slice of columns is compact
    self = args[0]
    flat = self.compact()
    return flat if flat is not self else self._new({k: v.clone() for k, v in self.fields().items()})


@implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    # state_dict() and torch.save detach tensors; shares storage
    self = args[0]
    return self._new({k: func(v) for k, v in self.fields().items()})


@implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    # .to(device), .cpu(), .cuda() keep the tensor quantized; .to(dtype) changes what it dequantizes to
    self = args[0].compact()
    dtype = kwargs.get("dtype") or self.dtype
    _check_float_dtype(type(self), dtype)
    device, non_blocking = kwargs.get("device"), kwargs.get("non_blocking", False)
    fields = {k: v.to(device=device, non_blocking=non_blocking, copy=True) for k, v in self.fields().items()}
    return self._new(fields, dtype=dtype)


@implements([aten.is_pinned.default])
def _is_pinned(func, args, kwargs):
    # DataLoader/DCP staging asks whether state is in pinned memory
    return all(v.is_pinned() for v in args[0].fields().values())


@implements([aten.view.default, aten._unsafe_view.default])
def _view(func, args, kwargs):
    # reshape/flatten of state (the optimizer's flat step, DCP, FSDP): the flat element order, hence
    # every block and every inner tensor, is unchanged
    self, size = args[0], args[1]
    if not self.is_compact():
        raise NotImplementedError(
            f"{type(self).__name__}: a slice of columns of shape {tuple(self.shape)} cannot be viewed as {list(size)} "
            f"(its inner tensors are strided); take a copy first (clone())"
        )
    return self._new(self.fields(), shape=infer_size(size, self.numel()))


def _slice_bound(index: int | None, default: int, size: int) -> int:
    """A slice bound as torch clamps it: None is ``default``, a negative one counts from the end, and the result
    lies in [0, size]."""
    if index is None:
        return default
    return min(max(index + size if index < 0 else index, 0), size)


def _codes_per_byte(self) -> int:
    layout = self.fast_path_layout()
    return 2 if layout is not None and layout.bits == 4 else 1  # 4-bit codes: two per byte


@implements([aten.slice.Tensor])
def _slice(func, args, kwargs):
    # row shards of state (FSDP2 chunks dim 0): only on block boundaries, so every block stays whole; column
    # shards (tensor parallelism's Shard(1), which DCP narrows along dim 1): see _slice_columns
    self = args[0]
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1 :])[:4]
    dim = dim % max(self.dim(), 1)
    if step < 1:
        raise ValueError(f"{type(self).__name__}: slice step must be positive, got {step}")
    size = self.shape[dim] if self.dim() else 1
    start = _slice_bound(start, 0, size)
    length = -(-max(_slice_bound(end, size, size) - start, 0) // step)  # the indices torch's slice selects
    if dim > 1 or (step != 1 and length > 1):
        raise NotImplementedError(
            f"{type(self).__name__}: slicing is supported along dim 0 (rows) and dim 1 (columns) with step 1 only, "
            f"got dim={dim}, step={step}"
        )
    end = start + length
    if dim == 1:
        return _slice_columns(self, start, end)
    if not self.is_compact():  # rows of a slice of columns: the same rows of each of its (rows, n) views
        fields = {name: _flat_if_contiguous(inner[start:end]) for name, inner in self.fields().items()}
        return self._new(fields, shape=(end - start,) + tuple(self.shape[1:]))
    rows = self.shape[0] if self.dim() else 1
    row = self.numel() // max(rows, 1)
    first, last, bs = start * row, end * row, self.block_size
    if first == last:  # empty: no element, no block, wherever it starts
        first = last = 0
    if first % bs or (last % bs and last != self.numel()):
        raise ValueError(
            f"{type(self).__name__}: rows [{start}:{end}] cover elements [{first}:{last}], which do "
            f"not start and end on a block boundary (block_size={bs})"
        )
    fields = self.fields()
    per_byte = _codes_per_byte(self)
    for name in self.elementwise_fields:
        fields[name] = fields[name][first // per_byte : (last + per_byte - 1) // per_byte]
    for name in self.blockwise_fields:
        fields[name] = fields[name][first // bs : n_blocks(last, bs)]
    return self._new(fields, shape=(end - start,) + tuple(self.shape[1:]))


@implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func, args, kwargs):
    # torch.chunk: DTensor's all-gather along dim 1 (Shard(1)) splits the gathered rows into each rank's part
    self, sizes = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % max(self.dim(), 1)
    n = self.shape[dim] if self.dim() else 1
    if isinstance(sizes, int):
        sizes = [min(sizes, n - start) for start in range(0, n, sizes)] or [0]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [aten.slice.Tensor(self, dim, start, start + size) for start, size in zip(starts, sizes)]


# ---- columns: slicing, concatenating and padding whole blocks of each row (tensor parallelism, DCP) -------------


def _flat_if_contiguous(inner: torch.Tensor) -> torch.Tensor:
    return inner.view(-1) if inner.is_contiguous() else inner


def _by_rows(self, inner: torch.Tensor) -> torch.Tensor:
    """``inner`` (one of ``self``'s inner tensors, flat or a slice of columns' strided view) as ``(rows, n)``."""
    return inner.view(self.shape[0], inner.numel() // self.shape[0]) if inner.dim() == 1 else inner


def _check_columns(self, start: int, end: int, what: str) -> tuple[int, int]:
    """The elements ``[first, last)`` of each row that columns ``[start:end]`` of ``self`` cover; ValueError unless
    they are whole blocks of every row (and whole bytes of 4-bit codes), NotImplementedError for a format whose
    scales are not per block (``column_shardable``)."""
    name = type(self).__name__
    if not type(self).column_shardable:
        raise NotImplementedError(
            f"{name}: {what} is supported along dim 0 only, not dim 1: its scales do not each cover a block of one row"
        )
    if self.dim() < 2:
        raise ValueError(f"{name}: {what} along dim 1 needs two or more dimensions, got shape {tuple(self.shape)}")
    inner = math.prod(self.shape[2:])
    row, first, last, bs = self.shape[1] * inner, start * inner, end * inner, self.block_size
    if row % bs or first % bs or last % bs or bs % _codes_per_byte(self):
        raise ValueError(
            f"{name}: columns [{start}:{end}] of shape {tuple(self.shape)} cover elements [{first}:{last}] of each "
            f"row of {row}, which are not whole blocks of the row (block_size={bs}); {what} along dim 1 keeps "
            f"every block whole"
        )
    return first, last


def _slice_columns(self, start: int, end: int):
    """Columns ``[start:end]`` of ``self``, whose inner tensors are views of ``self``'s (strided, ``(rows, n)``):
    a write into the slice (``copy_``, ``zero_``, an in-place op) writes into ``self``, as DCP's load expects."""
    if (start, end) == (0, self.shape[1]) and self.dim() >= 2:
        return self._new(self.fields())
    first, last = _check_columns(self, start, end, "slicing")
    shape = (self.shape[0], end - start) + tuple(self.shape[2:])
    if self.shape[0] == 0 or first == last:  # no element: nothing to alias
        return type(self).zeros(shape, device=self.device, dtype=self.dtype, **self.attrs())
    per = {name: _codes_per_byte(self) for name in self.elementwise_fields}
    per.update({name: self.block_size for name in self.blockwise_fields})
    fields = {
        name: _flat_if_contiguous(_by_rows(self, inner)[:, first // per[name] : last // per[name]])
        for name, inner in self.fields().items()
    }
    return self._new(fields, shape=shape)


def _cat_columns(parts: Sequence[QuantizedState]) -> QuantizedState:
    """``parts`` (one format and layout, the same shape but along dim 1) concatenated along dim 1: each row of the
    result is the parts' rows end to end, each of them whole blocks."""
    first = parts[0]
    for part in parts:
        same = part.shape[:1] == first.shape[:1] and part.shape[2:] == first.shape[2:]
        if type(part) is not type(first) or part.attrs() != first.attrs() or part.dim() < 2 or not same:
            raise ValueError(
                f"cat of quantized states along dim 1 needs one format, layout and shape but for dim 1: got {part!r} "
                f"beside {first!r}"
            )
        _check_columns(part, 0, part.shape[1], "concatenating")
    shape = (first.shape[0], sum(part.shape[1] for part in parts)) + tuple(first.shape[2:])
    if first.shape[0] == 0:
        return type(first).zeros(shape, device=first.device, dtype=first.dtype, **first.attrs())
    fields = {
        name: torch.cat([_by_rows(part, getattr(part, name)) for part in parts], dim=1).view(-1)
        for name in first.tensor_fields()
    }
    return first._new(fields, shape=shape)


# ---- rows: concatenating, padding and gathering whole blocks (DTensor, FSDP2, DCP) ----------------------


def _check_whole_blocks(self, what: str) -> None:
    if self.numel() % self.block_size:
        raise ValueError(
            f"{type(self).__name__}: {what} needs whole blocks, but a tensor of shape {tuple(self.shape)} "
            f"holds {self.numel()} elements, not a multiple of block_size={self.block_size}"
        )


def _cat_rows(parts: Sequence[QuantizedState]) -> QuantizedState:
    """``parts`` (one format and layout, the same trailing shape) concatenated along dim 0. Every part but the
    last must be whole blocks, so that the blocks of the result are the parts' blocks and the inner tensors are
    the parts' inner tensors end to end."""
    first = parts[0]
    for part in parts:
        if type(part) is not type(first) or part.attrs() != first.attrs() or part.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"cat of quantized states needs one format, layout and row shape: got {part!r} beside {first!r}"
            )
    for part in parts[:-1]:
        _check_whole_blocks(part, "concatenating along dim 0")
    parts = [part.compact() for part in parts]
    fields = {name: torch.cat([getattr(part, name) for part in parts]) for name in first.tensor_fields()}
    rows = sum(part.shape[0] for part in parts)
    return first._new(fields, shape=(rows,) + tuple(first.shape[1:]))


@implements([aten.cat.default])
def _cat(func, args, kwargs):
    # DTensor's gathers and pads along dim 0 (a quantized state in every part, the rows whole blocks), and along
    # dim 1 (Shard(1): each row's parts whole blocks)
    tensors, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    dim = dim % max(tensors[0].dim(), 1)
    if not all(isinstance(t, QuantizedState) for t in tensors) or dim > 1:
        raise NotImplementedError(
            f"cat of quantized states is supported along dim 0 and dim 1, with every tensor quantized; "
            f"got dim={dim} and {[type(t).__name__ for t in tensors]}"
        )
    return _cat_rows(tensors) if dim == 0 else _cat_columns(tensors)


@implements([aten.constant_pad_nd.default])
def _constant_pad_nd(func, args, kwargs):
    # DTensor pads an uneven last shard with zeros after its last row (Shard(0)) or column (Shard(1)) before an
    # all-gather (-> Replicate). F.pad's list runs from the last dim: (before, after) of dim n - 1, of n - 2, ...
    self, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    nonzero = [i for i, v in enumerate(pad) if v]
    dim = self.dim() - 1 - nonzero[0] // 2 if len(nonzero) == 1 and nonzero[0] % 2 else None
    if value != 0 or len(pad) > 2 * self.dim() or (nonzero and dim not in (0, 1)) or any(v < 0 for v in pad):
        raise NotImplementedError(
            f"{type(self).__name__}: padding is supported with zeros after the last row or column only, "
            f"got pad={pad}, value={value}"
        )
    if not nonzero:
        return self
    shape = list(self.shape)
    shape[dim] = pad[nonzero[0]]
    zeros = type(self)(shape, self.dtype, **self.zeros_fields(shape, self.device, **self.attrs()), **self.attrs())
    return _cat_rows([self, zeros]) if dim == 0 else _cat_columns([self, zeros])


if torch.distributed.is_available() and hasattr(torch.ops, "_c10d_functional"):
    _c10d = torch.ops._c10d_functional

    @implements([_c10d.all_gather_into_tensor.default])
    def _all_gather_into_tensor(func, args, kwargs):
        # DTensor.full_tensor() and redistribute(Replicate) of a sharded state; DCP's full state dict: every
        # rank's rows are whole blocks, so gathering each inner tensor gathers the blocks
        self, group_size, group_name = args
        self = self.compact()
        _check_whole_blocks(self, "an all-gather along dim 0")
        fields = {name: func(inner, group_size, group_name) for name, inner in self.fields().items()}
        return self._new(fields, shape=(self.shape[0] * group_size,) + tuple(self.shape[1:]))

    @implements([_c10d.wait_tensor.default])
    def _wait_tensor(func, args, kwargs):
        # the wait that follows a functional collective (AsyncCollectiveTensor, compiled collectives)
        self = args[0]
        for inner in self.fields().values():
            _c10d.wait_tensor.default(inner)
        return self

    # torch >= 2.12 wraps a functional collective's result with this op (defined in Python, on import) to make
    # it an AsyncCollectiveTensor; a quantized result is waited for at once instead
    _OPS_BY_NAME["_c10d_functional._wrap_tensor_autograd.default"] = _wait_tensor
