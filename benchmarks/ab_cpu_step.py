"""The fused C step of another revision against this tree's, timed in one process, step by step in turn.

A CPU VM's speed moves by 10-50% from one run to the next (its neighbours, its clocks), more than most changes to
the C step: two runs of ``benchmark_step.py`` cannot tell them apart. Here one optimizer's steps alternate between
the two builds on the same parameters and states, so both see the same machine; each build's minimum and median
are printed, and their ratio. Only the C library differs: the optimizer, its plans and the Python around the launch
are this tree's (the revision's library must take the same arguments and hold the same built-in rules, in the same
order: checked).

    python benchmarks/ab_cpu_step.py --before HEAD~1 --optims AdamW8bit,AdEMAMix8bit [--threads 1] [--steps 16]

``--before`` is any revision git knows; its ``torchao_optim`` is extracted to a temporary folder and its C step
built there, with this machine's compiler and flags (``$TORCHAO_OPTIM_CFLAGS`` included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optimizers  # noqa: E402
from benchmark_step import GEOMETRIES, draw_params  # noqa: E402

import torchao_optim.optim.launch as launch  # noqa: E402
from torchao_optim.kernels import cpu  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BUILD = "import torchao_optim.kernels.cpu as c; print(c._build(c._compiler(), c.step_source(c.BUILT_IN)))"


def build_revision(revision: str, folder: str) -> Path:
    """The built C step of ``revision``'s package (its built-in rules), under ``folder``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "torchao_optim"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    env = dict(os.environ, PYTHONPATH=folder, TORCHAO_OPTIM_CACHE_DIR=os.path.join(folder, "cache"))
    out = subprocess.run([sys.executable, "-c", BUILD], cwd=folder, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the C step of {revision} could not be built:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def timed_pairs(optimizer, libraries: dict, steps: int, warmup: int = 2) -> dict[str, list[float]]:
    """``steps`` steps of ``optimizer`` on each library in turn (the first ``warmup`` rounds not kept): ms each."""
    own = launch.cpu_rule
    times: dict[str, list[float]] = {name: [] for name in libraries}
    try:
        for round_ in range(warmup + steps):
            for name, library in libraries.items():
                launch.cpu_rule = lambda rule, library=library: (library, own(rule)[1])
                start = time.perf_counter()
                optimizer.step()
                if round_ >= warmup:
                    times[name].append(1e3 * (time.perf_counter() - start))
    finally:
        launch.cpu_rule = own
    return times


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the revision to compare with (e.g. HEAD~1, main)")
    parser.add_argument("--optims", default="AdamW8bit", help="comma list of benchmarks/optimizers.py names")
    parser.add_argument("--geometry", default="gpt25m", choices=sorted(GEOMETRIES))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=16, help="steps of each build")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    after = cpu.cpu_kernels()
    if after is None:
        raise SystemExit(f"the C step could not be built here: {cpu.cpu_kernels_status()}")
    with tempfile.TemporaryDirectory() as folder:
        before = cpu.open_library(build_revision(args.before, folder))
        if cpu._rule_table(before) != cpu._rule_table(after):
            raise SystemExit(f"{args.before}'s C step holds other built-in rules: {cpu._rule_table(before)}")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        print(f"# {args.geometry}, {args.dtype} parameters, {args.threads} threads, torch {torch.__version__}")
        rev = args.before
        print(f"| optimizer | {rev}: min ms | median | this tree: min ms | median | min, this / {rev} |")
        print("|---|---|---|---|---|---|")
        rows = []
        for name in args.optims.split(","):
            params = draw_params(GEOMETRIES[args.geometry](), dtype, "cpu")
            optimizer = optimizers.build(name, params, weight_decay=0.01, compile=False)
            times = timed_pairs(optimizer, {"before": before, "after": after}, args.steps)
            b, a = times["before"], times["after"]
            rows.append(dict(optimizer=name, before=b, after=a))
            print(
                f"| {name} | {min(b):.2f} | {statistics.median(b):.2f} | {min(a):.2f} | {statistics.median(a):.2f} "
                f"| {min(a) / min(b):.2f} |"
            )
    return rows


if __name__ == "__main__":
    main()
