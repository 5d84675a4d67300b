"""Test helpers shipped with the library, so that a new state format is tested by subclassing one case."""

from torchao_optim.testing.compare import assert_same_tensor, fresh_function, save_load
from torchao_optim.testing.format_case import StateFormatTestCase, requires_cuda
from torchao_optim.testing.optimizer_case import OptimizerConformanceCase
from torchao_optim.testing.rule_case import RULES, ReferenceLion, RuleConformanceCase

__all__ = [
    "StateFormatTestCase",
    "OptimizerConformanceCase",
    "RuleConformanceCase",
    "ReferenceLion",
    "RULES",
    "assert_same_tensor",
    "fresh_function",
    "requires_cuda",
    "save_load",
]
