#!/usr/bin/env python
"""End-to-end step benchmark: the time each optimizer adds to forward and backward in a real training loop.

    python benchmarks/benchmark_e2e.py --out results/e2e            # GPU: ViT-B and a 1.1B LLaMA, 3 repeats
    python benchmarks/benchmark_e2e.py --quick --out results/e2e    # fewer steps, for a first look

An optimizer's step time on its own (``benchmark_step.py``) is not what a user pays: in a training loop the
step is queued behind backward's kernels, shares the GPU's caches and clocks with them, and its host time may
hide behind them. So this script trains real models, with synthetic inputs made on the device once (no data
pipeline in the loop), fp32 parameters and ``--amp`` autocast, and measures in one process:

- ``fwd+bwd``: ``zero_grad(set_to_none=True)``, forward, loss, backward, and no optimizer;
- the same followed by ``opt.step()``, for each optimizer.

Each optimizer starts from the same weights (copied back before it is built, so every one times the same work),
takes ``--warmup`` untimed steps (its compiles, CUDA-graph capture and the first step's state creation fall
there), then ``--steps`` timed ones. A CUDA event recorded between consecutive steps gives each step's time
as the GPU runs the loop (the host queues ahead of it; where the host falls behind, its stalls count too):
``step ms`` is their median, which a one-off stall (a garbage collection, a clock change) does not move, and
``optimizer ms`` the median of CUDA events around each ``opt.step()`` (its own time in the loop).

The loop must be bound by the GPU for the difference to be the optimizer's: where the host takes longer to issue
a step than the GPU takes to run it, the step time follows the host's speed (which drifts by several ms between
blocks on a shared machine) and hides the optimizer's device time. On one H200 the host took 26-37 ms to issue
ViT-B's forward and backward, as long as the GPU's 26 ms at batch 64, and blocks of the same optimizer differed
by up to 6 ms a step; so ``vit_b`` runs at batch 256 by default (about 90 ms on the GPU), where they agree within
a few tenths of a ms. An optimizer's work does not depend on the batch.

The optimizers and ``fwd+bwd`` take turns, in an order rotated each round, for ``--repeats`` rounds; in each
round an optimizer's **added ms** is its step ms minus that round's ``fwd+bwd`` step ms. The table gives the
median over the rounds and the spread (min–max); where two rows' spreads overlap it says "within noise" rather
than ranking them (``noise.py``). On a CPU the timer is ``time.perf_counter``. JSON goes to
``--out``/e2e_<device>.json, the Markdown tables beside it.

Optimizer names are those of ``benchmarks/optimizers.py``; the default list is torch's fused and foreach
AdamW, ours with fp32 state (``AdamW-none``), ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, and bitsandbytes'
and torchao's AdamW where they import (a note says why one is left out). Workloads: ``vit_b`` (timm's
``vit_base_patch16_224``, random init, a 45-class head as in the fine-tuning benchmark) and ``llama_1b``
(``transformers``' LlamaForCausalLM with TinyLlama-1.1B's sizes, random init).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizers  # noqa: E402  (the optimizer table every benchmark shares; it imports torchao_optim)
from noise import NO_SPREAD, Spread, difference, ordering  # noqa: E402

BASELINE = "fwd+bwd"
DEFAULT_OPTIMS = ("AdamWTorchFused", "AdamWTorchForeach", "AdamW-none", "AdamW8bit", "AdamW4bit", "AdamWFp8")
PEERS = ("AdamWBnb8bit", "AdamWTorchao8bit", "AdamWTorchao4bit")
REFERENCE = "AdamWTorchFused"
# Timed steps per block: about 3 s of steps on an H200 (ViT-B at batch 256 and the 1.1B LLaMA each about 90 ms a
# step), which keeps the default run (both workloads, 6 optimizers, 3 rounds) near 5 minutes.
STEPS = {"vit_b": 30, "llama_1b": 30}
QUICK_STEPS = {"vit_b": 8, "llama_1b": 8}
WARMUP, QUICK_WARMUP = 8, 5  # our optimizers capture their CUDA graph on the third step


class E2EError(Exception):
    """Bad input or a missing package: reported as one line on stderr, exit code 2."""


# ---- workloads ------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """A model, one batch of synthetic inputs on its device, and the loss of the model on that batch."""

    name: str
    description: str
    model: nn.Module
    batch: Any
    loss: Callable[[nn.Module, Any], torch.Tensor]
    lr: float = 1e-4


def vit_b(device, batch_size: int = 256, num_classes: int = 45, **model_kwargs) -> Workload:
    """timm's ViT-B/16 (86M params), random init, on ``batch_size`` random 224x224 images."""
    try:
        import timm
    except Exception as err:  # ImportError, or a torchvision built for another torch
        raise E2EError(f"the vit_b workload needs timm (pip install timm): {type(err).__name__}: {err}") from None
    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=num_classes, **model_kwargs)
    model.to(device)
    size = model.patch_embed.img_size
    gen = torch.Generator(device=device).manual_seed(0)
    images = torch.randn(batch_size, 3, *size, generator=gen, device=device)
    labels = torch.randint(num_classes, (batch_size,), generator=gen, device=device)
    return Workload(
        "vit_b",
        f"timm vit_base_patch16_224{' ' + json.dumps(model_kwargs) if model_kwargs else ''}, "
        f"{num_classes} classes, batch {batch_size}",
        model,
        (images, labels),
        lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]),
        lr=1e-4,
    )


