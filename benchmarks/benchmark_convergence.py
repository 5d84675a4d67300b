"""Convergence benchmark: does 8-bit optimizer state train a language model as well as fp32 AdamW?

Trains a small GPT (``gpt.py``) as a byte-level language model on the Python standard library's own
source files (``stdlib_corpus.py``), which ship with every Python: no download, no GPU needed. Each
optimizer is trained once per seed, and every optimizer of a seed starts from the same weights and sees the
same batches in the same order. The learning rate follows a linear warm-up then a cosine decay, assigned
each step as a Python float to ``group["lr"]`` (for our optimizers this must not recompile anything).

Optimizers (``--optims``, comma separated):

- ``AdamW``: ``torch.optim.AdamW``, the fp32 reference;
- ``AdamW8bit``: ``torchao_optim.AdamW8bit``;
- ``AdamW-<format>``: ``torchao_optim.AdamW(..., state_format=<format>)``, for every registered format
  (``torchao_optim.list_state_formats()``) and ``none`` (fp32 state through our update);
- ``bnb``: ``bitsandbytes.optim.AdamW8bit``; ``torchao``: ``torchao.optim.AdamW8bit`` (if installed);
- ``SGD``/``SGD8bit``/``SGDTorchQuantized``, ``Lion``/``Lion8bit``, ``Muon``/``Muon8bit``, ``AdamWTorchQuantized``,
  ``SGDBnb8bit``,
  ``LionBnb8bit``: the other optimizers against their fp32 forms (``*TorchQuantized``: a stock optimizer through
  ``quantize_optimizer_state``); see ``benchmarks/optimizers.py``.

The default is ``AdamW``, ``AdamW8bit`` and ``AdamW-<format>`` for every registered format that is not already
covered by ``AdamW8bit`` and that the fused C step takes (every built-in one: ``"4bit"``, ``"fp8"``, the factored
formats), over seeds 0 and 1, with the ``small`` model: a few minutes on a 2-core CPU, printed before training starts
(estimated from timed steps). The others run only when asked for, by ``--all_formats`` or ``--optims``: those
:data:`OUT_OF_DEFAULT` leaves out (``4bit_rank1``, outside fp32's seed range here), and registered formats no fused
executor takes, on the per-parameter compiled path (on a 2-core CPU a first step compiles for about a minute).

Written under ``--out`` (default ``results/convergence``):

- ``results.md``: the table below, also printed: final validation loss per optimizer (mean ± range over
  seeds, range = max - min), training time, optimizer-state memory and bytes per parameter;
- ``results.json``: the configuration, environment, every run's curves and the final numbers;
- ``val_loss.png``: validation-loss curves (needs matplotlib; skipped with a note without it).

Acceptance check, printed and saved: each optimizer's mean final validation loss is within AdamW's
seed-to-seed spread: ``|mean - AdamW's mean| <= AdamW's range`` (range = max - min over at least two seeds).

Language-model quality on a GPU (``benchmarks/lm_quality.sh``): the ``gpt125m`` (114M parameters, 2000 steps) and
``gpt350m`` (354M parameters, 1000 steps) presets train with bf16 autocast on CUDA (``--amp``) on the standard
library's sources and torch's (``--corpus_packages``), so that a run reads its corpus less than once. Their runs
are held to targets (:func:`targets`): on gpt125m, 4-bit, 8-bit and FP8 state's mean inside fp32 AdamW's seed
range ``[min, max]``, 4-bit's also below torchao ``AdamW4bit``'s mean; on gpt350m, within 1% of AdamW's loss.
A set of runs too long for one call is split into parts, each a list of optimizers and seeds: ``results.json`` is
rewritten after every run, so a stopped call keeps what finished, and ``--budget_s`` starts a run only if it is
expected to end in time, and stops one whose own pace says it will not (the runs left out are recorded).
``--merge PATH [PATH ...]`` then reads every part's ``results.json`` (refusing runs of other settings, another
corpus, or a run twice) and writes the table, ``results.json`` and ``val_loss.png`` of all of them under ``--out``.

``--formats_from FILE`` runs a Python file first, which may register state formats and optimizers of its own
(``benchmarks/fourbit_variants.py``: the 4-bit variants), so that ``--optims`` accepts their names.

The script exits with status 1 when an optimizer fails the acceptance check or its target, or when runs were left
out for want of time (after writing its results), 0 otherwise (an undecided check, with one seed, is not a failure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import runpy
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # gpt.py, stdlib_corpus.py, optimizers.py
import optimizers  # noqa: E402  (the optimizer table every benchmark shares; puts this checkout first)
from gpt import GPT, GPTConfig  # noqa: E402
from optimizers import lr_at, set_lr, state_nbytes  # noqa: E402,F401  (lr_at: part of this script's API)
from stdlib_corpus import load_stdlib_corpus, package_root  # noqa: E402

import torchao_optim  # noqa: E402
from torchao_optim.optim.fused import SCALES_READ  # noqa: E402

REFERENCE = "AdamW"
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALIASES = {"AdamW8bit": "dtq8"}  # our named optimizers, and the state format each one is


# ---- model presets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A model, and the training settings used when the corresponding flag is not given."""

    model: GPTConfig
    steps: int
    batch_size: int
    lr: float
    note: str
    amp: str = "none"  # autocast on CUDA (--amp): "bf16" or "none"; the CPU default is always "none"
    eval_batches: int = 8
    corpus_packages: tuple[str, ...] = ()  # installed packages whose sources join the stdlib's (--corpus_packages)
    target: str | None = None  # the low-bit formats' targets on this model (TARGET_RULES), if any


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        GPTConfig(d_model=64, n_layer=2, n_head=2, context=64),
        steps=300,
        batch_size=16,
        lr=3e-3,
        note="tests and smoke runs",
    ),
    "small": Preset(
        GPTConfig(d_model=128, n_layer=3, n_head=4, context=64),
        steps=300,
        batch_size=16,
        lr=2e-3,
        note="the default: under 3 minutes on a quiet 2-core CPU",
    ),
    "gpt10m": Preset(
        GPTConfig(d_model=384, n_layer=6, n_head=6, context=256), steps=3000, batch_size=32, lr=1e-3, note="a GPU"
    ),
    "gpt25m": Preset(
        GPTConfig(d_model=512, n_layer=8, n_head=8, context=256),
        steps=5000,
        batch_size=32,
        lr=6e-4,
        note="a GPU; about 25.6M parameters",
    ),
    # The language-model quality benchmark (benchmarks/lm_quality.sh): 16 layers rather than GPT-2 small's 12,
    # because a byte vocabulary has no large embedding matrix, and 12 layers of width 768 hold only 86M
    # parameters. Batch 32 x 512 bytes: about 11 TFLOP a step, so 2000 steps take about 1.5 minutes on one H200
    # at 250 TFLOP/s, and read 33M bytes: 0.6 times the training split of the stdlib with torch's sources.
    "gpt125m": Preset(
        GPTConfig(d_model=768, n_layer=16, n_head=12, context=512),
        steps=2000,
        batch_size=32,
        lr=6e-4,
        note="one GPU, bf16 autocast; 114M parameters; the stdlib and torch's sources",
        amp="bf16",
        eval_batches=16,
        corpus_packages=("torch",),
        target="seed_range",
    ),
    # 28 layers of width 1024 (GPT-2 medium's width and heads): 354M parameters. About 36 TFLOP a step,
    # 2.5 minutes a run on one H200 at 250 TFLOP/s.
    "gpt350m": Preset(
        GPTConfig(d_model=1024, n_layer=28, n_head=16, context=512),
        steps=1000,
        batch_size=32,
        lr=3e-4,
        note="one GPU, bf16 autocast; 354M parameters; the stdlib and torch's sources",
        amp="bf16",
        eval_batches=16,
        corpus_packages=("torch",),
        target="within_1%",
    ),
}


