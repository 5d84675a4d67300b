"""Optimizers over low-bit state: the format-agnostic update rules, their compiled form, the optimizers."""
from torchao_optim.optim.adam import Adam, Adam8bit, AdamDTQ8bit, AdamW, AdamW8bit, dequantize_state_dict
from torchao_optim.optim.lion import Lion8bit
from torchao_optim.optim.muon import Muon8bit
from torchao_optim.optim.sgd import SGD8bit
from torchao_optim.optim.update import adam_update

__all__ = [
    "Adam", "AdamW", "Adam8bit", "AdamW8bit", "AdamDTQ8bit", "SGD8bit", "Lion8bit", "Muon8bit", "adam_update",
    "dequantize_state_dict",
]
