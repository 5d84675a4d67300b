"""One bit-for-bit comparison of states for every test: plain tensors, or a format's inner tensors."""
from __future__ import annotations

import torch

from torchao_optim.state import QuantizedState

__all__ = ["assert_same_tensor"]


def assert_same_tensor(test, a, b, what: str = "") -> None:
    """``a`` and ``b`` have the same type, shape and dtype, the same format attributes, and bit-identical data
    (every inner tensor of a quantized state); ``test`` is the ``unittest.TestCase`` that reports."""
    test.assertIs(type(a), type(b), what)
    test.assertEqual(a.shape, b.shape, what)
    test.assertEqual(a.dtype, b.dtype, what)
    if isinstance(a, QuantizedState):
        test.assertEqual(a.attrs(), b.attrs(), what)
        for name in a.tensor_fields():
            test.assertTrue(torch.equal(getattr(a, name), getattr(b, name)), f"{what}: field {name} differs")
    else:
        test.assertTrue(torch.equal(a, b), f"{what} differs")
