"""Parity of each update rule with bitsandbytes' 8-bit optimizer: how far do ours and bitsandbytes' drift from the
full-precision optimizer on the same gradients?

The case is ``benchmark_parity.py``'s (two parameters of shapes (256, 512) and (1024, 256), gradients standard normal
times ``1e-2 * (1 + t % 3)``), run for ``--steps`` steps (default 100: Adagrad's and RMSprop's second moments keep
accumulating). Per rule, three optimizers over the same initial parameters and gradients: torch's (fp32 state, the
reference), ours with 8-bit state (its default format: ``dtq8``, Adagrad's ``fp8``; on the fused step where it
runs) and bitsandbytes' 8-bit one. The error
is the mean |p - p_ref| over all elements; the ratio is ours over bitsandbytes' (the target: at most 1.5).

Settings bitsandbytes supports for each: Adagrad with ``lr_decay=0`` and no initial accumulator, RMSprop without
momentum and not centered (its 8-bit RMSprop has neither), SGD with momentum 0.9, Lion, AdamW, AdEMAMix. Lion and
AdEMAMix have no torch.optim class: ours with fp32 state is their reference.

    python benchmarks/rule_parity.py --seeds 0,1,2           # needs bitsandbytes (it runs on the CPU too)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # the checkout this script belongs to, whatever else is installed
from benchmark_parity import drift  # noqa: E402

import torchao_optim  # noqa: E402

# rule: (lr, options both take, torch's class, ours, bitsandbytes' class name)
RULES = {
    "adagrad": (1e-2, {}, torch.optim.Adagrad, torchao_optim.Adagrad8bit, "Adagrad8bit"),
    "rmsprop": (1e-3, {}, torch.optim.RMSprop, torchao_optim.RMSprop8bit, "RMSprop8bit"),
    "sgd": (1e-2, {"momentum": 0.9}, torch.optim.SGD, torchao_optim.SGD8bit, "SGD8bit"),
    "lion": (1e-4, {}, None, torchao_optim.Lion8bit, "Lion8bit"),
    "adamw": (1e-3, {"weight_decay": 1e-2}, torch.optim.AdamW, torchao_optim.AdamW8bit, "AdamW8bit"),
    # three states, fused (the C step, the Triton kernel's three-state form); a parameter they leave steps eagerly (the
    # compiled step stores the same codes, and compiling takes about a minute on a CPU)
    "ademamix": (1e-3, {}, None, functools.partial(torchao_optim.AdEMAMix8bit, compile=False), "AdEMAMix8bit"),
}


def errors(rule: str, seed: int, steps: int) -> dict[str, float]:
    """``{"ours": ..., "bitsandbytes": ...}``: each one's mean drift from the full-precision optimizer."""
    lr, options, torch_cls, ours_cls, bnb_name = RULES[rule]
    if torch_cls is None:  # no torch.optim class: ours with fp32 state is the reference
        reference = lambda ps: ours_cls(ps, lr=lr, state_format="none", **options)  # noqa: E731
    else:
        reference = lambda ps: torch_cls(ps, lr=lr, foreach=False, **options)  # noqa: E731
    bnb_cls = getattr(importlib.import_module("bitsandbytes.optim"), bnb_name)
    return {
        "ours": drift(lambda ps: ours_cls(ps, lr=lr, **options), reference, seed, steps),
        "bitsandbytes": drift(lambda ps: bnb_cls(ps, lr=lr, **options), reference, seed, steps),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rules", default=",".join(RULES), help=f"comma-separated, of {', '.join(RULES)}")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    rules = args.rules.split(",")
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        parser.error(f"unknown rules {unknown}; known: {', '.join(RULES)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"torch {torch.__version__}; {args.steps} steps; seeds {seeds}; mean |p - p_ref| over all elements")
    print("| rule | ours (8-bit) | bitsandbytes 8-bit | ours / bitsandbytes, mean (per seed) |")
    print("|---|---|---|---|")
    worst = 0.0
    for rule in rules:
        runs = [errors(rule, seed, args.steps) for seed in seeds]
        ours, bnb = [r["ours"] for r in runs], [r["bitsandbytes"] for r in runs]
        ratios = [o / b for o, b in zip(ours, bnb)]
        worst = max(worst, statistics.mean(ratios))
        print(
            f"| {rule} | {statistics.mean(ours):.3e} | {statistics.mean(bnb):.3e} | {statistics.mean(ratios):.2f} "
            f"({', '.join(f'{r:.2f}' for r in ratios)}) |"
        )
    print(f"largest mean ratio {worst:.2f} (target: at most 1.5)")
    return 0 if worst <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
