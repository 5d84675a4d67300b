"""Column statistics that span ranks: rank-1 scales (``"4bit_rank1"``) and factored means (``"factored"``,
``"factored4"``) of row-sharded parameters (FSDP2, HSDP).

Under ``Shard(0)`` each rank holds whole rows of a parameter and of its states. A rank-1 scaled state
(:class:`~torchao_optim.state.FourBitRank1Tensor` with ``rows > 0``) scales element ``(i, j)`` by
``min(row_max[i], col_max[j])``; a factored one (:class:`~torchao_optim.state.FactoredState`) stands for
``row_mean[i] * col_mean[j] / mean(col_mean)``. The row statistics are the rank's own, but a column's is taken over
every row, on every rank. Each rank stores its rows' codes and row statistics and the column statistics of the
whole tensor, so its state is its rows of one process's state, on any mesh.

The step (:func:`~torchao_optim.optim.compiled_path.step_compiled`, the only executor these states take) keeps that
true with :class:`ColumnReduce`: the update of such a parameter writes its new state into an fp32 copy of the
local shard (the values it would have quantized); each copy's own column statistic (the format's ``column_stat``:
rank-1's column maxima; a factored state's fp64 column sums and its row count) is computed, those of the group's
copies are concatenated and all-reduced with the format's ``column_reduce`` (MAX, SUM) in one collective per mesh
dimension that shards them (the shard dimension of HSDP: its replicas hold the same rows), and each copy is then
quantized with the statistic of the whole tensor (``assign(x, columns=...)``: the maxima; the sums over the total
row count). One collective per parameter group, format and step (per parameter when the step runs in backward, one
at a time) while the copies fit in ``STAGING_BYTES`` per rank; a larger group flushes more often, at points that
depend only on global shapes and mesh sizes, so every rank takes part in the same collectives. Padding rows never
take part: the states are local shards without FSDP2's padding, and an empty shard contributes the reduction's
identity (zeros: maxima are >= 0, and it adds no sum and no row).

A maximum is the same in any order: rank-1 states are those of one process, bit for bit. A sum is not: the
factored formats sum in fp64 on one process too, and round the mean to fp32 once, so the two orders agree unless
their fp64 sums (each within ``rows * 2**-53`` of the exact one, relative) round to different fp32 means, which
then differ by one fp32 ulp: at most about ``rows * 2**-30`` of the column means per step (docs/distributed.md).

Every rank must step the same parameters in the same order: FSDP2 gives every rank a gradient (an empty one on
an empty shard) for the same parameters. The fused plans leave these parameters to the compiled path on every
rank, an empty shard's included (:func:`spans_ranks`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchao_optim.optim.sharded import is_dtensor, local
from torchao_optim.state import QuantizedState

__all__ = ["STAGING_BYTES", "ColumnReduce", "quantize_shard", "shared_columns", "spans_ranks"]

# fp32 copies staged per rank before their column statistics are all-reduced (256 MiB: a 1B-parameter model's rank-1
# states on 16 ranks in one collective)
STAGING_BYTES = 256 << 20


def shared_columns(p: Tensor, value) -> int:
    """How many column statistics ``value`` (a state of ``p``) shares with the other row shards of ``p``: 0 unless
    ``p`` is a DTensor and its state's format scales by columns (``QuantizedState.shared_columns``)."""
    if not is_dtensor(p) or not is_dtensor(value):
        return 0
    lv = local(value)
    if not isinstance(lv, QuantizedState):
        return 0
    return type(lv).shared_columns(p.shape, **lv.attrs())


def spans_ranks(p: Tensor, state: dict) -> bool:
    """Whether one of ``p``'s states has column statistics that span ranks: its step all-reduces them, on the
    compiled path, on every rank (decided from the global shape, so an empty shard's answer is its peers')."""
    return is_dtensor(p) and any(shared_columns(p, v) for k, v in state.items() if k != "step")


def _shard_dims(p: Tensor) -> list[int]:
    """The mesh dimensions that shard ``p``'s rows (``Shard(0)``), in mesh order."""
    from torch.distributed.tensor import Shard

    return [dim for dim, pl in enumerate(p.placements) if isinstance(pl, Shard)]


def _shard_groups(p: Tensor) -> list:
    """The process groups of the mesh dimensions that shard ``p``'s rows, in mesh order."""
    return [p.device_mesh.get_group(dim) for dim in _shard_dims(p)]


