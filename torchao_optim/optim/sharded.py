"""Optimizer state for DTensor parameters (FSDP2's ``fully_shard`` and HSDP by rows, tensor parallelism by columns).

A sharded parameter's state is a DTensor with the parameter's mesh, placements, global shape and stride, whose
local tensor is the state of the local shard: quantized from the shard alone, so a rank never holds more
than its share. The step works on local tensors only (:func:`local`), but for an update that needs a whole
matrix (Muon's orthogonalization): :func:`map_whole` gathers it onto one rank and scatters the result's rows.

The block rule. FSDP2 shards dim 0 in chunks of ``ceil(rows / world)`` rows, so a flat block of 256 elements
could straddle two ranks, and where blocks fall would then depend on the world size (torchao #4912): the
codes saved on two ranks would not be those saved on eight. Here the block size of a sharded parameter's
state is chosen from its global shape alone so that every block lies within one row (of ``numel / size(0)``
elements): the format's block size, halved while it does not divide the row, down to an eighth of it
(:func:`row_aligned_block_size`). Every shard, whatever the mesh, is then whole blocks, its codes and scales
are exactly a slice of those of the whole tensor, and a checkpoint holds the same bytes for any world size.
A parameter none of whose rows is a whole number of such blocks (a 1-D bias, a row of 100 elements) keeps
plain fp32 state, on one rank as on eight.

Tensor parallelism shards dim 1 (``Shard(1)``): each rank holds every row, and a chunk of ``ceil(cols / world)``
columns of each (the last ranks fewer, or none). With the same block size, from the global shape, every block of
the whole tensor lies within one rank's columns exactly when the block divides each rank's first column and column
count, in elements (:func:`column_aligned`); each rank's shard, quantized row-major, then holds the codes and
scales of its blocks of the whole tensor, in the same order. Unlike the rule for rows, this depends on the mesh's
size: (96, 512) with blocks of 256 is quantized on 2 ranks (256 columns each) and not on 4 (128 each), where it
keeps plain fp32 state. The decision is still the same on every rank of a mesh.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from torchao_optim.state import QuantizedState

__all__ = [
    "is_dtensor",
    "local",
    "quantizable_sharding",
    "row_aligned_block_size",
    "column_aligned",
    "state_block_size",
    "like_param",
    "local_part",
    "local_rows",
    "local_columns",
    "element_offset",
    "row_shard_dim",
    "map_whole",
]


# How far the rule may shrink a format's block (a scale per 32 elements for 256-element blocks: 1.125 bytes
# per element for an 8-bit state instead of 1.016, still 3.5x less than fp32).
MAX_SHRINK = 8


def is_dtensor(t) -> bool:
    # No tensor is a DTensor before torch.distributed.tensor is imported: importing it here would add a second
    # to every import of this package.
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local(t: Tensor | None) -> Tensor | None:
    """The local tensor of a DTensor (no copy, no communication); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def quantizable_sharding(placements: Sequence) -> bool:
    """Whether a DTensor with ``placements`` holds whole rows on every rank: each placement is ``Shard(0)`` or
    ``Replicate()`` (FSDP2, HSDP). Other shardings (along another dim, strided, partial) keep plain state."""
    from torch.distributed.tensor import Replicate, Shard

    return all(type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0) for pl in placements)


def row_aligned_block_size(shape: Sequence[int], block_size: int) -> int | None:
    """The block size for the state of a sharded parameter of global ``shape``: ``block_size``, halved while
    it does not divide the row (``prod(shape[1:])``), down to ``block_size // MAX_SHRINK``; None when no such
    block fits (1-D and 0-d parameters, odd rows). Depends on the global shape only, never on the mesh."""
    if len(shape) < 2:
        return None
    row = math.prod(shape[1:])
    b = block_size
    while row % b:
        if b % 2 or b // 2 < max(2, block_size // MAX_SHRINK):
            return None
        b //= 2
    return b


