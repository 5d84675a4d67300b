"""Optimizer-step benchmark: our formats against torch AdamW (fused, foreach), bitsandbytes and torchao.

For each parameter geometry and dtype it measures, for every optimizer in one run:
- the step time (median after warm-up; CUDA events on a GPU, wall clock on a CPU),
- the first step (compile included; caches are cold unless --warm-cache),
- the step time when the learning rate changes every step (as a Python float, like a scheduler),
- optimizer-state bytes per parameter and the step's transient peak memory (CUDA),
and prints each time's ratio to the bandwidth floor (bytes the step must move / copy bandwidth measured
in the same run) and to torch's fused AdamW. Writes JSON and a PNG bar chart.

    python benchmarks/benchmark_step.py                          # GPU: vit_b and llama_1b, fp32 and bf16
    python benchmarks/benchmark_step.py --device cpu             # CPU: the 25.7M-param GPT geometry
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

if "--warm-cache" not in sys.argv:  # cold caches, so that the first step includes every compile
    _cache = tempfile.mkdtemp(prefix="bench_step_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_cache, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_cache, "triton")

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchao_optim  # noqa: E402
from torchao_optim.state import QuantizedState  # noqa: E402

Shape = Tuple[int, ...]


# ---- geometries ------------------------------------------------------------------------------------
def vit_b_shapes(num_classes: int = 45) -> List[Shape]:
    """timm's vit_base_patch16_224 with a 45-class head (resisc45): 85.8M params, 152 tensors."""
    d, mlp = 768, 3072
    shapes: List[Shape] = [(1, 1, d), (1, 197, d), (d, 3, 16, 16), (d,)]
    for _ in range(12):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (mlp, d), (mlp,), (d, mlp), (d,)]
    return shapes + [(d,), (d,), (num_classes, d), (num_classes,)]


def llama_1b_shapes() -> List[Shape]:
    """TinyLlama-1.1B: hidden 2048, 22 layers, intermediate 5632, kv dim 256, vocab 32000; 201 tensors."""
    h, inter, kv, vocab = 2048, 5632, 256, 32000
    shapes: List[Shape] = [(vocab, h)]
    for _ in range(22):
        shapes += [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return shapes + [(h,), (vocab, h)]


def gpt25m_shapes() -> List[Shape]:
    """A byte-level GPT: d=512, 8 layers, context 512, untied head; 25.74M params, 101 tensors."""
    d = 512
    shapes: List[Shape] = [(256, d), (512, d)]
    for _ in range(8):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,), (256, d)]


GEOMETRIES: Dict[str, Callable[[], List[Shape]]] = {
    "vit_b": vit_b_shapes, "llama_1b": llama_1b_shapes, "gpt25m": gpt25m_shapes,
}


# ---- optimizers ------------------------------------------------------------------------------------
def optimizer_factories(device: str) -> Dict[str, Callable]:
    """name -> factory(params); peers only where installed (the reason is printed otherwise)."""
    f: Dict[str, Callable] = {
        "torch_fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
    }
    for fmt in torchao_optim.list_state_formats():
        f[f"ours_{fmt}"] = (lambda fmt: lambda ps: torchao_optim.AdamW(ps, state_format=fmt))(fmt)
        if device == "cuda":
            f[f"ours_{fmt}_compiled"] = (lambda fmt: lambda ps: torchao_optim.AdamW(ps, state_format=fmt,
                                                                                     fused=False))(fmt)
    # the one-state optimizers against their full-precision forms ("x floor" is against Adam's two-state floor)
    f["torch_sgd_foreach"] = lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True)
    f["ours_sgd8bit"] = lambda ps: torchao_optim.SGD8bit(ps, lr=1e-3, momentum=0.9)
    f["ours_lion_fp32"] = lambda ps: torchao_optim.Lion8bit(ps, state_format="none")
    f["ours_lion8bit"] = lambda ps: torchao_optim.Lion8bit(ps)
    f["torch_foreach_quantized"] = lambda ps: torchao_optim.quantize_optimizer_state(
        torch.optim.AdamW(ps, foreach=True))
    try:
        import bitsandbytes as bnb

        f["bnb_8bit"] = lambda ps: bnb.optim.AdamW8bit(ps)
        f["bnb_sgd8bit"] = lambda ps: bnb.optim.SGD8bit(ps, lr=1e-3, momentum=0.9)
        f["bnb_lion8bit"] = lambda ps: bnb.optim.Lion8bit(ps)
    except Exception as err:  # ImportError, or a broken native library
        print(f"[skip] bitsandbytes: {type(err).__name__}: {err}".splitlines()[0])
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        f["torchao_8bit"] = lambda ps: TorchaoAdamW8bit(ps)
    except Exception as err:
        print(f"[skip] torchao: {type(err).__name__}: {err}".splitlines()[0])
    return f


# ---- measurement -----------------------------------------------------------------------------------
def state_bytes(opt) -> int:
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, QuantizedState):
                total += sum(t.numel() * t.element_size() for t in value.fields().values())
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                inner = getattr(value, "__tensor_flatten__", None)
                if inner is not None:  # another project's tensor subclass
                    total += sum(getattr(value, n).numel() * getattr(value, n).element_size() for n in inner()[0])
                else:
                    total += value.numel() * value.element_size()
    return total


