"""Tune and inspect the fused Adam kernel on CUDA: step time for each (ITERS, PREFETCH, num_warps, register cap,
TAIL_TILES_PER_SM, PDL, FLAT_MAX_BITS, FOLD_ROWS), registers and spills.

    python benchmarks/tune_fused.py --geometry llama_1b --dtype fp32 --iters 1,4,8 --prefetch 0,1 --warps 2,4
    python benchmarks/tune_fused.py --geometry vit_b --dtype bf16 --iters 8 --prefetch 1 --warps 1 --tail 0,32,64
    python benchmarks/tune_fused.py --state-format factored --iters 8 --prefetch 1 --warps 1 --fold-rows 0,8,32
    python benchmarks/tune_fused.py --optim RMSpropCentered8bit --dtype bf16 --iters 8 --prefetch 1 --warps 1 \
        --maxnreg 0,112,128

``--optim`` names any fused optimizer of ``benchmarks/optimizers.py`` (default: torchao_optim.AdamW with
``--state-format``)."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_step import GEOMETRIES, copy_bandwidth, draw_params, floor_bytes, step_times, warm_up  # noqa: E402
from optimizers import build, state_nbytes  # noqa: E402

import torchao_optim  # noqa: E402
import torchao_optim.kernels.tables as tables  # noqa: E402
import torchao_optim.kernels.triton_rank1 as triton_rank1  # noqa: E402
import torchao_optim.optim.fused as fused  # noqa: E402


class Settings(NamedTuple):
    """One point of the grid: the module settings a timed step runs under (strings where "auto" is allowed)."""

    iters: int
    prefetch: bool
    warps: int
    maxnreg: str
    tail: int
    pdl: int
    flat_bits: int
    fold_rows: int
    stats_strip: str
    stats_rows: str
    stats_maxnreg: str
    stats_grouped: str


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="llama_1b")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--state-format", default="dtq8")
    ap.add_argument("--optim", default=None, help="an optimizer of benchmarks/optimizers.py instead of AdamW")
    ap.add_argument("--iters", default="1,4,8,16")
    ap.add_argument("--prefetch", default="0,1")
    ap.add_argument("--warps", default="2,4")
    ap.add_argument(
        "--maxnreg",
        default="auto",
        help="register caps to try (auto: optim.fused.REGISTER_CAPS'; 0: none, the compiler's choice)",
    )
    ap.add_argument(
        "--tail",
        default=str(fused.TAIL_TILES_PER_SM),
        help="tiles per SM at the end of a plan that go one per program (optim.fused.TAIL_TILES_PER_SM)",
    )
    ap.add_argument("--pdl", default="1", help="programmatic dependent launch of the update kernels (optim.fused.PDL)")
    ap.add_argument(
        "--flat-bits",
        default=str(tables.FLAT_MAX_BITS),
        help="the one-load encoder for codebooks needing at most this many mantissa bits per exponent "
        "(kernels.tables.FLAT_MAX_BITS; 0: two loads always, 7: dtq8 too)",
    )
    ap.add_argument(
        "--fold-rows",
        default=str(fused.FOLD_ROWS),
        help="factored states: rows per program of the step that takes their sums (optim.fused.FOLD_ROWS; 0: a first "
        "pass takes them)",
    )
    ap.add_argument(
        "--stats-strip",
        default="auto",
        help="scales over a matrix: tiles a program of the first pass walks down a column of tiles, every kind "
        "(auto: kernels.triton_rank1.STATS_TILES' own)",
    )
    ap.add_argument(
        "--stats-rows",
        default="auto",
        help="scales over a matrix: rows of a first-pass tile, every kind (auto: kernels.triton_rank1.STATS_TILES' "
        "own; rank-1 aligned rows are read one at a time, the loop unrolled this many times)",
    )
    ap.add_argument(
        "--stats-maxnreg",
        default="auto",
        help="scales over a matrix: the first pass's register cap (auto: STATS_TILES' own; 0: none)",
    )
    ap.add_argument(
        "--stats-grouped",
        default="auto",
        help="scales over a matrix: 1, each first-pass tile's rows' loads written before their updates; 0, the "
        "compiler's order (auto: STATS_TILES' own)",
    )
    ap.add_argument("--steps", type=int, default=30)
    return ap.parse_args(argv)


def grid(args: argparse.Namespace) -> list[Settings]:
    """Every combination of the listed values, the first option's slowest."""

    def ints(text):
        return [int(x) for x in text.split(",")]

    return [
        Settings(*point)
        for point in itertools.product(
            ints(args.iters),
            [bool(x) for x in ints(args.prefetch)],
            ints(args.warps),
            args.maxnreg.split(","),
            ints(args.tail),
            ints(args.pdl),
            ints(args.flat_bits),
            ints(args.fold_rows),
            args.stats_strip.split(","),
            args.stats_rows.split(","),
            args.stats_maxnreg.split(","),
            args.stats_grouped.split(","),
        )
    ]


