"""Blockwise absmax quantization to a codebook: plain functions, eager and ``torch.compile(fullgraph=True)``.

A tensor is read as a flat sequence cut into blocks of ``block_size`` elements (the last block may be short:
it is zero-padded for the reductions, and the padding is never stored). Each block is scaled by its largest
finite magnitude (``absmax``, fp32) into [-1, 1], and each element is stored as the index of the nearest
codebook value.

Non-finite input never leaks into the rest of its block: ``absmax`` is taken over finite values only, NaN
quantizes to 0 and +/-Inf saturates to the largest code of its sign.
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch
import torch.nn.functional as F

from torchao_optim.quant.dynamic_map import DynamicMapSpec

__all__ = [
    "n_blocks",
    "as_blocks",
    "block_absmax",
    "normalize",
    "quantize_nearest",
    "quantize_nearest_search",
    "dequantize_codes",
    "quantize_blockwise",
    "dequantize_blockwise",
]


def n_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def as_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` flattened and zero-padded to whole blocks: shape (n_blocks, block_size)."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block_size
    # Sizes that are whole blocks (nearly all large tensors) need no padding: a compiled graph for them
    # stays a single pass; other sizes get a graph of their own.
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Largest finite magnitude of each block, fp32, shape (n_blocks,). All-zero or all-non-finite blocks give 0."""
    blocks = as_blocks(x.float(), block_size)  # (n_blocks, block_size)
    return torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=1)


def normalize(x: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x / absmax`` of its block, flat fp32 in [-1, 1]; NaN becomes 0, +/-Inf becomes +/-1."""
    blocks = as_blocks(x.float(), block_size)  # (n_blocks, block_size)
    scale = torch.where(absmax > 0, absmax, 1.0)[:, None]  # (n_blocks, 1)
    y = (blocks / scale).reshape(-1)[: x.numel()]
    return torch.where(torch.isnan(y), 0.0, y).clamp(-1.0, 1.0)


@functools.lru_cache(maxsize=None)
def _table(values: Tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def codebook(values: Tuple[float, ...], like: torch.Tensor) -> torch.Tensor:
    """A codebook as an fp32 tensor on ``like``'s device.

    Eager code gets one cached copy per device (no host-to-device copy in a step). Code being traced
    (``torch.compile``, or inner tensors that are fake or functional) gets a fresh tensor, which becomes a
    constant of the graph: a cached tensor must never be created under a tracing mode.
    """
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=like.device)
    return _table(tuple(values), like.device)


def quantize_nearest(y: torch.Tensor, spec: DynamicMapSpec) -> torch.Tensor:
    """Index (uint8) of the dynamic-map value nearest to each element of ``y`` (fp32 in [-1, 1], no NaN).

    Arithmetic search: the decade comes from comparisons against the decade lower bounds, the position in
    the decade from one multiply-floor; the exact nearest value is then one of that rank and its two
    neighbours, which absorbs any rounding in the arithmetic. Ties go to the smaller magnitude. In the
    unsigned map a positive value is never rounded to 0, but to the smallest positive value.
    """
    a = y.abs()
    lower = torch.full_like(a, spec.lower[0])
    inv_step = torch.full_like(a, spec.inv_step[0])
    last = torch.full_like(a, spec.counts[0] - 1)
    first = torch.full_like(a, spec.first_rank[0])
    for d in range(1, len(spec.lower)):
        inside = a >= spec.lower[d]
        lower = torch.where(inside, spec.lower[d], lower)
        inv_step = torch.where(inside, spec.inv_step[d], inv_step)
        last = torch.where(inside, spec.counts[d] - 1, last)
        first = torch.where(inside, spec.first_rank[d], first)
    k = torch.minimum(((a - lower) * inv_step).floor().clamp_min(0.0), last)
    rank = (first + k).to(torch.int64)
    max_rank = spec.max_rank
    if spec.signed:  # the signed map has +1.0 but no -1.0
        rank_hi = torch.minimum(rank + 1, torch.where(y < 0, max_rank - 1, max_rank))
    else:
        rank_hi = (rank + 1).clamp_max(max_rank)
    rank_lo = (rank - 1).clamp_min(0)
    mags = codebook(spec.magnitudes, y)
    err = (a - mags[rank]).abs()
    err_lo = (a - mags[rank_lo]).abs()
    err_hi = (a - mags[rank_hi]).abs()
    best = torch.where(err_lo <= err, rank_lo, rank)
    best = torch.where(err_hi < torch.minimum(err, err_lo), rank_hi, best)
    if spec.signed:
        best = torch.where(y < 0, spec.zero_code - best, spec.zero_code + best)
    else:
        # Never round a positive value to 0 in the unsigned map (exp_avg_sq): Adam divides by sqrt(v), and
        # a v rounded to 0 would turn an element's tiny update into one of size lr * m / eps.
        best = torch.where((a > 0) & (best == 0), 1, best)
    return best.to(torch.uint8)


def quantize_nearest_search(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the nearest value of any sorted ``table`` (<= 256 entries), by binary search.

    The generic quantizer, for codebooks without the dynamic map's structure. Ties go to the lower index.
    """
    midpoints = (table[1:] + table[:-1]) / 2
    return torch.bucketize(y, midpoints).to(torch.uint8)


def dequantize_codes(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Codebook values of ``codes``, fp32, same shape."""
    return table[codes.to(torch.int64)]


def quantize_blockwise(
    x: torch.Tensor, spec: DynamicMapSpec, block_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 shaped like ``x``, absmax fp32 (n_blocks,)) for the dynamic map ``spec``."""
    absmax = block_absmax(x, block_size)
    codes = quantize_nearest(normalize(x, absmax, block_size), spec)
    return codes.view(x.shape), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, block_size: int, dtype=torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: codebook value times block absmax, shaped like ``codes``."""
    values = as_blocks(dequantize_codes(codes, table), block_size) * absmax[:, None]  # (n_blocks, block_size)
    return values.reshape(-1)[: codes.numel()].view(codes.shape).to(dtype)
