"""The shared optimizer test case: every state format, on every executor, trains like fp32 AdamW.

:class:`OptimizerConformanceCase` is :class:`~torchao_optim.testing.StateFormatTestCase`'s twin one level up.
A subclass names a format (or ``"none"``) and an executor (``"compiled"``: the per-parameter
``torch.compile`` path, ``fused=False``; ``"eager"``: the same update run eagerly, ``compile=False``, what the
compiled path falls back to; ``"fused"``: the multi-tensor Triton path, ``fused=True``; ``"cpu"``: the fused C
step of :mod:`torchao_optim.kernels.cpu`, ``fused=None`` on the CPU) and so
gets every check below: the executor is the one used; parity with ``torch.optim.AdamW``/``Adam`` on the same
gradients; exact resume from a ``torch.save`` checkpoint; a non-finite gradient element contained to its
element; an lr that changes every step, used at once and compiling nothing new. A new format is covered by
that subclass alone, never by editing a list.

Runs are small (under a thousand elements, a few steps): on a machine without CUDA the fused executor runs
in Triton's interpreter, and is skipped where neither is available; the cpu executor is skipped where no C
compiler is.
"""

from __future__ import annotations

import math
import unittest
import warnings

import expecttest
import torch
from torch._dynamo.utils import counters

from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim import Adam, AdamW
from torchao_optim.optim.fused import fused_available
from torchao_optim.state import QuantizedState, get_state_format
from torchao_optim.testing.compare import Failures, assert_same_tensor, save_load

__all__ = ["OptimizerConformanceCase", "EXECUTORS", "compiled_or_eager"]

EXECUTORS = ("compiled", "eager", "fused", "cpu")
FUSED_OPTION = {"compiled": False, "eager": False, "fused": True, "cpu": None}  # each executor's fused= argument


def compiled_or_eager(fmt: str, compiled_on_cpu) -> str:
    """The executor that stands for the per-parameter update of format ``fmt`` in a generated test class:
    ``"compiled"`` with CUDA or for the formats in ``compiled_on_cpu``, else ``"eager"``. Compiling the update
    takes inductor's C++ backend about half a minute a test on a CPU, per format; eager runs the same update,
    which each format's compiled form equals bit for bit (StateFormatTestCase)."""
    return "compiled" if torch.cuda.is_available() or fmt in compiled_on_cpu else "eager"


NAN, INF = float("nan"), float("inf")
ROUNDING = 1 + 1e-5  # fp32 rounding of a bound computed from a codebook value times a scale
# Plain fp32 state against torch.optim, relative to the parameter's scale: the two round in a different order
# (fused multiply-adds on a GPU), up to an ulp of p per step. 1e-6 is about 8 ulps; measured 4.8e-8 on a CPU.
FP32_REL = 1e-6


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _as_float(state):
    return state.dequantize(torch.float32) if isinstance(state, QuantizedState) else state


