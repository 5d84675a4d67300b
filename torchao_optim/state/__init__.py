"""Optimizer-state formats: the shared base class, the registry and the built-in formats."""

from torchao_optim.state.base import QuantizedState, implements
from torchao_optim.state.codebook import CodebookState
from torchao_optim.state.dtq8 import DTQ8bitTensor  # noqa: E402  (registers "dtq8")
from torchao_optim.state.factored import Factored4Tensor, FactoredTensor  # noqa: E402  ("factored", "factored4")
from torchao_optim.state.fourbit import FourBitRank1Tensor, FourBitTensor  # noqa: E402  ("4bit", "4bit_rank1")
from torchao_optim.state.fp8 import Fp8Tensor  # noqa: E402  (registers "fp8")
from torchao_optim.state.layout import StateLayout
from torchao_optim.state.registry import get_state_format, list_state_formats, register_state_format

__all__ = [
    "CodebookState",
    "DTQ8bitTensor",
    "Factored4Tensor",
    "FactoredTensor",
    "FourBitRank1Tensor",
    "FourBitTensor",
    "Fp8Tensor",
    "StateLayout",
    "QuantizedState",
    "get_state_format",
    "implements",
    "list_state_formats",
    "register_state_format",
]
