"""How far each low-bit state's AdamW update is from fp32 AdamW's, measured along one fp32 AdamW training run.

A language-model run of benchmark_convergence.py (same presets, corpus, schedule and batches) trains with torch's
fp32 AdamW. Beside it, every candidate optimizer keeps its own state over a *shadow* copy of the parameters: at each
step the shadow is reset to the reference's parameters, given the same gradients, and stepped. So each candidate's
state evolves by its own recursion (its rounding errors accumulate as they would in training), while every candidate
sees the same trajectory, and one run compares them all for the cost of their optimizer steps. Every
``--every`` steps it records, for each candidate and each parameter, with ``u`` the reference's update and ``q``
the candidate's (both ``p_after - p_before``, weight decay included):

- ``gain`` = ``<q, u> / <u, u>``: how far the candidate moves along the reference's step (1: as far; 0.8: it
  learns as if its learning rate were 20% lower along that direction);
- ``cos``: the cosine between ``q`` and ``u``;
- ``m_err`` and ``v_err``: the relative L2 error of the candidate's dequantized ``exp_avg`` and of
  ``sqrt(exp_avg_sq)`` against the reference's state (where the candidate's state is a torchao_optim one);
- ``v_bias``: the mean of ``log(sqrt(v_q) / sqrt(v))`` over elements where the reference's ``v`` is nonzero:
  above 0 the candidate overestimates the denominator, and shrinks its steps.

The totals over all parameters (sums of the inner products) go to the table, per step and averaged; the
parameters furthest from the reference at the last record (lowest ``gain``) are listed per candidate, which is
where a curve departs. A candidate that is the reference itself (``AdamW``) reads gain 1 and cos 1 (a check).

    python benchmarks/state_error.py --model_size gpt350m --steps 300 --device cuda \\
        --formats_from benchmarks/fourbit_variants.py --optims AdamW4bit,AdamW-4bit_bal,AdamW-4bit_vsq

Writes ``--out``/state_error.json (every record) and prints the table. The schedule is the preset's full one
(``--steps`` only cuts the run short), so the first steps of a run are measured at their true learning rates.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchmark_convergence as bc  # noqa: E402
import optimizers  # noqa: E402

from torchao_optim.state import QuantizedState  # noqa: E402

REFERENCE = "AdamW"


def _dense(t) -> torch.Tensor | None:
    """A state tensor's values in fp32: ours and torchao's subclasses dequantized, plain float tensors as they are;
    anything else (codes without their scales, such as bitsandbytes' ``state1``) is not compared."""
    if isinstance(t, QuantizedState):
        return t.dequantize(torch.float32)
    if not isinstance(t, torch.Tensor):
        return None
    if type(t) is not torch.Tensor:
        return t.dequantize().float() if callable(getattr(t, "dequantize", None)) else None
    return t.float() if t.is_floating_point() else None


class Shadow:
    """A candidate optimizer over a copy of the reference model's parameters."""

    def __init__(self, name: str, model: torch.nn.Module, args):
        self.name = name
        self.model = copy.deepcopy(model)
        self.pairs = list(zip(model.parameters(), self.model.parameters()))
        self.optimizer = optimizers.build(
            name,
            self.model.param_groups(args.weight_decay),
            lr=args.lr,
            weight_decay=0.0,
            betas=(args.beta1, args.beta2),
            eps=args.eps,
            compile=True,
        )
        self.seconds = 0.0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        start = time.perf_counter()
        for p, s in self.pairs:
            s.copy_(p)
            s.grad = p.grad
        optimizers.set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.seconds += time.perf_counter() - start

    def state_of(self, s: torch.nn.Parameter) -> dict:
        return self.optimizer.state.get(s, {})


@torch.no_grad()
def compare(shadow: Shadow, before: list[torch.Tensor], reference: torch.optim.Optimizer, names: list[str]) -> dict:
    """This step's per-parameter and total measures of ``shadow`` against the reference (see the module doc)."""
    per = {}
    tot = {}
    for name, (p, s), p0 in zip(names, shadow.pairs, before):
        u = (p.float() - p0).double()
        q = (s.float() - p0).double()
        uq, uu, qq = (u * q).sum().item(), (u * u).sum().item(), (q * q).sum().item()
        l1, u1 = (q - u).abs().sum().item(), u.abs().sum().item()
        for k, v in zip(("uq", "uu", "qq", "l1", "u1"), (uq, uu, qq, l1, u1)):
            tot[k] = tot.get(k, 0.0) + v
        rec = {
            "gain": uq / uu if uu > 0 else None,
            "cos": uq / math.sqrt(uu * qq) if uu > 0 and qq > 0 else None,
            "err": math.sqrt(max(uu - 2 * uq + qq, 0.0) / uu) if uu > 0 else None,
            "l1": l1 / u1 if u1 > 0 else None,
        }
        ref_state, state = reference.state.get(p, {}), shadow.state_of(s)
        m_ref, v_ref = ref_state.get("exp_avg"), ref_state.get("exp_avg_sq")
        m_q, v_q = _dense(state.get("exp_avg")), _dense(state.get("exp_avg_sq"))
        if m_ref is not None and m_q is not None:
            rec["m_err"] = ((m_q - m_ref).norm() / m_ref.norm().clamp_min(1e-30)).item()
            if v_ref is not None:  # elements the reference moves by a tenth of a unit step or more, that stand still
                moving = m_ref.abs() > 0.1 * (v_ref.sqrt() + 1e-8)
                rec["dead"] = ((m_q == 0) & moving).float().mean().item()
        if v_ref is not None and v_q is not None:
            r_ref, r_q = v_ref.sqrt(), v_q.clamp_min(0).sqrt()
            rec["v_err"] = ((r_q - r_ref).norm() / r_ref.norm().clamp_min(1e-30)).item()
            live = (v_ref > 0) & (v_q > 0)
            if live.any():
                log_ratio = r_q[live].log() - r_ref[live].log()
                rec["v_bias"] = log_ratio.mean().item()
                # elements whose denominator is off by more than 2x: their steps are over 2x too long (v_lo) or
                # under half as long (v_hi) as the reference's
                rec["v_lo"] = (log_ratio < -math.log(2)).float().mean().item()
                rec["v_hi"] = (log_ratio > math.log(2)).float().mean().item()
        per[name] = rec
    uu, uq, qq = tot["uu"], tot["uq"], tot["qq"]
    total = {
        "l1": tot["l1"] / tot["u1"] if tot["u1"] > 0 else None,
        "gain": uq / uu if uu > 0 else None,
        "cos": uq / math.sqrt(uu * qq) if uu > 0 and qq > 0 else None,
        "err": math.sqrt(max(uu - 2 * uq + qq, 0.0) / uu) if uu > 0 else None,
    }
    for key in ("m_err", "dead", "v_err", "v_bias", "v_lo", "v_hi"):  # weighted by the parameters' sizes
        pairs = [(r[key], p.numel()) for r, (p, _) in zip(per.values(), shadow.pairs) if r.get(key) is not None]
        if pairs:
            total[key] = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
    return {"total": total, "params": per}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every other flag is benchmark_convergence.py's (--model_size, --device, --optims, --seeds (the first "
        "is used), --formats_from, --skip_missing, --batch_size, --lr, ...), with its defaults; --steps there is the "
        "schedule's length.",
    )
    ap.add_argument("--stop_at", type=int, default=None, help="stop after this many steps (default: all)")
    ap.add_argument("--every", type=int, default=10, help="record every this many steps")
    ap.add_argument("--worst", type=int, default=5, help="parameters listed per candidate at the last record")
    ap.add_argument("--out", default="results/state_error")
    return ap


