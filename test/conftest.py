"""Test-session setup: on a machine without CUDA, Triton kernels run in Triton's interpreter (when Triton is
installed), so the fused engine is tested on the CPU too. Set before anything imports the kernels."""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the made-up formats live beside the tests
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