TINYLLAMA = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def llama_1b(device, batch_size: int = 4, seq_len: int = 1024, **config) -> Workload:
    """``transformers``' LlamaForCausalLM with TinyLlama-1.1B's sizes (``config`` overrides them), random init,
    built on the device, on ``batch_size`` random sequences of ``seq_len`` tokens (next-token loss)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as err:
        raise E2EError(f"the llama_1b workload needs transformers: {type(err).__name__}: {err}") from None
    sizes = {**TINYLLAMA, **config}
    with torch.device(device):  # random init where the model lives: seconds on a GPU, a minute on the host
        model = LlamaForCausalLM(LlamaConfig(**sizes)).float()
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(sizes["vocab_size"], (batch_size, seq_len), generator=gen, device=device)
    changed = {k: v for k, v in config.items() if TINYLLAMA.get(k) != v}
    return Workload(
        "llama_1b",
        f"LlamaForCausalLM, TinyLlama-1.1B sizes{' with ' + json.dumps(changed) if changed else ''}, "
        f"batch {batch_size} x {seq_len} tokens",
        model,
        ids,
        lambda m, b: m(input_ids=b, labels=b).loss,
        lr=1e-5,
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {"vit_b": vit_b, "llama_1b": llama_1b}


# ---- one timed block: one optimizer (or none) from the starting weights ----------------------------------------
@dataclass
class Block:
    step_ms: float  # the median of the timed steps' times
    mean_step_ms: float  # the timed loop's time over its number of steps
    optimizer_ms: float | None  # the median of opt.step()'s own times; None without an optimizer
    first_step_s: float  # wall time of the first step, compiles included
    peak_gb: float | None  # CUDA max allocated during the block, the saved starting weights left out
    state_bytes: int = 0


class _Timer:
    """CUDA events on a GPU (read after one synchronize at the end), ``time.perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(amp: str, device: torch.device):
    if amp == "none":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def train_step(work: Workload, opt, amp: str, device: torch.device, timer=None, opt_times=None) -> None:
    """One training step as a user writes it; with ``timer``, the marks around ``opt.step()`` go to
    ``opt_times``. Without an optimizer, the same without the step."""
    if opt is None:
        work.model.zero_grad(set_to_none=True)
    else:
        opt.zero_grad(set_to_none=True)
    with _autocast(amp, device):
        loss = work.loss(work.model, work.batch)
    loss.backward()
    if opt is None:
        return
    if timer is None:
        opt.step()
        return
    before = timer.mark()
    opt.step()
    opt_times.append((before, timer.mark()))


