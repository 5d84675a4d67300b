"""Bit-for-bit comparison of two source trees: the same optimizer steps, hashed, to compare across trees.

Runs every optimizer (AdamW, Adam, SGD8bit, Lion8bit, Muon8bit) in every built-in state format, on the CPU's
executors (the fused C step and the per-parameter path run eagerly), in fp32 and bf16 (bf16 with stochastic
rounding), for a few steps of gradients whose magnitudes spread over e^4 within each block, one of them with
non-finite values. Each case's parameters and state tensors (a quantized state's inner tensors) are hashed.

    PYTHONPATH=<tree> python benchmarks/bits_ab.py --out a.json      # once per tree
    python benchmarks/bits_ab.py --compare a.json b.json              # exits 1 on any difference

A refactor that must not change behaviour gives the same hashes on both trees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

SHAPES = [(256, 64), (1000,), (33, 7), (4, 300)]
FORMATS = ["none", "dtq8", "4bit", "fp8", "4bit_rank1"]
OPTIMIZERS = ["AdamW", "Adam", "SGD8bit", "Lion8bit", "Muon8bit"]
EXECUTORS = {"fused": {"fused": None}, "eager": {"fused": False, "compile": False}}
STEPS = 5


def _tensors(value):
    """The plain tensors behind ``value``: itself, or a tensor subclass's inner tensors, by name."""
    if type(value) is torch.Tensor:
        return {"": value}
    if hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return {name: getattr(value, name) for name in names}
    return {"": torch.as_tensor(value)}


def _digest(params, opt) -> str:
    h = hashlib.sha256()
    for i, p in enumerate(params):
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for key in sorted(opt.state[p]):
            for name, t in sorted(_tensors(opt.state[p][key]).items()):
                h.update(f"{i}/{key}/{name}".encode())
                h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _make(name: str, params, fmt: str, kwargs: dict):
    import torchao_optim

    cls = getattr(torchao_optim, name)
    extra = {"lr": 1e-2}
    if name == "SGD8bit":
        extra.update(momentum=0.9, weight_decay=1e-2)
    elif name == "Lion8bit":
        extra.update(lr=1e-3, weight_decay=1e-2)
    elif name in ("AdamW", "Adam"):
        extra.update(weight_decay=1e-2)
    return cls(params, state_format=fmt, min_quant_size=0, **extra, **kwargs)


def run_case(name: str, fmt: str, executor: str, dtype: torch.dtype) -> str:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    kwargs = dict(EXECUTORS[executor])
    if dtype == torch.bfloat16:
        kwargs["bf16_stochastic_round"] = True
    opt = _make(name, params, fmt, kwargs)
    scales = [torch.exp(torch.empty(s).uniform_(-3.0, 1.0, generator=gen)) for s in SHAPES]
    for step in range(STEPS):
        for p, scale in zip(params, scales):
            g = torch.randn(p.shape, generator=gen) * scale
            if step == 2 and p.dim() == 1:
                g[3], g[500] = float("nan"), float("inf")
            p.grad = g.to(dtype)
        opt.step()
    return _digest(params, opt)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the hashes of this tree's cases to this JSON file")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files")
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
        only = sorted(a.keys() ^ b.keys())
        print(f"{len(a.keys() & b.keys())} cases in both, {len(differ)} differ, {len(only)} in one only")
        for k in differ:
            print("differs:", k)
        for k in only:
            print("in one only:", k)
        return 1 if differ else 0
    torch.manual_seed(0)
    results = {}
    for name in OPTIMIZERS:
        for fmt in FORMATS:
            for executor in EXECUTORS:
                for dtype in (torch.float32, torch.bfloat16):
                    case = f"{name}/{fmt}/{executor}/{str(dtype).split('.')[-1]}"
                    try:
                        results[case] = run_case(name, fmt, executor, dtype)
                    except Exception as err:  # noqa: BLE001 - a refused case is recorded as such, on both trees
                        results[case] = f"error: {type(err).__name__}: {str(err)[:200]}"
                    print(case, results[case][:16], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
