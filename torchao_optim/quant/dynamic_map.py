"""The dynamic tree map of the 8-bit optimizers paper (Dettmers et al., 2021).

A value of the map is ``sign * 10**e * f``: a decade ``10**e`` (the exponent, written in unary in the
bitwise form of the type) times a linear fraction ``f`` in (0.1, 1). Decade ``i`` (``0 <= i < max_exponent_bits``)
holds the midpoints of an evenly spaced grid on [0.1, 1] scaled by ``10**(i - max_exponent_bits + 1)``; the
smaller the decade, the fewer fraction bits it has. Zero and 1.0 complete the map.

Formats quantize to it like to any other sorted codebook (:mod:`torchao_optim.quant.codec`).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["create_dynamic_map", "dynamic_map_values"]


def _decade_counts(signed: bool, max_exponent_bits: int, total_bits: int) -> tuple[int, ...]:
    """Number of map values in each decade (positive side only), smallest decade first."""
    non_sign_bits = total_bits - 1
    counts = []
    for i in range(max_exponent_bits):
        grid_points = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        counts.append(max(int(grid_points) - 1, 0))
    return tuple(counts)


def _check_args(signed: bool, max_exponent_bits: int, total_bits: int) -> None:
    if not isinstance(total_bits, int) or not 2 <= total_bits <= 8:
        raise ValueError(f"total_bits must be an int in [2, 8], got {total_bits!r}")
    if not isinstance(max_exponent_bits, int) or not 1 <= max_exponent_bits <= 8:
        raise ValueError(f"max_exponent_bits must be an int in [1, 8], got {max_exponent_bits!r}")
    counts = _decade_counts(signed, max_exponent_bits, total_bits)
    n_values = (2 if signed else 1) * sum(counts) + 2
    if n_values != 2**total_bits:
        raise ValueError(
            f"a dynamic map with signed={signed}, max_exponent_bits={max_exponent_bits}, total_bits={total_bits} "
            f"has {n_values} values, not 2**total_bits = {2**total_bits}; choose another max_exponent_bits "
            f"(for total_bits=4, max_exponent_bits=3 works signed and unsigned)"
        )


def _decade_points(i: int, count: int, max_exponent_bits: int) -> torch.Tensor:
    # Midpoints of `count` equal intervals on [0.1, 1], in fp32 as the reference implementation builds them,
    # then scaled by the decade.
    grid = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float32)
    mids = (grid[:-1] + grid[1:]) / 2.0
    return mids * (10.0 ** (i - max_exponent_bits + 1))


@functools.cache
def _dynamic_map_cached(signed: bool, max_exponent_bits: int, total_bits: int) -> torch.Tensor:
    _check_args(signed, max_exponent_bits, total_bits)
    counts = _decade_counts(signed, max_exponent_bits, total_bits)
    positives = [_decade_points(i, n, max_exponent_bits) for i, n in enumerate(counts) if n > 0]
    pos = torch.cat(positives)
    parts = [pos, torch.tensor([0.0, 1.0])]
    if signed:
        parts.append(-pos)
    values, _ = torch.sort(torch.cat(parts).to(torch.float32))
    return values


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic tree quantization map as a sorted 1-D fp32 tensor of ``2**total_bits`` values.

    Args:
        signed (bool, optional): a sign bit and a symmetric map (for ``exp_avg``); unsigned maps spend the
            sign bit on one more fraction bit (for ``exp_avg_sq``). Default: ``True``.
        max_exponent_bits (int, optional): number of decades, the smallest being ``10**-(max_exponent_bits-1)``
            of the largest. Default: ``7``.
        total_bits (int, optional): bits per code. Default: ``8``.

    The signed 8-bit map has 127 positive values, their 127 negatives, 0 and +1.0 (no -1.0); the unsigned
    one 254 positive values, 0 and 1.0. Raises ``ValueError`` for combinations that do not give exactly
    ``2**total_bits`` values.
    """
    return _dynamic_map_cached(bool(signed), max_exponent_bits, total_bits).clone()


@functools.cache
def dynamic_map_values(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> tuple[float, ...]:
    """``create_dynamic_map(...)`` as a tuple of floats: the codebook a format hands to its layout."""
    return tuple(_dynamic_map_cached(bool(signed), max_exponent_bits, total_bits).tolist())