def run_block(
    work: Workload,
    name: str,
    start_weights: Sequence[torch.Tensor],
    steps: int,
    warmup: int,
    amp: str,
    device: torch.device,
) -> Block:
    """Copy the starting weights back, build optimizer ``name`` (none for :data:`BASELINE`), take ``warmup``
    untimed steps, then ``steps`` timed ones."""
    model = work.model
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, w in zip(params, start_weights):
            p.copy_(w)
            p.grad = None
    gc.collect()
    held = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        held = sum(w.numel() * w.element_size() for w in start_weights if w.device.type == "cuda")
    opt = None if name == BASELINE else optimizers.build(name, params, lr=work.lr, weight_decay=0.01)
    timer = _Timer(device)
    opt_times: list[tuple[Any, Any]] = []
    t0 = time.perf_counter()
    train_step(work, opt, amp, device)
    _synchronize(device)
    first_step_s = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        train_step(work, opt, amp, device)
    _synchronize(device)
    marks = [timer.mark()]
    for _ in range(steps):
        train_step(work, opt, amp, device, timer, opt_times)
        marks.append(timer.mark())
    _synchronize(device)
    step_ms = statistics.median(timer.ms(a, b) for a, b in zip(marks, marks[1:]))
    mean_step_ms = timer.ms(marks[0], marks[-1]) / steps
    optimizer_ms = statistics.median(timer.ms(a, b) for a, b in opt_times) if opt_times else None
    peak_gb = None
    if device.type == "cuda":
        peak_gb = (torch.cuda.max_memory_allocated(device) - held) / 1e9
    state_bytes = optimizers.state_nbytes(opt) if opt is not None else 0
    del opt, opt_times
    for p in params:
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Block(step_ms, mean_step_ms, optimizer_ms, first_step_s, peak_gb, state_bytes)


# ---- the rounds, and what they add up to ----------------------------------------------------------------------
@dataclass
class Row:
    name: str
    step_ms: list[float] = field(default_factory=list)
    mean_step_ms: list[float] = field(default_factory=list)
    added_ms: list[float] = field(default_factory=list)
    optimizer_ms: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    peak_gb: float | None = None
    state_bytes: int = 0


