"""Test helpers shipped with the library, so that a new state format is tested by subclassing one case."""
from torchao_optim.testing.format_case import StateFormatTestCase, requires_cuda

__all__ = ["StateFormatTestCase", "requires_cuda"]
