"""Formats that exist only for the tests, written after the fused kernels and unknown to them.

Each is what a contributor writes: a codebook, a layout, a registration. The fused engine must take them
with no kernel edit, and give the same codes as their compiled path.
"""

import torch

from torchao_optim.state import CodebookState, StateLayout, register_state_format


def _cubic(signed: bool):
    if signed:  # 255 values: denser near 0, like a dynamic map, but with no decade structure
        t = torch.linspace(-1, 1, 255, dtype=torch.float64)
        return tuple(sorted(set((t**3).float().tolist())))
    t = torch.linspace(0, 1, 256, dtype=torch.float64)
    return tuple((t**2).float().tolist())


@register_state_format("test_cubic8")
class Cubic8Tensor(CodebookState):
    """8-bit codes of a made-up codebook (cubic spacing signed, quadratic unsigned)."""

    attr_fields = ("signed", "block_size")

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        return super()._attrs(block_size=block_size, signed=bool(signed), **attrs)

    @classmethod
    def layout(cls, *, signed, block_size):
        return StateLayout(
            codes="codes", scales="absmax", block_size=block_size, codebook=_cubic(signed), never_zero=not signed
        )


@register_state_format("test_linear4")
class Linear4Tensor(CodebookState):
    """4-bit codes, two per byte, of an even grid, blocks of 128."""

    attr_fields = ("signed", "block_size")
    default_block_size = 128

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        return super()._attrs(block_size=block_size, signed=bool(signed), **attrs)

    @classmethod
    def layout(cls, *, signed, block_size):
        grid = torch.linspace(-1, 1, 15) if signed else torch.linspace(0, 1, 16)
        return StateLayout(
            codes="codes",
            scales="absmax",
            block_size=block_size,
            bits=4,
            codebook=tuple(grid.tolist()),
            never_zero=not signed,
        )


@register_state_format("test_grid8")
class Grid8Tensor(Cubic8Tensor):
    """8-bit codes; ``exp_avg_sq``'s codebook the even grid ``(i + 1) / 256`` with no zero level, which the fused
    kernels encode with no table (``quant.codec.grid_bits``), ``exp_avg``'s the made-up cubic one."""

    @classmethod
    def layout(cls, *, signed, block_size):
        codebook = _cubic(True) if signed else tuple((i + 1) / 256 for i in range(256))
        return StateLayout(codes="codes", scales="absmax", block_size=block_size, codebook=codebook)
