"""Pure quantization functions: codebooks, the O(1) encoder and blockwise absmax quantization."""

from torchao_optim.quant.blockwise import (
    as_blocks,
    block_absmax,
    codebook_tensor,
    dequantize_blockwise,
    n_blocks,
    normalize,
    quantize_blockwise,
    quantize_nearest,
    quantize_nearest_search,
)
from torchao_optim.quant.codec import bucket_tables, decision_boundaries, pack_nibbles, unpack_nibbles
from torchao_optim.quant.dynamic_map import create_dynamic_map, dynamic_map_values

__all__ = [
    "as_blocks",
    "block_absmax",
    "bucket_tables",
    "codebook_tensor",
    "create_dynamic_map",
    "decision_boundaries",
    "dynamic_map_values",
    "dequantize_blockwise",
    "n_blocks",
    "normalize",
    "pack_nibbles",
    "quantize_blockwise",
    "quantize_nearest",
    "quantize_nearest_search",
    "unpack_nibbles",
]
