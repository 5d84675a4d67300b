"""Pure quantization functions: codebooks and blockwise absmax quantization."""
from torchao_optim.quant.blockwise import (
    as_blocks,
    block_absmax,
    codebook,
    dequantize_blockwise,
    dequantize_codes,
    n_blocks,
    normalize,
    quantize_blockwise,
    quantize_nearest,
    quantize_nearest_search,
)
from torchao_optim.quant.dynamic_map import DynamicMapSpec, create_dynamic_map, dynamic_map_spec

__all__ = [
    "DynamicMapSpec",
    "as_blocks",
    "block_absmax",
    "codebook",
    "create_dynamic_map",
    "dequantize_blockwise",
    "dequantize_codes",
    "dynamic_map_spec",
    "n_blocks",
    "normalize",
    "quantize_blockwise",
    "quantize_nearest",
    "quantize_nearest_search",
]
