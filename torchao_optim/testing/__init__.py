"""Test helpers shipped with the library: the shared case a new state format subclasses, the optimizer conformance
table its format is crossed with, and the training problem the optimizer tests share."""

from torchao_optim.testing.compare import assert_same_tensor, fresh_function, save_load
from torchao_optim.testing.format_case import StateFormatTestCase, requires_cuda
from torchao_optim.testing.optim_db import (
    ConformanceCase,
    OptimizerInfo,
    ReferenceLion,
    ReferenceMuon,
    Sample,
    conformance_cases,
    optim_db,
)
from torchao_optim.testing.problems import SpreadProblem

__all__ = [
    "StateFormatTestCase",
    "ConformanceCase",
    "OptimizerInfo",
    "ReferenceLion",
    "ReferenceMuon",
    "Sample",
    "SpreadProblem",
    "assert_same_tensor",
    "conformance_cases",
    "fresh_function",
    "optim_db",
    "requires_cuda",
    "save_load",
]
