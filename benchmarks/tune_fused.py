"""Tune and inspect the fused Adam kernel on CUDA: step time for each (ROWS, num_warps), registers and spills.

    python benchmarks/tune_fused.py --geometry llama_1b --dtype fp32 --rows 2,4,8 --warps 4,8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchao_optim  # noqa: E402
import torchao_optim.optim.fused as fused  # noqa: E402
from benchmark_step import GEOMETRIES, _time, copy_bandwidth, floor_bytes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="llama_1b")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--state-format", default="dtq8")
    ap.add_argument("--rows", default="2,4,8")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    shapes = GEOMETRIES[args.geometry]()
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to("cuda", dtype))
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to("cuda", dtype)
        params.append(p)
    floor = floor_bytes(shapes, dtype.itemsize, quantized=True) / copy_bandwidth("cuda") * 1e3
    print(f"# {args.geometry} {args.dtype} {args.state_format}: floor {floor:.3f} ms")
    print("| rows | warps | step ms | x floor | regs | spills |\n|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for warps in map(int, args.warps.split(",")):
            fused.ROWS, fused.NUM_WARPS = rows, warps
            opt = torchao_optim.AdamW(params, state_format=args.state_format, fused=True)
            for _ in range(3):
                opt.step()
            times = [_time(opt.step, "cuda") for _ in range(args.steps)]
            ms = 1e3 * statistics.median(times)
            plans = next(iter(opt._plans.values()))["plans"]
            big = max(plans, key=lambda pl: pl.n_programs)
            regs, spills = getattr(big.compiled, "n_regs", "?"), getattr(big.compiled, "n_spills", "?")
            print(f"| {rows} | {warps} | {ms:.3f} | {ms / floor:.2f} | {regs} | {spills} |")
            del opt
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