def training_flops(cfg: GPTConfig, tokens: int) -> float:
    """Floating-point operations of forward and backward over ``tokens`` tokens: 6 per parameter and token, plus
    the attention scores and their weighted sum (causal: half of the 2 x 2 x context x d_model multiply-adds per
    token and layer that full attention costs, times 3 for the backward pass)."""
    per_token = 6 * cfg.num_params() + 3 * 2 * cfg.n_layer * cfg.context * cfg.d_model
    return per_token * tokens


# ---- optimizers: the table every benchmark shares (benchmarks/optimizers.py) ----------------------------


def has_fused_layout(state_format: str, executor: str = "cpu") -> bool:
    """Whether a fused executor (``"cpu"``: the C step, the main job's; ``"triton"``: the Triton kernels, on CUDA) takes
    a matrix's states in ``state_format``: both its states describe themselves by a layout with scales it reads
    (``optim.fused.SCALES_READ``). A format without one takes the per-parameter compiled path, whose first step
    compiles (about a minute on a 2-core CPU)."""
    fmt = torchao_optim.get_state_format(state_format)
    layouts = [fmt.zeros((256, 256), signed=s, device="meta").fused_layout() for s in (True, False)]
    return all(x is not None and x.scale in SCALES_READ[executor] for x in layouts)


# Formats left out of the default run although the fused C step takes them, each for a measured reason: the default
# run is the acceptance check, and exits with status 1 when a format fails it.
OUT_OF_DEFAULT = {
    "4bit_rank1": "its mean ends outside fp32 AdamW's seed range on the small model (Δ +0.146, benchmarks/README.md)",
}


def default_optims(all_formats: bool = False) -> list[str]:
    """AdamW, AdamW8bit, and every registered format that no alias above already covers, that the fused C step takes
    and that :data:`OUT_OF_DEFAULT` does not leave out; with ``all_formats``, the others too (those, and the formats
    no fused executor takes, whose first step compiles)."""
    covered = set(ALIASES.values())
    formats = [f for f in torchao_optim.list_state_formats() if f not in covered]
    default = [f for f in formats if has_fused_layout(f) and f not in OUT_OF_DEFAULT]
    return [REFERENCE, *ALIASES] + [f"AdamW-{f}" for f in formats if all_formats or f in default]


def takes_compiled_path(name: str) -> bool:
    """Whether optimizer ``name`` is an Adam of ours whose matrices take the per-parameter compiled path: a format
    without a layout the fused executors read, or ``fused=False``."""
    entry = optimizers.optimizer_table()[optimizers.resolve(name)]
    if not entry.name.startswith("Adam") or entry.state_format in (None, "none"):
        return False
    return entry.name.startswith("AdamWCompiled-") or not has_fused_layout(entry.state_format)


def compiled_graph_count() -> int:
    """Graphs torch.compile has produced so far in this process."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # private API: report nothing rather than fail the benchmark
        return -1


# ---- progress bar --------------------------------------------------------------------------------------

try:
    from tqdm.auto import tqdm
except ImportError:  # the [bench] extra installs tqdm; without it, print a line now and then

    class tqdm:  # noqa: N801
        def __init__(self, iterable, desc="", **_):
            self.iterable, self.desc, self.postfix = iterable, desc, {}

        def __iter__(self):
            n = len(self.iterable)
            for i, item in enumerate(self.iterable):
                yield item
                if (i + 1) % max(1, n // 10) == 0 or i + 1 == n:
                    print(f"{self.desc}: {i + 1}/{n} {self.postfix}", file=sys.stderr, flush=True)

        def set_postfix(self, **kwargs):
            self.postfix = kwargs

        def close(self):
            pass


# ---- one run -------------------------------------------------------------------------------------------


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor, amp: str = "none") -> torch.Tensor:
    """The model's loss on one batch, under bf16 autocast with ``amp="bf16"`` (parameters and gradients stay in
    their own dtype; the cross-entropy runs in fp32 under autocast)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
        return model(x, y)


