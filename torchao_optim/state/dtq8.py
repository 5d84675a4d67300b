"""DTQ8bitTensor: 8-bit dynamic tree quantization with one fp32 absmax per block (format "dtq8").

The format of bitsandbytes' 8-bit optimizers: the signed dynamic map for ``exp_avg``, the unsigned one for
``exp_avg_sq``, blocks of 256 elements, codes that are indexes into the sorted map (so they equal
bitsandbytes' codes for the same input, up to ties). 1.016 bytes per element: one code byte plus 4 bytes
of absmax per 256 elements; Adam's two states take 2.03 bytes per parameter.
"""

from __future__ import annotations

from torchao_optim.quant import dynamic_map_values
from torchao_optim.state.codebook import CodebookState
from torchao_optim.state.layout import StateLayout
from torchao_optim.state.registry import register_state_format

__all__ = ["DTQ8bitTensor"]


@register_state_format("dtq8")
class DTQ8bitTensor(CodebookState):
    """8-bit dynamic-tree-quantized tensor.

    Fields: ``codes`` (uint8, flat, one per element: the index of its value in the sorted dynamic map),
    ``absmax`` (fp32, one per block of ``block_size`` elements; the last block may be short), ``signed``
    (which map), ``block_size`` (default 256).

    Construct with ``DTQ8bitTensor.zeros(shape, signed=..., block_size=256, device=None, dtype=torch.float32)``
    or ``DTQ8bitTensor.from_float(x, signed=..., block_size=256)``.
    """

    attr_fields = ("signed", "block_size")
    default_block_size = 256

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        if not isinstance(signed, bool):
            raise TypeError(f"DTQ8bitTensor needs signed=True (exp_avg) or signed=False (exp_avg_sq), got {signed!r}")
        return super()._attrs(block_size=block_size, signed=signed, **attrs)

    @classmethod
    def layout(cls, *, signed: bool, block_size: int) -> StateLayout:
        # The unsigned map holds exp_avg_sq, which Adam divides by: a positive value never encodes to 0.
        return StateLayout(
            codes="codes",
            scales="absmax",
            block_size=block_size,
            codebook=dynamic_map_values(signed),
            never_zero=not signed,
        )
