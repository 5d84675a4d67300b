"""Blockwise absmax quantization to a codebook: plain functions, eager and ``torch.compile(fullgraph=True)``.

A tensor is read as a flat sequence cut into blocks of ``block_size`` elements (the last block may be short:
it is zero-padded for the reductions, and the padding is never stored). Each block is multiplied by the
reciprocal of its largest finite magnitude (``absmax``, fp32) into [-1, 1], and each element is stored as
the code of the nearest codebook value (:mod:`torchao_optim.quant.codec` gives the exact rule). The fused
CUDA kernel computes exactly the same expressions, so both give the same codes bit for bit.

Non-finite input never leaks into the rest of its block: ``absmax`` is taken over finite values only, NaN
quantizes to 0 and +/-Inf saturates to the largest code of its sign.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from torchao_optim.quant.codec import (
    bucket_tables,
    decision_boundaries,
    encode,
    encode_search,
    pack_nibbles,
    unpack_nibbles,
)

__all__ = [
    "n_blocks",
    "as_blocks",
    "block_absmax",
    "normalize",
    "quantize_nearest",
    "quantize_nearest_search",
    "quantize_blockwise",
    "dequantize_blockwise",
    "codebook_tensor",
]


def n_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def _whole_blocks(shape, block_size: int) -> bool:
    """Whether ``shape`` is already whole blocks, ``(n_blocks, block_size)``: the compiled path's shape for a
    quantized parameter (``optim.compiled_path.step_shape``), with its block-size dimension static. Flattening and
    slicing are then skipped: each would be more symbolic arithmetic to trace, for the same values."""
    return len(shape) == 2 and shape[1] == block_size


def _is_blocks(x: torch.Tensor, block_size: int) -> bool:
    return _whole_blocks(x.shape, block_size) and x.is_contiguous()


def as_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` flattened and zero-padded to whole blocks: shape (n_blocks, block_size)."""
    if _is_blocks(x, block_size):
        return x
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


@functools.cache
def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def codebook_tensor(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """A codebook as an fp32 tensor on ``like``'s device (the decode table).

    Eager code gets one cached copy per device (no host-to-device copy in a step). Code being traced
    (``torch.compile``, or inner tensors that are fake or functional) gets a fresh tensor, which becomes a
    constant of the graph: a cached tensor must never be created under a tracing mode.
    """
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor:
        return torch.tensor(tuple(values), dtype=torch.float32, device=like.device)
    return _table(tuple(values), like.device)


TINY = 2.0**-126  # the smallest normal fp32: below it an absmax's reciprocal may overflow


def lifted_reciprocal(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lift, inv)`` of each scale: a value over it is ``x * lift * inv``. ``lift`` is 2**64 where the scale is
    subnormal (its reciprocal would overflow; exact: a power of two), else 1; ``inv`` the correctly rounded reciprocal
    of ``scale * lift`` (1 for a zero scale, whose values are all 0)."""
    lift = torch.where(scale < TINY, 2.0**64, 1.0)
    return lift, 1.0 / torch.where(scale > 0, scale * lift, 1.0)


def normalize(x: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x * (1 / absmax)`` of its block, flat fp32 in [-1, 1]; NaN becomes 0, +/-Inf becomes +/-1.

    A multiply by one reciprocal per block (not a division per element): the fused kernels do the same. The
    reciprocal of a subnormal absmax overflows, so such a block and its absmax are first multiplied by 2**64
    (exact: a power of two), which leaves every other block's arithmetic as it is.
    """
    blocks = as_blocks(x.float(), block_size)  # (n_blocks, block_size)
    lift, inv = lifted_reciprocal(absmax)  # (n_blocks,)
    y = (blocks * lift[:, None] * inv[:, None]).reshape(-1)
    if not _is_blocks(x, block_size):
        y = y[: x.numel()]
    # y != y is NaN: a vector compare in inductor's C++ backend, where isnan is a scalar loop per vector
    return torch.where(y != y, 0.0, y).clamp(-1.0, 1.0)


def quantize_nearest(y: torch.Tensor, codebook: Sequence[float], never_zero: bool = False) -> torch.Tensor:
    """Code (uint8) of the nearest ``codebook`` value to each ``y`` (fp32 in [-1, 1], no NaN), in O(1).

    ``codebook`` is sorted (at most 256 values); ties go to the smaller magnitude; with ``never_zero`` a
    nonzero value never takes the code of 0.0. :mod:`torchao_optim.quant.codec` states the rule exactly.
    """
    return encode(y, bucket_tables(tuple(codebook), never_zero, like=y))


def quantize_nearest_search(y: torch.Tensor, codebook: Sequence[float], never_zero: bool = False) -> torch.Tensor:
    """The same codes as :func:`quantize_nearest`, by binary search over the decision boundaries (uint8).

    The reference the O(1) encoder is tested against.
    """
    bounds = decision_boundaries(tuple(codebook), never_zero).to(y.device)
    return encode_search(y, bounds).to(torch.uint8)


def quantize_blockwise(
    x: torch.Tensor, codebook: Sequence[float], block_size: int, never_zero: bool = False, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax): flat uint8 codes (4-bit codes two per byte) and fp32 absmax (n_blocks,)."""
    absmax = block_absmax(x, block_size)
    codes = quantize_nearest(normalize(x, absmax, block_size), codebook, never_zero)
    return (codes if bits == 8 else pack_nibbles(codes)), absmax


def dequantize_blockwise(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    codebook: Sequence[float],
    block_size: int,
    shape,
    dtype=torch.float32,
    bits: int = 8,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: codebook value times block absmax, of ``shape`` and ``dtype``."""
    numel = 1
    for d in shape:  # symbolic under torch.compile(dynamic=True): a plain product, not torch.Size.numel
        numel = numel * d
    codes = codes if bits == 8 else unpack_nibbles(codes, numel)
    # int32 indexes: inductor's C++ backend loads a table lane by lane, and int64 indexes double that work
    values = codebook_tensor(codebook, codes)[codes.to(torch.int32)]
    if _whole_blocks(shape, block_size):
        return (values.view(shape) * absmax[:, None]).to(dtype)
    blocks = as_blocks(values, block_size) * absmax[:, None]  # (n_blocks, block_size)
    return blocks.reshape(-1)[:numel].view(shape).to(dtype)