def measure(
    work: Workload,
    names: Sequence[str],
    repeats: int,
    steps: int,
    warmup: int,
    amp: str,
    device: torch.device,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """:data:`BASELINE` and each optimizer of ``names`` in turn, ``repeats`` rounds, the order rotated by one
    each round (so that none always runs first); rows in the order of ``names``, baseline first."""
    params = [p for p in work.model.parameters() if p.requires_grad]
    start_weights = [p.detach().clone() for p in params]
    conditions = [BASELINE, *names]
    rows = {n: Row(n) for n in conditions}
    # untimed: the GPU's clocks rise under load, and the first forward/backward sets up cuBLAS and the allocator
    run_block(work, BASELINE, start_weights, steps, warmup, amp, device)
    for r in range(repeats):
        order = conditions[r % len(conditions) :] + conditions[: r % len(conditions)]
        base_ms = None
        blocks = {}
        for name in order:
            block = run_block(work, name, start_weights, steps, warmup, amp, device)
            blocks[name] = block
            row = rows[name]
            row.step_ms.append(block.step_ms)
            row.mean_step_ms.append(block.mean_step_ms)
            if block.optimizer_ms is not None:
                row.optimizer_ms.append(block.optimizer_ms)
            if row.first_step_s is None:
                row.first_step_s = block.first_step_s  # the first round's: compiles included
            if block.peak_gb is not None:
                row.peak_gb = max(row.peak_gb or 0.0, block.peak_gb)
            row.state_bytes = block.state_bytes
            if name == BASELINE:
                base_ms = block.step_ms
        for name in names:
            rows[name].added_ms.append(blocks[name].step_ms - base_ms)
        log(f"  round {r + 1}/{repeats}: " + ", ".join(f"{n} {blocks[n].step_ms:.2f}" for n in conditions) + " ms/step")
    del start_weights
    return [rows[n] for n in conditions]


def row_dict(row: Row, n_params: int) -> dict[str, Any]:
    out: dict[str, Any] = dict(
        name=row.name,
        step_ms=Spread.of(row.step_ms).as_dict(),
        step_ms_runs=row.step_ms,
        mean_step_ms_runs=row.mean_step_ms,
    )
    if row.name != BASELINE:
        out.update(
            added_ms=Spread.of(row.added_ms).as_dict(),
            added_ms_runs=row.added_ms,
            optimizer_ms=Spread.of(row.optimizer_ms).as_dict(),
            optimizer_ms_runs=row.optimizer_ms,
            state_bytes=row.state_bytes,
            state_bytes_per_param=row.state_bytes / n_params,
        )
    out.update(first_step_s=row.first_step_s, peak_gb=row.peak_gb)
    return out


def markdown(result: dict[str, Any], reference: str = REFERENCE) -> str:
    """One workload's table: per optimizer the added ms (median and spread), the comparison with ``reference``
    ("within noise" where the spreads overlap), the optimizer's own ms, the step ms, memory and first step."""
    rows = result["rows"]
    base = next(r for r in rows if r["name"] == BASELINE)
    opts = [r for r in rows if r["name"] != BASELINE]
    ref = next((r for r in opts if optimizers.resolve(r["name"]) == optimizers.resolve(reference)), None)
    n = base["step_ms"]["n"]
    lines = [
        f"### {result['workload']}: {result['description']}",
        "",
        f"{result['n_params'] / 1e6:.1f}M params, amp {result['amp']}, {result['steps']} timed steps after "
        f"{result['warmup']} untimed, {n} round{'s' if n != 1 else ''}; {BASELINE} alone: "
        f"{Spread.from_dict(base['step_ms']).text()} ms/step.",
        "",
        f"| optimizer | added ms/step | vs {ref['name'] if ref else reference} | optimizer ms (events) | "
        "step ms | state B/param | peak GB | first step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in opts:
        added = Spread.from_dict(r["added_ms"])
        if ref is None:
            versus = "n/a"
        elif r is ref:
            versus = "(reference)"
        else:
            versus = difference(added, Spread.from_dict(ref["added_ms"]), " ms")
        peak = "n/a" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
        lines.append(
            f"| {r['name']} | {added.text()} | {versus} | {Spread.from_dict(r['optimizer_ms']).text(3)} | "
            f"{Spread.from_dict(r['step_ms']).text()} | {r['state_bytes_per_param']:.2f} | {peak} | "
            f"{r['first_step_s']:.1f} |"
        )
    order = ordering([(r["name"], Spread.from_dict(r["added_ms"])) for r in opts])
    lines.append("")
    lines.append(
        "Added ms/step: a round's step ms minus the same round's fwd+bwd step ms; median over the rounds "
        "(min–max in brackets). Rows whose ranges overlap are within noise: their order is not a finding. "
        "Optimizer ms: CUDA events around opt.step() in the loop, median over the timed steps."
    )
    if order:
        lines.append(f"Least added time first (≈: within noise): {order}.")
    elif n < 2:
        lines.append(f"One round only: {NO_SPREAD}; run with --repeats 3 to tell differences from noise.")
    return "\n".join(lines) + "\n"


# ---- the command line -----------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (through main)
        raise E2EError(f"{message} (see --help)")


def get_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="benchmark_e2e.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workloads", default="vit_b,llama_1b", help="comma list of " + ", ".join(WORKLOADS))
    p.add_argument(
        "--optims",
        default=None,
        help="comma list of benchmarks/optimizers.py names; default: "
        + ",".join(DEFAULT_OPTIMS + PEERS)
        + " (peers only where they import)",
    )
    p.add_argument("--repeats", type=_positive_int, default=3, help="rounds of every optimizer and fwd+bwd")
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="timed steps per block (default "
        + ", ".join(f"{w} {n}" for w, n in STEPS.items())
        + "; with --quick "
        + ", ".join(f"{w} {n}" for w, n in QUICK_STEPS.items())
        + ")",
    )
    p.add_argument(
        "--warmup",
        type=_positive_int,
        default=None,
        help=f"untimed steps per block (default {WARMUP}; {QUICK_WARMUP} quick)",
    )
    p.add_argument("--quick", action="store_true", help="fewer steps per block, for a first look")
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16", help="autocast dtype (fp32 parameters)")
    p.add_argument("--device", default=None, help="torch device; default cuda if available, else cpu")
    p.add_argument(
        "--vit_batch",
        type=_positive_int,
        default=256,
        help="images per vit_b step (at 64 the host, not the GPU, can set the step time)",
    )
    p.add_argument("--vit_kwargs", type=_json_object, default={}, help="extra timm.create_model kwargs (JSON)")
    p.add_argument("--llama_batch", type=_positive_int, default=4, help="sequences per llama_1b step")
    p.add_argument("--llama_seq", type=_positive_int, default=1024, help="tokens per llama_1b sequence")
    p.add_argument(
        "--llama_config", type=_json_object, default={}, help="LlamaConfig overrides (JSON), e.g. smaller sizes"
    )
    p.add_argument("--reference", default=REFERENCE, help="the optimizer the tables compare the others with")
    p.add_argument("--out", default="results/e2e", help="folder for e2e_<device>.json and e2e_<device>.md")
    return p