def _column_shard_dim(placements: Sequence) -> int | None:
    """The mesh dimension of ``placements``' one ``Shard(1)``, every other ``Replicate()``; else None."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [i for i, pl in enumerate(placements) if type(pl) is not Replicate]
    if len(dims) != 1 or type(placements[dims[0]]) is not Shard or placements[dims[0]].dim != 1:
        return None
    return dims[0]


def column_aligned(shape: Sequence[int], placements: Sequence, mesh, block_size: int) -> bool:
    """Whether a DTensor of global ``shape`` sharded as ``placements`` over ``mesh`` has every block of
    ``block_size`` elements (one that divides a row, :func:`row_aligned_block_size`) within one rank's columns:
    one mesh dimension is ``Shard(1)`` (tensor parallelism), every other ``Replicate()``, and the block divides
    the ``ceil(cols / size)`` columns of a full chunk, in elements (then it divides every rank's first column and
    count too: the last, shorter chunk ends the row, which is whole blocks). Depends on the mesh's size."""
    dim = _column_shard_dim(placements)
    if dim is None or len(shape) < 2:
        return False
    cols, inner = shape[1], math.prod(shape[2:])
    chunk = min(cols, -(-cols // mesh.size(dim)))
    return (chunk * inner) % block_size == 0 and (cols * inner) % block_size == 0


def state_block_size(p: Tensor, block_size: int) -> int | None:
    """The block size of the quantized state of the DTensor parameter ``p``, for a format whose block is
    ``block_size`` and which ``p``'s sharding may split (every scale covers one block); None: plain state.
    Rows whole on every rank (``Shard(0)``, ``Replicate()``): :func:`row_aligned_block_size`, from the global
    shape alone. Columns split (``Shard(1)``): the same block, where it is :func:`column_aligned` on ``p``'s
    mesh. Any other sharding (``_StridedShard``, ``Partial``, rows and columns both split): None."""
    block = row_aligned_block_size(p.shape, block_size)
    if block is None or quantizable_sharding(p.placements):
        return block
    return block if column_aligned(p.shape, p.placements, p.device_mesh, block) else None


def like_param(p: Tensor, local_state: Tensor) -> Tensor:
    """``local_state`` (the state of ``p``'s local shard) as a DTensor laid out like ``p``, on the device of
    ``local_state``."""
    from torch.distributed.tensor import DTensor

    mesh = p.device_mesh
    if local_state.is_meta or local_state.device.type == mesh.device_type:
        return DTensor.from_local(local_state, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    # A shard held off its mesh's device: FSDP2's CPUOffloadPolicy keeps a GPU mesh's parameters in host memory.
    # from_local would move the state to the mesh's device, away from its parameter (and from the fused C step);
    # it is wrapped where it is instead, as FSDP2 wraps those parameters.
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(p.shape, p.stride(), local_state.dtype)
    return DTensor(local_state, DTensorSpec(mesh, tuple(p.placements), tensor_meta=meta), requires_grad=False)


def local_rows(p: Tensor) -> tuple:
    """``(first row, rows)`` of ``p``'s global dim 0 that its local shard holds. Each ``Shard(0)`` mesh
    dimension, in order, splits the rows left by the previous ones into chunks of ``ceil(rows / size)``."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if not quantizable_sharding(p.placements):
        raise ValueError(
            f"a whole state can be split only for a parameter sharded along dim 0 (Shard(0) or "
            f"Replicate() on every mesh dimension), not {tuple(p.placements)}"
        )
    mesh, start, rows = p.device_mesh, 0, p.shape[0]
    for dim, placement in enumerate(p.placements):
        if type(placement) is Shard:
            chunk = -(-rows // mesh.size(dim))
            first = min(rows, dist.get_rank(mesh.get_group(dim)) * chunk)
            start, rows = start + first, min(rows, first + chunk) - first
    if rows != local(p).shape[0]:
        raise ValueError(
            f"rows {start}:{start + rows} of {tuple(p.shape)} computed for this rank, but its shard "
            f"has {local(p).shape[0]} rows"
        )
    return start, rows


def element_offset(p: Tensor) -> int:
    """Where ``p``'s local shard starts in the whole parameter, in elements (row-major); 0 for a plain tensor
    and for placements that do not shard rows (stochastic rounding then draws the bits of a whole tensor)."""
    if not is_dtensor(p) or len(p.shape) == 0 or not quantizable_sharding(p.placements):
        return 0
    return local_rows(p)[0] * math.prod(p.shape[1:])


def local_columns(p: Tensor) -> tuple:
    """``(first column, columns)`` of ``p``'s global dim 1 that its local shard holds, for a ``p`` sharded along
    dim 1 on one mesh dimension (``Shard(1)``, every other ``Replicate()``): chunks of ``ceil(cols / size)``."""
    dim = _column_shard_dim(p.placements)
    if dim is None or len(p.shape) < 2:
        raise ValueError(f"columns are split only by one Shard(1) placement, not {tuple(p.placements)}")
    mesh, cols = p.device_mesh, p.shape[1]
    chunk = -(-cols // mesh.size(dim))
    first = min(cols, mesh.get_local_rank(dim) * chunk)
    count = min(cols, first + chunk) - first
    if count != local(p).shape[1]:
        raise ValueError(
            f"columns {first}:{first + count} of {tuple(p.shape)} computed for this rank, but its shard "
            f"has {local(p).shape[1]} columns"
        )
    return first, count


def local_part(p: Tensor, full: Tensor) -> Tensor:
    """The part of ``full`` (a tensor of ``p``'s global shape) that ``p``'s local shard holds: its rows
    (:func:`local_rows`) or, under ``Shard(1)``, its columns (:func:`local_columns`), taken with ``narrow`` (a
    quantized ``full`` is sliced on its block boundaries by the op table; a slice of columns is then copied into
    a state of its own, ``compact()``)."""
    if len(p.shape) == 0:
        return full
    if quantizable_sharding(p.placements):
        start, rows = local_rows(p)
        return full if rows == full.shape[0] else full.narrow(0, start, rows)
    if _column_shard_dim(p.placements) is None:
        raise ValueError(
            f"a whole state can be split only for a parameter sharded along dim 0 (Shard(0) or Replicate() on every "
            f"mesh dimension) or along dim 1 on one of them (Shard(1)), not {tuple(p.placements)}"
        )
    start, cols = local_columns(p)
    part = full if cols == full.shape[1] else full.narrow(1, start, cols)
    return part.compact() if isinstance(part, QuantizedState) else part


def row_shard_dim(placements: Sequence) -> int | None:
    """The mesh dimension whose ranks split a DTensor's rows, for ``placements`` that are ``Replicate()`` on every
    mesh dimension but at most one, which is ``Shard(0)`` (FSDP2; HSDP's ``(Replicate(), Shard(0))``); None where
    every dimension replicates (each rank holds the whole tensor). ValueError for any other sharding."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [i for i, pl in enumerate(placements) if type(pl) is not Replicate]
    if len(dims) > 1 or any(not (type(placements[i]) is Shard and placements[i].dim == 0) for i in dims):
        raise ValueError(
            f"placements {tuple(placements)}: the rows must be split along one mesh dimension (Shard(0)), "
            f"every other one Replicate()"
        )
    return dims[0] if dims else None


def map_whole(params: Sequence[Tensor], shards: Sequence[Tensor], fn, owners: Sequence[int], out_dtype) -> list:
    """For each DTensor ``params[i]`` whose rows are split along one mesh dimension (:func:`row_shard_dim`), with
    ``shards[i]`` a tensor of its local shard's shape: each rank's rows of ``fn(whole, i)``, in ``out_dtype``,
    where ``whole`` is the tensor of the global shape that the ranks' ``shards[i]`` make up.

    ``fn`` runs once per tensor and mesh group, on the rank ``owners[i] % size`` of that dimension (``size``
    ranks): every rank's shard is gathered there (``torch.distributed.gather``), and the rows of the result are
    scattered back (``scatter``). Every rank of each group must call this with the same tensors in the same order
    (collectives). All gathers are issued first, then, in order, each owner's ``fn`` and each scatter: the owners
    of different tensors run ``fn`` at the same time. A tensor replicated on every mesh dimension, or split over a
    dimension of one rank, is ``fn`` of the local tensor, with no communication.

    FSDP2 gives each rank ``ceil(rows / size)`` rows, the last ranks fewer or none: each shard travels padded
    to that many rows (gather and scatter move equal sizes). The collectives run on the mesh's device; a shard
    held elsewhere (``CPUOffloadPolicy`` on GPUs) is copied there and back, and ``fn`` runs where the shards are.
    """
    import torch.distributed as dist

    results: list = [None] * len(params)
    pending = []
    for i, (p, shard) in enumerate(zip(params, shards)):
        dim = row_shard_dim(p.placements)
        mesh = p.device_mesh
        if dim is None or mesh.size(dim) == 1:
            results[i] = fn(shard, i).to(out_dtype)
            continue
        group, size, rank = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
        owner = owners[i] % size
        chunk = -(-p.shape[0] // size)
        comm = shard.device if shard.device.type == mesh.device_type else torch.device(mesh.device_type)
        padded = torch.zeros((chunk, *shard.shape[1:]), dtype=shard.dtype, device=comm)
        padded[: shard.shape[0]].copy_(shard)
        gathered = [torch.empty_like(padded) for _ in range(size)] if rank == owner else None
        dst = dist.get_global_rank(group, owner)
        work = dist.gather(padded, gathered, dst=dst, group=group, async_op=True)
        pending.append((i, group, dst, rank == owner, chunk, comm, padded, gathered, work))
    scatters = []
    for i, group, src, owns, chunk, comm, _sent, gathered, work in pending:  # _sent: alive until gathered
        shard = shards[i]
        pieces = None
        work.wait()
        if owns:
            whole = torch.cat(gathered)[: params[i].shape[0]].to(shard.device)
            out = fn(whole, i).to(device=comm, dtype=out_dtype)
            out = torch.cat([out, out.new_zeros((len(gathered) * chunk - out.shape[0], *out.shape[1:]))])
            pieces = list(out.split(chunk))
        rows = torch.empty((chunk, *shard.shape[1:]), dtype=out_dtype, device=comm)
        scatters.append((i, rows, pieces, dist.scatter(rows, pieces, src=src, group=group, async_op=True)))
    for i, rows, _, work in scatters:
        work.wait()
        results[i] = rows[: shards[i].shape[0]].to(shards[i].device)
    return results