@torch.no_grad()
def evaluate(model: GPT, batches, device, amp: str = "none") -> float:
    """Mean loss over the fixed validation batches."""
    model.eval()
    losses = [loss_of(model, x.to(device), y.to(device), amp).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class OutOfTime(Exception):
    """A run stopped because, at the pace of its own steps, it would end after the budget's deadline;
    ``run_seconds``: the whole run's wall time at that pace."""

    def __init__(self, message: str, run_seconds: float):
        super().__init__(message)
        self.run_seconds = run_seconds


def train_one(
    name: str, seed: int, args, model_cfg: GPTConfig, corpus, val_batches, device, deadline: float | None = None
) -> dict:
    """Train a fresh model with optimizer ``name`` on seed ``seed``; return the run's record. With ``deadline`` (a
    ``time.perf_counter()`` value), raise :class:`OutOfTime` as soon as the run's own pace (its last steps and
    evaluation) says it would end after it: an optimizer slower than the estimate (another library's, or one on
    the compiled path) is stopped early instead of running into the end of the call."""
    wall_start = time.perf_counter()
    torch.manual_seed(seed)
    model = GPT(model_cfg)  # built on the CPU, so the weights depend on the seed only
    init_checksum = sum(p.double().sum().item() for p in model.parameters())
    model.to(device=device, dtype=PARAM_DTYPES[args.param_dtype])
    run_model = torch.compile(model) if args.compile_model else model  # the same parameters
    groups = model.param_groups(args.weight_decay)
    # weight decay is set per group (model.param_groups); 0 here only fills the groups that do not set it
    optimizer = optimizers.build(
        name, groups, lr=args.lr, weight_decay=0.0, betas=(args.beta1, args.beta2), eps=args.eps, compile=True
    )
    batch_gen = torch.Generator().manual_seed(seed)  # same batches in the same order for every optimizer

    eval_start = time.perf_counter()
    val_curve = [(0, evaluate(run_model, val_batches, device, args.amp))]
    eval_s = time.perf_counter() - eval_start
    train_losses: list[float | None] = []
    step_times: list[float] = []
    graphs_before = compiled_graph_count()
    # redrawn at most every 30 s into a log (a file, a pipe), where each redraw is another line
    mininterval = 0.1 if sys.stderr.isatty() else 30.0
    bar = tqdm(range(args.steps), desc=f"{name} seed {seed}", dynamic_ncols=True, leave=True, mininterval=mininterval)
    for step in bar:
        set_lr(optimizer, lr_at(step, args.lr, args.warmup, args.steps))
        x, y = corpus.train_batch(args.batch_size, args.seq_len, batch_gen)
        x, y = x.to(device), y.to(device)
        start = time.perf_counter()
        loss = loss_of(run_model, x, y, args.amp)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # waits for the device
        step_times.append(time.perf_counter() - start)
        train_losses.append(_finite_or_none(loss_value))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            eval_start = time.perf_counter()
            val_curve.append((step + 1, evaluate(run_model, val_batches, device, args.amp)))
            eval_s = time.perf_counter() - eval_start
        if deadline is not None and step >= 10 and step % 10 == 0:
            left = args.steps - step - 1
            evals_left = left // args.eval_every + 1
            projected = time.perf_counter() + left * statistics.median(step_times[-10:]) + evals_left * eval_s
            if projected > deadline:
                bar.close()
                raise OutOfTime(
                    f"{name} seed {seed} stopped at step {step + 1} of {args.steps}: at its pace it would end "
                    f"{projected - deadline:.0f} s after the budget",
                    projected - wall_start,
                )
        bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{val_curve[-1][1]:.3f}", refresh=False)
    bar.close()

    n_params = model.num_params()
    state_bytes = state_nbytes(optimizer)
    final = val_curve[-1][1]
    return {
        "optimizer": name,
        "seed": seed,
        "init_param_checksum": init_checksum,
        "final_val_loss": _finite_or_none(final),
        "diverged": not math.isfinite(final),
        "val_curve": [[s, _finite_or_none(v)] for s, v in val_curve],
        "train_loss": train_losses,
        "train_time_s": sum(step_times),
        "first_step_s": step_times[0],
        "compiled_graphs": None if graphs_before < 0 else compiled_graph_count() - graphs_before,
        "state_bytes": state_bytes,
        "state_bytes_per_param": state_bytes / n_params,
        "n_params": n_params,
        "wall_s": time.perf_counter() - wall_start,
    }


def estimate_seconds(args, model_cfg: GPTConfig, corpus, val_batches, device) -> tuple[float, float]:
    """One run's expected wall time in seconds, and the step time it is scaled from: training steps of fp32 AdamW on
    a throwaway model, and evaluations, timed here (medians) and scaled to a run's steps and evaluations.
    Our fused-path optimizers' steps cost about what fp32 AdamW's do at this size (the model's forward and
    backward dominate); an optimizer that compiles its first step takes longer than this says."""
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device=device, dtype=PARAM_DTYPES[args.param_dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run_model = torch.compile(model) if args.compile_model else model
    gen = torch.Generator().manual_seed(0)

    def train_step() -> None:
        x, y = corpus.train_batch(args.batch_size, args.seq_len, gen)
        loss_of(run_model, x.to(device), y.to(device), args.amp).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # first calls: allocations, lazy initialisation (and compilation, with --compile_model)
    if args.compile_model:
        evaluate(run_model, val_batches[:1], device, args.amp)  # compiles the evaluation's graph
    # the median of the steps of about a second (at least 5): on a shared machine a step now and then waits for
    # another process
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < 1.0 and len(times) < 100):
        times.append(_timed(train_step))
    step_s = statistics.median(times)
    eval_s = statistics.median(_timed(lambda: evaluate(run_model, val_batches, device, args.amp)) for _ in range(2))
    evaluations = 1 + len({s for s in range(args.eval_every, args.steps + 1, args.eval_every)} | {args.steps})
    return args.steps * step_s + evaluations * eval_s, step_s


def _timed(fn) -> float:
    """Seconds ``fn()`` takes; on CUDA, until the device has finished it."""
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:02.0f}s"


# ---- summary -------------------------------------------------------------------------------------------


def summarize(runs: list[dict], optims: Sequence[str]) -> dict[str, dict]:
    """Per optimizer with at least one run: the final validation loss over seeds (mean, min, max, range), times and
    memory."""
    out = {}
    for name in optims:
        rs = [r for r in runs if r["optimizer"] == name]
        if not rs:
            continue
        finals = [r["final_val_loss"] for r in rs]
        ok = [f for f in finals if f is not None]
        out[name] = {
            "seeds": [r["seed"] for r in rs],
            "final_val_loss": finals,
            "mean": sum(ok) / len(ok) if ok and len(ok) == len(finals) else None,
            "min": min(ok) if ok else None,
            "max": max(ok) if ok else None,
            "range": (max(ok) - min(ok)) if ok else None,
            "train_time_s_mean": sum(r["train_time_s"] for r in rs) / len(rs),
            "first_step_s_max": max(r["first_step_s"] for r in rs),
            "state_bytes": rs[0]["state_bytes"],
            "state_bytes_per_param": rs[0]["state_bytes_per_param"],
        }
    return out


def reference_mean_on(summary: dict[str, dict], seeds: Sequence[int]) -> float | None:
    """fp32 AdamW's mean final validation loss over ``seeds`` (those an optimizer ran): None unless AdamW ran each
    of them without diverging. Comparing on the same seeds keeps seed-to-seed differences out of a difference of
    means where the two ran different seeds."""
    ref = summary.get(REFERENCE)
    if ref is None:
        return None
    finals = dict(zip(ref["seeds"], ref["final_val_loss"]))
    values = [finals.get(seed) for seed in seeds]
    return None if not values or None in values else sum(values) / len(values)


