"""Optimizer-step benchmark: our formats against torch AdamW (fused, foreach), bitsandbytes and torchao.

For each parameter geometry and dtype it measures, for every optimizer in one run:
- the step time (median after warm-up: ``--warmup`` steps, then on a GPU ``WARM_S`` seconds of steps, the time an
  idle GPU's clocks take to rise; wall clock on a CPU). On a GPU, ``step ms`` is the time per step a training loop
  sustains: the larger of ``device ms``, CUDA events around the step queued behind a GPU spin that covers the
  host's part (as a training loop queues the step behind backward's kernels: the step's own time on the device,
  which the floor bounds), and ``host ms``, the call's wall time (a step whose host is slower is host-bound).
  ``alone ms`` is the step from an idle GPU, the host's time before its first kernel included: what one step
  costs with nothing queued before it,
- the first step (compile included; caches are cold unless --warm-cache),
- the step time when the learning rate changes every step (as a Python float, like a scheduler),
- optimizer-state bytes per parameter and the step's transient peak memory (CUDA),
(our steps on CUDA are replayed from a CUDA graph after their first steps unless ``--no-step-graphs``)
and prints each time's ratio to the bandwidth floor (bytes the step must move with that optimizer's own state
bytes / copy bandwidth measured in the same run) and to torch's fused AdamW. Writes ``step_<device>.json`` and a
bar chart, ``step_<device>.png``, under ``--out`` (default ``results/step``, relative to the working directory, as
the other benchmarks' ``results/<name>``; the repository ignores ``/results/``).

    python benchmarks/benchmark_step.py                          # GPU: vit_b and llama_1b, fp32 and bf16
    python benchmarks/benchmark_step.py --device cpu             # CPU: the 25.7M-param GPT geometry

Optimizer names are those of ``benchmarks/optimizers.py`` (``--optims AdamWTorchFused,AdamW-4bit,...``; the
older ``torch_fused``, ``ours_<format>``, ``ours_<format>_compiled``, ``bnb_8bit``, ``torchao_8bit`` still work).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizers  # noqa: E402  (the optimizer table every benchmark shares)

import torchao_optim  # noqa: E402

Shape = tuple[int, ...]


# ---- geometries ------------------------------------------------------------------------------------
def vit_b_shapes(num_classes: int = 45) -> list[Shape]:
    """timm's vit_base_patch16_224 with a 45-class head (resisc45): 85.8M params, 152 tensors."""
    d, mlp = 768, 3072
    shapes: list[Shape] = [(1, 1, d), (1, 197, d), (d, 3, 16, 16), (d,)]
    for _ in range(12):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (mlp, d), (mlp,), (d, mlp), (d,)]
    return shapes + [(d,), (d,), (num_classes, d), (num_classes,)]


def llama_1b_shapes() -> list[Shape]:
    """TinyLlama-1.1B: hidden 2048, 22 layers, intermediate 5632, kv dim 256, vocab 32000; 201 tensors."""
    h, inter, kv, vocab = 2048, 5632, 256, 32000
    shapes: list[Shape] = [(vocab, h)]
    for _ in range(22):
        shapes += [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return shapes + [(h,), (vocab, h)]


def gpt25m_shapes() -> list[Shape]:
    """A byte-level GPT: d=512, 8 layers, context 512, untied head; 25.74M params, 101 tensors."""
    d = 512
    shapes: list[Shape] = [(256, d), (512, d)]
    for _ in range(8):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,), (256, d)]


GEOMETRIES: dict[str, Callable[[], list[Shape]]] = {
    "vit_b": vit_b_shapes,
    "llama_1b": llama_1b_shapes,
    "gpt25m": gpt25m_shapes,
}


# ---- optimizers ------------------------------------------------------------------------------------
def default_optims(device: str) -> list[str]:
    """torch's fused and foreach AdamW, AdamW with every registered format (and its compiled path: every format on
    CUDA, dtq8's for reference on the CPU, where it is slow), and the peers that are installed (the reason is
    printed for the others)."""
    names = ["AdamWTorchFused", "AdamWTorchForeach"]
    for fmt in torchao_optim.list_state_formats():
        names.append(f"AdamW-{fmt}")
        if device == "cuda" or fmt == "dtq8":
            names.append(f"AdamWCompiled-{fmt}")
    for peer in ("AdamWBnb8bit", "AdamWTorchao8bit", "AdamWTorchao4bit", "AdamWTorchaoFp8"):
        missing = optimizers.missing_package(peer)
        if missing:
            print(f"[skip] {peer}: cannot import {missing[0]} (pip install {missing[1]})")
        else:
            names.append(peer)
    return names


