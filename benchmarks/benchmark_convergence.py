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
covered by ``AdamW8bit`` and that the fused executors take (it has a ``fast_path_layout()``), over seeds 0 and 1,
with the ``small`` model: under 3 minutes on a quiet 2-core CPU, printed before training starts (estimated from timed
steps). A format without a fused layout (``4bit_rank1``) takes the per-parameter compiled path: on a 2-core CPU its
first step compiles for about a minute and its steps are about 4x slower, so it runs only when asked for, by
``--all_formats`` or ``--optims``.

Written under ``--out`` (default ``results/convergence``):

- ``results.md``: the table below, also printed: final validation loss per optimizer (mean ± range over
  seeds, range = max - min), training time, optimizer-state memory and bytes per parameter;
- ``results.json``: the configuration, environment, every run's curves and the final numbers;
- ``val_loss.png``: validation-loss curves (needs matplotlib; skipped with a note without it).

Acceptance check, printed and saved: each optimizer's mean final validation loss is within AdamW's
seed-to-seed spread: ``|mean - AdamW's mean| <= AdamW's range`` (range = max - min over at least two seeds).
The script exits with status 1 when an optimizer fails it (after writing its results), 0 otherwise (an undecided
check, with one seed, is not a failure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
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
from stdlib_corpus import load_stdlib_corpus  # noqa: E402

import torchao_optim  # noqa: E402

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
}


# ---- optimizers: the table every benchmark shares (benchmarks/optimizers.py) ----------------------------


def has_fused_layout(state_format: str) -> bool:
    """Whether the fused executors (the C step on the CPU, the Triton kernels on CUDA) take a matrix's states in
    ``state_format``: both its states describe themselves by a layout. A format without one takes the
    per-parameter compiled path, whose first step compiles (about a minute on a 2-core CPU)."""
    fmt = torchao_optim.get_state_format(state_format)
    return all(fmt.zeros((256, 256), signed=s, device="meta").fast_path_layout() is not None for s in (True, False))


def default_optims(all_formats: bool = False) -> list[str]:
    """AdamW, AdamW8bit, and every registered format that no alias above already covers and that has a fused
    layout; with ``all_formats``, the formats without one too."""
    covered = set(ALIASES.values())
    formats = [f for f in torchao_optim.list_state_formats() if f not in covered]
    return [REFERENCE, *ALIASES] + [f"AdamW-{f}" for f in formats if all_formats or has_fused_layout(f)]


def takes_compiled_path(name: str) -> bool:
    """Whether optimizer ``name`` is an Adam of ours whose matrices take the per-parameter compiled path: a format
    without a fused layout, or ``fused=False``."""
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


@torch.no_grad()
def evaluate(model: GPT, batches, device) -> float:
    """Mean loss over the fixed validation batches."""
    model.eval()
    losses = [model(x.to(device), y.to(device)).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def train_one(name: str, seed: int, args, model_cfg: GPTConfig, corpus, val_batches, device) -> dict:
    """Train a fresh model with optimizer ``name`` on seed ``seed``; return the run's record."""
    torch.manual_seed(seed)
    model = GPT(model_cfg)  # built on the CPU, so the weights depend on the seed only
    init_checksum = sum(p.double().sum().item() for p in model.parameters())
    model.to(device=device, dtype=PARAM_DTYPES[args.param_dtype])
    groups = model.param_groups(args.weight_decay)
    # weight decay is set per group (model.param_groups); 0 here only fills the groups that do not set it
    optimizer = optimizers.build(
        name, groups, lr=args.lr, weight_decay=0.0, betas=(args.beta1, args.beta2), eps=args.eps, compile=True
    )
    batch_gen = torch.Generator().manual_seed(seed)  # same batches in the same order for every optimizer

    val_curve = [(0, evaluate(model, val_batches, device))]
    train_losses: list[float | None] = []
    step_times: list[float] = []
    graphs_before = compiled_graph_count()
    bar = tqdm(range(args.steps), desc=f"{name} seed {seed}", dynamic_ncols=True, leave=True)
    for step in bar:
        set_lr(optimizer, lr_at(step, args.lr, args.warmup, args.steps))
        x, y = corpus.train_batch(args.batch_size, args.seq_len, batch_gen)
        x, y = x.to(device), y.to(device)
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # waits for the device
        step_times.append(time.perf_counter() - start)
        train_losses.append(_finite_or_none(loss_value))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step + 1, evaluate(model, val_batches, device)))
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
    }


