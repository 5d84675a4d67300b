"""Optimizers over low-bit state: the format-agnostic update rule, its compiled form, Adam/AdamW."""
from torchao_optim.optim.adam import Adam, Adam8bit, AdamDTQ8bit, AdamW, AdamW8bit, dequantize_state_dict
from torchao_optim.optim.update import adam_update

__all__ = ["Adam", "AdamW", "Adam8bit", "AdamW8bit", "AdamDTQ8bit", "adam_update", "dequantize_state_dict"]
