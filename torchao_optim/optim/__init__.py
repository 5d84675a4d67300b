"""Optimizers over low-bit state: planning, the executors, the compiled path and the optimizers (their update rules
are :mod:`torchao_optim.rules`)."""

from torchao_optim.optim.adagrad import Adagrad8bit
from torchao_optim.optim.adam import (
    Adam,
    Adam4bit,
    Adam8bit,
    AdamDTQ8bit,
    AdamFp8,
    AdamW,
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    dequantize_state_dict,
)
from torchao_optim.optim.ademamix import AdEMAMix8bit
from torchao_optim.optim.convert import convert_state_dict
from torchao_optim.optim.convert_torchao import load_torchao_checkpoint
from torchao_optim.optim.lion import Lion8bit
from torchao_optim.optim.muon import Muon8bit
from torchao_optim.optim.rmsprop import RMSprop8bit
from torchao_optim.optim.sgd import SGD8bit
from torchao_optim.rules import adam_update

__all__ = [
    "Adam",
    "AdamW",
    "Adam8bit",
    "AdamW8bit",
    "AdamDTQ8bit",
    "Adam4bit",
    "AdamW4bit",
    "AdamFp8",
    "AdamWFp8",
    "SGD8bit",
    "Lion8bit",
    "Muon8bit",
    "Adagrad8bit",
    "RMSprop8bit",
    "AdEMAMix8bit",
    "adam_update",
    "convert_state_dict",
    "load_torchao_checkpoint",
    "dequantize_state_dict",
]
