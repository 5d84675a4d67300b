#!/usr/bin/env python
"""Render the fine-tuning benchmark's results (JSON lines) as a Markdown table and a PNG chart.

    python benchmarks/render_finetune_table.py results/finetune.jsonl

prints the table, writes it to ``results/finetune.md`` and draws ``results/finetune.png`` (loss curves and
max-memory bars; needs matplotlib). ``--md`` and ``--png`` choose other paths, ``--no_png`` skips the
chart. Several files may be given; their runs form one table, in order.

Results of repeated runs (``--repeats``) carry each repeat's throughput: the table gives the median with the
spread (min–max) and compares each row's throughput with the reference row's (the first, or ``--reference``):
a difference inside the run-to-run spread reads "within noise" (``noise.py``), and a row measured once says it
has no spread to judge by. Where the runs timed the optimizer's step, a column gives it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # noise.py sits here
from noise import Spread, difference, ordering  # noqa: E402

REQUIRED_KEYS = ("optim", "memory_gb", "memory_kind", "train_time_s", "throughput_imgs_s", "val_acc")


class RenderError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The runs in ``paths`` (JSON lines, blank lines ignored), in order."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise RenderError(f"results file {path!r} does not exist")
        for number, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise RenderError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            missing = [k for k in REQUIRED_KEYS if not isinstance(row, dict) or k not in row]
            if missing:
                raise RenderError(f"{path}:{number}: not a benchmark result (missing {', '.join(missing)})")
            rows.append(row)
    if not rows:
        raise RenderError(f"no results in {', '.join(paths)}")
    return rows


def format_duration(seconds: float) -> str:
    """``551`` -> ``9m 11s``, as in the reference table; under a minute, seconds with one decimal."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes}m {secs}s"


def labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A name for each run: its run name (the optimizer by default), plus its AMP mode where that tells
    runs apart, plus a counter where nothing does."""
    base = [row.get("run_name") or row["optim"] for row in rows]
    out = [b if base.count(b) == 1 else f"{b} ({row.get('amp', '?')})" for b, row in zip(base, rows)]
    seen: dict[str, int] = {}
    result = []
    for name in out:
        if out.count(name) > 1:
            seen[name] = seen.get(name, 0) + 1
            name = f"{name} #{seen[name]}"
        result.append(name)
    return result


def _percent(value: Any) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}%"


def _memory(row: dict[str, Any]) -> str:
    text = f"{row['memory_gb']:.2f}"
    return text + " (peak RSS)" if row["memory_kind"] == "cpu_peak_rss" else text


def throughput_spread(row: dict[str, Any]) -> Spread:
    """The row's throughput over its repeats (one sample for a row measured once)."""
    return Spread.of(row.get("throughput_runs") or [row["throughput_imgs_s"]])


def _reference(rows: Sequence[dict[str, Any]], names: Sequence[str], reference: str | None) -> int:
    """The index of the row the others are compared with: the first, or the one whose label or optimizer is
    ``reference``."""
    if reference is None:
        return 0
    for i, (name, row) in enumerate(zip(names, rows)):
        if reference in (name, row["optim"]):
            return i
    raise RenderError(f"--reference {reference!r} is none of the table's rows ({', '.join(names)})")


