"""What every test compares with: bit-for-bit states (plain tensors, or a format's inner tensors), and a
checkpoint's round trip through ``torch.save``/``torch.load``."""
from __future__ import annotations

import io

import torch

from torchao_optim.state import QuantizedState

__all__ = ["assert_same_tensor", "save_load"]


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


def save_load(obj, weights_only: bool = True):
    """``obj`` after ``torch.save`` to memory and ``torch.load`` back (``weights_only`` as a checkpoint is
    loaded; False for whole optimizer objects)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)