def acceptance(summary: dict[str, dict]) -> dict[str, dict]:
    """For each optimizer but the reference: is its mean final validation loss within the reference's
    seed-to-seed spread, ``|mean - reference mean| <= reference range`` (range = max - min over seeds)?
    Undecided (None) with fewer than two reference seeds; failed if the optimizer diverged."""
    ref = summary.get(REFERENCE)
    checks = {}
    for name, s in summary.items():
        if name == REFERENCE:
            continue
        decidable = ref is not None and len(ref["seeds"]) >= 2 and ref["mean"] is not None
        difference = s["mean"] - ref["mean"] if decidable and s["mean"] is not None else None
        if s["mean"] is None:
            passed = False  # a diverged run
        elif not decidable:
            passed = None
        else:
            passed = abs(difference) <= ref["range"]
        checks[name] = {
            "mean": s["mean"],
            "difference_of_means": difference,
            "reference_range": ref["range"] if decidable else None,
            # also recorded: the stricter reading, the mean inside the reference's [min, max]
            "within_reference_min_max": None if difference is None else ref["min"] <= s["mean"] <= ref["max"],
            "passed": passed,
        }
    return checks


# The low-bit formats' targets: each named optimizer of ours, the target it is held to, and the peer a 4-bit state
# must beat.
TARGET_FORMATS = {
    "AdamW4bit": "4-bit",
    "AdamW-4bit": "4-bit",
    "AdamW8bit": "8-bit",
    "AdamW-dtq8": "8-bit",
    "AdamWFp8": "FP8",
    "AdamW-fp8": "FP8",
}
PEER_4BIT = "AdamWTorchao4bit"
TOLERANCE = 0.01  # relative: the "within" target's bound on the difference to fp32 AdamW's loss
TARGET_RULES = ("seed_range", "within_1%")


def targets(summary: dict[str, dict], rule: str) -> dict[str, dict]:
    """The low-bit formats' targets (:data:`TARGET_FORMATS`), for each of them that ran, under ``rule``.

    ``"seed_range"`` (gpt125m, three seeds): the mean final validation loss inside fp32 AdamW's seed range, its
    ``[min, max]`` (the literal reading, stricter than :func:`acceptance`'s ``|difference| <= range``; undecided
    with fewer than two AdamW seeds), and for 4-bit state also below torchao ``AdamW4bit``'s mean.
    ``"within_1%"`` (gpt350m, one seed): within 1% of AdamW's mean on the same seeds. ``passed`` is False when a
    required check fails (or the run diverged), None when one cannot be decided (no AdamW run, or none on the
    optimizer's seeds under ``"within_1%"``, one AdamW seed under ``"seed_range"``, or a 4-bit state without
    torchao's to compare with), True otherwise."""
    if rule not in TARGET_RULES:
        raise ValueError(f"unknown target rule {rule!r}; choose from {', '.join(TARGET_RULES)}")
    ref = summary.get(REFERENCE)
    peer = summary.get(PEER_4BIT)
    out = {}
    for name, s in summary.items():
        kind = TARGET_FORMATS.get(name)
        if kind is None:
            continue
        mean = s["mean"]
        has_ref = ref is not None and ref["mean"] is not None
        ref_seeds = len(ref["seeds"]) if has_ref else 0
        if not has_ref:
            ref_mean = None
        else:
            ref_mean = ref["mean"] if rule == "seed_range" else reference_mean_on(summary, s["seeds"])
        relative = (mean - ref_mean) / ref_mean if ref_mean is not None and mean is not None else None
        in_range = below_peer = None
        if relative is not None and ref_seeds >= 2:
            in_range = ref["min"] <= mean <= ref["max"]
        within = None if relative is None else abs(relative) <= TOLERANCE
        if kind == "4-bit" and mean is not None and peer is not None and peer["mean"] is not None:
            below_peer = mean < peer["mean"]
        if rule == "within_1%":
            required = [within]
        else:
            required = [in_range] + ([below_peer] if kind == "4-bit" else [])
        if mean is None or any(c is False for c in required):
            passed = False
        else:
            passed = None if any(c is None for c in required) else True
        out[name] = {
            "rule": rule,
            "format": kind,
            "mean": mean,
            "reference_min": ref["min"] if has_ref else None,
            "reference_max": ref["max"] if has_ref else None,
            "reference_seeds": ref_seeds,
            "reference_mean": ref_mean,
            "relative_difference": relative,
            "in_reference_range": in_range,
            "within_one_percent": within,
            "peer_mean": peer["mean"] if peer is not None else None,
            "below_peer_mean": below_peer,
            "passed": passed,
        }
    return out


def target_lines(checks: dict[str, dict]) -> list[str]:
    """One line per target: the numbers compared, and the verdict."""
    lines = []
    for name, t in checks.items():
        verdict = {True: "PASS", False: "FAIL", None: "undecided"}[t["passed"]]
        if t["mean"] is None:
            lines.append(f"- Target, {name} ({t['format']}): diverged: FAIL")
            continue
        parts = [f"mean {t['mean']:.4f}"]
        if t["reference_seeds"] == 0:
            parts.append("no fp32 AdamW run to compare with")
        elif t["rule"] == "within_1%" and t["relative_difference"] is None:
            parts.append("no fp32 AdamW run on the same seeds")
        elif t["rule"] == "within_1%":
            within = "within" if t["within_one_percent"] else "not within"
            parts.append(f"{t['relative_difference']:+.2%} against fp32 AdamW on the same seeds: {within} 1%")
        elif t["reference_seeds"] >= 2:
            inside = "inside" if t["in_reference_range"] else "outside"
            parts.append(f"{inside} fp32 AdamW's seed range [{t['reference_min']:.4f}, {t['reference_max']:.4f}]")
        else:
            parts.append("fp32 AdamW ran on one seed: no seed range yet")
        if t["format"] == "4-bit" and t["rule"] == "seed_range":
            if t["below_peer_mean"] is None:
                parts.append(f"{PEER_4BIT} not run")
            else:
                below = "below" if t["below_peer_mean"] else "not below"
                parts.append(f"{below} {PEER_4BIT}'s mean {t['peer_mean']:.4f}")
        lines.append(f"- Target, {name} ({t['format']}): {'; '.join(parts)}: {verdict}")
    return lines


def _fmt(x: float | None, digits: int = 3) -> str:
    return "nan" if x is None else f"{x:.{digits}f}"