def estimate_seconds(args, model_cfg: GPTConfig, corpus, val_batches, device) -> tuple[float, float]:
    """The run's expected wall time in seconds, and the step time it is scaled from: training steps of fp32 AdamW on
    a throwaway model, and evaluations, timed here (medians) and scaled to every run's steps and evaluations.
    Our fused-path optimizers' steps cost about what fp32 AdamW's do at this size (the model's forward and
    backward dominate); an optimizer that compiles its first step takes longer than this says."""
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device=device, dtype=PARAM_DTYPES[args.param_dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)

    def train_step() -> None:
        x, y = corpus.train_batch(args.batch_size, args.seq_len, gen)
        model(x.to(device), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # first calls: allocations, lazy initialisation
    # the median of the steps of about a second (at least 5): on a shared machine a step now and then waits for
    # another process
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < 1.0 and len(times) < 100):
        times.append(_timed(train_step))
    step_s = statistics.median(times)
    eval_s = statistics.median(_timed(lambda: evaluate(model, val_batches, device)) for _ in range(2))
    evaluations = 1 + len({s for s in range(args.eval_every, args.steps + 1, args.eval_every)} | {args.steps})
    per_run = args.steps * step_s + evaluations * eval_s
    return len(args.seeds) * len(args.optims) * per_run, step_s


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
    """Per optimizer: the final validation loss over seeds (mean, min, max, range), times and memory."""
    out = {}
    for name in optims:
        rs = [r for r in runs if r["optimizer"] == name]
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


def _fmt(x: float | None, digits: int = 3) -> str:
    return "nan" if x is None else f"{x:.{digits}f}"


def markdown_table(summary: dict[str, dict], checks: dict[str, dict]) -> str:
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
    return "\n".join(lines) + "\n"


def failed_acceptance(result: dict) -> list[str]:
    """The optimizers whose acceptance check failed (a diverged run included); undecided checks are not failures."""
    return [name for name, c in result["acceptance"].items() if isinstance(c, dict) and c["passed"] is False]