def floor_bytes(n_params: int, param_bytes: int, state_bytes: int) -> int:
    """Bytes one step must move: param and grad read, param written, every state byte read and written. With
    the optimizer's own state bytes, so each format is measured against the floor of its own byte count
    (fp32 state: 28 bytes per fp32 parameter; 8-bit: about 16; 4-bit: about 14)."""
    return 3 * param_bytes * n_params + 2 * state_bytes


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy, counting bytes read and written."""
    n = (1 << 28) if device == "cuda" else (1 << 25)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = [optimizers.time_call(lambda: dst.copy_(src), device) for _ in range(10)]
    return 2 * 4 * n / statistics.median(times[2:])


WARM_S = 0.3  # seconds of steps before each optimizer's timed ones, on a GPU


def draw_params(shapes, dtype, device) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` (scale 0.02) with gradients (scale 1e-3), drawn where they live: a
    1.1B-parameter set in a second on a GPU, where drawing on the host and copying takes a minute."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=gen, device=device) * 0.02).to(dtype))
        p.grad = (torch.randn(s, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


def warm_up(step: Callable[[], None]) -> None:
    """``WARM_S`` seconds of ``step`` on the GPU: an idle GPU's clocks take that long to rise under load."""
    end = time.perf_counter() + WARM_S
    while time.perf_counter() < end:
        step()
        torch.cuda.synchronize()


def step_times(step: Callable[[], None], device: str, steps: int) -> dict[str, float]:
    """Medians over ``steps`` calls of ``step``, in ms: ``alone`` (CUDA events from an idle GPU, the host's time
    before the first kernel included), ``host`` (the call's wall time), ``device`` (events around the step queued
    behind a GPU spin that covers the host's time: the step's own time on the device) and ``step``, the larger of
    ``device`` and ``host``: the time per step a training loop sustains (host-bound where the host is slower).
    On a CPU all four are the wall time."""
    alone, host = zip(*(optimizers.timed(step, device) for _ in range(steps)))
    spin_s = 2 * max(host) + 2e-4
    on_gpu = str(device).startswith("cuda")
    device_s = [optimizers.timed(step, device, spin_s)[0] for _ in range(steps)] if on_gpu else alone
    out = dict(alone=statistics.median(alone), host=statistics.median(host), device=statistics.median(device_s))
    out["step"] = max(out["device"], out["host"])
    return {k: 1e3 * v for k, v in out.items()}


def bench_one(name, shapes, dtype, device, steps, warmup) -> dict:
    torch._dynamo.reset()
    params = draw_params(shapes, dtype, device)
    opt = optimizers.build(name, params)
    first = optimizers.wall_time(opt.step, device)
    for _ in range(warmup):
        opt.step()
    if device == "cuda":
        warm_up(opt.step)
    times = step_times(opt.step, device, steps)

    def step_new_lr(i=[0]):  # noqa: B006 - the counter of calls, kept between them
        i[0] += 1
        optimizers.set_lr(opt, 1e-3 * (1 + 1e-3 * (i[0] % 100)))  # noqa: F821 - called before `del opt` below
        opt.step()  # noqa: F821

    step_new_lr()
    out = dict(
        name=name,
        first_step_s=first,
        step_ms=times["step"],
        device_ms=times["device"],
        host_ms=times["host"],
        alone_ms=times["alone"],
        step_lr_change_ms=step_times(step_new_lr, device, steps)["step"],
        state_bytes=optimizers.state_nbytes(opt),
    )
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        out["transient_peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    del opt, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def set_inductor_options(options: list[str]) -> None:
    """Set inductor configs given as ``name=value`` (``value`` a Python literal; ``name`` dotted, as
    ``triton.autotune_pointwise``), for every compile in this process. The library passes its own
    ``torchao_optim.optim.compiled.COMPILE_OPTIONS`` to its compiles, and those win over the same names set here."""
    import ast

    import torch._inductor.config as config

    for option in options:
        name, sep, value = option.partition("=")
        *path, last = name.split(".")
        target = config
        for part in path:
            target = getattr(target, part, None)
        if not sep or not hasattr(target, last):
            raise SystemExit(f"--option {option!r}: expected name=value with an inductor config name")
        setattr(target, last, ast.literal_eval(value))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--geometries",
        default=None,
        help="comma list of " + ",".join(GEOMETRIES) + " (default: vit_b,llama_1b on cuda, gpt25m on cpu)",
    )
    ap.add_argument("--dtypes", default="fp32,bf16", help="parameter dtypes: fp32,bf16")
    ap.add_argument("--optims", default=None, help="comma list of names (default: all available)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 50 cuda, 10 cpu)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warm-cache", action="store_true", help="keep the compile caches (first step not cold)")
    ap.add_argument(
        "--out",
        default="results/step",
        help="directory for step_<device>.json and step_<device>.png (relative to the working directory). "
        "Default: %(default)s",
    )
    ap.add_argument(
        "--formats-from",
        default=None,
        help="a Python file that registers more state formats (e.g. test/made_up_formats.py): each is "
        "benchmarked like the built-in ones, with no other change",
    )
    ap.add_argument(
        "--no-step-graphs",
        action="store_true",
        help="issue every CUDA step from Python: no CUDA-graph replay (torchao_optim.optim.replay)",
    )
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        help="an inductor config to set first, as name=value (a Python literal), e.g. "
        "triton.autotune_pointwise=False; repeatable (the library's COMPILE_OPTIONS win over it)",
    )
    args = ap.parse_args(argv)
    with contextlib.nullcontext() if args.warm_cache else cold_caches():
        return run(args, argv)


