"""Test helpers shipped with the library, so that a new state format is tested by subclassing one case."""
from torchao_optim.testing.compare import assert_same_tensor, save_load
from torchao_optim.testing.format_case import StateFormatTestCase, requires_cuda
from torchao_optim.testing.optimizer_case import OptimizerConformanceCase

__all__ = [
    "StateFormatTestCase", "OptimizerConformanceCase", "assert_same_tensor", "requires_cuda", "save_load",
]
