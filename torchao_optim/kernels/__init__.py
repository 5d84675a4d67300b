"""The fused kernels: Triton's (modules ``triton_*``, imported only where Triton is) and the C step (``cpu.py``).

Leaves of the package: they know state layouts and update rules as data (:mod:`torchao_optim.rules`), never an
optimizer or a format class."""

import os


def triton_interpreter() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, read when Triton is first imported):
    on CPU tensors, as Python, with no PTX."""
    return os.environ.get("TRITON_INTERPRET") == "1"