class OptimizerConformanceCase(expecttest.TestCase):
    """Set ``format_name`` (a registered format or ``"none"``) and ``executor`` (:data:`EXECUTORS`).

    ``parity_tolerance`` is ``(mean, max)`` of ``|p - p_ref|`` over each parameter with quantized state, as a
    fraction of ``sum(lr)`` over the steps (how far an Adam step can move an element, about lr): the
    distance to ``torch.optim.AdamW`` trained on the same gradients. The default is for 8-bit formats:
    dtq8 measured mean 0.0092 and max 0.089 over these tests (AdamW, Adam with maximize, the lr schedule;
    compiled and fused alike), so (0.025, 0.2) leaves 2.2-2.7x; an lr off by 10% gives mean 0.05 and fails.
    Plain fp32 state (``"none"``, and parameters below ``min_quant_size``) must match torch.optim to
    ``FP32_REL`` of the parameter's scale.

    ``max_error`` (``{signed: fraction}``) is a state's largest requantization error as a fraction of its
    block's scale; None derives it from the format's ``StateLayout``. ``device`` defaults to CUDA where there is
    one; ``shapes``, ``min_quant_size``, ``lr`` and ``steps`` size the runs.
    """

    format_name: str = ""
    executor: str = "compiled"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    parity_tolerance = (0.025, 0.2)
    max_error = None
    # whole blocks; a 2-D shape whose last block is partial; below min_quant_size (fp32 state)
    shapes = ((4, 128), (3, 100), (50,))
    min_quant_size = 256
    lr, steps = 1e-2, 6
    __test__ = False  # collected only through subclasses that name a format

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__test__ = bool(cls.format_name)
        if cls.executor not in EXECUTORS:
            raise ValueError(f"{cls.__name__}.executor must be one of {EXECUTORS}, got {cls.executor!r}")
        if cls.executor == "cpu":
            cls.device = "cpu"
            unittest.skipUnless(cpu_kernels_available(), "the fused CPU step could not be built (no C compiler)")(cls)
        if cls.executor == "fused":
            unittest.skipUnless(
                fused_available(cls.device),
                f"the fused executor cannot run on {cls.device}: it "
                "needs Triton and a CUDA device, or Triton's interpreter (TRITON_INTERPRET=1) on "
                "the CPU",
            )(cls)

    def setUp(self):
        # a compiled step that fell back to eager mode warns: here that is a failure, not a slower pass
        caught = warnings.catch_warnings()
        caught.__enter__()
        self.addCleanup(caught.__exit__, None, None, None)
        warnings.simplefilter("error", RuntimeWarning)

    # ---- a training problem, the same for every optimizer that trains it --------------------------------
    def params(self):
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=gen).to(self.device)) for s in self.shapes]

    def grads(self, step):
        """Each element's gradient is ``scale * (direction + 2 * noise)``: a consistent direction under noise,
        with magnitudes spread over e^4 within each block, so that blockwise quantization matters."""
        gen = torch.Generator().manual_seed(1)
        fixed = [
            (torch.empty(s).uniform_(-3, 1, generator=gen).exp(), torch.randn(s, generator=gen)) for s in self.shapes
        ]
        gen.manual_seed(100 + step)
        return [
            (scale * (direction + 2 * torch.randn(scale.shape, generator=gen))).to(self.device)
            for scale, direction in fixed
        ]

    def optimizer(self, params, cls=AdamW, **kw):
        kw.setdefault("lr", self.lr)
        kw.setdefault("weight_decay", 0.1)
        return cls(
            params,
            state_format=self.format_name,
            fused=FUSED_OPTION[self.executor],
            compile=self.executor != "eager",
            min_quant_size=self.min_quant_size,
            **kw,
        )

    def train(self, opt, params, steps, start=0, sched=None):
        for k in range(start, start + steps):
            for p, g in zip(params, self.grads(k)):
                p.grad = g
            opt.step()
            if sched is not None:
                sched.step()

    # ---- assertions -------------------------------------------------------------------------------------
    def failures(self) -> Failures:
        """A :class:`~torchao_optim.testing.compare.Failures` naming this case's format and executor."""
        return Failures(self, f"format {self.format_name!r}, executor {self.executor!r}")

    def step_with_bad_gradients(self, bad):
        """Two runs A and B, one step each on the same gradients; then a second step where A's gradients hold
        ``bad`` (per parameter, (flat index, value) pairs) and B's do not. Returns ``(a, b, opt_a, opt_b,
        before)``, ``before`` A's parameters and states (as fp32) before the second step."""
        a, b = self.params(), self.params()
        oa, ob = self.optimizer(a), self.optimizer(b)
        self.train(oa, a, 1)
        self.train(ob, b, 1)
        before = [(p.detach().clone(), {k: _as_float(v).clone() for k, v in oa.state[p].items()}) for p in a]
        for p, q, g, hits in zip(a, b, self.grads(1), bad):
            p.grad, q.grad = g.clone(), g.clone()
            for i, value in hits:
                p.grad.view(-1)[i] = value
        oa.step()
        ob.step()
        return a, b, oa, ob, before

    def fusable(self, params):
        """The parameters a fused executor must plan: all of them."""
        return list(params)

    def assertExecutorUsed(self, opt, params):
        context = f"format {self.format_name!r}, executor {self.executor!r}"
        if self.executor not in ("compiled", "eager"):
            plans = opt._plans[id(opt.param_groups[0])]
            fused = {id(p) for p in self.fusable(params)}
            self.assertEqual(
                [params[i].shape for i in plans["rest"]],
                [p.shape for p in params if id(p) not in fused],
                f"{context}: left to the compiled path",
            )
            self.assertEqual(
                {id(p) for plan in plans["plans"] for p in plan.params},
                fused,
                f"{context}: the parameters the fused plans cover",
            )
            self.assertEqual(
                {plan.executor for plan in plans["plans"]},
                {"cpu" if self.executor == "cpu" else "triton"},
                f"{context}: the plans' executor",
            )
        else:
            self.assertEqual(opt._plans, {}, f"{context}: fused plans")
            self.assertEqual(opt._update.enabled, self.executor == "compiled", f"{context}: compiled or eager as asked")

    def assertFollows(self, opt, ours, ref, lr_sum, what=""):
        """``ours`` within ``parity_tolerance`` of ``ref`` (fp32 state: within fp32 rounding), every parameter
        checked and every one outside its bound reported."""
        with self.failures() as check:
            for p, q in zip(ours, ref):
                err = (p.detach() - q.detach()).abs()
                where = f"{what}, shape {tuple(p.shape)}:"
                if isinstance(opt.state[p]["exp_avg"], QuantizedState):
                    mean_bound, max_bound = self.parity_tolerance
                    check.at_most(err.mean() / lr_sum, mean_bound, f"{where} mean |p - p_ref| / sum(lr)")
                    check.at_most(err.max() / lr_sum, max_bound, f"{where} max |p - p_ref| / sum(lr)")
                else:
                    scale = q.abs().max().item()
                    check.at_most(
                        err.max() / max(scale, 1e-30), FP32_REL, f"{where} (fp32 state) max |p - p_ref| / max |p_ref|"
                    )

    def assertBitEqual(self, a, b, what):
        assert_same_tensor(self, a, b, what)

    def requant_bound(self, state, signed):
        """(fraction, scales): a requantized element lies within ``fraction * scales[its block]`` of its value.
        From a codebook: half its widest gap, or its smallest nonzero value where nonzero never rounds to 0."""
        layout = state.fast_path_layout()
        if self.max_error is not None:
            scales = getattr(state, layout.scales if layout else type(state).blockwise_fields[0])
            return self.max_error[signed], scales
        if layout is None:
            self.fail(f"{self.format_name} has no StateLayout: set max_error on its conformance case")
        book = sorted(layout.codebook)
        frac = max(b - a for a, b in zip(book, book[1:])) / 2
        if layout.never_zero:
            frac = max(frac, min(v for v in book if v > 0))
        return frac, getattr(state, layout.scales)

    # ---- the checks ---------------------------------------------------------------------------------------
    def test_uses_its_executor_and_state_format(self):
        """Every parameter is updated by the case's executor; states are the format's from min_quant_size on."""
        params = self.params()
        opt = self.optimizer(params)
        self.train(opt, params, 1)
        self.assertExecutorUsed(opt, params)
        with self.failures() as check:
            for p in params:
                quantized = self.format_name != "none" and p.numel() >= self.min_quant_size
                for key in ("exp_avg", "exp_avg_sq"):
                    state = opt.state[p][key]
                    what = f"{key} of shape {tuple(p.shape)}"
                    check.values(
                        type(state), get_state_format(self.format_name) if quantized else torch.Tensor, f"{what}: type"
                    )
                    check.values(
                        (state.shape, state.dtype, state.device),
                        (p.shape, torch.float32, p.device),
                        f"{what}: shape, dtype, device",
                    )

    def test_adamw_matches_torch_adamw(self):
        """AdamW (decoupled weight decay) against torch.optim.AdamW on the same gradients."""
        ours, ref = self.params(), self.params()
        opt = self.optimizer(ours)
        self.train(opt, ours, self.steps)
        self.train(torch.optim.AdamW(ref, lr=self.lr, weight_decay=0.1, foreach=False), ref, self.steps)
        self.assertFollows(opt, ours, ref, self.lr * self.steps, "AdamW")

    def test_adam_l2_maximize_matches_torch_adam(self):
        """Adam (L2 weight decay added to the gradient) with maximize=True against torch.optim.Adam."""
        ours, ref = self.params(), self.params()
        opt = self.optimizer(ours, cls=Adam, maximize=True)
        self.train(opt, ours, self.steps)
        self.train(torch.optim.Adam(ref, lr=self.lr, weight_decay=0.1, maximize=True, foreach=False), ref, self.steps)
        self.assertFollows(opt, ours, ref, self.lr * self.steps, "Adam maximize")

    def test_exact_resume(self):
        """2 steps, checkpoint (optimizer and lr scheduler, through torch.save and torch.load(weights_only=True)),
        a new optimizer on copies of the parameters; both go on 2 steps: bit-identical, every state field."""

        def make(params):
            opt = self.optimizer(params)
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.7**k)

        first = self.params()
        opt, sched = make(first)
        self.train(opt, first, 2, sched=sched)
        ckpt = save_load({"params": [p.detach() for p in first], "opt": opt.state_dict(), "sched": sched.state_dict()})
        resumed = [torch.nn.Parameter(t.clone()) for t in ckpt["params"]]
        opt2, sched2 = make(resumed)
        opt2.load_state_dict(ckpt["opt"])
        sched2.load_state_dict(ckpt["sched"])
        self.train(opt, first, 2, start=2, sched=sched)
        self.train(opt2, resumed, 2, start=2, sched=sched2)
        self.assertExecutorUsed(opt2, resumed)
        with self.failures() as check:
            check.values(opt2.param_groups[0]["lr"], opt.param_groups[0]["lr"], "lr after resuming")
            self.check_resumed(check, opt2, resumed, opt, first)

    def check_resumed(self, check, opt2, resumed, opt, first):
        """Every resumed parameter, and every state of it, bit-identical to the run that went on."""
        for p, q in zip(resumed, first):
            what = f"shape {tuple(p.shape)}"
            check.same(p.detach(), q.detach(), f"{what}: the resumed parameter against the one that went on")
            if check.values(set(opt2.state[p]), set(opt.state[q]), f"{what}: state keys"):
                for key in opt.state[q]:
                    check.same(opt2.state[p][key], opt.state[q][key], f"{what}: {key}")

    def test_non_finite_gradient_stays_in_its_element(self):
        """Run A sees NaN/+-Inf gradient elements, run B finite values there, after the same history. A new
        parameter element depends only on its own old state and gradient (states are requantized after the
        update), so every other element of A must equal B's bit for bit, and the bad ones must not move. States:
        bit-identical in blocks without a bad element; in a block with one, A's scale excludes the bad element's
        new value, so A and B requantize the same values with different scales: within one requantization
        error of each, and the bad element within one of its old value."""
        bad = [((3, NAN), (200, INF), (263, -INF)), ((5, NAN), (290, INF)), ((10, NAN),)]  # (flat index, value)
        a, b, oa, ob, before = self.step_with_bad_gradients(bad)
        with self.failures() as check:
            for p, q, hits, (p0, s0) in zip(a, b, bad, before):
                what = f"shape {tuple(p.shape)}"
                idx = torch.tensor([i for i, _ in hits], device=p.device)
                others = torch.ones(p.numel(), dtype=torch.bool, device=p.device)
                others[idx] = False
                check.equal(p.view(-1)[idx], p0.view(-1)[idx], f"{what}: the bad elements (they must not move)")
                check.equal(p.view(-1)[others], q.view(-1)[others], f"{what}: the other elements, against run B")
                check.values(float(oa.state[p]["step"]), 2.0, f"{what}: step")
                for key in ("exp_avg", "exp_avg_sq"):
                    self.check_contained(
                        check,
                        f"{what} {key}",
                        oa.state[p][key],
                        ob.state[q][key],
                        s0[key],
                        idx,
                        others,
                        signed=key == "exp_avg",
                    )
        self.train(oa, a, 1, start=2)  # and training goes on
        with self.failures() as check:
            for p in a:
                check.that(
                    torch.isfinite(p).all(), f"shape {tuple(p.shape)}: a non-finite parameter element a step later"
                )

    def check_contained(self, check, what, sa, sb, s0, idx, others, signed):
        """A state ``sa`` of run A after the step with bad gradient elements at ``idx``, against ``sb`` of run B
        and ``s0``, A's state (as fp32) before that step: see test_non_finite_gradient_stays_in_its_element."""
        fa, fb, f0 = (x.reshape(-1) for x in (_as_float(sa), _as_float(sb), s0))
        if not check.that(
            torch.isfinite(fa).all(), f"{what}: {int((~torch.isfinite(fa)).sum())} non-finite elements, expected none"
        ):
            return
        if not isinstance(sa, QuantizedState):
            check.equal(fa[idx], f0[idx], f"{what}: the bad elements' state (it must not move)")
            check.equal(fa[others], fb[others], f"{what}: the other elements' state, against run B")
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
        for name in sa.data_fields():  # per element (packed codes: several per entry) or per block
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
        moved = (fa - f0).abs()[idx] / (frac * scale_a[block[idx]] * ROUNDING).clamp_min(1e-30)
        check.that(
            (moved <= 1).all(),
            f"{what}: the bad elements' state moved by up to {moved.max().item():.4g} of "
            f"the bound (one requantization error)",
        )

    def test_lr_schedule_without_recompiles(self):
        """A float lr assigned to ``group["lr"]`` every step, then a tensor lr changed in place, then lr 0: each
        is used at once (the parameters follow torch.optim.AdamW run with the same schedule; lr 0 moves
        nothing while the state goes on), and after the first step nothing is compiled again."""
        ours, ref = self.params(), self.params()
        opt = self.optimizer(ours)
        r = torch.optim.AdamW(ref, lr=self.lr, weight_decay=0.1, foreach=False)
        tensor_lr = torch.tensor(0.0, device=self.device)
        schedule = [(1e-2, False), (3e-3, False), (2e-2, False), (4e-3, True), (1.5e-2, True)]
        for k, (lr, as_tensor) in enumerate(schedule):
            if as_tensor:
                tensor_lr.fill_(lr)
            opt.param_groups[0]["lr"], r.param_groups[0]["lr"] = (tensor_lr if as_tensor else lr), lr
            if k == 1:
                graphs = _graphs()
                no_recompile = torch._dynamo.config.patch(error_on_recompile=True)
                no_recompile.__enter__()
                self.addCleanup(no_recompile.__exit__, None, None, None)
            self.train(opt, ours, 1, start=k)
            self.train(r, ref, 1, start=k)
        self.assertFollows(opt, ours, ref, sum(lr for lr, _ in schedule), "lr schedule")
        opt.param_groups[0]["lr"] = 0.0
        still = [p.detach().clone() for p in ours]
        self.train(opt, ours, 1, start=len(schedule))
        with self.failures() as check:
            check.values(_graphs() - graphs, 0, "graphs compiled after the first lr change")
            for p, p0 in zip(ours, still):
                check.equal(p.detach(), p0, f"shape {tuple(p.shape)}: lr 0 (it must not move)")
                check.values(float(opt.state[p]["step"]), len(schedule) + 1, f"shape {tuple(p.shape)}: step")
