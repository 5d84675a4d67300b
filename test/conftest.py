"""Test-session setup: on a machine without CUDA, Triton kernels run in Triton's interpreter (when Triton is
installed), so the fused engine is tested on the CPU too. Set before anything imports the kernels. Tests marked
``slow`` (wide sweeps) run only with ``--runslow``."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the made-up formats live beside the tests
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run the tests marked slow: wide sweeps that take many minutes on a CPU",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a wide sweep, many minutes on a CPU; skipped unless --runslow is given")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow", default=False):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