def choose_optimizers(spec: str | None, log: Callable[[str], None] = print) -> list[str]:
    """The optimizers to run: ``spec``'s (unknown names are an error) or the defaults; those whose package does
    not import are left out with a note."""
    if spec:
        names = [n.strip() for n in spec.split(",") if n.strip()]
        unknown = [n for n in names if optimizers.resolve(n) is None]
        if unknown:
            raise E2EError(
                f"unknown optimizer(s) {', '.join(map(repr, unknown))}; known: {', '.join(optimizers.names())}"
            )
    else:
        names = list(DEFAULT_OPTIMS + PEERS)
    chosen = []
    for n in names:
        missing = optimizers.missing_package(n)
        if missing:
            log(f"[skip] {n}: cannot import {missing[0]} (pip install {missing[1]})")
        else:
            chosen.append(n)
    if not chosen:
        raise E2EError("no optimizer left to run")
    return chosen


def build_workload(name: str, args, device: torch.device) -> Workload:
    if name == "vit_b":
        return vit_b(device, args.vit_batch, **args.vit_kwargs)
    if name == "llama_1b":
        return llama_1b(device, args.llama_batch, args.llama_seq, **args.llama_config)
    raise E2EError(f"unknown workload {name!r} (choose from: {', '.join(WORKLOADS)})")


def run_workload(work: Workload, names, args, device, log=print) -> dict[str, Any]:
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS).get(work.name, 20)
    warmup = args.warmup or (QUICK_WARMUP if args.quick else WARMUP)
    n_params = sum(p.numel() for p in work.model.parameters() if p.requires_grad)
    log(f"\n## {work.name}: {work.description} ({n_params / 1e6:.1f}M params)")
    torch.manual_seed(0)
    rows = measure(work, names, args.repeats, steps, warmup, args.amp, device, log)
    return dict(
        workload=work.name,
        description=work.description,
        n_params=n_params,
        amp=args.amp,
        steps=steps,
        warmup=warmup,
        repeats=args.repeats,
        rows=[row_dict(r, n_params) for r in rows],
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = get_parser().parse_args(argv)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise E2EError(f"--device {args.device} requested but CUDA is not available (use --device cpu)")
        workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = [w for w in workloads if w not in WORKLOADS]
        if unknown or not workloads:
            raise E2EError(f"unknown workload(s) {unknown or workloads} (choose from: {', '.join(WORKLOADS)})")
        names = choose_optimizers(args.optims)
        if optimizers.resolve(args.reference) is None:
            raise E2EError(f"unknown --reference {args.reference!r}")
        env = dict(
            torch=torch.__version__,
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
            date=time.strftime("%Y-%m-%d"),
            command=" ".join(["python", "benchmarks/benchmark_e2e.py", *(sys.argv[1:] if argv is None else argv)]),
        )
        print(f"# {env['date']} torch {env['torch']} on {env['device']}; optimizers: {', '.join(names)}")
        results, tables = [], []
        for name in workloads:
            t0 = time.perf_counter()
            work = build_workload(name, args, device)
            result = run_workload(work, names, args, device)
            result["seconds"] = time.perf_counter() - t0
            del work
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            table = markdown(result, args.reference)
            print("\n" + table)
            results.append(result)
            tables.append(table)
    except E2EError as err:
        print(f"benchmark_e2e.py: error: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"e2e_{device.type}")
    with open(stem + ".json", "w", encoding="utf-8") as fh:
        json.dump(dict(env=env, results=results), fh, indent=1)
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(f"# {env['date']}, torch {env['torch']}, {env['device']}\n\n`{env['command']}`\n\n")
        fh.write("\n".join(tables))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
