"""What every test compares with: bit-for-bit states (plain tensors, or a format's inner tensors), a
checkpoint's round trip through ``torch.save``/``torch.load``, and a function with a compile cache of its own."""
from __future__ import annotations

import io
import types

import torch

from torchao_optim.state import QuantizedState

__all__ = ["assert_same_tensor", "fresh_function", "save_load"]


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


def fresh_function(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled entries per code object, so a function compiled
    this way starts with none and counts only its own recompiles, without ``torch._dynamo.reset()`` (after which
    every compiled function of the process would compile again)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