def _reduce(groups: list, stats: list[Tensor], op: str) -> list[Tensor]:
    """``stats`` all-reduced with ``op`` ("max" or "sum") over each of ``groups``: one collective per group for all of
    them (of one dtype)."""
    import torch.distributed as dist

    flat = torch.cat(stats)
    for group in groups:
        dist.all_reduce(flat, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op], group=group)
    return list(flat.split([m.numel() for m in stats]))


def _local_stat(fmt: type, x: Tensor | None, state: QuantizedState, cols: int, device) -> Tensor:
    """The column statistic of the local rows ``x`` on ``device`` (the reduction's identity for an empty shard)."""
    rows = state.rows if x is not None else 0
    return fmt.column_stat(x if rows else None, rows, cols).to(device)


def _collective_device(p: Tensor) -> torch.device:
    """Where the collective runs: with ``p``'s shard, or on its mesh's device where the shard is elsewhere
    (``CPUOffloadPolicy`` keeps a GPU mesh's shards in host memory)."""
    where = local(p).device
    return where if where.type == p.device_mesh.device_type else torch.device(p.device_mesh.device_type)


def _shard_fraction(p: Tensor) -> float:
    """The share of ``p``'s rows a rank holds at most, from the mesh alone (the same number on every rank)."""
    return 1 / math.prod(p.device_mesh.size(dim) for dim in _shard_dims(p))


class ColumnReduce:
    """The states of one step whose column statistics span ranks: staged, then reduced and quantized together
    (see the module's docstring)."""

    def __init__(self) -> None:
        # (mesh, shard dims) -> [(state, fp32 copy or None, column count)]
        self._pending: dict[tuple, list] = {}
        self._bytes = 0.0

    @staticmethod
    def for_step(params: list[Tensor]) -> ColumnReduce | None:
        """A :class:`ColumnReduce` where a DTensor is among ``params``, else None (nothing to reduce)."""
        return ColumnReduce() if any(map(is_dtensor, params)) else None

    def stage(self, p: Tensor, state: dict) -> dict:
        """``state``, or a copy of it whose states that span ranks are fp32 copies of their local shards (what the
        update reads and writes in their place); they are quantized back by :meth:`finish`."""
        keys = [k for k, v in state.items() if k != "step" and shared_columns(p, v)]
        if not keys:
            return state
        size = 4 * p.numel() * _shard_fraction(p) * len(keys)
        if self._pending and self._bytes + size > STAGING_BYTES:
            self.finish()  # those staged before: their updates have run
        self._bytes += size
        staged = dict(state)
        dims = tuple(i for i, pl in enumerate(p.placements) if not pl.is_replicate())
        for k in keys:
            lv = local(state[k])
            x = lv.dequantize(torch.float32) if lv.numel() else None
            if x is not None:
                staged[k] = x
            # one collective per mesh, sharding and format (one reduction, one dtype of statistic)
            key = (p.device_mesh, dims, type(lv))
            self._pending.setdefault(key, []).append((p, lv, x, shared_columns(p, state[k])))
        return staged

    def finish(self) -> None:
        """Quantize every staged copy with the column statistics of the whole tensor: one all-reduce per mesh
        dimension that shards them, for all of them (per format)."""
        pending, self._pending, self._bytes = self._pending, {}, 0.0
        for (_, _, fmt), entries in pending.items():
            p0 = entries[0][0]
            device = _collective_device(p0)
            stats = [_local_stat(fmt, x, lv, cols, device) for _, lv, x, cols in entries]
            stats = _reduce(_shard_groups(p0), stats, fmt.column_reduce)
            for (_, lv, x, _), columns in zip(entries, stats):
                if x is not None:
                    lv.assign(x, columns=columns.to(lv.device))


def quantize_shard(p: Tensor, fmt: type, value: Tensor, **attrs) -> QuantizedState:
    """``value`` (``p``'s local rows, fp32) quantized in ``fmt`` with ``attrs`` (a row shard's), its column
    statistics all-reduced where they span ranks: a collective, which every rank of ``p``'s mesh must call for
    ``p`` (loading a checkpoint of another form, on every rank)."""
    q = fmt.from_float(value, **attrs)
    cols = fmt.shared_columns(p.shape, **attrs)
    if cols and is_dtensor(p):
        stat = _local_stat(fmt, value if value.numel() else None, q, cols, _collective_device(p))
        (columns,) = _reduce(_shard_groups(p), [stat], fmt.column_reduce)
        if q.rows:
            q.assign(value, columns=columns.to(value.device))
    return q
