"""Accuracy parity: how far does AdamW with low-bit state drift from fp32 AdamW on the same gradients?

The case (the one torchao 0.18's low-bit optimizers were measured on): two parameters of shapes (256, 512)
and (1024, 256), initialized from a standard normal; 30 AdamW steps, lr 1e-3, weight decay 1e-2, default
betas and eps; at step ``t`` (from 0) every gradient is standard normal times ``1e-2 * (1 + t % 3)``, the same
for both optimizers. The error is the mean absolute difference between the parameters and those of
``torch.optim.AdamW`` (fp32 state), over all elements.

The bar, torchao 0.18 on this case: 4-bit 1.2e-3, FP8 2.0e-4, 8-bit 9.0e-5. Every registered format is
measured (``--formats`` to choose), and with ``--variants`` the alternatives the defaults were chosen over:
the 4-bit dynamic tree map for ``exp_avg`` (torchao's), rank-1 normalization (``4bit_rank1``), and e4m3 or
e5m2 for FP8's ``exp_avg_sq``.

    python benchmarks/benchmark_parity.py                    # every registered format, seed 0
    python benchmarks/benchmark_parity.py --variants --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout this script belongs to, whatever else is installed
import torchao_optim  # noqa: E402
from torchao_optim.state import FourBitTensor, Fp8Tensor, register_state_format  # noqa: E402

SHAPES = ((256, 512), (1024, 256))
STEPS, LR, WEIGHT_DECAY, GRAD_SCALE = 30, 1e-3, 1e-2, 1e-2
# torchao 0.18 on this case, by our format of the same size
TORCHAO = {"4bit": 1.2e-3, "fp8": 2.0e-4, "dtq8": 9.0e-5}


def drift(make, make_ref, seed: int = 0, steps: int = STEPS) -> float:
    """Mean |p - p_ref| over every element after ``steps`` steps of the case: ``make(params)`` and
    ``make_ref(params)`` build the two optimizers, over copies of the same initial parameters, and both step on the
    same gradients."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(shape, generator=gen) for shape in SHAPES]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt, ref_opt = make(ours), make_ref(ref)
    for step in range(steps):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, generator=gen) * (GRAD_SCALE * (1 + step % 3))
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    total = sum((p.detach() - q.detach()).abs().sum().item() for p, q in zip(ours, ref))
    return total / sum(p.numel() for p in ours)


def parity_error(state_format: str, seed: int = 0, compile: bool = False) -> float:
    """Mean |p - p_ref| after the case's 30 steps, ``p_ref`` from ``torch.optim.AdamW`` on the same gradients."""
    return drift(
        lambda ps: torchao_optim.AdamW(
            ps, lr=LR, weight_decay=WEIGHT_DECAY, state_format=state_format, compile=compile, fused=False
        ),
        lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False),
        seed,
    )


def register_variants() -> list[str]:
    """Register the alternatives the defaults were chosen over (names starting with ``variant_``)."""
    variants = {
        "variant_4bit_dynamic": (FourBitTensor, {"first_moment": "dynamic"}),
        "variant_fp8_e4m3_sq": (Fp8Tensor, {"second_moment": "e4m3"}),
        "variant_fp8_e5m2_sq": (Fp8Tensor, {"second_moment": "e5m2"}),
    }
    for name, (base, attrs) in variants.items():
        if name not in torchao_optim.list_state_formats():
            cls_name = "".join(part.title() for part in name.split("_"))
            register_state_format(name)(type(cls_name, (base,), {**attrs, "__module__": __name__}))
    return list(variants)


def run(formats: Sequence[str], seeds: Sequence[int], compile: bool = False) -> dict[str, list[float]]:
    return {fmt: [parity_error(fmt, seed, compile) for seed in seeds] for fmt in formats}


def table(results: dict[str, list[float]]) -> str:
    lines = [
        "| state format | mean abs param error vs fp32 AdamW (per seed) | torchao 0.18 | lower |",
        "|---|---|---|---|",
    ]
    for fmt, errors in results.items():
        bar = TORCHAO.get(fmt)
        lower = "" if bar is None else ("yes" if max(errors) < bar else "**no**")
        lines.append(
            f"| {fmt} | {', '.join(f'{e:.3e}' for e in errors)} | {'' if bar is None else f'{bar:.1e}'} | {lower} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default=None, help="comma-separated state formats (default: every registered one)")
    parser.add_argument("--variants", action="store_true", help="also the alternatives the defaults beat")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    parser.add_argument("--compile", action="store_true", help="the compiled step (default: eager, same codes)")
    args = parser.parse_args(argv)
    formats = args.formats.split(",") if args.formats else torchao_optim.list_state_formats()
    if args.variants:
        formats = formats + register_variants()
    print(table(run(formats, [int(s) for s in args.seeds.split(",")], args.compile)))


if __name__ == "__main__":
    main()
