"""How each optimizer's low-bit state follows fp32 AdamW where gradients are small.

Adam's step does not depend on the gradients' scale, but for eps: a block of gradients of 1e-7 takes the same steps as
one of 1e-3. A low-bit state whose block scales have a floor breaks this below it. One matrix of 128-column rows (one
block each) whose rows take gradients of one scale each, from ``--scales``, is stepped ``--steps`` times by fp32
AdamW (``torch.optim.AdamW``, foreach) and by each optimizer of ``--optims`` (names of ``benchmarks/optimizers.py``;
peers where installed) from the same start and gradients; printed per scale, over the rows of that scale, how far each
optimizer's total step goes along fp32's (``gain``: <q, u> / <u, u>, 1 at best) and its relative error (``err``:
|q - u| / |u|). No weight decay, so that only the gradients' steps are compared; eps 1e-8.

    python benchmarks/small_gradients.py
    python benchmarks/small_gradients.py --optims AdamW8bit,AdamW4bit,AdamWTorchao4bit,AdamWTorchao8bit --device cuda
    python benchmarks/small_gradients.py --formats_from benchmarks/fourbit_variants.py --optims AdamW4bit,AdamW-4bit_dyn
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optimizers import build, missing_package  # noqa: E402

COLS = 128  # one block of every built-in blockwise format, and of torchao's 4-bit state
ROWS_PER_SCALE = 64


def measure(
    names: list[str], scales: list[float], steps: int, device: str, seed: int = 0, compile: bool = True
) -> dict:
    """``{name: {scale: (gain, err)}}`` over rows of each scale of one matrix (fp32 parameters); ``compile``: our
    optimizers' per-parameter path compiled (as in training) or eager."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(scales) * ROWS_PER_SCALE
    start = torch.randn(rows, COLS, generator=gen) * 0.02
    row_scale = torch.tensor(scales).repeat_interleave(ROWS_PER_SCALE)[:, None]
    grads = [torch.randn(rows, COLS, generator=gen) * row_scale for _ in range(steps)]
    hyper = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)

    def run(make) -> torch.Tensor:
        p = torch.nn.Parameter(start.clone().to(device))
        opt = make([p])
        for g in grads:
            p.grad = g.to(device)
            opt.step()
        return (p.detach().cpu() - start).view(len(scales), ROWS_PER_SCALE * COLS)

    reference = run(lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper))
    out = {}
    for name in names:
        q = run(lambda ps, name=name: build(name, ps, compile=compile, **hyper))
        gain = (q * reference).sum(1) / (reference * reference).sum(1)
        err = (q - reference).norm(dim=1) / reference.norm(dim=1)
        out[name] = {s: (float(gn), float(e)) for s, gn, e in zip(scales, gain, err)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optims", default="AdamW8bit,AdamW4bit,AdamWFp8,AdamWTorchao8bit,AdamWTorchao4bit")
    ap.add_argument("--scales", default="1e-3,1e-5,1e-6,1e-7,1e-8", help="the rows' gradient scales")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--formats_from", default=None, help="a Python file run first (it may register formats)")
    args = ap.parse_args()
    if args.formats_from:
        runpy.run_path(args.formats_from)
    names = []
    for name in args.optims.split(","):
        missing = missing_package(name)
        if missing:
            print(f"# {name} skipped: {missing[0]} does not import")
        else:
            names.append(name)
    scales = [float(s) for s in args.scales.split(",")]
    results = measure(names, scales, args.steps, args.device)
    print(
        f"# {args.steps} steps, {ROWS_PER_SCALE} rows of {COLS} per gradient scale, against torch.optim.AdamW (fp32), "
        f"lr 1e-3, betas (0.9, 0.95), eps 1e-8, no weight decay; gain (err)"
    )
    print("| optimizer | " + " | ".join(f"gradients {s:g}" for s in scales) + " |")
    print("|---|" + "---|" * len(scales))
    for name, by_scale in results.items():
        print(f"| {name} | " + " | ".join(f"{g:.3f} ({e:.3f})" for g, e in by_scale.values()) + " |")


if __name__ == "__main__":
    main()
