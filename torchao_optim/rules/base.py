"""An update rule as data, and what every rule's plain tensor update shares.

A :class:`FusedRule` says what a fused kernel needs to run a rule, and nothing of any optimizer: its states and
their signs, its per-step coefficients, its element update in each kernel family's form, and the name of its
source in the C step. The kernels read these; no table of names picks a kernel or coefficients, so a rule a
kernel was not built for is refused by name (``optim/launch.py``), never run with another rule's arithmetic; the
planner (``optim/fused.py``) leaves a rule an executor has no form of to the compiled path there.
A rule is one file (``rules/<name>.py``): its Triton functions are written there in Triton's language and made
``@triton.jit`` functions by :func:`triton_jit` when a kernel first asks for them, so that importing a rule imports
no Triton; its C update is source text there, which ``kernels/cpu.py`` builds into the C step.

Non-finite gradient elements are skipped by every rule: that element's parameter and states keep their values
(up to requantization of its block) and nothing else in its block changes. This is bitsandbytes' policy, except
that we keep the element's state rather than zeroing it. An element whose new state would overflow the state's
dtype is skipped the same way.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchao_optim.quant.rounding import stochastic_round_bf16

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

__all__ = [
    "FusedRule",
    "OUTPUTS",
    "finite_grad",
    "param_div",
    "param_sqrt",
    "split_direction",
    "sqrt_rn",
    "store_param",
    "triton_jit",
]

OUTPUTS = ("param", "direction")  # what a rule's element update writes (FusedRule.output)


@dataclass(frozen=True)
class FusedRule:
    """An update rule as the fused kernels take it.

    Args:
        name (str): the rule's name, for messages.
        state_keys (Tuple[str, ...]): the states it reads and writes, in the kernels' order. Their number picks the
            kernel family: one state, the one-state Triton kernel (``kernels/triton_momentum.py``); two, the
            two-state one (``kernels/triton_adam.py``). The C step takes one, two or three.
        signed (Tuple[bool, ...]): per state, whether it may hold a negative value (the unsigned codebook serves
            a state that cannot).
        coefficient_names (Tuple[str, ...]): the columns of its per-step coefficient rows; the one-state Triton
            kernel reads 4, the two-state one 7, the C step any number.
        coefficients (Callable): ``(steps, hyperparams, option) -> rows``: float64 ``steps.shape +
            (n_coefs,)`` from advanced step counts and the group's hyperparameter tensor, once per step.
        option (str, optional): the launch setting its element updates take as their one constant (``OPTION``,
            ``option``), and its coefficient function as ``option``: Adam's ``"decoupled"``, SGD's ``"nesterov"``.
            Default: None.
        triton_update (Callable, optional): returns its element update, a ``@triton.jit`` function the Triton
            kernel family of its states takes as a constexpr (made by :func:`triton_jit`; Triton is imported then,
            not before): one state, ``(p, g, s, coefs, OPTION, PTX) -> (p, s)``; two, ``(p, g, m, v, coefs,
            OPTION, PTX) -> (p, m, v)``; fp32 tiles, the gradient already negated for ``maximize``. Default: None
            (no Triton kernel runs it).
        triton_coefficients (Callable, optional): returns a Triton kernel ``(steps, hyperparams, coefs, n, OPTION,
            N_POW2, PDL)`` that advances ``n`` step counts and writes their rows in one launch, for every plan of a
            group on a device. Default: None (the rows come from ``coefficients``, in torch).
        c_source (str, optional): its element update in C, as source text the C step is built with
            (``kernels/cpu.py``): a function ``c_name`` that updates ``n`` fp32 elements in place; one state,
            ``void (float *p, const float *g, float *s, int n, const float *c, int option)``; two, ``void (float
            *p, const float *g, float *m, float *v, int n, const float *c, int option)``; three, ``void (float *p,
            const float *g, float *s0, float *s1, float *s2, int n, const float *c, int option)``. Default: None
            (the C step does not run it).
        c_name (str, optional): the name of the function ``c_source`` defines; given with it. Default: None.
        output (str, optional): what the element update's first result is. ``"param"``: the new parameter, written in
            place. ``"direction"``: a tensor the plan holds, fp32 and shaped as the parameter, which the optimizer
            reads after the launch and the parameter is not touched by the kernel (Muon8bit orthogonalizes it); the
            update writes NaN for an element it skips, and that element's parameter must be kept
            (:func:`split_direction`). Default: ``"param"``.
    """

    name: str
    state_keys: tuple[str, ...]
    signed: tuple[bool, ...]
    coefficient_names: tuple[str, ...]
    coefficients: Callable[..., torch.Tensor]
    option: str | None = None
    triton_update: Callable[[], Any] | None = None
    triton_coefficients: Callable[[], Any] | None = None
    c_source: str | None = None
    c_name: str | None = None
    output: str = "param"

    def __post_init__(self):
        if self.output not in OUTPUTS:
            raise ValueError(f"rule {self.name!r}: output must be one of {OUTPUTS}, got {self.output!r}")
        if len(self.signed) != len(self.state_keys):
            raise ValueError(
                f"rule {self.name!r}: {len(self.state_keys)} state keys {self.state_keys} but "
                f"{len(self.signed)} signs {self.signed}"
            )
        if (self.c_source is None) != (self.c_name is None):
            raise ValueError(
                f"rule {self.name!r}: c_source and c_name go together (the source, and the name of the function it "
                f"defines), got c_name={self.c_name!r} and {'no' if self.c_source is None else 'a'} c_source"
            )
        if self.c_name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.c_name):
            raise ValueError(f"rule {self.name!r}: c_name must be a C identifier, got {self.c_name!r}")

    @property
    def n_coefs(self) -> int:
        """Columns of its coefficient rows."""
        return len(self.coefficient_names)


def triton_jit(fn: Callable, calls: tuple[Callable, ...] = (), imports: tuple[str, ...] = ()) -> Callable[[], Any]:
    """A function written in Triton's language, as a callable that returns it as a ``@triton.jit`` function, made on
    the first call (and kept): a rule's file writes its Triton functions without importing Triton, so that importing
    the package imports no Triton, and a kernel asks for them when it first launches (``FusedRule.triton_update``).

    On that call ``tl`` (``triton.language``) and ``triton`` are bound in ``fn``'s module, where its body finds them,
    with ``imports`` (dotted names of other Triton objects, bound under their last part: Adam's coefficients kernel
    takes ``"triton.language.extra.cuda.gdc_launch_dependents"``), and so is each of ``calls``: a function ``fn``
    calls, written the same way, jit-compiled first and bound under its name, where Triton looks a callee up. The
    module writes ``from __future__ import annotations``, so that a ``tl.constexpr`` annotation is a string at import
    (Triton reads it as one), and may import the names under ``typing.TYPE_CHECKING``, for readers and linters.
    """
    return functools.partial(_jit, fn, tuple(calls), tuple(imports))


@functools.cache
def _jit(fn: Callable, calls: tuple[Callable, ...], imports: tuple[str, ...]) -> Any:
    import triton
    import triton.language as tl

    names = {"tl": tl, "triton": triton}
    for path in imports:
        module, _, name = path.rpartition(".")
        names[name] = getattr(importlib.import_module(module), name)
    scope = fn.__globals__
    for name, value in names.items():
        if scope.get(name, value) is not value:
            raise ValueError(
                f"{fn.__module__}.{fn.__qualname__}: its module's {name!r} is {scope[name]!r}, not the Triton "
                f"object {value!r} its Triton functions mean by it"
            )
        scope[name] = value
    for callee in calls:
        scope[callee.__name__] = _jit(callee, (), ())
    return triton.jit(fn)


def param_sqrt(x, PTX: tl.constexpr):
    """A tile's square root where only the parameter's update depends on it, never a state (written in Triton's
    language, for a rule's tile update: ``triton_jit(..., calls=(param_sqrt, param_div))``): on a GPU build
    (``PTX``) the fast one, within an ulp; in Triton's interpreter correctly rounded, as the C step and the compiled
    path take it, so that there the kernel stores their parameter bit for bit. A state that depends on a square
    root (RMSprop's momentum buffer) takes ``tl.sqrt_rn`` itself: its codes must not depend on the executor."""
    if PTX:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


def param_div(x, d, PTX: tl.constexpr):
    """``x / d`` where only the parameter's update depends on it (see :func:`param_sqrt`): on a GPU build ``x`` times
    the reciprocal that flushes subnormals (``rcp.approx.ftz``, within an ulp; the product within two), with none of
    the range checks and slow path a correctly rounded division compiles to (one call and two branches an element);
    correctly rounded in Triton's interpreter. ``d`` is an optimizer's denominator, ``sqrt(...) + eps``: 0 (then
    ``x / 0`` either way) or normal and below 2**126 (the square root of the largest fp32 is 1.8e19), where that
    reciprocal flushes nothing."""
    if PTX:
        return x * tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return x / d


def finite_grad(grad: torch.Tensor, dtype: torch.dtype, maximize: bool):
    """``(g, finite)``: the gradient in ``dtype`` (negated with ``maximize``) with its non-finite elements set
    to 0, and where they were finite: every rule skips the others (parameter and state keep their values)."""
    g = grad.to(dtype)
    if maximize:
        g = -g
    finite = torch.isfinite(g)
    return torch.where(finite, g, 0.0), finite


def split_direction(direction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(direction, ok)`` from a direction an update wrote with NaN where it skipped an element (a rule whose output is
    ``"direction"``): ``ok`` where the value is finite, and the direction with 0 elsewhere, so that a skipped element
    counts as 0 in whatever mixes the elements and its parameter can be kept."""
    ok = torch.isfinite(direction)
    return torch.where(ok, direction, 0.0), ok


def store_param(param: torch.Tensor, value: torch.Tensor, round_key: torch.Tensor | None) -> None:
    """``param.copy_(value)``; a bf16 ``param`` with a ``round_key`` (int64 ``(key, element offset)``, see
    :mod:`torchao_optim.quant.rounding`) is written with stochastic rounding instead of round-to-nearest."""
    if round_key is not None and param.dtype == torch.bfloat16:
        value = stochastic_round_bf16(value.to(torch.float32), round_key[0], round_key[1])
    param.copy_(value)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """``x.sqrt()`` correctly rounded, as the compiled path (inductor), the C step (``sqrtf``) and the Triton kernels
    (``tl.sqrt_rn``) take it. Eager torch's vectorized fp32 square root on the CPU is not (measured: 0.7% of elements
    an ulp off with AVX-512); through fp64 it is (an fp32 square root rounded twice is rounded once). A rule whose
    state depends on a square root (RMSprop's momentum buffer) takes it here, so that its eager update, which the
    compiled one falls back to, stores the same state."""
    if x.dtype == torch.float64:
        return x.sqrt()
    return x.to(torch.float64).sqrt().to(x.dtype)
