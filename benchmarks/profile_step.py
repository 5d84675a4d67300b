"""Where a CUDA optimizer step's time goes: host time, step time, kernel time.

For one geometry of ``benchmark_step.py`` and each optimizer named (``optimizers.py``'s table, built as the step
benchmark builds it), with and without the step replayed from a CUDA graph (``torchao_optim.optim.replay``), it
prints the median of
- host ms: ``opt.step()`` returning, measured on the host with the GPU idle before it,
- event ms: CUDA events around one step, as ``benchmark_step.py`` times it (the GPU waits for the host's first
  launch, so host time before it counts),
whether the step was replayed (``replayed``: every group's graph captured; ``failed``: a capture failed), and then
the step's kernels from ``torch.profiler`` (their GPU time per step, whatever the host did). Each optimizer first
runs ``benchmark_step.WARM_S`` seconds of steps, as the step benchmark does.

    python benchmarks/profile_step.py --geometry vit_b --dtype fp32 --optims AdamW-dtq8,AdamW-4bit
    python benchmarks/profile_step.py --geometry vit_b --dtype bf16 --optims AdamW-dtq8 --timeline
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizers  # noqa: E402
from benchmark_step import GEOMETRIES, draw_params, warm_up  # noqa: E402

from torchao_optim.optim import replay  # noqa: E402


def replay_status(opt) -> str:
    """Whether each parameter group's step is replayed from a captured graph (torchao_optim's optimizers)."""
    graphs = getattr(opt, "_graphs", None)
    if graphs is None:
        return "n/a"
    if any(g.failed for g in graphs.values()):
        return "failed"
    captured = sum(g.graph is not None for g in graphs.values())
    return f"{captured}/{len(opt.param_groups)} groups replayed"


def profile(name: str, shapes, dtype, steps: int) -> None:
    opt = optimizers.build(name, draw_params(shapes, dtype, "cuda"))
    for graphs in (False, True):
        replay.ENABLED = graphs
        warm_up(opt.step)
        host, event = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.step()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        for _ in range(steps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            stop.record()
            stop.synchronize()
            event.append(start.elapsed_time(stop))
        print(
            f"{name} step graphs={graphs}: host {1e3 * statistics.median(host):.3f} ms, "
            f"event {statistics.median(event):.3f} ms ({replay_status(opt) if graphs else 'not replayed'})"
        )
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = 10
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            opt.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    print(f"{name} kernels per step (graphs on), GPU ms: {sum(e.device_time_total for e in kernels) / n / 1e3:.3f}")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:8]:
        print(f"  {e.key[:60]:60s} {e.count / n:5.1f} per step  {e.device_time_total / n / 1e3:.3f} ms")


def timeline(name: str, shapes, dtype, steps: int = 6) -> None:
    """Each kernel of ``steps`` steps, each step queued behind a GPU spin (as behind backward's kernels): when it
    starts after the spin ends and how long it takes, in us (``torch.profiler``'s trace)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    opt = optimizers.build(name, draw_params(shapes, dtype, "cuda"))
    warm_up(opt.step)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda._sleep(4_000_000)
            opt.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    print(f"{name} timeline: us after the spin, duration, kernel, grid")
    end = None
    for e in sorted(events, key=lambda e: e["ts"]):
        if "spin" in e["name"]:
            end = e["ts"] + e["dur"]
            print("  ---")
        elif end is not None:
            print(f"  +{e['ts'] - end:8.1f} {e['dur']:9.1f}  {e['name'][:50]:50s} {e.get('args', {}).get('grid')}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="vit_b", choices=sorted(GEOMETRIES))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument(
        "--optims",
        default="AdamW-dtq8",
        help="comma list of optimizers.py names (AdamWCompiled-<format>: the per-parameter compiled path)",
    )
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="print each kernel of six steps queued behind a GPU spin, with its start and duration",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA device")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"# {args.geometry} {args.dtype}, torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for name in args.optims.split(","):
        if args.timeline:
            timeline(name, GEOMETRIES[args.geometry](), dtype)
        else:
            profile(name, GEOMETRIES[args.geometry](), dtype, args.steps)


if __name__ == "__main__":
    main()
