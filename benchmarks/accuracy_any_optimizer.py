"""Accuracy of quantized state in stock torch.optim optimizers: ``quantize_optimizer_state`` against fp32.

For each optimizer, three runs from the same parameters on the same gradients: the stock optimizer with fp32
state (the reference), the same optimizer after ``torchao_optim.quantize_optimizer_state`` (states requantized
once per step), and, for comparison, the same optimizer with its states replaced by quantized tensors by hand
(``--per-op``: what a user gets without ``quantize_optimizer_state``; every in-place op requantizes, and
only single-tensor steps work). For AdamW our own ``AdamW8bit`` is the yardstick. Prints the largest and mean
``|p - p_ref|`` after ``--steps`` steps, over parameters with quantized state. CPU, a few seconds:

    PYTHONPATH=. python benchmarks/accuracy_any_optimizer.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

try:
    import torchao_optim
except ImportError:  # not installed: use the checkout this script belongs to
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torchao_optim
from torchao_optim.testing import SpreadProblem

SHAPES = ((256, 256), (512, 96), (4096,))
OPTIMIZERS = {
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "Adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, **kw),
    "SGD momentum 0.9": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw),
    "SGD nesterov": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, **kw),
    "RMSprop": lambda ps, **kw: torch.optim.RMSprop(ps, lr=1e-3, **kw),
    "RMSprop centered momentum": lambda ps, **kw: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.9, **kw),
    "Adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=1e-2, **kw),
}


# the tests' training problem: gradients whose magnitudes spread over e^4 within a block
PROBLEM = SpreadProblem(SHAPES)


def params():
    return PROBLEM.params()


def grads(step):
    return PROBLEM.grads(step)


def train(opt, ps, steps, per_op_format=None):
    for k in range(steps):
        for p, g in zip(ps, grads(k)):
            p.grad = g.clone()
        opt.step()
        if per_op_format and k == 0:  # replace the fresh fp32 states by quantized ones, once
            fmt = torchao_optim.get_state_format(per_op_format)
            for p in ps:
                for key, v in opt.state[p].items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        signed = key not in torchao_optim.UNSIGNED_STATE_KEYS
                        opt.state[p][key] = fmt.from_float(v.clamp_min(0) if not signed else v, signed=signed)
    return ps


def error(ps, ref):
    err = torch.cat([(p.detach() - q.detach()).abs().reshape(-1) for p, q in zip(ps, ref)])
    return err.max().item(), err.mean().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--format", default="dtq8")
    args = ap.parse_args(argv)
    print(f"|p - p_ref| after {args.steps} steps, shapes {SHAPES}, format {args.format} (max / mean)")
    print("| optimizer | quantize_optimizer_state | foreach=True | per-op requantization | AdamW8bit |")
    print("|---|---|---|---|---|")
    for name, make in OPTIMIZERS.items():
        ps = params()
        ref = train(make(ps, foreach=False), ps, args.steps)
        row = [name]
        for foreach in (False, True):
            opt = torchao_optim.quantize_optimizer_state(
                make(ps := params(), foreach=foreach), args.format, min_quant_size=4096
            )
            row.append("{:.2e} / {:.2e}".format(*error(train(opt, ps, args.steps), ref)))
        ps = params()
        row.append("{:.2e} / {:.2e}".format(*error(train(make(ps, foreach=False), ps, args.steps, args.format), ref)))
        if name == "AdamW":
            ps = params()
            ours = torchao_optim.AdamW(
                ps, lr=1e-2, weight_decay=0.1, state_format=args.format, compile=False, fused=False
            )
            row.append("{:.2e} / {:.2e}".format(*error(train(ours, ps, args.steps), ref)))
        else:
            row.append("")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
