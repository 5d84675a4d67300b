"""Compile settings, in one place, and the automatic eager fallback.

Every compiled function in the library goes through :func:`compiled`: ``fullgraph=True`` (a graph break
would silently run the update op by op) and ``dynamic=True`` (one compiled graph serves every parameter
size, so compile time does not grow with the number of distinct shapes).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

__all__ = ["compiled", "COMPILE_OPTIONS", "CompiledOrEager"]

COMPILE_OPTIONS = {
    # The codebook gathers index a 256-entry table with indexes built in range; bounds asserts cost time.
    "assert_indirect_indexing": False,
}


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS)


def _compile_errors():
    errors = [torch._dynamo.exc.TorchDynamoException]
    if hasattr(torch._dynamo.exc, "FailOnRecompileLimitHit"):
        errors.append(torch._dynamo.exc.FailOnRecompileLimitHit)
    try:
        from torch._inductor.exc import CppCompileError, InductorError

        errors += [CppCompileError, InductorError]
    except ImportError:  # older torch
        pass
    return tuple(errors)


class CompiledOrEager:
    """Call ``fn`` compiled; if compiling fails (no C++ compiler, an unsupported backend), warn once and
    run ``fn`` eagerly from then on. Results agree within fp32 rounding either way."""

    def __init__(self, fn: Callable, enabled: bool = True):
        self.fn = fn
        self.enabled = enabled
        self._compiled = compiled(fn) if enabled else None

    def __call__(self, *args, **kwargs):
        if self.enabled:
            try:
                return self._compiled(*args, **kwargs)
            except _compile_errors() as err:
                self.enabled = False
                warnings.warn(
                    f"torch.compile failed for {self.fn.__name__} ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}); falling back to eager mode, which is "
                    f"correct but slower. Pass compile=False to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return self.fn(*args, **kwargs)

