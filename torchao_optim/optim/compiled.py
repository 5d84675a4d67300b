"""Compile settings, in one place, and the automatic eager fallback.

Every compiled function in the library goes through :func:`compiled`: ``fullgraph=True`` (a graph break
would silently run the update op by op) and ``dynamic=True`` (one compiled graph serves every parameter
size, so compile time does not grow with the number of distinct shapes).

:class:`CompiledOrEager` keeps one compiled callable per configuration of its arguments (tensor types,
dtypes, ranks and format attributes, and the flags), each with its own dynamo cache. Dynamo allows a
function only ``torch._dynamo.config.recompile_limit`` (8) cache entries, and every configuration is an
entry: one cache shared by all of them would run the ninth configuration a process meets eagerly, for good.
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

from torchao_optim.state import QuantizedState

__all__ = ["compiled", "COMPILE_OPTIONS", "CompiledOrEager", "configuration_key"]

COMPILE_OPTIONS = {
    # The codebook gathers index a 256-entry table with indexes built in range; bounds asserts cost time.
    "assert_indirect_indexing": False,
    # Reductions over a block (the absmax) as looped reductions, one block per program, not as persistent ones.
    # On the H200 (ViT-B, fp32; figures in benchmarks/README.md) the dtq8 and 4-bit steps got faster (2.11 ->
    # 1.61 ms, 2.13 -> 1.95 ms; 4-bit rank-1's stayed within 2%, 4.78 -> 4.85 ms) and so did the cold first steps of
    # 4-bit formats (14.2 -> 7.3 s, rank-1 17.0 -> 11.9 s). A persistent reduction over blocks of 128 has three
    # Triton configurations to autotune, compiled one after another; for the step's largest kernel (the absmax
    # fused with the whole update) they were the first step's critical path. A looped inner reduction has one.
    "triton.persistent_reductions": False,
}
BACKEND = "inductor"

# torch >= 2.13 gives a compiled callable a cache of its own on request; older versions key dynamo's cache
# by code object, so a copy of the function's code object gets a cache of its own there.
_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def compiled(fn: Callable, isolated: bool = False) -> Callable:
    """``fn`` under ``torch.compile`` with the library's settings; ``isolated``: with a dynamo cache (and
    recompile limit) of its own, not shared with other compiled callables of the same function."""
    kwargs: dict[str, Any] = {}
    if isolated and _ISOLATE:
        kwargs["isolate_recompiles"] = True
    elif isolated:
        fn = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    if BACKEND == "inductor":
        kwargs["options"] = COMPILE_OPTIONS
    return torch.compile(fn, fullgraph=True, dynamic=True, backend=BACKEND, **kwargs)


def configuration_key(args, kwargs) -> Hashable:
    """What selects a compiled graph, apart from sizes: each tensor's dtype, rank, contiguity and
    ``requires_grad``, a subclass's type and flatten context (its format attributes), and every other
    argument's value. Computed on every call: kept to attribute reads (about 20 us for Adam's 12 arguments)."""
    return tuple(map(_describe, args)) + tuple((k, _describe(v)) for k, v in kwargs.items())


def _describe(a):
    if type(a) is torch.Tensor:
        return (a.dtype, a.dim(), a.is_contiguous(), a.requires_grad)
    if isinstance(a, torch.Tensor):
        return (type(a), a.dtype, a.dim(), a.__tensor_flatten__()[1] if hasattr(a, "__tensor_flatten__") else None)
    return (type(a), a)


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


class _raise_on_recompile_limit:
    """Within: dynamo raises when a cache is full instead of running the frame eagerly without a word, so
    that the fallback below warns. (Left alone under ``suppress_errors``, which asks for silence; set and
    restored by hand: ``config.patch`` costs milliseconds, this is on every call.)"""

    def __enter__(self):
        config = torch._dynamo.config
        self._old = getattr(config, "fail_on_recompile_limit_hit", None)
        if self._old is not None and not config.suppress_errors:
            config.fail_on_recompile_limit_hit = True
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            torch._dynamo.config.fail_on_recompile_limit_hit = self._old
        return False


# Set on a tensor by torch._dynamo.mark_static_address: a user's torch.compile of a training step marks every
# parameter and state tensor of the optimizer so (torch._dynamo's optimizer support, for CUDA graphs).
_STATIC_MARK = "_dynamo_static_input_type"


def _unmarked(a):
    """``a``, or, where ``a`` (or an inner tensor of a quantized state) is marked a static address, the same
    storage through a new tensor object without the mark. Dynamo guards on the identity of a marked input, so
    the update compiled for one parameter would compile again for each other one, and after the recompile limit
    (8) run eagerly for good."""
    if isinstance(a, QuantizedState):
        fields = a.fields()
        if not any(hasattr(v, _STATIC_MARK) for v in fields.values()):
            return a
        return a._new({k: _unmarked(v) for k, v in fields.items()})
    if not isinstance(a, torch.Tensor) or not hasattr(a, _STATIC_MARK):
        return a
    out = a.new_empty(0).set_(a.untyped_storage(), a.storage_offset(), a.shape, a.stride())
    return out.requires_grad_(a.requires_grad)


_COMPILED: dict[Hashable, Callable] = {}


class CompiledOrEager:
    """Call ``fn`` compiled, one compiled callable per :func:`configuration_key`. If compiling fails (no C++
    compiler, an unsupported backend, a full cache), warn once, saying why and what it costs, and run ``fn``
    eagerly from then on. An input that fails eagerly too is an error of the input, not of the compiler:
    it is raised, and compiling stays on. Results agree within fp32 rounding either way."""

    def __init__(self, fn: Callable, enabled: bool = True):
        self.fn = fn
        self.enabled = enabled

    def compiled_for(self, *args, **kwargs) -> Callable | None:
        """The compiled callable that serves these arguments (None when compiling is off)."""
        if not self.enabled:
            return None
        # Shared by every instance (every optimizer, and its copies): a new optimizer reuses the graphs
        # compiled for an earlier one.
        key = (self.fn, BACKEND, configuration_key(args, kwargs))
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = compiled(self.fn, isolated=True)
        return fn

    def __call__(self, *args, **kwargs):
        fn = self.compiled_for(*args, **kwargs)
        if fn is None:
            return self.fn(*args, **kwargs)
        try:
            with _raise_on_recompile_limit():
                return fn(*map(_unmarked, args), **{k: _unmarked(v) for k, v in kwargs.items()})
        except _compile_errors() as err:
            out = self.fn(*args, **kwargs)  # raises if the input, not the compiler, is at fault
            self.enabled = False
            # dynamo's first line often only names the stage ("backend=... raised:"); the cause follows
            reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:300]
            warnings.warn(
                f"torch.compile failed for {self.fn.__name__} ({type(err).__name__}: {reason}); falling back to "
                f"eager mode from now on. Eager mode is correct but runs the update op by op, with a temporary "
                f"fp32 copy of each state (measured: 13x slower steps on a 2-core CPU). Pass compile=False to skip the "
                f"attempt and this warning.",
                RuntimeWarning,
                stacklevel=3,
            )
            return out