def markdown_table(rows: Sequence[dict[str, Any]], reference: str | None = None) -> str:
    """The table; rows from repeated runs add the throughput's spread and its comparison with the reference row
    (the first, or ``reference``), and rows that timed the optimizer's step add that column."""
    names = labels(rows)
    repeated = any("throughput_runs" in r for r in rows)
    timed_step = any("optim_step_ms" in r for r in rows)
    ref = _reference(rows, names, reference) if repeated else None
    header = [
        "Optimizer",
        "Model",
        "AMP",
        "Device",
        "Steps",
        "Max memory (GB)",
        "Training time",
        "Throughput (imgs/s)",
    ]
    if repeated:
        header.append(f"vs {names[ref]}")
    if timed_step:
        header.append("Optimizer step (ms)")
    header.append("Val accuracy")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for i, (name, row) in enumerate(zip(names, rows)):
        model = str(row.get("model", "")).split("/")[-1]
        cells = [
            name,
            model,
            str(row.get("amp", "")),
            str(row.get("device_name") or row.get("device", "")),
            str(row.get("steps", "")),
            _memory(row),
            format_duration(row["train_time_s"]),
            throughput_spread(row).text(1),
        ]
        if repeated:
            cells.append(
                "(reference)"
                if i == ref
                else difference(throughput_spread(row), throughput_spread(rows[ref]), relative=True)
            )
        if timed_step:
            step = row.get("optim_step_ms")
            cells.append("" if step is None else Spread.of(row.get("optim_step_ms_runs") or [step]).text(3))
        cells.append(_percent(row["val_acc"]))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    notes = []
    if any(r["memory_kind"] == "cuda_max_allocated" for r in rows):
        notes.append("Max memory on CUDA is `torch.cuda.max_memory_allocated()`.")
    if any(r["memory_kind"] == "cpu_peak_rss" for r in rows):
        notes.append(
            '"peak RSS": a CPU run, whose figure is the whole process\'s peak resident set size '
            "(`resource.getrusage`), not comparable to CUDA's allocated memory."
        )
    notes.append("GB = 10^9 bytes; training time excludes evaluation.")
    if repeated:
        notes.append(
            "Throughput: the median over the repeats (min–max in brackets), after each run's untimed warm-up "
            "steps; a difference from the reference inside the spreads is within noise, not a finding."
        )
    if timed_step:
        notes.append(
            "Optimizer step: its own time per step in the training loop (CUDA events around `optimizer.step()`; "
            "the wall clock on a CPU), median over the timed steps."
        )
    text = "\n".join(lines) + "\n\n" + " ".join(notes) + "\n"
    order = ordering(list(zip(names, map(throughput_spread, rows))), lower_is_better=False) if repeated else ""
    if order:
        text += f"\nHighest throughput first (≈: within noise): {order}.\n"
    return text


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Loss curves (left) and max-memory bars annotated with accuracy (right), as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RenderError("the PNG chart needs matplotlib (pip install matplotlib), or pass --no_png") from None

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    names = labels(rows)
    colors = [f"C{i % 10}" for i in range(len(rows))]
    for name, color, row in zip(names, colors, rows):
        curve = row.get("loss_curve") or []
        if curve:
            steps, losses = zip(*curve)
            ax_loss.plot(steps, losses, label=name, color=color, linewidth=1.2, marker="." if len(curve) < 20 else None)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("Training loss")
    ax_loss.grid(alpha=0.3)
    if any(row.get("loss_curve") for row in rows):
        ax_loss.legend(fontsize=8)

    values = [r["memory_gb"] for r in rows]
    bars = ax_mem.barh(range(len(rows)), values, color=colors)
    for bar, row in zip(bars, rows):
        if row["memory_kind"] == "cpu_peak_rss":
            bar.set_hatch("//")
            bar.set_edgecolor("white")
        ax_mem.annotate(
            f" {row['memory_gb']:.2f} GB, acc {_percent(row['val_acc'])}",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=8,
        )
    ax_mem.set_yticks(range(len(rows)))
    ax_mem.set_yticklabels(names, fontsize=8)
    ax_mem.invert_yaxis()
    ax_mem.set_xlim(0, max(values) * 1.6 if values and max(values) > 0 else 1)
    kinds = {r["memory_kind"] for r in rows}
    ax_mem.set_xlabel(
        "GB ("
        + ", ".join(
            sorted(
                {"cuda_max_allocated": "CUDA max allocated", "cpu_peak_rss": "hatched: CPU peak RSS"}.get(k, k)
                for k in kinds
            )
        )
        + ")"
    )
    ax_mem.set_title("Max memory")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render fine-tuning benchmark results as Markdown and PNG.")
    parser.add_argument("results", nargs="+", help="JSON-lines files written by benchmark_adam_8bit.py")
    parser.add_argument("--md", default=None, help="Markdown output; default <first results file>.md")
    parser.add_argument("--png", default=None, help="PNG output; default <first results file>.png")
    parser.add_argument("--no_png", action="store_true", help="skip the chart")
    parser.add_argument(
        "--reference",
        default=None,
        help="the row (label or optimizer) the others' throughput is compared with; default the first",
    )
    args = parser.parse_args(argv)
    stem = Path(args.results[0]).with_suffix("")
    try:
        rows = load_results(args.results)
        table = markdown_table(rows, args.reference)
        md_path = Path(args.md or f"{stem}.md")
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(table, encoding="utf-8")
        print(table)
        print(f"wrote {md_path}")
        if not args.no_png:
            png_path = args.png or f"{stem}.png"
            plot(rows, png_path)
            print(f"wrote {png_path}")
    except RenderError as err:
        print(f"render_finetune_table.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
