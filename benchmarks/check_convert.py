"""Does a checkpoint converted from bitsandbytes or torchao train on as the source library would train it?

For each source optimizer that imports (bitsandbytes' AdamW8bit; torchao's AdamW8bit, AdamW4bit, AdamWFp8), a
small MLP trains ``--resume-at`` steps with the source library, whose ``state_dict`` goes through ``torch.save``
and ``torch.load``; then ``--steps`` more steps on the same batches, four ways:

- source:    the source library, from its checkpoint;
- converted: ours (the format of the same width), from ``convert_state_dict(checkpoint, source)``;
- fresh:     ours from no optimizer state at all (a resume that lost the moments): the control;
- back:      ours trains the first steps instead, its checkpoint is converted to the source's layout
             (``convert_state_dict(..., target=source)``), and the source library continues; compared with ours
             continuing.

The yardstick is how far the two libraries drift apart anyway: both train the same model on the same batches from
step 0 for all ``resume_at + steps`` steps, and ``bound`` is the distance between their parameters (L2 over every
parameter). A conversion passes if ``converted`` and ``back`` end within ``bound`` of the library that continued
without converting, and closer to it than ``fresh``: a converted state must carry what a lost one does not. (For
the 8-bit and FP8 states ``fresh`` lies far outside ``bound``; our 4-bit format has another first-moment codebook
than torchao's, the two drift apart faster, and there only the comparison with ``fresh`` tells a lost state.) The
8-bit states convert with their very codes (no requantization), torchao's FP8 and 4-bit ones through one
requantization into our format; ``requant`` (info) is the source library continuing from its own checkpoint sent
to ours and back.

    PYTHONPATH=. python benchmarks/check_convert.py --device cuda --out $OUT

writes ``$OUT/check_convert.json`` and exits 1 if any conversion fails or any control cannot tell.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import torch

import torchao_optim

# source name -> (library, our optimizer of the same width, torchao_format)
SOURCES = {
    "bnb_adamw8bit": ("bitsandbytes", "AdamW8bit", None),
    "torchao_adamw8bit": ("torchao", "AdamW8bit", "8bit"),
    "torchao_adamw4bit": ("torchao", "AdamW4bit", "4bit"),
    "torchao_adamwfp8": ("torchao", "AdamWFp8", "fp8"),
}


def source_class(name: str):
    """The source library's optimizer class, or None where the library does not import."""
    try:
        if name == "bnb_adamw8bit":
            import bitsandbytes

            return bitsandbytes.optim.AdamW8bit
        from torchao import optim

        return {"torchao_adamw8bit": optim.AdamW8bit, "torchao_adamw4bit": optim.AdamW4bit}.get(name, optim.AdamWFp8)
    except Exception:  # not installed, or installed without what it needs on this machine
        return None


def available() -> list[str]:
    return [name for name in SOURCES if source_class(name) is not None]


def model(width: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    # two quantized weights, and biases small enough to keep plain state in every library
    net = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Tanh(), torch.nn.Linear(2 * width, width))
    return net.to(device)


def batch(step: int, width: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, width, generator=g)
    return x.to(device), torch.tanh(x.roll(1, dims=1)).to(device)


def train(net, opt, first: int, steps: int, width: int, device: str) -> None:
    for step in range(first, first + steps):
        x, y = batch(step, width, device)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def params(net) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in net.parameters()]).cpu()


