"""The conformance case for the one-state optimizers (SGD8bit, Lion8bit, Muon8bit), per format and executor.

:class:`RuleConformanceCase` is :class:`~torchao_optim.testing.OptimizerConformanceCase`'s sibling: a subclass
names an optimizer of :data:`RULES`, a format and an executor, and gets the same guarantees checked against the
optimizer's full-precision reference (``torch.optim.SGD``, ``torch.optim.Muon`` with ``torch.optim.AdamW`` for
its non-matrix parameters, and :class:`ReferenceLion`, a plain implementation of the paper's update): the
executor is the one used; parity no worse than AdamW's in the same format against ``torch.optim.AdamW`` on the
same problem; exact resume; a non-finite gradient element contained to its element; an lr that changes every
step, used at once and compiling nothing new.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from torchao_optim.optim import AdamW, Lion8bit, Muon8bit, SGD8bit
from torchao_optim.state import QuantizedState, get_state_format
from torchao_optim.testing.compare import Failures, save_load
from torchao_optim.testing.optimizer_case import (
    FP32_REL,
    FUSED_OPTION,
    ROUNDING,
    OptimizerConformanceCase,
    _as_float,
    _graphs,
)

__all__ = ["RuleConformanceCase", "ReferenceLion", "RULES"]


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


class Rule(NamedTuple):
    ours: Callable  # (params, state_format=, fused=, min_quant_size=, lr=) -> optimizer
    reference: Callable  # (params, lr=) -> the full-precision reference
    lr: float
    state_key: str  # the state the rule keeps for every parameter the tests quantize
    executors: tuple


RULES: dict[str, Rule] = {
    "sgd": Rule(
        lambda ps, **kw: SGD8bit(ps, momentum=0.9, dampening=0.1, weight_decay=1e-3, **kw),
        lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, dampening=0.1, weight_decay=1e-3, foreach=False),
        1e-2,
        "momentum_buffer",
        ("compiled", "eager", "fused", "cpu"),
    ),
    "sgd_nesterov_maximize": Rule(
        lambda ps, **kw: SGD8bit(ps, momentum=0.9, nesterov=True, maximize=True, **kw),
        lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True, maximize=True, foreach=False),
        1e-2,
        "momentum_buffer",
        ("compiled", "eager", "fused", "cpu"),
    ),
    "lion": Rule(
        lambda ps, **kw: Lion8bit(ps, weight_decay=0.1, **kw),
        lambda ps, lr: ReferenceLion(ps, lr=lr, weight_decay=0.1),
        1e-3,
        "exp_avg",
        ("compiled", "eager", "fused", "cpu"),
    ),
    "muon": Rule(
        lambda ps, **kw: Muon8bit(ps, **kw),
        lambda ps, lr: ReferenceMuon(ps, lr=lr),
        2e-2,
        "momentum_buffer",
        ("compiled", "eager", "cpu"),
    ),
}


class RuleConformanceCase(OptimizerConformanceCase):
    """Set ``rule`` (a key of :data:`RULES`), ``format_name`` and ``executor``. ``parity_slack`` multiplies the
    bound that comes from AdamW's parity in the same format (1: no worse than AdamW)."""

    rule: str = ""
    parity_slack = 1.0
    __test__ = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__test__ = bool(cls.rule and cls.format_name)
        if cls.rule and cls.executor not in RULES[cls.rule].executors:
            raise ValueError(f"{cls.__name__}: {cls.rule} has no {cls.executor} executor")

    # the Adam checks of the parent case are not this case's
    test_adamw_matches_torch_adamw = test_adam_l2_maximize_matches_torch_adam = None
    test_uses_its_executor_and_state_format = test_exact_resume = None
    test_non_finite_gradient_stays_in_its_element = test_lr_schedule_without_recompiles = None

    def fusable(self, params):
        """Muon8bit's matrices take the compiled path on every executor: only its AdamW fallback is fused."""
        return [p for p in params if not (self.rule == "muon" and p.dim() == 2)]

    def optimizer(self, params, lr=None):
        spec = RULES[self.rule]
        return spec.ours(
            params,
            lr=spec.lr if lr is None else lr,
            state_format=self.format_name,
            fused=FUSED_OPTION[self.executor],
            compile=self.executor != "eager",
            min_quant_size=self.min_quant_size,
        )

    def relative_error(self, ours, ref, start):
        """mean |p - p_ref| / mean |p_ref - p_0| over the parameters with quantized state (and over all, for
        fp32 state): how far from its reference the optimizer went, per unit of how far the reference went."""
        pick = [i for i, p in enumerate(ours) if p.numel() >= self.min_quant_size] or list(range(len(ours)))
        err = sum((ours[i] - ref[i]).detach().abs().sum() for i in pick)
        moved = sum((ref[i] - start[i]).detach().abs().sum() for i in pick)
        return (err / moved).item()

    def fp32_state_bound(self) -> float:
        """The relative error allowed with fp32 state: fp32 rounding. Muon orthogonalizes in bf16, where an fp32
        rounding difference in its input may move an output by a bf16 ulp (2**-8 relative; measured 0 on a CPU).
        Lion steps by ``sign(c)``: where ``c`` is within an ulp of 0, a rounding difference (the CUDA kernel
        contracts ``m + (1 - beta1) * (g - m)`` into a fused multiply-add, torch rounds twice) flips the sign and
        moves that element by ``2 lr`` against about ``lr`` a step; allowed for one element in 1000."""
        if self.rule == "muon":
            return 2**-8
        if self.rule == "lion":
            return 2e-3 / self.steps
        return FP32_REL * 10

    def adamw_relative_error(self):
        """AdamW's relative error in this format against torch.optim.AdamW on the same problem: the bound."""
        ours, ref, start = self.params(), self.params(), self.params()
        # eagerly: the compiled path's numbers (its codes bit for bit), without compiling AdamW for each case
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
        return self.relative_error(ours, ref, start)

    # ---- the checks ---------------------------------------------------------------------------------------
    def failures(self) -> Failures:
        return Failures(self, f"{self.rule}, format {self.format_name!r}, executor {self.executor!r}")

    def test_rule_uses_its_executor_and_state_format(self):
        params = self.params()
        opt = self.optimizer(params)
        self.train(opt, params, 1)
        self.assertExecutorUsed(opt, params)
        key = RULES[self.rule].state_key
        with self.failures() as check:
            for p in params[:2]:  # the quantized ones
                state = opt.state[p][key]
                expected = get_state_format(self.format_name) if self.format_name != "none" else torch.Tensor
                what = f"{key} of shape {tuple(p.shape)}"
                check.values(type(state), expected, f"{what}: type")
                check.values((state.shape, state.dtype), (p.shape, torch.float32), f"{what}: shape and dtype")

    def test_rule_matches_its_reference(self):
        """Parity: fp32 state within fp32 rounding of the reference (Muon: of bf16 orthogonalization); quantized
        state no further from the reference, relative to how far the reference moved, than AdamW in the same
        format from torch.optim.AdamW."""
        spec = RULES[self.rule]
        ours, ref, start = self.params(), self.params(), self.params()
        opt = self.optimizer(ours)
        self.train(opt, ours, self.steps)
        self.train(spec.reference(ref, lr=spec.lr), ref, self.steps)
        rel = self.relative_error(ours, ref, start)
        with self.failures() as check:
            if self.format_name == "none":
                check.at_most(rel, self.fp32_state_bound(), f"shapes {self.shapes}: relative error (fp32 rounding)")
            else:
                check.at_most(
                    rel,
                    self.adamw_relative_error() * self.parity_slack,
                    f"shapes {self.shapes}: relative error (against AdamW's in this format, times {self.parity_slack})",
                )

    def test_rule_exact_resume(self):
        first = self.params()
        opt = self.optimizer(first)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.7**k)
        self.train(opt, first, 2, sched=sched)
        ckpt = save_load({"params": [p.detach() for p in first], "opt": opt.state_dict(), "sched": sched.state_dict()})
        resumed = [torch.nn.Parameter(t.clone()) for t in ckpt["params"]]
        opt2 = self.optimizer(resumed)
        sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda k: 0.7**k)
        opt2.load_state_dict(ckpt["opt"])
        sched2.load_state_dict(ckpt["sched"])
        self.train(opt, first, 2, start=2, sched=sched)
        self.train(opt2, resumed, 2, start=2, sched=sched2)
        self.assertExecutorUsed(opt2, resumed)
        with self.failures() as check:
            self.check_resumed(check, opt2, resumed, opt, first)

    def test_rule_non_finite_gradient_stays_in_its_element(self):
        """As the Adam case: bad elements do not move, their states stay within one requantization error, clean
        blocks of the states are bit-identical to a run with finite values there, and every other parameter
        element is bit-identical (Muon: finite; its orthogonalization mixes the whole matrix)."""
        bad = [
            ((3, float("nan")), (200, float("inf"))),
            ((5, float("nan")), (290, -float("inf"))),
            ((10, float("nan")),),
        ]
        a, b, oa, ob, before = self.step_with_bad_gradients(bad)
        with self.failures() as check:
            for p, q, hits, (p0, s0) in zip(a, b, bad, before):
                what = f"shape {tuple(p.shape)}"
                idx = torch.tensor([i for i, _ in hits], device=p.device)
                others = torch.ones(p.numel(), dtype=torch.bool, device=p.device)
                others[idx] = False
                check.equal(p.view(-1)[idx], p0.view(-1)[idx], f"{what}: the bad elements (they must not move)")
                check.that(
                    torch.isfinite(p).all(),
                    f"{what}: {int((~torch.isfinite(p)).sum())} non-finite parameter elements, expected none",
                )
                if not (self.rule == "muon" and p.dim() == 2):
                    check.equal(p.view(-1)[others], q.view(-1)[others], f"{what}: the other elements, against run B")
                for key, sa in oa.state[p].items():
                    if key != "step":
                        self.check_bad_elements_state(
                            check,
                            f"{what} {key}",
                            sa,
                            ob.state[q][key],
                            s0[key],
                            idx,
                            others,
                            signed=key != "exp_avg_sq",
                        )

    def check_bad_elements_state(self, check, what, sa, sb, s0, idx, others, signed):
        """The state of the bad elements within one requantization error of where it was; blocks without a bad
        element bit-identical to run B's (plain state: the bad elements' unchanged, the others equal to B's)."""
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
        frac, scale_a = self.requant_bound(sa, signed)
        block = torch.arange(numel, device=fa.device) // sa.block_size
        hit = torch.zeros(math.ceil(numel / sa.block_size), dtype=torch.bool, device=fa.device)
        hit[idx // sa.block_size] = True
        for name in sa.data_fields():
            x, y = getattr(sa, name), getattr(sb, name)
            keep = ~hit if name in sa.blockwise_fields else (~hit[block])[:: math.ceil(numel / x.numel())]
            check.equal(x[keep], y[keep], f"{what}.{name}: the blocks without a bad element, against run B")
        moved = (fa - f0).abs()[idx] / (frac * scale_a[block[idx]] * ROUNDING).clamp_min(1e-30)
        check.that(
            (moved <= 1).all(),
            f"{what}: the bad elements' state moved by up to {moved.max().item():.4g} of "
            f"the bound (one requantization error)",
        )

    def test_rule_lr_schedule_without_recompiles(self):
        """Float lrs assigned every step, then a tensor lr changed in place: the reference with the same schedule
        is followed within the parity bound, and nothing compiles after the first step; lr 0 moves nothing."""
        spec = RULES[self.rule]
        bound = (
            self.fp32_state_bound() if self.format_name == "none" else (self.adamw_relative_error() * self.parity_slack)
        )  # before counting graphs: it compiles AdamW's
        ours, ref, start = self.params(), self.params(), self.params()
        opt = self.optimizer(ours)
        r = spec.reference(ref, lr=spec.lr)
        tensor_lr = torch.tensor(0.0, device=self.device)
        schedule = [
            (spec.lr, False),
            (spec.lr * 0.3, False),
            (spec.lr * 2, False),
            (spec.lr * 0.4, True),
            (spec.lr * 1.5, True),
        ]
        graphs = None
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
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
        rel = self.relative_error(ours, ref, start)
        opt.param_groups[0]["lr"] = 0.0
        still = [p.detach().clone() for p in ours]
        self.train(opt, ours, 1, start=len(schedule))
        with self.failures() as check:
            check.at_most(rel, bound, f"shapes {self.shapes}, lr schedule: relative error")
            check.values(_graphs() - graphs, 0, "graphs compiled after the first lr change")
            for p, p0 in zip(ours, still):  # every rule's weight decay is scaled by lr too
                check.equal(p.detach(), p0, f"shape {tuple(p.shape)}: lr 0 (it must not move)")