def floor_bytes(shapes: List[Shape], param_bytes: int, quantized: bool, min_quant_size: int = 4096) -> int:
    """Bytes one step must read and write: param and grad read, param written; states read and written.
    Quantized: 1 byte per element and 4 per 256-element block (fp32 below min_quant_size). Not quantized:
    torch.optim's states, which have the parameter's dtype."""
    total = 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        if quantized:
            state = (2 * n + 2 * 4 * ((n + 255) // 256)) if n >= min_quant_size else 2 * 4 * n
        else:
            state = 2 * param_bytes * n
        total += 3 * param_bytes * n + 2 * state
    return total


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy, counting bytes read and written."""
    n = (1 << 28) if device == "cuda" else (1 << 25)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = [_time(lambda: dst.copy_(src), device) for _ in range(10)]
    return 2 * 4 * n / statistics.median(times[2:])


def _time(fn, device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_one(name, factory, shapes, dtype, device, steps, warmup) -> Dict:
    torch._dynamo.reset()
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype) * 0.02)
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    opt = factory(params)
    t0 = time.perf_counter()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        opt.step()
    times = [_time(opt.step, device) for _ in range(steps)]

    def step_new_lr(i=[0]):
        i[0] += 1
        lr = 1e-3 * (1 + 1e-3 * (i[0] % 100))
        for g in opt.param_groups:
            if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor and refuses floats
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        opt.step()

    step_new_lr()
    lr_times = [_time(step_new_lr, device) for _ in range(steps)]
    out = dict(name=name, first_step_s=first, step_ms=1e3 * statistics.median(times),
               step_lr_change_ms=1e3 * statistics.median(lr_times), state_bytes=state_bytes(opt))
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--geometries", default=None, help="comma list of " + ",".join(GEOMETRIES)
                    + " (default: vit_b,llama_1b on cuda, gpt25m on cpu)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="parameter dtypes: fp32,bf16")
    ap.add_argument("--optims", default=None, help="comma list of names (default: all available)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 50 cuda, 10 cpu)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warm-cache", action="store_true", help="keep the compile caches (first step not cold)")
    ap.add_argument("--out", default="results/step")
    ap.add_argument("--formats-from", default=None,
                    help="a Python file that registers more state formats (e.g. test/made_up_formats.py): each is "
                         "benchmarked like the built-in ones, with no other change")
    args = ap.parse_args(argv)
    if args.formats_from:
        import runpy

        runpy.run_path(args.formats_from)

    device = args.device
    geometries = (args.geometries or ("vit_b,llama_1b" if device == "cuda" else "gpt25m")).split(",")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    steps = args.steps or (50 if device == "cuda" else 10)
    factories = optimizer_factories(device)
    if args.optims:
        unknown = set(args.optims.split(",")) - set(factories)
        if unknown:
            sys.exit(f"unknown or unavailable optimizers: {sorted(unknown)}; available: {sorted(factories)}")
        factories = {k: v for k, v in factories.items() if k in args.optims.split(",")}
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    bandwidth = copy_bandwidth(device)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               date=time.strftime("%Y-%m-%d"), copy_bandwidth_gbs=bandwidth / 1e9, cpu_count=os.cpu_count(),
               command=" ".join(["python", "benchmarks/benchmark_step.py"] + (argv or sys.argv[1:])))
    print(f"# {env['date']} torch {env['torch']} on {env['device']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = []
    for geo in geometries:
        shapes = GEOMETRIES[geo]()
        n_params = sum(torch.Size(s).numel() for s in shapes)
        for dname in args.dtypes.split(","):
            dtype = dtypes[dname]
            floor8 = floor_bytes(shapes, dtype.itemsize, quantized=True) / bandwidth * 1e3
            floor32 = floor_bytes(shapes, dtype.itemsize, quantized=False) / bandwidth * 1e3
            print(f"\n## {geo} ({n_params / 1e6:.1f}M params, {len(shapes)} tensors), {dname} params: "
                  f"floor {floor8:.3f} ms (8-bit state), {floor32:.3f} ms (torch.optim's state)")
            rows = []
            for name, factory in factories.items():
                try:
                    r = bench_one(name, factory, shapes, dtype, device, steps, args.warmup)
                except Exception as err:
                    print(f"[fail] {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                    continue
                quantized = r["state_bytes"] < 4 * n_params
                r.update(geometry=geo, dtype=dname, n_params=n_params, n_tensors=len(shapes),
                         floor_ms=floor8 if quantized else floor32, state_bytes_per_param=r["state_bytes"] / n_params)
                rows.append(r)
            fused = next((r["step_ms"] for r in rows if r["name"] == "torch_fused"), None)
            print(f"| optimizer | step ms | x floor | x torch fused | lr-change ms | first step s | state B/param |"
                  + (" transient MB |" if device == "cuda" else ""))
            print("|---|---|---|---|---|---|---|" + ("---|" if device == "cuda" else ""))
            for r in rows:
                r["x_floor"] = r["step_ms"] / r["floor_ms"]
                r["x_torch_fused"] = r["step_ms"] / fused if fused else None
                print(f"| {r['name']} | {r['step_ms']:.3f} | {r['x_floor']:.2f} | "
                      f"{r['x_torch_fused']:.2f} | {r['step_lr_change_ms']:.3f} | {r['first_step_s']:.1f} | "
                      f"{r['state_bytes_per_param']:.2f} |"
                      + (f" {r['transient_peak_mb']:.1f} |" if device == "cuda" else ""))
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
        ax.axvline(min(r["floor_ms"] for r in rows), color="k", ls="--", label="8-bit floor")
        ax.set_xscale("log")
        ax.set_xlabel("step time (ms, log)")
        ax.set_title(f"{geo}, {dt} params")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()