@contextlib.contextmanager
def cold_caches():
    """Inductor and Triton compile into fresh, empty caches inside the block, so that a first step includes every
    compile (both read their cache folder from the environment when they compile); after it the caches are removed
    and the environment is as it was."""
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    root = tempfile.mkdtemp(prefix="bench_step_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    try:
        yield root
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


def run(args, argv=None):
    """The benchmark for ``main``'s parsed ``args`` (``argv``: the command line it came from, for the record)."""
    set_inductor_options(args.option)
    if args.no_step_graphs:
        from torchao_optim.optim import replay

        replay.ENABLED = False
    if args.formats_from:
        import runpy

        runpy.run_path(args.formats_from)

    device = args.device
    geometries = (args.geometries or ("vit_b,llama_1b" if device == "cuda" else "gpt25m")).split(",")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    steps = args.steps or (50 if device == "cuda" else 10)
    names = args.optims.split(",") if args.optims else default_optims(device)
    unknown = [n for n in names if optimizers.resolve(n) is None]
    if unknown:
        sys.exit(f"unknown optimizers: {unknown}; known: {', '.join(optimizers.names())}")
    for n in [n for n in names if optimizers.missing_package(n)]:  # asked for, but not installed: said, skipped
        print(
            f"[skip] {n}: cannot import {optimizers.missing_package(n)[0]} "
            f"(pip install {optimizers.missing_package(n)[1]})"
        )
        names.remove(n)
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    bandwidth = copy_bandwidth(device)
    env = dict(
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        date=time.strftime("%Y-%m-%d"),
        copy_bandwidth_gbs=bandwidth / 1e9,
        cpu_count=os.cpu_count(),
        command=" ".join(["python", "benchmarks/benchmark_step.py"] + (argv or sys.argv[1:])),
    )
    print(f"# {env['date']} torch {env['torch']} on {env['device']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = []
    for geo in geometries:
        shapes = GEOMETRIES[geo]()
        n_params = sum(torch.Size(s).numel() for s in shapes)
        for dname in args.dtypes.split(","):
            dtype = dtypes[dname]
            print(
                f"\n## {geo} ({n_params / 1e6:.1f}M params, {len(shapes)} tensors), {dname} params; the floor "
                f"of each optimizer is its own bytes moved (params, grads, its state) over the copy bandwidth"
            )
            rows = []
            for name in names:
                try:
                    r = bench_one(name, shapes, dtype, device, steps, args.warmup)
                except Exception as err:
                    print(f"[fail] {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                    continue
                floor_ms = floor_bytes(n_params, dtype.itemsize, r["state_bytes"]) / bandwidth * 1e3
                r.update(
                    geometry=geo,
                    dtype=dname,
                    n_params=n_params,
                    n_tensors=len(shapes),
                    floor_ms=floor_ms,
                    state_bytes_per_param=r["state_bytes"] / n_params,
                )
                rows.append(r)
            fused = next((r["step_ms"] for r in rows if optimizers.resolve(r["name"]) == "AdamWTorchFused"), None)
            print(
                "| optimizer | step ms | floor ms | x floor | x torch fused | lr-change ms | device ms | host ms | "
                "alone ms | first step s | state B/param |" + (" transient MB |" if device == "cuda" else "")
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if device == "cuda" else ""))
            for r in rows:
                r["x_floor"] = r["step_ms"] / r["floor_ms"]
                r["x_torch_fused"] = r["step_ms"] / fused if fused else None
                x_fused = "" if r["x_torch_fused"] is None else f"{r['x_torch_fused']:.2f}"
                print(
                    f"| {r['name']} | {r['step_ms']:.3f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} | {x_fused} | "
                    f"{r['step_lr_change_ms']:.3f} | {r['device_ms']:.3f} | {r['host_ms']:.3f} | "
                    f"{r['alone_ms']:.3f} | "
                    f"{r['first_step_s']:.1f} | "
                    f"{r['state_bytes_per_param']:.2f} |"
                    + (f" {r['transient_peak_mb']:.1f} |" if device == "cuda" else "")
                )
            results += rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"step_{device}.json"), "w") as fh:
        json.dump(dict(env=env, results=results), fh, indent=1)
    _plot(results, os.path.join(args.out, f"step_{device}.png"))
    return results


def _plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    cases = sorted({(r["geometry"], r["dtype"]) for r in results})
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, (geo, dt) in zip(axes[0], cases):
        rows = [r for r in results if (r["geometry"], r["dtype"]) == (geo, dt)]
        ax.barh([r["name"] for r in rows], [r["step_ms"] for r in rows])
        ax.scatter(
            [r["floor_ms"] for r in rows],
            [r["name"] for r in rows],
            color="k",
            marker="|",
            s=200,
            label="floor (own bytes)",
        )
        ax.set_xscale("log")
        ax.set_xlabel("step time (ms, log)")
        ax.set_title(f"{geo}, {dt} params")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()