def exit_status(result: dict) -> int:
    """The script's exit status: 1 if an optimizer failed the acceptance check, else 0."""
    return 1 if failed_acceptance(result) else 0


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
        f"{','.join(default_optims())} (the registered formats with a fused layout)",
    )
    parser.add_argument(
        "--all_formats",
        action="store_true",
        help="with the default --optims, also every registered format without a fused layout "
        f"({', '.join(o for o in default_optims(True) if o not in default_optims()) or 'none today'}): "
        "the per-parameter compiled path, whose first step compiles (about a minute on a 2-core CPU) "
        "and whose steps are slower",
    )
    parser.add_argument(
        "--model_size", default="small", choices=list(PRESETS), help="model preset, see below. Default: %(default)s"
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
        default=8,
        help="fixed validation batches of --batch_size sequences per evaluation. Default: %(default)s",
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
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and complete the flags; a bad request exits with a one-line error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.model_size]

    def fail(message: str):
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    args.steps = preset.steps if args.steps is None else args.steps
    args.batch_size = preset.batch_size if args.batch_size is None else args.batch_size
    args.seq_len = preset.model.context if args.seq_len is None else args.seq_len
    args.lr = preset.lr if args.lr is None else args.lr
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

    if args.optims is None:
        args.optims = ",".join(default_optims(args.all_formats))
    elif args.all_formats:
        fail("--all_formats extends the default --optims; with --optims, name every optimizer to run")
    args.optims = [o.strip() for o in args.optims.split(",") if o.strip()]
    for name in args.optims:
        if optimizers.resolve(name) is None:
            fail(f"unknown optimizer {name!r}; choose from {', '.join(optimizers.names())}")
        missing = optimizers.missing_package(name)
        if missing is not None:
            fail(f"--optims {name} needs {missing[1]}, which could not be imported; pip install {missing[1]}")
    if len(set(args.optims)) != len(args.optims) or not args.optims:
        fail(f"--optims must name each optimizer once, got {args.optims}")
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


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; returns what it writes to ``results.json``."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls for the model; optimizer math stays fp32
        torch.backends.cudnn.allow_tf32 = True
    preset = PRESETS[args.model_size]
    wall_start = time.perf_counter()

    corpus = load_stdlib_corpus()
    val_batches = corpus.val_batches(args.eval_batches, args.batch_size, args.seq_len)
    n_params = preset.model.num_params()
    print(
        f"corpus: {corpus.train.numel() / 1e6:.1f} MB train ({corpus.n_train_files} files), "
        f"{corpus.val.numel() / 1e6:.2f} MB validation ({corpus.n_val_files} files) from {corpus.root}"
    )
    print(
        f"model: {args.model_size} ({n_params / 1e6:.2f}M params); {args.steps} steps x {args.batch_size} x "
        f"{args.seq_len} bytes; lr {args.lr:g}; seeds {args.seeds}; optimizers {', '.join(args.optims)}; "
        f"device {device}"
    )

    expected_s, step_s = estimate_seconds(args, preset.model, corpus, val_batches, device)
    print(
        f"expected duration: about {_minutes(expected_s)} ({len(args.optims)} optimizers x {len(args.seeds)} "
        f"seeds x {args.steps} steps; an fp32 AdamW step takes {step_s * 1e3:.0f} ms here)"
    )
    unfused = [o for o in args.optims if takes_compiled_path(o)]
    if unfused:
        print(
            f"  not counted: {', '.join(unfused)} take the per-parameter compiled path: a first step that compiles "
            "(about a minute on a 2-core CPU) and slower steps"
        )

    runs = []
    for seed in args.seeds:
        for name in args.optims:
            runs.append(train_one(name, seed, args, preset.model, corpus, val_batches, device))

    summary = summarize(runs, args.optims)
    checks = acceptance(summary)
    table = markdown_table(summary, checks)
    plot_note = plot_curves(runs, args.optims, out / "val_loss.png")
    config = {k: v for k, v in vars(args).items()}
    config["model"] = preset.model.to_dict()
    config["n_params"] = n_params
    config["lr_schedule"] = "linear warm-up, then cosine to 0.1 x lr, assigned as a float to group['lr'] each step"
    result = {
        "config": config,
        "corpus": corpus.describe(),
        "environment": environment(device.type),
        "spread": "range = max - min over seeds",
        "summary": summary,
        "acceptance": {
            "criterion": "|mean final val loss - AdamW's| <= AdamW's range (max - min) over seeds",
            **checks,
        },
        "runs": runs,
        "total_wall_time_s": time.perf_counter() - wall_start,
    }
    with open(out / "results.json", "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    (out / "results.md").write_text(table)
    print()
    print(table)
    if plot_note:
        print(plot_note)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}" + ("" if plot_note else f", {out / 'val_loss.png'}"))
    print(f"took {_minutes(result['total_wall_time_s'])} (expected about {_minutes(expected_s)})")
    failed = failed_acceptance(result)
    if failed:
        print(f"acceptance check failed: {', '.join(failed)} (exit status 1)")
    return result


if __name__ == "__main__":
    sys.exit(exit_status(main()))
