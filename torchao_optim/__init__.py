"""torchao_optim: low-bit optimizer state for PyTorch, as tensor subclasses."""

from torchao_optim.optim import (
    Adagrad8bit,
    Adam,
    Adam4bit,
    Adam8bit,
    AdamDTQ8bit,
    AdamFp8,
    AdamW,
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    AdEMAMix8bit,
    Lion8bit,
    Muon8bit,
    RMSprop8bit,
    SGD8bit,
    convert_state_dict,
    dequantize_state_dict,
    load_torchao_checkpoint,
)
from torchao_optim.optim.backward import step_in_backward
from torchao_optim.optim.overrides import overrides
from torchao_optim.optim.quantize_state import UNSIGNED_STATE_KEYS, quantize_optimizer_state
from torchao_optim.quant import create_dynamic_map
from torchao_optim.state import (
    DTQ8bitTensor,
    Factored4Tensor,
    FactoredTensor,
    FourBitRank1Tensor,
    FourBitTensor,
    Fp8Tensor,
    QuantizedState,
    get_state_format,
    list_state_formats,
    register_state_format,
)

__version__ = "0.1.0"

__all__ = [
    "Adam",
    "Adam4bit",
    "Adam8bit",
    "AdamDTQ8bit",
    "AdamFp8",
    "AdamW",
    "AdamW4bit",
    "AdamW8bit",
    "Lion8bit",
    "Muon8bit",
    "SGD8bit",
    "Adagrad8bit",
    "RMSprop8bit",
    "AdEMAMix8bit",
    "AdamWFp8",
    "convert_state_dict",
    "dequantize_state_dict",
    "load_torchao_checkpoint",
    "quantize_optimizer_state",
    "overrides",
    "step_in_backward",
    "UNSIGNED_STATE_KEYS",
    "DTQ8bitTensor",
    "Factored4Tensor",
    "FactoredTensor",
    "FourBitRank1Tensor",
    "FourBitTensor",
    "Fp8Tensor",
    "QuantizedState",
    "create_dynamic_map",
    "get_state_format",
    "list_state_formats",
    "register_state_format",
]
