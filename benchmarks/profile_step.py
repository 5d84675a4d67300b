"""Where a CUDA optimizer step's time goes: host time, step time, kernel time.

For one geometry of ``benchmark_step.py`` and AdamW with one state format, with and without the step replayed
from a CUDA graph (``torchao_optim.optim.replay``), it prints the median of
- host ms: ``opt.step()`` returning, measured on the host with the GPU idle before it,
- event ms: CUDA events around one step, as ``benchmark_step.py`` times it (the GPU waits for the host's first
  launch, so host time before it counts),
and then the step's kernels from ``torch.profiler`` (their GPU time per step, whatever the host did).

    python benchmarks/profile_step.py --geometry vit_b --dtype fp32 --state-format dtq8
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
from benchmark_step import GEOMETRIES  # noqa: E402
import torchao_optim  # noqa: E402
from torchao_optim.optim import replay  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="vit_b", choices=sorted(GEOMETRIES))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--state-format", default="dtq8")
    ap.add_argument("--fused", default="auto", choices=["auto", "off"], help="off: the per-parameter compiled path")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA device")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in GEOMETRIES[args.geometry]()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torchao_optim.AdamW(params, state_format=args.state_format, fused=None if args.fused == "auto" else False)
    for graphs in (False, True):
        replay.ENABLED = graphs
        for _ in range(5):
            opt.step()
        torch.cuda.synchronize()
        host, event = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            opt.step()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            event.append(start.elapsed_time(end))
        print(f"{args.geometry} {args.dtype} {args.state_format} fused={args.fused} step graphs={graphs}: "
              f"host {1e3 * statistics.median(host):.3f} ms, event {statistics.median(event):.3f} ms")
    from torch.profiler import ProfilerActivity, profile

    n = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            opt.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    print(f"kernels per step (graphs on), GPU ms: {sum(e.device_time_total for e in kernels) / n / 1e3:.3f}")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:8]:
        print(f"  {e.key[:60]:60s} {e.count / n:5.1f} per step  {e.device_time_total / n / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