def markdown_table(summary: dict[str, dict], checks: dict[str, dict], target_checks: dict | None = None) -> str:
    lines = [
        "| optimizer | final val loss (mean ± range) | per seed | Δ mean vs AdamW | train time (s) | first step (s) "
        "| state memory (MiB) | state bytes / param |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref_mean = summary.get(REFERENCE, {}).get("mean")
    for name, s in summary.items():
        delta = "—" if name == REFERENCE or ref_mean is None or s["mean"] is None else f"{s['mean'] - ref_mean:+.4f}"
        per_seed = ", ".join(_fmt(f) for f in s["final_val_loss"])
        lines.append(
            f"| {name} | {_fmt(s['mean'])} ± {_fmt(s['range'])} | {per_seed} | {delta} "
            f"| {s['train_time_s_mean']:.1f} | {s['first_step_s_max']:.1f} "
            f"| {s['state_bytes'] / 2**20:.2f} | {s['state_bytes_per_param']:.2f} |"
        )
    lines += [
        "",
        "Final val loss: mean over seeds ± range (max − min over seeds), in nats per byte (ln 256 = 5.545 is "
        "a uniform guess). Train time: mean per run of the training steps' wall time, evaluation excluded; "
        "first step: the slowest first step over seeds (it includes torch.compile for our optimizers). "
        "State memory: every tensor in `optimizer.state`, quantized state counted by its inner tensors.",
        "",
    ]
    for name, c in checks.items():
        verdict = {True: "PASS", False: "FAIL", None: "undecided (needs AdamW with at least two seeds)"}[c["passed"]]
        if c["difference_of_means"] is not None:
            lines.append(
                f"- Acceptance, {name}: |mean − AdamW mean| = {abs(c['difference_of_means']):.4f} "
                f"{'≤' if c['passed'] else '>'} AdamW's seed range {c['reference_range']:.4f}: {verdict}"
            )
        else:
            lines.append(f"- Acceptance, {name}: {verdict}" + (" (diverged)" if c["mean"] is None else ""))
    if target_checks:
        lines += ["", *target_lines(target_checks)]
    return "\n".join(lines) + "\n"


def failed_acceptance(result: dict) -> list[str]:
    """The optimizers whose acceptance check failed (a diverged run included); undecided checks are not failures."""
    return [name for name, c in result["acceptance"].items() if isinstance(c, dict) and c["passed"] is False]


def failed_targets(result: dict) -> list[str]:
    """The optimizers whose target (:func:`targets`) failed; undecided targets are not failures."""
    return [name for name, t in result.get("targets", {}).items() if t["passed"] is False]


def exit_status(result: dict) -> int:
    """The script's exit status: 1 if an optimizer failed the acceptance check or its target, or if runs were left
    out for want of time (``--budget_s``), else 0."""
    return 1 if failed_acceptance(result) or failed_targets(result) or result.get("skipped_runs") else 0


def plot_curves(runs: list[dict], optims: Sequence[str], path: Path) -> str | None:
    """Validation loss against step (one colour per optimizer, one line per seed); with AdamW among the
    runs, a second panel shows each run's difference to AdamW on the same seed. Returns a note if skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the plot (pip install matplotlib)"
    has_ref = REFERENCE in optims
    fig, axes = plt.subplots(1, 2 if has_ref else 1, figsize=(12 if has_ref else 6.5, 4.5), squeeze=False)
    ref = {r["seed"]: dict(r["val_curve"]) for r in runs if r["optimizer"] == REFERENCE}
    for i, name in enumerate(optims):
        color = f"C{i}"
        for j, r in enumerate(rr for rr in runs if rr["optimizer"] == name):
            steps = [s for s, v in r["val_curve"] if v is not None]
            vals = [v for s, v in r["val_curve"] if v is not None]
            style = ["-", "--", ":", "-."][j % 4]
            axes[0][0].plot(steps, vals, style, color=color, label=f"{name} seed {r['seed']}")
            if has_ref and name != REFERENCE and r["seed"] in ref:
                diffs = [(s, v - ref[r["seed"]][s]) for s, v in zip(steps, vals) if ref[r["seed"]].get(s) is not None]
                axes[0][1].plot(
                    [s for s, _ in diffs], [d for _, d in diffs], style, color=color, label=f"{name} seed {r['seed']}"
                )
    axes[0][0].set(xlabel="step", ylabel="validation loss (nats/byte)", title="Validation loss")
    axes[0][0].legend(fontsize="small")
    axes[0][0].grid(alpha=0.3)
    if has_ref:
        axes[0][1].axhline(0.0, color="C0", lw=1)
        axes[0][1].set(xlabel="step", ylabel="val loss − AdamW val loss (same seed)", title="Difference to fp32 AdamW")
        axes[0][1].grid(alpha=0.3)
        if len(optims) > 1:
            axes[0][1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---- command line --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    presets = "\n".join(
        f"  {k:7s} d_model {p.model.d_model}, {p.model.n_layer} layers, {p.model.n_head} heads, context "
        f"{p.model.context}, {p.model.num_params() / 1e6:.2f}M params; {p.steps} steps x batch {p.batch_size}, "
        f"lr {p.lr:g}: {p.note}"
        for k, p in PRESETS.items()
    )
    presets += (
        "\n\nParts and merge: run a list of optimizers and seeds per call (results.json is rewritten after every "
        "run, so an interrupted call keeps what finished; --budget_s leaves out the runs that would not end in "
        "time), then --merge DIR [DIR ...] --out MERGED writes the table, results.json and val_loss.png of every "
        "run found under the DIRs (see benchmarks/lm_quality.sh)."
    )
    parser = argparse.ArgumentParser(
        description="Train a byte-level GPT on the Python standard library's source once per optimizer and "
        "seed, and compare final validation losses, training time and optimizer-state memory.",
        epilog=f"model presets (--model_size; --steps, --batch_size, --lr override their defaults):\n{presets}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--optims",
        default=None,
        help="comma-separated optimizers of benchmarks/optimizers.py: AdamW (torch.optim.AdamW), "
        "AdamW8bit (torchao_optim.AdamW8bit), AdamW-FMT (torchao_optim.AdamW(state_format=FMT)) "
        f"for FMT in {', '.join(torchao_optim.list_state_formats() + ['none'])}, AdamW4bit, "
        "AdamWFp8, bnb (bitsandbytes.optim.AdamW8bit), torchao (torchao.optim.AdamW8bit), "
        "AdamWTorchao4bit, AdamWTorchaoFp8, ... Default: "
        f"{','.join(default_optims())} (the registered formats the fused C step takes, but those --all_formats adds)",
    )
    compiled_only = [o for o in default_optims(True) if o not in default_optims() and takes_compiled_path(o)]
    parser.add_argument(
        "--all_formats",
        action="store_true",
        help="with the default --optims, also "
        + "; ".join(f"AdamW-{f}: {why}" for f, why in OUT_OF_DEFAULT.items())
        + "; and every registered format without a fused layout "
        f"({', '.join(compiled_only) or 'none today'}): "
        "the per-parameter compiled path, whose first step compiles (about a minute on a 2-core CPU) "
        "and whose steps are slower",
    )
    parser.add_argument(
        "--model_size", default="small", choices=list(PRESETS), help="model preset, see below. Default: %(default)s"
    )
    parser.add_argument(
        "--amp",
        default=None,
        choices=["bf16", "none"],
        help="autocast of the model's forward and backward (parameters, gradients and optimizer state keep their "
        "dtype). Default: the preset's on CUDA (bf16 for gpt125m and gpt350m), none on the CPU",
    )
    parser.add_argument(
        "--compile_model",
        action="store_true",
        help="torch.compile the model (each run compiles its first step; the optimizers' own compilation is "
        "separate). Default: off",
    )
    parser.add_argument(
        "--corpus_packages",
        default=None,
        help="comma-separated installed packages (import names) whose *.py sources join the standard library's, "
        "for a corpus the run does not read many times over; '' for the standard library alone. "
        "Default: the preset's (torch for gpt125m and gpt350m, none otherwise)",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps. Default: the preset's")
    parser.add_argument("--batch_size", type=int, default=None, help="sequences per batch. Default: the preset's")
    parser.add_argument(
        "--seq_len",
        type=int,
        default=None,
        help="bytes per sequence, at most the preset's context. Default: the context",
    )
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate. Default: the preset's")
    parser.add_argument(
        "--warmup", type=int, default=None, help="linear warm-up steps; 0 for none. Default: 5%% of --steps"
    )
    parser.add_argument("--beta1", type=float, default=0.9, help="Adam beta1. Default: %(default)s")
    parser.add_argument("--beta2", type=float, default=0.95, help="Adam beta2. Default: %(default)s")
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam epsilon. Default: %(default)s")
    parser.add_argument(
        "--weight_decay",
        type=float,
        default=0.1,
        help="decoupled weight decay of the weight matrices; embeddings, biases and LayerNorm "
        "weights get none. Default: %(default)s",
    )
    parser.add_argument(
        "--param_dtype",
        default="fp32",
        choices=list(PARAM_DTYPES),
        help="the model's parameter dtype (bf16: pure bf16 training, where AdamW8bitSR's stochastic "
        "rounding matters). Default: %(default)s",
    )
    parser.add_argument(
        "--seeds",
        default="0,1",
        help="comma-separated seeds, each setting the initial weights and the batch order. Default: %(default)s",
    )
    parser.add_argument(
        "--eval_every",
        type=int,
        default=None,
        help="steps between validation evaluations (and after the last step). Default: --steps / 10",
    )
    parser.add_argument(
        "--eval_batches",
        type=int,
        default=None,
        help="fixed validation batches of --batch_size sequences per evaluation. Default: the preset's (8; 16 for "
        "gpt125m and gpt350m)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="device to train on. Default: cuda if available, else cpu",
    )
    parser.add_argument(
        "--out",
        default="results/convergence",
        help="directory for results.md, results.json and val_loss.png. Default: %(default)s",
    )
    parser.add_argument(
        "--skip_missing",
        action="store_true",
        help="leave out, with a line saying so, the optimizers of --optims whose package cannot be imported "
        "(bitsandbytes, torchao), rather than stop",
    )
    parser.add_argument(
        "--budget_s",
        type=float,
        default=None,
        help="start a run only if it is expected to end within this many seconds of the script's start (its "
        "estimate, or the time an earlier run of the same optimizer took), and stop a run once its own steps' pace "
        "says it would end later; the runs left out are listed, "
        "recorded as skipped_runs, and make the exit status 1. Default: no limit",
    )
    parser.add_argument(
        "--formats_from",
        "--formats-from",
        metavar="FILE",
        default=None,
        help="a Python file run first, which registers more state formats or optimizers (e.g. "
        "benchmarks/fourbit_variants.py): their names are then accepted by --optims",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="PATH",
        default=None,
        help="train nothing: read the results.json of earlier runs (files, or directories searched recursively) "
        "and write their combined table, results.json and val_loss.png under --out. Only --out applies",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and complete the flags; a bad request exits with a one-line error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.model_size]

    def fail(message: str):
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    if args.merge is not None:
        return args

    args.steps = preset.steps if args.steps is None else args.steps
    args.batch_size = preset.batch_size if args.batch_size is None else args.batch_size
    args.seq_len = preset.model.context if args.seq_len is None else args.seq_len
    args.lr = preset.lr if args.lr is None else args.lr
    args.eval_batches = preset.eval_batches if args.eval_batches is None else args.eval_batches
    if args.amp is None:
        args.amp = preset.amp if args.device == "cuda" else "none"
    if args.corpus_packages is None:
        args.corpus_packages = list(preset.corpus_packages)
    else:
        args.corpus_packages = [name.strip() for name in args.corpus_packages.split(",") if name.strip()]
    for name in args.corpus_packages:
        try:
            package_root(name)
        except ValueError as error:
            fail(f"--corpus_packages: {error}")
    if args.budget_s is not None and args.budget_s <= 0:
        fail(f"--budget_s must be positive, got {args.budget_s:g}")
    args.warmup = max(1, args.steps // 20) if args.warmup is None else args.warmup
    args.eval_every = max(1, args.steps // 10) if args.eval_every is None else args.eval_every
    if min(args.steps, args.batch_size, args.seq_len, args.eval_every, args.eval_batches) < 1:
        fail("--steps, --batch_size, --seq_len, --eval_every and --eval_batches must be positive")
    if args.warmup < 0:
        fail(f"--warmup must be 0 (no warm-up) or positive, got {args.warmup}")
    if args.seq_len > preset.model.context:
        fail(f"--seq_len {args.seq_len} exceeds the {args.model_size} model's context of {preset.model.context}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but torch.cuda.is_available() is False")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        fail(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds:
        fail("--seeds is empty")

    if args.formats_from is not None:
        if not os.path.isfile(args.formats_from):
            fail(f"--formats_from {args.formats_from}: no such file")
        runpy.run_path(args.formats_from)  # registers formats (register_state_format) and optimizers
    if args.optims is None:
        args.optims = ",".join(default_optims(args.all_formats))
    elif args.all_formats:
        fail("--all_formats extends the default --optims; with --optims, name every optimizer to run")
    args.optims = [o.strip() for o in args.optims.split(",") if o.strip()]
    args.skipped_optims = []  # (name, package) left out by --skip_missing
    for name in args.optims:
        if optimizers.resolve(name) is None:
            fail(f"unknown optimizer {name!r}; choose from {', '.join(optimizers.names())}")
        missing = optimizers.missing_package(name)
        if missing is not None and args.skip_missing:
            args.skipped_optims.append((name, missing[1]))
        elif missing is not None:
            fail(f"--optims {name} needs {missing[1]}, which could not be imported; pip install {missing[1]}")
    if len(set(args.optims)) != len(args.optims) or not args.optims:
        fail(f"--optims must name each optimizer once, got {args.optims}")
    args.optims = [o for o in args.optims if o not in {name for name, _ in args.skipped_optims}]
    if not args.optims:
        fail("--skip_missing left no optimizer of --optims to run")
    return args


def environment(device: str) -> dict:
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "torchao_optim": torchao_optim.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    for module in ("bitsandbytes", "torchao"):
        if module in sys.modules:
            env[module] = getattr(sys.modules[module], "__version__", "unknown")
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---- results: written after every run, and by --merge -------------------------------------------------

# The settings that make runs comparable: runs merged into one table must agree on all of them, and on the corpus.
RUN_SETTINGS = (
    "model_size",
    "model",
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "warmup",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "param_dtype",
    "eval_every",
    "eval_batches",
    "amp",
    "compile_model",
    "device",
)


def build_result(base: dict, runs: list[dict], optims: Sequence[str], skipped: list[dict], wall_start: float) -> dict:
    """What ``results.json`` holds: ``base`` (configuration, corpus, environment) with the runs so far, their
    summary, acceptance checks and targets, and the runs left out (``skipped_runs``)."""
    summary = summarize(runs, optims)
    checks = acceptance(summary)
    preset = PRESETS.get(base["config"].get("model_size"))
    rule = preset.target if preset is not None else None
    return {
        **base,
        "spread": "range = max - min over seeds",
        "summary": summary,
        "acceptance": {
            "criterion": "|mean final val loss - AdamW's| <= AdamW's range (max - min) over seeds",
            **checks,
        },
        "targets": targets(summary, rule) if rule is not None else {},
        "runs": runs,
        "skipped_runs": skipped,
        "total_wall_time_s": time.perf_counter() - wall_start,
    }


def table_of(result: dict) -> str:
    """The Markdown table and check lines of a result (:func:`build_result`), with the runs left out."""
    checks = {k: v for k, v in result["acceptance"].items() if isinstance(v, dict)}
    table = markdown_table(result["summary"], checks, result["targets"])
    if result["skipped_runs"]:
        left_out = ", ".join(f"{r['optimizer']} seed {r['seed']}" for r in result["skipped_runs"])
        table += f"\nNot run (out of time): {left_out}.\n"
    uneven = coverage_lines(result)
    if uneven:
        table += "\n" + "\n".join(uneven) + "\n"
    return table


def write_result(out: Path, result: dict, plot: bool) -> str | None:
    """Write ``results.json`` and ``results.md`` under ``out`` (each replaced whole: a process stopped while
    writing leaves the previous version), and with ``plot`` also ``val_loss.png``; returns the plot's note, if
    skipped."""
    for name, text in (
        ("results.json", json.dumps(result, indent=1, allow_nan=False)),
        ("results.md", table_of(result)),
    ):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, out / name)
    return plot_curves(result["runs"], list(result["summary"]), out / "val_loss.png") if plot else None


def find_results(paths: Sequence[str]) -> list[Path]:
    """The ``results.json`` files named by ``paths``: a file itself, a directory every one under it (sorted)."""
    found = []
    for path in map(Path, paths):
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(path.rglob("results.json"))
        else:
            raise ValueError(f"--merge {path}: no such file or directory")
    return list(dict.fromkeys(found))


def _corpus_key(corpus: dict) -> tuple:
    # the digest where recorded (the same bytes, wherever the files were read from); before it was, the sizes of the
    # splits and the packages read
    if corpus.get("sha256"):
        return (corpus["sha256"],)
    return (corpus.get("train_bytes"), corpus.get("val_bytes"), sorted(corpus.get("packages", {})))


def merge_results(paths: Sequence[str], out: Path) -> dict:
    """Combine the runs of several ``results.json`` (see :func:`find_results`) into one result, as if one call had
    run them all. Raises ValueError if the files disagree on a setting of :data:`RUN_SETTINGS` or on the corpus,
    or if two of them hold a run of the same optimizer and seed. Files written by an earlier merge are skipped."""
    loaded = []
    for path in find_results(paths):
        data = json.loads(path.read_text())
        if "merged_from" in data:
            print(f"skipping {path}: written by an earlier --merge")
            continue
        if not {"config", "runs"} <= data.keys():
            raise ValueError(f"{path} is not a results.json of benchmark_convergence.py (no config or runs)")
        loaded.append((path, data))
    if not loaded:
        raise ValueError(f"--merge {' '.join(map(str, paths))}: found no results.json of a run")
    first_path, first = loaded[0]
    settings = {k: first["config"].get(k) for k in RUN_SETTINGS}
    runs, source = [], {}
    for path, data in loaded:
        for key in RUN_SETTINGS:
            if data["config"].get(key) != settings[key]:
                raise ValueError(
                    f"{path} was run with {key}={data['config'].get(key)!r}, {first_path} with "
                    f"{key}={settings[key]!r}: runs of different settings do not make one table"
                )
        if _corpus_key(data["corpus"]) != _corpus_key(first["corpus"]):
            raise ValueError(
                f"{path} and {first_path} trained on different corpora ({data['corpus'].get('sha256')} against "
                f"{first['corpus'].get('sha256')}): another Python or another version of a corpus package"
            )
        for run in data["runs"]:
            key = (run["optimizer"], run["seed"])
            if key in source:
                raise ValueError(
                    f"{run['optimizer']} seed {run['seed']} ran twice: in {source[key]} and in {path}; "
                    "merge one of them"
                )
            source[key] = path
            runs.append(run)
    runs.sort(key=lambda r: r["seed"])  # each optimizer's seeds in order, whatever the order of the parts
    names = list(dict.fromkeys(r["optimizer"] for r in runs))
    optims = [REFERENCE] * (REFERENCE in names) + [n for n in names if n != REFERENCE]
    skipped = [
        r for _, data in loaded for r in data.get("skipped_runs", []) if (r["optimizer"], r["seed"]) not in source
    ]
    config = {
        **first["config"],
        "optims": optims,
        "seeds": sorted({r["seed"] for r in runs}),
        "out": str(out),
    }
    environments = {str(path): data.get("environment", {}) for path, data in loaded}
    for key in ("torch", "gpu", "device"):
        values = {str(env.get(key)) for env in environments.values()}
        if len(values) > 1:
            print(f"note: the merged runs differ in {key}: {', '.join(sorted(values))}")
    base = {
        "config": config,
        "corpus": first["corpus"],
        "environment": first.get("environment", {}),
        "environments": environments,
        "merged_from": [str(path) for path, _ in loaded],
    }
    result = build_result(base, runs, optims, skipped, time.perf_counter())
    result["total_wall_time_s"] = sum(data.get("total_wall_time_s", 0.0) for _, data in loaded)
    return result


def coverage_lines(result: dict) -> list[str]:
    """A line per optimizer that ran on fewer seeds than the others."""
    seeds = {name: s["seeds"] for name, s in result["summary"].items()}
    every = sorted({seed for ss in seeds.values() for seed in ss})
    return [f"- {name} ran on seeds {sorted(ss)} of {every}" for name, ss in seeds.items() if sorted(ss) != every]


def merge_main(args) -> dict:
    """--merge: combine, print and write; a bad request exits with status 2 and a one-line error."""
    out = Path(args.out)
    try:
        result = merge_results(args.merge, out)
    except ValueError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    out.mkdir(parents=True, exist_ok=True)
    plot_note = write_result(out, result, plot=True)
    print(f"merged {len(result['runs'])} runs from {len(result['merged_from'])} files")
    print()
    print(table_of(result))
    if plot_note:
        print(plot_note)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}" + ("" if plot_note else f", {out / 'val_loss.png'}"))
    _print_failures(result)
    return result


def _print_failures(result: dict) -> None:
    failed, missed = failed_acceptance(result), failed_targets(result)
    if failed:
        print(f"acceptance check failed: {', '.join(failed)} (exit status 1)")
    if missed:
        print(f"target missed: {', '.join(missed)} (exit status 1)")
    if result["skipped_runs"]:
        print(f"{len(result['skipped_runs'])} runs left out for want of time (exit status 1)")


def expected_run_seconds(name: str, runs: list[dict], estimate: float) -> float:
    """The expected wall time of the next run of ``name``: the last run of it, else the larger of the estimate and
    the longest run so far (a first run of another optimizer may have compiled)."""
    own = [r["wall_s"] for r in runs if r["optimizer"] == name]
    if own:
        return own[-1]
    return max([estimate] + [r["wall_s"] for r in runs])


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark (or, with --merge, combine earlier runs); returns what it writes to ``results.json``."""
    args = parse_args(argv)
    if args.merge is not None:
        return merge_main(args)
    wall_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, package in args.skipped_optims:
        print(f"skipping {name}: it needs {package}, which could not be imported")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls for the model; optimizer math stays fp32
        torch.backends.cudnn.allow_tf32 = True
    preset = PRESETS[args.model_size]

    corpus = load_stdlib_corpus(packages=args.corpus_packages)
    val_batches = corpus.val_batches(args.eval_batches, args.batch_size, args.seq_len)
    n_params = preset.model.num_params()
    described = corpus.describe()
    print(
        f"corpus: {corpus.train.numel() / 1e6:.1f} MB train ({corpus.n_train_files} files), "
        f"{corpus.val.numel() / 1e6:.2f} MB validation ({corpus.n_val_files} files) from {described['stdlib']}"
        + "".join(f" and {source}" for source in described["packages"].values())
        + f"; a run reads {args.steps * args.batch_size * args.seq_len / corpus.train.numel():.3g}x the train split"
    )
    print(
        f"model: {args.model_size} ({n_params / 1e6:.2f}M params); {args.steps} steps x {args.batch_size} x "
        f"{args.seq_len} bytes; lr {args.lr:g}; autocast {args.amp}; seeds {args.seeds}; optimizers "
        f"{', '.join(args.optims)}; device {device}"
    )

    per_run_s, step_s = estimate_seconds(args, preset.model, corpus, val_batches, device)
    n_runs = len(args.optims) * len(args.seeds)
    rate = ""
    if device.type == "cuda":  # the model's arithmetic rate, to compare with the GPU's peak
        rate = f", {training_flops(preset.model, args.batch_size * args.seq_len) / step_s / 1e12:.0f} TFLOP/s"
    print(
        f"expected duration: about {_minutes(n_runs * per_run_s)} ({len(args.optims)} optimizers x "
        f"{len(args.seeds)} seeds x {args.steps} steps, about {_minutes(per_run_s)} a run; an fp32 AdamW step takes "
        f"{step_s * 1e3:.0f} ms here{rate})"
    )
    unfused = [o for o in args.optims if takes_compiled_path(o)]
    if unfused:
        print(
            f"  not counted: {', '.join(unfused)} take the per-parameter compiled path: a first step that compiles "
            "(about a minute on a 2-core CPU) and slower steps"
        )

    config = {k: v for k, v in vars(args).items()}
    config["model"] = preset.model.to_dict()
    config["n_params"] = n_params
    config["lr_schedule"] = "linear warm-up, then cosine to 0.1 x lr, assigned as a float to group['lr'] each step"
    base = {"config": config, "corpus": described, "environment": environment(device.type)}
    plan = [(name, seed) for seed in args.seeds for name in args.optims]
    runs: list[dict] = []
    skipped: list[dict] = []
    paced: dict[str, float] = {}  # the whole-run seconds of an optimizer stopped for its pace
    for name, seed in plan:
        if args.budget_s is not None:
            spent = time.perf_counter() - wall_start
            expected = paced.get(name) or expected_run_seconds(name, runs, per_run_s)
            if spent + expected > args.budget_s:  # left out; a shorter run after it may still fit
                skipped.append({"optimizer": name, "seed": seed})
                print(
                    f"out of time: {spent:.0f} s spent and {name} seed {seed} expected to take {expected:.0f} s, "
                    f"over --budget_s {args.budget_s:g}; left out"
                )
                continue
        deadline = None if args.budget_s is None else wall_start + args.budget_s
        try:
            runs.append(train_one(name, seed, args, preset.model, corpus, val_batches, device, deadline))
        except OutOfTime as stopped:
            print(f"out of time: {stopped}; left out")
            skipped.append({"optimizer": name, "seed": seed, "stopped": str(stopped)})
            paced[name] = stopped.run_seconds  # its other seeds start only if a run at this pace fits
            continue
        if len(runs) < len(plan):  # what has finished is kept if the process is stopped
            write_result(out, build_result(base, runs, args.optims, [], wall_start), plot=False)

    result = build_result(base, runs, args.optims, skipped, wall_start)
    plot_note = write_result(out, result, plot=True)
    print()
    print(table_of(result))
    if plot_note:
        print(plot_note)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}" + ("" if plot_note else f", {out / 'val_loss.png'}"))
    print(f"took {_minutes(result['total_wall_time_s'])} (expected about {_minutes(n_runs * per_run_s)})")
    _print_failures(result)
    return result


if __name__ == "__main__":
    sys.exit(exit_status(main()))