def apply(settings: Settings, tiles: dict) -> None:
    """Set the kernels' module settings for one timed run; ``tiles``: ``triton_rank1.STATS_TILES`` as it was before
    any run (each "auto" keeps its value)."""

    def pick(text, default, convert=int):
        return default if text == "auto" else convert(text)

    triton_rank1.STATS_TILES = {
        kind: tile._replace(
            strip=pick(settings.stats_strip, tile.strip),
            rows=pick(settings.stats_rows, tile.rows),
            maxnreg=pick(settings.stats_maxnreg, tile.maxnreg, lambda x: int(x) or None),
            grouped=pick(settings.stats_grouped, tile.grouped, lambda x: bool(int(x))),
        )
        for kind, tile in tiles.items()
    }
    fused.ITERS, fused.PREFETCH, fused.NUM_WARPS = settings.iters, settings.prefetch, settings.warps
    fused.TAIL_TILES_PER_SM, fused.FOLD_ROWS = settings.tail, settings.fold_rows
    fused.PDL, tables.FLAT_MAX_BITS = bool(settings.pdl), settings.flat_bits
    fused.MAXNREG = pick(settings.maxnreg, None)


def main():
    args = parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    params = draw_params(GEOMETRIES[args.geometry](), dtype, "cuda")
    n_params = sum(p.numel() for p in params)
    bandwidth = copy_bandwidth("cuda")
    floor = None
    tiles = dict(triton_rank1.STATS_TILES)
    for settings in grid(args):
        apply(settings, tiles)
        if args.optim:
            opt = build(args.optim, params)
        else:
            opt = torchao_optim.AdamW(params, state_format=args.state_format, fused=True)
        warm_up(opt.step)  # as benchmark_step.py: the clocks rise under load
        if floor is None:  # the format's own bytes moved, over the copy bandwidth
            floor = floor_bytes(n_params, dtype.itemsize, state_nbytes(opt)) / bandwidth * 1e3
            print(f"# {args.geometry} {args.dtype} {args.optim or args.state_format}: floor {floor:.3f} ms")
            print(
                "| iters | prefetch | warps | maxnreg | tail | pdl | flat | fold rows | pass strip | pass rows "
                "| pass maxnreg | pass grouped | step ms | x floor | host ms | regs | spills |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        times = step_times(opt.step, "cuda", args.steps)  # the device's time (host ahead), and the host's
        ms, host_ms = times["device"], times["host"]
        plans = next(iter(opt._plans.values()))["plans"]
        big = max(plans, key=lambda pl: pl.n_programs)
        regs, spills = getattr(big.compiled, "n_regs", "?"), getattr(big.compiled, "n_spills", "?")
        pass_tile = big.stats_tile_shape if big.rank1 is not None and not big.fold_sums else None
        strip, rows, cap, grouped = (
            (pass_tile.strip, pass_tile.rows, pass_tile.maxnreg or "-", int(pass_tile.grouped))
            if pass_tile
            else ("-",) * 4
        )
        print(
            f"| {settings.iters} | {int(settings.prefetch)} | {settings.warps} | {big.maxnreg or '-'} "
            f"| {settings.tail} | {settings.pdl} | {big.flat} | {settings.fold_rows if big.fold_sums else '-'} "
            f"| {strip} | {rows} | {cap} | {grouped} "
            f"| {ms:.3f} | {ms / floor:.2f} | {host_ms:.3f} | {regs} "
            f"| {spills} |"
        )
        del opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