def saved(state_dict):
    """``state_dict`` after ``torch.save`` and ``torch.load`` (what a resumed job reads)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def check(name: str, *, device: str, width: int, resume_at: int, steps: int, lr: float) -> dict:
    library, ours_name, fmt = SOURCES[name]
    source = source_class(name)
    ours = getattr(torchao_optim, ours_name)
    to_source = {} if fmt is None else dict(torchao_format=fmt)

    def new(cls, net):
        return cls(net.parameters(), lr=lr)

    def continued(cls, net, state_dict):
        opt = new(cls, net)
        if state_dict is not None:
            opt.load_state_dict(state_dict)
        train(net, opt, resume_at, steps, width, device)
        return params(net)

    start = model(width, device)
    opt = new(source, start)
    train(start, opt, 0, resume_at, width, device)
    checkpoint = saved(opt.state_dict())
    before = params(start)

    def copy_of(net):
        clone = model(width, device)
        clone.load_state_dict(net.state_dict())
        return clone

    by_source = continued(source, copy_of(start), saved(checkpoint))
    converted = continued(ours, copy_of(start), torchao_optim.convert_state_dict(saved(checkpoint), library))
    fresh = continued(ours, copy_of(start), None)
    # the source library from its own checkpoint after a round trip through ours
    ours_opt = new(ours, copy_of(start))
    ours_opt.load_state_dict(torchao_optim.convert_state_dict(saved(checkpoint), library))
    there_and_back = torchao_optim.convert_state_dict(ours_opt.state_dict(), "torchao_optim", library, **to_source)
    requant = continued(source, copy_of(start), there_and_back)

    # ours first, then the source library from our checkpoint
    ours_start = model(width, device)
    ours_first = new(ours, ours_start)
    train(ours_start, ours_first, 0, resume_at, width, device)
    ours_checkpoint = saved(ours_first.state_dict())
    by_ours = continued(ours, copy_of(ours_start), saved(ours_checkpoint))
    back = continued(
        source,
        copy_of(ours_start),
        torchao_optim.convert_state_dict(ours_checkpoint, "torchao_optim", library, **to_source),
    )

    # the yardstick: both libraries from step 0
    scratch = []
    for cls in (source, ours):
        net = model(width, device)
        train(net, new(cls, net), 0, resume_at + steps, width, device)
        scratch.append(params(net))

    def dist(a, b) -> float:
        return float((a - b).norm())

    out = dict(
        movement=dist(by_source, before),
        gap=dist(converted, by_source),
        back_gap=dist(back, by_ours),
        requant=dist(requant, by_source),
        fresh=dist(fresh, by_source),
        bound=dist(*scratch),
    )
    out["converts"] = out["gap"] <= out["bound"] and out["back_gap"] <= out["bound"]
    # a converted state must carry what a lost one does not: the source's trajectory, closer than a restart
    out["control_tells"] = out["fresh"] > max(out["gap"], out["back_gap"])
    return out


def versions() -> dict:
    found = {"torch": torch.__version__, "torchao_optim": torchao_optim.__version__}
    for module in ("bitsandbytes", "torchao"):
        try:
            found[module] = __import__(module).__version__
        except Exception as err:
            found[module] = f"not importable: {type(err).__name__}"
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--resume-at", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sources", nargs="*", default=None, help=f"of {list(SOURCES)} (default: all that import)")
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = parser.parse_args(argv)
    names = args.sources or available()
    results = {"versions": versions(), "device": args.device, "args": vars(args), "sources": {}}
    for name in names:
        if source_class(name) is None:
            results["sources"][name] = {"skipped": "the library does not import"}
            continue
        r = check(name, device=args.device, width=args.width, resume_at=args.resume_at, steps=args.steps, lr=args.lr)
        results["sources"][name] = r
        print(
            f"{name:18s} moved {r['movement']:.3e}  converted gap {r['gap']:.3e}  back gap {r['back_gap']:.3e}  "
            f"bound {r['bound']:.3e}  requant {r['requant']:.3e}  fresh {r['fresh']:.3e}  "
            f"{'ok' if r['converts'] and r['control_tells'] else 'FAIL'}",
            flush=True,
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check_convert.json").write_text(json.dumps(results, indent=2))
    checked = [r for r in results["sources"].values() if "skipped" not in r]
    if not checked:
        print("no source library imports: nothing was checked", file=sys.stderr)
        return 1
    return 0 if all(r["converts"] and r["control_tells"] for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
