"""DTQ8bitTensor: 8-bit dynamic tree quantization with one fp32 absmax per block (format "dtq8").

The format of bitsandbytes' 8-bit optimizers: the signed dynamic map for ``exp_avg``, the unsigned one for
``exp_avg_sq``, blocks of 256 elements, codes that are indexes into the sorted map (so they equal
bitsandbytes' codes for the same input). 1.016 bytes per element: one code byte plus 4 bytes of absmax
per 256 elements; Adam's two states take 2.03 bytes per parameter.
"""
from __future__ import annotations

from typing import Optional

import torch

from torchao_optim.quant import codebook, dequantize_blockwise, dynamic_map_spec, n_blocks, quantize_blockwise
from torchao_optim.state.base import QuantizedState
from torchao_optim.state.registry import register_state_format

__all__ = ["DTQ8bitTensor"]


@register_state_format("dtq8")
class DTQ8bitTensor(QuantizedState):
    """8-bit dynamic-tree-quantized tensor.

    Fields: ``codes`` (uint8, flat, one per element: the index of its value in the sorted dynamic map),
    ``absmax`` (fp32, one per block of ``block_size`` elements; the last block may be short), ``signed``
    (which map), ``block_size`` (default 256).

    Construct with ``DTQ8bitTensor.zeros(shape, signed=..., block_size=256, device=None, dtype=torch.float32)``
    or ``DTQ8bitTensor.from_float(x, signed=..., block_size=256)``.
    """

    elementwise_fields = ("codes",)
    blockwise_fields = ("absmax",)
    attr_fields = ("signed", "block_size")
    default_block_size = 256

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        if not isinstance(signed, bool):
            raise TypeError(f"DTQ8bitTensor needs signed=True (exp_avg) or signed=False (exp_avg_sq), got {signed!r}")
        return super()._attrs(block_size=block_size, signed=signed, **attrs)

    @classmethod
    def check_values(cls, x, *, signed, block_size):
        if not signed:
            negative = x < 0
            if negative.any():
                raise ValueError(f"DTQ8bitTensor with signed=False stores values >= 0 only (exp_avg_sq); got "
                                 f"{int(negative.sum())} negative values, the smallest {x.min().item()}")

    @classmethod
    def quantize_fields(cls, x, *, signed, block_size):
        codes, absmax = quantize_blockwise(x, dynamic_map_spec(signed), block_size)
        return {"codes": codes.view(-1), "absmax": absmax}

    @classmethod
    def zeros_fields(cls, shape, device, *, signed, block_size):
        zero_code = dynamic_map_spec(signed).zero_code
        return {
            "codes": torch.full((torch.Size(shape).numel(),), zero_code, dtype=torch.uint8, device=device),
            "absmax": torch.zeros(n_blocks(torch.Size(shape).numel(), block_size), device=device),
        }

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        table = codebook(dynamic_map_spec(self.signed).table, self.codes)
        flat = dequantize_blockwise(self.codes, self.absmax, table, self.block_size, dtype or self.dtype)
        return flat.view(self.shape)
