"""Optimizers over low-bit state: the format-agnostic update rule, its compiled form, Adam/AdamW."""
from torchao_optim.optim.adam import (Adam, Adam4bit, Adam8bit, AdamDTQ8bit, AdamFp8, AdamW, AdamW4bit, AdamW8bit,
                                      AdamWFp8, dequantize_state_dict)
from torchao_optim.optim.update import adam_update

__all__ = ["Adam", "AdamW", "Adam8bit", "AdamW8bit", "AdamDTQ8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8",
           "adam_update", "dequantize_state_dict"]
