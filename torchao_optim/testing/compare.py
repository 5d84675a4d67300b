"""What every test compares with: bit-for-bit states (plain tensors, or a format's inner tensors), a
checkpoint's round trip through ``torch.save``/``torch.load``, a function with a compile cache of its own, and
:class:`Failures`, which collects what failed and fails a test once, naming all of it."""

from __future__ import annotations

import io
import types

import torch

from torchao_optim.state import QuantizedState

__all__ = ["Failures", "assert_same_tensor", "difference", "fresh_function", "same_tensor_problems", "save_load"]


def difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """How plain tensors ``a`` and ``b`` differ, in words: their shapes or dtypes, or how many elements differ
    (NaN equals NaN here) and by how much at most."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} of shape {tuple(a.shape)} against {b.dtype} of shape {tuple(b.shape)}"
    x, y = a.detach().cpu(), b.detach().cpu()
    if not (x.is_floating_point() or x.is_complex()):
        x, y = x.long(), y.long()
    differ = x != y
    if x.is_floating_point():
        differ &= ~(x.isnan() & y.isnan())
    n = int(differ.sum())
    if n == 0:
        return "equal"
    gap = (x - y).abs()[differ]
    largest = gap[torch.isfinite(gap)].max().item() if torch.isfinite(gap).any() else float("inf")
    return f"{n} of {x.numel()} elements differ, by up to {largest:.3g}"


def same_tensor_problems(a, b, what: str = "") -> list[str]:
    """What keeps ``a`` from being ``b``: type, shape, dtype, format attributes, and every inner tensor of a
    quantized state (or the data of a plain one) bit for bit. Empty if they are the same."""
    where = f"{what}: " if what else ""
    if type(a) is not type(b):
        return [f"{where}a {type(a).__name__} against a {type(b).__name__}"]
    if a.shape != b.shape or a.dtype != b.dtype:
        return [f"{where}{a.dtype} of shape {tuple(a.shape)} against {b.dtype} of shape {tuple(b.shape)}"]
    if not isinstance(a, QuantizedState):
        return [] if torch.equal(a, b) else [f"{where}{difference(a, b)}; bound: bit-identical"]
    if a.attrs() != b.attrs():
        return [f"{where}attributes {a.attrs()} against {b.attrs()}"]
    return [
        f"{where}field {name}: {difference(getattr(a, name), getattr(b, name))}; bound: bit-identical"
        for name in a.tensor_fields()
        if not torch.equal(getattr(a, name), getattr(b, name))
    ]


def assert_same_tensor(test, a, b, what: str = "") -> None:
    """``a`` and ``b`` have the same type, shape and dtype, the same format attributes, and bit-identical data
    (every inner tensor of a quantized state); ``test`` is the ``unittest.TestCase`` that reports, naming every
    field that differs and by how much."""
    problems = same_tensor_problems(a, b, what)
    if problems:
        test.fail("\n".join(problems))


class Failures:
    """Collects a test's failed checks and, on leaving the ``with`` block, fails the test once with all of them:
    every shape that failed, each with what was measured and the bound, under ``context`` (the format, and the
    executor). An exception raised inside the block is reported as it is.

    Example::

        with Failures(self, "format dtq8, executor cpu") as check:
            for p, q in zip(ours, ref):
                check.at_most((p - q).abs().max(), 1e-3, f"shape {tuple(p.shape)}: max |p - p_ref|")
    """

    def __init__(self, test, context: str):
        self.test, self.context, self.lines = test, context, []

    def __enter__(self) -> Failures:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and self.lines:
            self.test.fail(f"{self.context}: {len(self.lines)} failed\n  " + "\n  ".join(self.lines))
        return False

    def that(self, ok, what: str) -> bool:
        """``ok`` is true; else ``what`` (which says what was measured and what was expected) is recorded."""
        ok = bool(ok)
        if not ok:
            self.lines.append(what)
        return ok

    def at_most(self, value, bound: float, what: str) -> bool:
        """``value`` (a number or a one-element tensor) is at most ``bound``; NaN is not."""
        value = float(value)
        return self.that(value <= bound, f"{what} {value:.4g}, bound {bound:.4g}")

    def equal(self, a: torch.Tensor, b: torch.Tensor, what: str) -> bool:
        """Plain tensors ``a`` and ``b`` are equal (``torch.equal``)."""
        return torch.equal(a, b) or self.that(False, f"{what}: {difference(a, b)}; bound: equal")

    def same(self, a, b, what: str) -> bool:
        """``a`` is ``b`` as :func:`assert_same_tensor` checks it."""
        problems = same_tensor_problems(a, b, what)
        self.lines += problems
        return not problems

    def values(self, a, b, what: str) -> bool:
        """``a == b`` for plain values (types, sets of keys, counts)."""
        return self.that(a == b, f"{what}: {a!r}, expected {b!r}")


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