def main(argv=None) -> dict:
    ours, rest = build_parser().parse_known_args(argv)
    args = bc.parse_args(rest + ["--out", ours.out])
    stop_at = min(ours.stop_at or args.steps, args.steps)
    seed = args.seeds[0]
    candidates, skipped = args.optims, [name for name, _ in args.skipped_optims]
    corpus = bc.load_stdlib_corpus(packages=tuple(args.corpus_packages))
    cfg = bc.PRESETS[args.model_size].model
    torch.manual_seed(seed)
    model = bc.GPT(cfg).to(args.device)  # as train_one: built on the CPU from the seed
    names = [n for n, _ in model.named_parameters()]
    reference = optimizers.build(
        REFERENCE, model.param_groups(args.weight_decay), lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps
    )
    shadows = [Shadow(n, model, args) for n in candidates]
    gen = torch.Generator().manual_seed(seed)  # the batches of benchmark_convergence.py's run of this seed
    records = {n: [] for n in candidates}
    losses = []
    print(
        f"{args.model_size}: {model.num_params() / 1e6:.1f}M parameters, {stop_at} of {args.steps} steps, "
        f"batch {args.batch_size} x {args.seq_len}, lr {args.lr}, on {args.device}; candidates {candidates}"
        + (f"; skipped (package missing) {skipped}" if skipped else ""),
        flush=True,
    )
    start = time.perf_counter()
    for step in range(stop_at):
        lr = optimizers.lr_at(step, args.lr, args.warmup, args.steps)
        x, y = corpus.train_batch(args.batch_size, args.seq_len, gen)
        x, y = x.to(args.device), y.to(args.device)
        loss = bc.loss_of(model, x, y, args.amp)
        loss.backward()
        record = (step + 1) % ours.every == 0 or step + 1 == stop_at
        before = [p.detach().float().clone() for p in model.parameters()] if record else None
        for shadow in shadows:
            shadow.step(lr)
        optimizers.set_lr(reference, lr)
        reference.step()
        if record:
            for shadow in shadows:
                if records[shadow.name]:  # per-parameter measures are kept for the last record only
                    records[shadow.name][-1].pop("params")
                records[shadow.name].append({"step": step + 1, **compare(shadow, before, reference, names)})
        reference.zero_grad(set_to_none=True)
        for shadow in shadows:
            for _, s in shadow.pairs:
                s.grad = None
        losses.append(loss.item())
        if record:
            gains = " ".join(f"{n} {_f(records[n][-1]['total']['gain'])}" for n in candidates)
            print(
                f"step {step + 1} loss {losses[-1]:.3f}; gain: {gains} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )

    result = {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "skipped_optims"},
            "stop_at": stop_at,
            "every": ours.every,
            "model": cfg.to_dict(),
            "n_params": model.num_params(),
        },
        "environment": bc.environment(args.device),
        "train_loss": losses,
        "candidates": candidates,
        "skipped": skipped,
        "optimizer_seconds": {s.name: s.seconds for s in shadows},
        "records": records,
    }
    out = Path(ours.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "state_error.json").write_text(json.dumps(result, indent=1))
    print(table(result, ours.worst))
    return result


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x, digits=3):
    return "—" if x is None else f"{x:.{digits}f}"


