"""The optimizer conformance table: every optimizer, in every state format, on every executor, one set of tests.

In the spirit of torch's ``OptimizerInfo``/``optim_db``: :data:`optim_db` holds one :class:`OptimizerInfo` per
optimizer (Adam, AdamW, SGD8bit, Lion8bit, Muon8bit, Adagrad8bit, RMSprop8bit, AdEMAMix8bit, and stock ``torch.optim``
optimizers through
:func:`~torchao_optim.quantize_optimizer_state`): how to build it in a state format on an executor, its
full-precision reference, the executors it has, the states it keeps, how its parity is measured and its
keyword samples. :func:`conformance_cases` crosses the table with the registered formats and the executors
into :class:`ConformanceCase` objects, and ``test/test_conformance.py`` runs its tests on each: the executor
is the one used and the states are the format's; parity with the reference on the same gradients; exact
resume from a ``torch.save`` checkpoint; a non-finite gradient element contained to its element; an lr that
changes every step, used at once and compiling nothing new. A newly registered format is covered with no
list edited.

The executors: ``"compiled"``, the per-parameter ``torch.compile`` path (``fused=False``); ``"eager"``, the same
update run eagerly (``compile=False``), what the compiled path falls back to; ``"fused"``, the multi-tensor
Triton path (``fused=True``); ``"cpu"``, the fused C step of :mod:`torchao_optim.kernels.cpu` (``fused=None`` on
the CPU). A stock optimizer's executors are its requantization, compiled or eager
(``quantize_optimizer_state(compile=...)``). Runs are small (under a thousand elements, a few steps), so that
the fused executor can run in Triton's interpreter on a machine without CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from torchao_optim.optim import Adagrad8bit, Adam, AdamW, AdEMAMix8bit, Lion8bit, Muon8bit, RMSprop8bit, SGD8bit
from torchao_optim.optim.fused import SCALES_READ
from torchao_optim.optim.quantize_state import UNSIGNED_STATE_KEYS, quantize_optimizer_state
from torchao_optim.state import QuantizedState, get_state_format
from torchao_optim.testing.compare import Failures
from torchao_optim.testing.problems import SpreadProblem

__all__ = [
    "EXECUTORS",
    "ConformanceCase",
    "OptimizerInfo",
    "ReferenceAdEMAMix",
    "ReferenceLion",
    "ReferenceMuon",
    "Sample",
    "conformance_cases",
    "is_signed",
    "optim_db",
]

EXECUTORS = ("compiled", "eager", "fused", "cpu")
FUSED_OPTION = {"compiled": False, "eager": False, "fused": True, "cpu": None}  # each executor's fused= argument

NAN, INF = float("nan"), float("inf")
ROUNDING = 1 + 1e-5  # fp32 rounding of a bound computed from a codebook value times a scale
# Plain fp32 state against torch.optim, relative to the parameter's scale: the two round in a different order
# (fused multiply-adds on a GPU), up to an ulp of p per step. 1e-6 is about 8 ulps; measured 4.8e-8 on a CPU.
FP32_REL = 1e-6
# The "lr" parity bound for 8-bit formats, (mean, max) of |p - p_ref| / sum(lr): dtq8 measured mean 0.0092 and
# max 0.092 (AdamW, Adam with maximize and with amsgrad, the lr schedule; every executor), so (0.025, 0.2) leaves
# 2.2-2.7x; an lr off by 10% gives mean 0.05 and fails. fp8: mean 0.0091, max 0.134.
DEFAULT_PARITY_TOLERANCE = (0.025, 0.2)


# ---- references ------------------------------------------------------------------------------------------------
class ReferenceLion(torch.optim.Optimizer):
    """Lion as the paper writes it (Chen et al. 2023, Algorithm 2), in plain fp32: the tests' reference."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = (beta1 * m + (1 - beta1) * p.grad).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class ReferenceAdEMAMix(torch.optim.Optimizer):
    """AdEMAMix as the paper writes it (Pagliardini et al. 2024, Algorithm 1, with its alpha and beta3 schedulers),
    in plain fp32, the schedules in Python floats: the tests' reference."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha=None,
        t_beta3=None,
        eps=1e-8,
        weight_decay=1e-2,
        maximize=False,
    ):
        defaults = dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps)
        super().__init__(params, dict(defaults, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2, beta3_final = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, m1=torch.zeros_like(p), m2=torch.zeros_like(p), nu=torch.zeros_like(p))
                state["step"] += 1
                t = state["step"]
                alpha, beta3 = group["alpha"], beta3_final
                if group["t_alpha"]:
                    alpha = min(t * alpha / group["t_alpha"], alpha)
                if group["t_beta3"]:
                    s, ln1, ln3 = t / group["t_beta3"], math.log(beta1), math.log(beta3_final)
                    beta3 = min(math.exp(ln1 * ln3 / ((1 - s) * ln3 + s * ln1)), beta3_final)
                g = -p.grad if group["maximize"] else p.grad
                m1, m2, nu = state["m1"], state["m2"], state["nu"]
                m1.mul_(beta1).add_(g, alpha=1 - beta1)
                m2.mul_(beta3).add_(g, alpha=1 - beta3)
                nu.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m1_hat = m1 / (1 - beta1**t)
                nu_hat = nu / (1 - beta2**t)
                update = (m1_hat + alpha * m2) / (nu_hat.sqrt() + group["eps"])
                p.add_(update + group["weight_decay"] * p, alpha=-group["lr"])


class ReferenceMuon:
    """torch.optim.Muon for the 2-D parameters and torch.optim.AdamW (Muon8bit's fallback settings) for the rest,
    behind one ``param_groups[0]["lr"]`` (assigning it sets both)."""

    def __init__(self, params, lr, **kw):
        matrices = [p for p in params if p.dim() == 2]
        others = [p for p in params if p.dim() != 2]
        self.muon = torch.optim.Muon(matrices, lr=lr, **kw)
        self.adamw = torch.optim.AdamW(
            others, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=kw.get("weight_decay", 0.1), foreach=False
        )
        self.param_groups = [_LinkedGroup(self.muon.param_groups[0], self.adamw.param_groups[0])]

    def step(self):
        self.muon.step()
        self.adamw.step()


class _LinkedGroup(dict):
    def __init__(self, *groups):
        super().__init__(groups[0])
        self.groups = groups

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        for g in self.groups:
            g[key] = value


# ---- the table ---------------------------------------------------------------------------------------------------
class Sample(NamedTuple):
    """Keyword arguments an optimizer is tested with, given to it and to its reference alike."""

    name: str  # "" for an optimizer's first sample; else part of the test id ("adam-maximize-dtq8-cpu")
    kwargs: dict
    executors: tuple[str, ...] | None = None  # those of the optimizer's executors this sample has (None: all)
    tensor_lr: bool = True  # the lr schedule test also gives a 0-d tensor lr (torch's foreach AdamW refuses one)


@dataclass(frozen=True)
class OptimizerInfo:
    """One optimizer of the conformance table.

    ``make(params, lr=, state_format=, executor=, min_quant_size=, **kwargs)`` builds it; ``reference(params, lr=,
    **kwargs)`` builds its full-precision reference; ``state_keys(p, kwargs)`` names the states it keeps for
    parameter ``p`` (besides ``step``); each state is signed unless its name is in ``UNSIGNED_STATE_KEYS``.

    ``parity`` is how the distance to the reference is measured (``test_matches_reference``):

    - ``"lr"``: ``(mean, max)`` of ``|p - p_ref|`` over each parameter with quantized state, as a fraction of
      ``sum(lr)`` over the steps (how far an Adam step can move an element, about lr), within the case's
      ``parity_tolerance``; each parameter with plain fp32 state within ``FP32_REL`` of its scale.
    - ``"adamw"``: ``sum |p - p_ref| / sum |p_ref - p_0|`` over the parameters of ``min_quant_size`` elements or
      more (how far from its reference the optimizer went, per unit of how far the reference went) no larger than
      AdamW's in the same format against ``torch.optim.AdamW`` on the same problem, times the case's
      ``parity_slack``; with fp32 state, at most ``fp32_bound(steps)``.

    ``mixes_elements(p)``: whether an element's update depends on other elements of ``p`` (Muon's
    orthogonalization), so that a non-finite gradient element leaves the others finite but not bit-identical;
    ``skips_non_finite``: whether a non-finite gradient element is skipped (our optimizers) or, as in torch.optim,
    makes that element's parameter non-finite (stock optimizers); ``plain_state``: whether ``"none"`` (fp32
    state) is one of its formats. A fused executor plans every parameter of a case.
    """

    name: str
    make: Callable
    reference: Callable
    lr: float
    executors: tuple[str, ...]
    samples: tuple[Sample, ...]
    state_keys: Callable[[torch.Tensor, dict], tuple[str, ...]]
    parity: str = "lr"
    fp32_bound: Callable[[int], float] = lambda steps: FP32_REL * 10
    mixes_elements: Callable[[torch.Tensor], bool] = lambda p: False
    skips_non_finite: bool = True
    stock: bool = False
    plain_state: bool = True

    def __post_init__(self):
        if self.parity not in ("lr", "adamw"):
            raise ValueError(f"{self.name}: parity must be 'lr' or 'adamw', got {self.parity!r}")
        for executor in self.executors:
            if executor not in EXECUTORS:
                raise ValueError(f"{self.name}: executor {executor!r} is not one of {EXECUTORS}")
        for sample in self.samples:
            for executor in sample.executors or ():
                if executor not in self.executors:
                    raise ValueError(f"{self.name}: sample {sample.name!r} names executor {executor!r}, not its own")


def _ours(cls):
    def make(params, *, lr, state_format, executor, min_quant_size, **kwargs):
        return cls(
            params,
            lr=lr,
            state_format=state_format,
            fused=FUSED_OPTION[executor],
            compile=executor != "eager",
            min_quant_size=min_quant_size,
            **kwargs,
        )

    return make


def _stock(cls):
    def make(params, *, lr, state_format, executor, min_quant_size, foreach=False, **kwargs):
        return quantize_optimizer_state(
            cls(params, lr=lr, foreach=foreach, **kwargs),
            state_format=state_format,
            min_quant_size=min_quant_size,
            compile=executor == "compiled",
        )

    return make


def _stock_reference(cls):
    return lambda params, *, lr, foreach=False, **kwargs: cls(params, lr=lr, foreach=foreach, **kwargs)


def _adam_keys(p, kwargs):
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kwargs.get("amsgrad") else ())


def _rmsprop_keys(p, kwargs):
    return (
        ("square_avg",)
        + (("momentum_buffer",) if kwargs.get("momentum", 0) > 0 else ())
        + (("grad_avg",) if kwargs.get("centered") else ())
    )


optim_db: list[OptimizerInfo] = [
    OptimizerInfo(
        name="adamw",
        make=_ours(AdamW),
        reference=lambda params, *, lr, **kw: torch.optim.AdamW(params, lr=lr, foreach=False, **kw),
        lr=1e-2,
        executors=EXECUTORS,
        samples=(Sample("", dict(weight_decay=0.1)),),
        state_keys=_adam_keys,
    ),
    OptimizerInfo(
        name="adam",
        make=_ours(Adam),
        reference=lambda params, *, lr, **kw: torch.optim.Adam(params, lr=lr, foreach=False, **kw),
        lr=1e-2,
        executors=EXECUTORS,
        samples=(
            Sample("maximize", dict(weight_decay=0.1, maximize=True)),  # L2 weight decay added to the gradient
            # max_exp_avg_sq quantized too: three states (the Triton kernel's three-state form)
            Sample("amsgrad", dict(weight_decay=0.1, maximize=True, amsgrad=True)),
        ),
        state_keys=_adam_keys,
    ),
    OptimizerInfo(
        name="sgd",
        make=_ours(SGD8bit),
        reference=lambda params, *, lr, **kw: torch.optim.SGD(params, lr=lr, foreach=False, **kw),
        lr=1e-2,
        executors=EXECUTORS,
        samples=(
            Sample("", dict(momentum=0.9, dampening=0.1, weight_decay=1e-3)),
            Sample("nesterov_maximize", dict(momentum=0.9, nesterov=True, maximize=True)),
        ),
        state_keys=lambda p, kw: ("momentum_buffer",),
        parity="adamw",
    ),
    OptimizerInfo(
        name="lion",
        make=_ours(Lion8bit),
        reference=lambda params, *, lr, **kw: ReferenceLion(params, lr=lr, **kw),
        lr=1e-3,
        executors=EXECUTORS,
        samples=(Sample("", dict(weight_decay=0.1)),),
        state_keys=lambda p, kw: ("exp_avg",),
        parity="adamw",
        # Lion steps by sign(c): where c is within an ulp of 0, a rounding difference (the CUDA kernel contracts
        # m + (1 - beta1) * (g - m) into a fused multiply-add, torch rounds twice) flips the sign and moves that
        # element by 2 lr against about lr a step; allowed for one element in 1000.
        fp32_bound=lambda steps: 2e-3 / steps,
    ),
    OptimizerInfo(
        name="muon",
        make=_ours(Muon8bit),
        reference=lambda params, *, lr, **kw: ReferenceMuon(params, lr=lr, **kw),
        lr=2e-2,
        executors=EXECUTORS,
        # the fused rule's option (nesterov) both ways, on the fused executors (the compiled path's update takes it as
        # a Python flag, as SGD's)
        samples=(Sample("", {}), Sample("no_nesterov", dict(nesterov=False), executors=("fused", "cpu"))),
        state_keys=lambda p, kw: ("momentum_buffer",) if p.dim() == 2 else ("exp_avg", "exp_avg_sq"),
        parity="adamw",
        # Muon orthogonalizes in bf16, where an fp32 rounding difference in its input may move an output by a bf16
        # ulp (2**-8 relative; measured 0 on a CPU).
        fp32_bound=lambda steps: 2**-8,
        mixes_elements=lambda p: p.dim() == 2,
    ),
    OptimizerInfo(
        name="adagrad",
        make=_ours(Adagrad8bit),
        reference=lambda params, *, lr, **kw: torch.optim.Adagrad(params, lr=lr, foreach=False, **kw),
        lr=1e-2,
        executors=EXECUTORS,
        samples=(Sample("", dict(lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1, maximize=True)),),
        state_keys=lambda p, kw: ("sum",),
    ),
    OptimizerInfo(
        name="rmsprop",
        make=_ours(RMSprop8bit),
        reference=lambda params, *, lr, **kw: torch.optim.RMSprop(params, lr=lr, foreach=False, **kw),
        lr=1e-2,
        executors=EXECUTORS,
        samples=(
            Sample("", dict(weight_decay=1e-3, maximize=True)),  # square_avg alone: the one-state kernels
            Sample("momentum", dict(momentum=0.9)),  # and momentum_buffer: the two-state kernels
            # and grad_avg: three states (the Triton kernel's three-state form)
            Sample("centered", dict(centered=True, momentum=0.5)),
            # square_avg and grad_avg: two states, the two-state kernels with a signed second state
            Sample("centered_no_momentum", dict(centered=True, weight_decay=1e-3, maximize=True)),
        ),
        state_keys=_rmsprop_keys,
        parity="adamw",
    ),
    OptimizerInfo(
        name="ademamix",
        make=_ours(AdEMAMix8bit),
        reference=lambda params, *, lr, **kw: ReferenceAdEMAMix(params, lr=lr, **kw),
        lr=1e-2,
        executors=EXECUTORS,  # three states: the Triton kernel's three-state form, the C step
        samples=(
            Sample("", dict(weight_decay=0.1)),
            # both schedulers within the run's steps, beta3 below 0.99 so that the slow EMA moves in a few steps
            Sample("schedulers", dict(betas=(0.9, 0.99, 0.98), alpha=3.0, t_alpha=4, t_beta3=5, maximize=True)),
        ),
        state_keys=lambda p, kw: ("exp_avg", "exp_avg_slow", "exp_avg_sq"),
        parity="adamw",
    ),
    # Stock optimizers keep their own step (and torch.optim's handling of a non-finite gradient); their states are
    # quantized once per step. "none" is no format of quantize_optimizer_state (it would be the stock optimizer).
    OptimizerInfo(
        name="stock_adamw",
        make=_stock(torch.optim.AdamW),
        reference=_stock_reference(torch.optim.AdamW),
        lr=1e-2,
        executors=("compiled", "eager"),
        samples=(
            Sample("", dict(weight_decay=0.1)),
            # torch.optim's default on CUDA: _foreach_* ops over the dequantized chunk
            Sample("foreach", dict(weight_decay=0.1, foreach=True), tensor_lr=False),
        ),
        state_keys=lambda p, kw: ("exp_avg", "exp_avg_sq"),
        skips_non_finite=False,
        stock=True,
        plain_state=False,
    ),
    OptimizerInfo(
        name="stock_rmsprop",
        make=_stock(torch.optim.RMSprop),
        reference=_stock_reference(torch.optim.RMSprop),
        lr=1e-2,
        executors=("compiled", "eager"),
        samples=(Sample("", dict(centered=True, momentum=0.5, weight_decay=1e-3)),),
        state_keys=lambda p, kw: ("square_avg", "momentum_buffer", "grad_avg"),
        parity="adamw",
        skips_non_finite=False,
        stock=True,
        plain_state=False,
    ),
]


# ---- a case: one optimizer sample, one format, one executor -------------------------------------------------------
_ADAMW_ERRORS: dict[tuple, float] = {}


class _Raise:
    """What :class:`~torchao_optim.testing.compare.Failures` reports to outside a ``unittest.TestCase``."""

    @staticmethod
    def fail(message):
        raise AssertionError(message)


def _as_float(state):
    return state.dequantize(torch.float32) if isinstance(state, QuantizedState) else state


@dataclass
class ConformanceCase:
    """``info``'s ``sample`` in ``format_name`` (a registered format or ``"none"``) on ``executor``, and what its
    tests need: the training problem, the optimizer and its reference, and the checks they share.

    ``parity_tolerance`` (``"lr"`` parity) defaults to the 8-bit bound, ``parity_slack`` (``"adamw"`` parity) to 1:
    no worse than AdamW. ``max_error`` (``{signed: fraction}``) is a state's largest requantization error as a
    fraction of its block's scale; None derives it from the format's ``StateLayout``. ``device`` defaults to
    CUDA where there is one; ``shapes``, ``min_quant_size`` and ``steps`` size the runs.
    """

    info: OptimizerInfo
    sample: Sample
    format_name: str
    executor: str
    parity_tolerance: tuple[float, float] = DEFAULT_PARITY_TOLERANCE
    parity_slack: float = 1.0
    max_error: dict | None = None
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    # whole blocks; a 2-D shape whose last block is partial; below min_quant_size (fp32 state)
    shapes: Sequence[Sequence[int]] = ((4, 128), (3, 100), (50,))
    min_quant_size: int = 256
    steps: int = 6

    def __post_init__(self):
        if self.executor not in self.info.executors:
            raise ValueError(f"{self.info.name} has no {self.executor!r} executor (it has {self.info.executors})")
        if self.executor == "cpu":
            self.device = "cpu"
        self.problem = SpreadProblem(self.shapes)

    # ---- names -----------------------------------------------------------------------------------------------
    @property
    def row(self) -> str:
        """The optimizer and its sample: ``"adamw"``, ``"sgd-nesterov_maximize"``."""
        return "-".join(part for part in (self.info.name, self.sample.name) if part)

    @property
    def id(self) -> str:
        """``row-format-executor``: ``"adamw-dtq8-cpu"``, so that ``pytest -k dtq8`` selects a format's cases."""
        return f"{self.row}-{self.format_name}-{self.executor}"

    def __repr__(self) -> str:
        return f"ConformanceCase({self.id})"

    def failures(self, test=None) -> Failures:
        """A :class:`~torchao_optim.testing.compare.Failures` naming this case; it fails ``test`` (a
        ``unittest.TestCase``), or raises ``AssertionError`` if None."""
        context = f"{self.row}, format {self.format_name!r}, executor {self.executor!r}"
        return Failures(test if test is not None else _Raise, context)

    # ---- the problem, the optimizer, its reference -----------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.info.lr

    def params(self) -> list[torch.nn.Parameter]:
        return self.problem.params(self.device)

    def train(self, opt, params, steps, start=0, sched=None):
        return self.problem.train(opt, params, steps, start=start, sched=sched)

    def optimizer(self, params, lr=None):
        return self.info.make(
            params,
            lr=self.lr if lr is None else lr,
            state_format=self.format_name,
            executor=self.executor,
            min_quant_size=self.min_quant_size,
            **self.sample.kwargs,
        )

    def reference(self, params, lr=None):
        return self.info.reference(params, lr=self.lr if lr is None else lr, **self.sample.kwargs)

    def quantized(self, p) -> bool:
        """Whether ``p``'s states are in the case's format (else plain fp32)."""
        return self.format_name != "none" and p.numel() >= self.min_quant_size

    def state_keys(self, p) -> tuple[str, ...]:
        return self.info.state_keys(p, self.sample.kwargs)

    # ---- checks --------------------------------------------------------------------------------------------------
    def check_executor(self, check, opt, params):
        """Every parameter is updated by the case's executor."""
        if self.info.stock:
            check.values(opt._quantized_state["compile"], self.executor == "compiled", "requantization compiled")
            return
        if self.executor in ("compiled", "eager"):
            check.values(opt._plans, {}, "fused plans")
            check.values(opt._update.enabled, self.executor == "compiled", "compiled or eager as asked")
            return
        plans = opt._plans[id(opt.param_groups[0])]
        check.values([params[i].shape for i in plans["rest"]], [], "left to the compiled path")
        planned = {id(p) for plan in plans["plans"] for p in plan.params}
        check.values(planned, {id(p) for p in params}, "the parameters the plans cover")
        check.values(
            {plan.executor for plan in plans["plans"]},
            {"cpu" if self.executor == "cpu" else "triton"},
            "the plans' executor",
        )

    def check_parity(self, check, opt, ours, ref, start, lr_sum, what):
        """``ours`` as close to ``ref`` (trained by the reference from ``start``) as ``info.parity`` says; every
        parameter outside its bound reported."""
        if self.info.parity == "adamw":
            rel = self.relative_error(ours, ref, start)
            if self.format_name == "none":
                bound, why = self.info.fp32_bound(self.steps), "fp32 rounding"
            else:
                bound = self.adamw_relative_error() * self.parity_slack
                why = f"against AdamW's in this format, times {self.parity_slack}"
            check.at_most(rel, bound, f"{what}, shapes {list(self.shapes)}: relative error ({why})")
            return
        for p, q in zip(ours, ref):
            err = (p.detach() - q.detach()).abs()
            where = f"{what}, shape {tuple(p.shape)}:"
            if self.quantized(p):
                mean_bound, max_bound = self.parity_tolerance
                check.at_most(err.mean() / lr_sum, mean_bound, f"{where} mean |p - p_ref| / sum(lr)")
                check.at_most(err.max() / lr_sum, max_bound, f"{where} max |p - p_ref| / sum(lr)")
            else:
                scale = q.abs().max().item()
                check.at_most(
                    err.max() / max(scale, 1e-30), FP32_REL, f"{where} (fp32 state) max |p - p_ref| / max |p_ref|"
                )

    def relative_error(self, ours, ref, start) -> float:
        """sum |p - p_ref| / sum |p_ref - p_0| over the parameters of ``min_quant_size`` elements or more (over
        all, where none is that large)."""
        pick = [i for i, p in enumerate(ours) if p.numel() >= self.min_quant_size] or list(range(len(ours)))
        err = sum((ours[i] - ref[i]).detach().abs().sum() for i in pick)
        moved = sum((ref[i] - start[i]).detach().abs().sum() for i in pick)
        return (err / moved).item()

    def adamw_relative_error(self) -> float:
        """AdamW's relative error in this format against torch.optim.AdamW on the same problem: the ``"adamw"``
        parity bound. Computed once per format and problem: run eagerly, the compiled path's numbers (its codes
        bit for bit), without compiling AdamW for each case."""
        key = (self.format_name, tuple(map(tuple, self.shapes)), self.min_quant_size, self.steps, self.device)
        if key not in _ADAMW_ERRORS:
            ours, ref, start = self.params(), self.params(), self.params()
            opt = AdamW(
                ours,
                lr=1e-2,
                weight_decay=0.1,
                state_format=self.format_name,
                fused=False,
                compile=False,
                min_quant_size=self.min_quant_size,
            )
            self.train(opt, ours, self.steps)
            self.train(torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False), ref, self.steps)
            _ADAMW_ERRORS[key] = self.relative_error(ours, ref, start)
        return _ADAMW_ERRORS[key]

    def requant_bound(self, state, signed):
        """(fraction, scales): a requantized element lies within ``fraction * scales[its block]`` of its value.
        From a codebook: half its widest gap, or its smallest nonzero value where nonzero never rounds to 0."""
        layout = state.fast_path_layout()
        if self.max_error is not None:
            scales = getattr(state, layout.scales if layout else type(state).blockwise_fields[0])
            return self.max_error[signed], scales
        if layout is None:
            raise AssertionError(f"{self.format_name} has no StateLayout: give its conformance case a max_error")
        book = sorted(layout.codebook)
        frac = max(b - a for a, b in zip(book, book[1:])) / 2
        if layout.never_zero:
            frac = max(frac, min(v for v in book if v > 0))
        return frac, getattr(state, layout.scales)

    def check_contained(self, check, what, sa, sb, s0, idx, others, signed):
        """A state ``sa`` of run A after the step with non-finite gradient elements at ``idx``, against ``sb`` of
        run B (finite gradients there) and ``s0``, A's state (as fp32) before that step.

        Plain state: the other elements equal to B's; the bad elements' unchanged where the optimizer skips
        them (else torch.optim's values, non-finite). Quantized state: finite; bit-identical to B's in blocks
        without a bad element; in a block with one, A's scale excludes the bad element's new value, so A and B
        requantize the same values with different scales: the other elements within one requantization error
        of each, and, where the optimizer skips it, the bad element within one of its old value."""
        skipped = self.info.skips_non_finite
        fa, fb, f0 = (x.reshape(-1) for x in (_as_float(sa), _as_float(sb), s0))
        if not isinstance(sa, QuantizedState):
            if skipped:
                check.equal(fa[idx], f0[idx], f"{what}: the bad elements' state (it must not move)")
            check.equal(fa[others], fb[others], f"{what}: the other elements' state, against run B")
            if skipped:
                check.that(torch.isfinite(fa).all(), f"{what}: non-finite elements, expected none")
            return
        if not check.that(
            torch.isfinite(fa).all(), f"{what}: {int((~torch.isfinite(fa)).sum())} non-finite elements, expected none"
        ):
            return
        numel = fa.numel()
        n_blocks = math.ceil(numel / sa.block_size)
        if any(getattr(sa, name).numel() != n_blocks for name in sa.blockwise_fields):
            return  # scales that are not per block (rank-1): the parameter-level checks hold
        frac, scale_a = self.requant_bound(sa, signed)
        scale_b = self.requant_bound(sb, signed)[1]
        block = torch.arange(numel, device=fa.device) // sa.block_size
        hit = torch.zeros(n_blocks, dtype=torch.bool, device=fa.device)
        hit[idx // sa.block_size] = True
        clean = ~hit[block]
        # per element (packed codes: several per entry) or per block; other fields (a factored format's empty means
        # beside blockwise codes) are checked at the parameter level
        for name in sa.elementwise_fields + sa.blockwise_fields:
            x, y = getattr(sa, name), getattr(sb, name)
            keep = ~hit if name in sa.blockwise_fields else clean[:: math.ceil(numel / x.numel())]
            check.equal(x[keep], y[keep], f"{what}.{name}: the blocks without a bad element, against run B")
        check.that(torch.isfinite(scale_a).all(), f"{what}: a non-finite scale")
        bound = frac * (scale_a + scale_b)[block] * ROUNDING
        excess = ((fa - fb).abs() / bound.clamp_min(1e-30))[others]
        check.that(
            (excess <= 1).all(),
            f"{what}: the other elements of a block with a bad one differ from run B by "
            f"up to {excess.max().item():.4g} of the bound (two requantization errors)",
        )
        if skipped:
            moved = (fa - f0).abs()[idx] / (frac * scale_a[block[idx]] * ROUNDING).clamp_min(1e-30)
            check.that(
                (moved <= 1).all(),
                f"{what}: the bad elements' state moved by up to {moved.max().item():.4g} of "
                f"the bound (one requantization error)",
            )


def is_signed(key: str) -> bool:
    """Whether a state of this name may hold negative values (the signed codebook)."""
    return key not in UNSIGNED_STATE_KEYS


def _has_fused_layout(case: ConformanceCase, executor: str = "cpu") -> bool:
    """Whether every state the case's ``executor`` (``"cpu"``: the fused C step; ``"fused"``: the Triton kernels) would
    plan has a ``StateLayout`` in its format, with scales that executor reads (``optim.fused.SCALES_READ``). A format
    without one has no fused executor to conform to: its fused cases would only test the compiled path again."""
    if case.format_name == "none":
        return True
    fmt = get_state_format(case.format_name)
    reads = SCALES_READ["cpu" if executor == "cpu" else "triton"]
    for p in case.params():
        if case.quantized(p):
            for key in case.state_keys(p):
                layout = fmt.zeros(p.shape, signed=is_signed(key)).fused_layout()
                if layout is None or layout.scale not in reads:
                    return False
    return True


def conformance_cases(
    formats: Iterable[str],
    *,
    db: Sequence[OptimizerInfo] = optim_db,
    compiled_on_cpu: Callable[[str, str], bool] = lambda row, fmt: fmt in ("none", "dtq8"),
    parity_tolerance: dict[str, tuple[float, float]] | None = None,
    parity_slack: dict[tuple[str, str], float] | None = None,
) -> list[ConformanceCase]:
    """Every optimizer sample of ``db`` crossed with ``formats`` (``"none"`` among them for plain fp32 state) and
    with each executor it has there. ``"fused"`` and ``"cpu"`` run where the format describes the states they
    plan as a ``StateLayout`` that executor reads. Of ``"compiled"`` and ``"eager"`` one runs: compiled with CUDA,
    where ``compiled_on_cpu(row, format)`` (``row``: :attr:`ConformanceCase.row`), and where the sample has the
    Triton executor but the format no layout it reads (the compiled path is then the format's path on CUDA); else
    eager. Compiling the
    update takes inductor's C++ backend about half a minute a test on a CPU, per format and configuration;
    eager runs the same update, which each format's compiled form equals bit for bit (StateFormatTestCase).
    ``parity_tolerance`` (by format) and ``parity_slack`` (by ``(row, format)``) override the defaults."""
    parity_tolerance = parity_tolerance or {}
    parity_slack = parity_slack or {}
    cases = []
    for info in db:
        for sample in info.samples:
            executors = sample.executors or info.executors
            for fmt in formats:
                if fmt == "none" and not info.plain_state:
                    continue

                def case(executor, info=info, sample=sample, fmt=fmt):
                    made = ConformanceCase(info, sample, fmt, executor)
                    made.parity_tolerance = parity_tolerance.get(fmt, DEFAULT_PARITY_TOLERANCE)
                    made.parity_slack = parity_slack.get((made.row, fmt), 1.0)
                    return made

                first = case(executors[0])
                fused = [e for e in ("fused", "cpu") if e in executors and _has_fused_layout(first, e)]
                if "fused" in executors and "fused" not in fused:
                    compile = True  # the Triton kernels cannot take the format: on CUDA the compiled path is its path
                else:
                    compile = torch.cuda.is_available() or compiled_on_cpu(first.row, fmt)
                per_parameter = [e for e in executors if e in ("compiled", "eager")]
                if per_parameter:
                    chosen = "compiled" if compile else "eager"
                    cases.append(case(chosen if chosen in per_parameter else per_parameter[0]))
                for executor in fused:
                    cases.append(case(executor))
    return cases