def table(result: dict, worst: int = 5) -> str:
    """Markdown: each candidate's totals averaged over the records (and at the last one), then its worst
    parameters at the last record."""
    columns = ("gain", "cos", "err", "l1", "m_err", "dead", "v_err", "v_bias", "v_lo", "v_hi")
    percent = {"dead", "v_lo", "v_hi"}  # shown in %
    header = ["optimizer", "gain (last)"] + [f"{c} %" if c in percent else c for c in columns] + ["opt. s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in result["candidates"]:
        tot = [r["total"] for r in result["records"][name]]
        cells = [name, _f(tot[-1]["gain"])]
        for c in columns:
            m = _mean(t.get(c) for t in tot)
            cells.append(_f(None if m is None else m * (100 if c in percent else 1), 2 if c in percent else 3))
        cells.append(f"{result['optimizer_seconds'][name]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    for name in result["candidates"]:
        last = result["records"][name][-1]
        params = sorted(
            ((p, r) for p, r in last["params"].items() if r["gain"] is not None), key=lambda pr: pr[1]["gain"]
        )[:worst]
        lines.append(
            f"\n{name}, lowest gain at step {last['step']}: "
            + "; ".join(f"{p} gain {_f(r['gain'])} cos {_f(r['cos'])} v_bias {_f(r.get('v_bias'))}" for p, r in params)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
