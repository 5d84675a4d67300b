"""Memory benchmark: for each optimizer configuration, the largest Llama whose training state fits on one GPU
machine (GPU memory and host memory both count), and its iteration time.

The "model" is the Llama parameters alone, no activations: an ``nn.Module`` holding one parameter per weight of
Llama-2-70B's layer shapes (hidden 8192, 64 heads, 8 key/value heads, ffn 28672, vocab 32000, RMSNorm weights,
untied embedding and head) with a growing number of layers. One iteration is a cheap forward touching every
parameter (``sum_i c_i * p_i.sum()``), a backward that writes a dense gradient per parameter, then the step and
``zero_grad(set_to_none=True)`` (with ``step_in_backward``: the backward alone). Per configuration and size it
measures the median iteration time (wall clock up to the device's synchronization), the GPU peak (allocated and
reserved, from a reset before the parameters are made), the host memory the process takes (peak RSS from a
reset, the drop of the machine's available memory, the pinned allocator's peak) and the optimizer-state bytes.

The search: measure at two small layer counts, fit ``bytes = a + b * layers`` for the GPU and for the host,
predict the largest layer count under both limits (times ``--margin``), then confirm it by running that size,
stepping down a layer while it runs out of memory or its host memory passes the limit.

    python benchmarks/benchmark_memory.py                            # GPU: the fit search, every config
    python benchmarks/benchmark_memory.py --geometry llama_1b        # GPU: every config on TinyLlama-1.1B
    python benchmarks/benchmark_memory.py --device cpu --geometry tiny --device-gb 0.2   # CPU smoke run

Configurations (``--configs``, comma list): torch's fused AdamW with fp32 and bf16 params, bitsandbytes'
and torchao's AdamW8bit, torchao's CPUOffloadOptimizer with and without ``offload_gradients``, and ours:
AdamW8bit, AdamW4bit, AdamW with the factored formats (``AdamW-factored``, ``AdamW-factored4``), AdamW8bit with bf16
params and stochastic rounding, alone, with ``offload_state=True``,
with ``step_in_backward`` and with both. Peers that are not installed and GPU-only configurations on a CPU are
skipped with the reason printed. Writes JSON and a PNG chart under ``results/memory/``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizers  # noqa: E402  (the optimizer table every benchmark shares)
from benchmark_step import llama_1b_shapes  # noqa: E402

import torchao_optim  # noqa: E402

Shape = tuple[int, ...]
LR = 1e-4


# ---- geometries --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Llama:
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def shapes(self, layers: int) -> list[Shape]:
        """Embedding, ``layers`` decoder layers (q, k, v, o, gate, up, down, two RMSNorm weights), the final
        norm and the untied head."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        shapes: list[Shape] = [(self.vocab, h)]
        for _ in range(layers):
            shapes += [(h, h), (kv, h), (kv, h), (h, h), (self.ffn, h), (self.ffn, h), (h, self.ffn), (h,), (h,)]
        return shapes + [(h,), (self.vocab, h)]


LLAMA_70B = Llama(hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000)  # 0.856B params a layer
TINY = Llama(hidden=128, heads=2, kv_heads=1, ffn=352, vocab=256)  # 0.18M params a layer, for CPU smoke runs
WARM_SHAPES: list[Shape] = [(256, 256), (256,), (256, 256), (256,)]  # imports and first-use set-up only
FAMILIES = {"llama70b": LLAMA_70B, "tiny": TINY}


def numel(shapes: Sequence[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)


class ParamModel(torch.nn.Module):
    """The parameters of a geometry and nothing else; ``forward`` is the loss ``sum_i c_i * p_i.sum()``, whose
    backward writes a dense, full-size gradient into every parameter."""

    def __init__(self, shapes: Sequence[Shape], dtype: torch.dtype, device: str):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen))
            for s in shapes
        )
        self.coeffs = [1.0 + (i % 7) / 7 for i in range(len(shapes))]

    def forward(self) -> torch.Tensor:
        return sum(p.sum(dtype=torch.float32) * c for p, c in zip(self.weights, self.coeffs))


# ---- configurations ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    name: str
    description: str
    make: Callable[[list[torch.nn.Parameter], bool], object]  # (params, compile) -> optimizer
    dtype: torch.dtype = torch.float32
    in_backward: bool = False
    cuda_only: bool = False
    requires: tuple[str, str] | None = None  # (import name, pip name)
    table_name: str | None = None  # its name in benchmarks/optimizers.py, where it has one


def _table(name: str) -> Callable:
    return lambda params, compile: optimizers.build(name, params, lr=LR, compile=compile)


def _torchao_offload(offload_gradients: bool) -> Callable:
    def make(params, compile):
        cls = importlib.import_module("torchao.optim").CPUOffloadOptimizer
        return cls(params, torch.optim.AdamW, offload_gradients=offload_gradients, fused=True, lr=LR, weight_decay=0.0)

    return make


def _ours_offload(params, compile):
    return torchao_optim.AdamW8bit(
        params, lr=LR, weight_decay=0.0, bf16_stochastic_round=True, compile=compile, offload_state=True
    )


def config_table() -> dict[str, Config]:
    bf16, tao = torch.bfloat16, ("torchao", "torchao")
    configs = [
        Config(
            "AdamWTorchFused",
            "torch.optim.AdamW(fused=True), fp32 params",
            _table("AdamWTorchFused"),
            table_name="AdamWTorchFused",
        ),
        Config(
            "AdamWTorchFused-bf16",
            "torch.optim.AdamW(fused=True), bf16 params (bf16 state)",
            _table("AdamWTorchFused"),
            bf16,
            table_name="AdamWTorchFused",
        ),
        Config(
            "AdamWBnb8bit",
            "bitsandbytes.optim.AdamW8bit, fp32 params",
            _table("AdamWBnb8bit"),
            table_name="AdamWBnb8bit",
        ),
        Config(
            "AdamWTorchao8bit",
            "torchao.optim.AdamW8bit, fp32 params",
            _table("AdamWTorchao8bit"),
            table_name="AdamWTorchao8bit",
        ),
        Config(
            "TorchaoOffload",
            "torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW, fused=True), fp32 params",
            _torchao_offload(False),
            cuda_only=True,
            requires=tao,
        ),
        Config(
            "TorchaoOffload-grads",
            "the same with offload_gradients=True",
            _torchao_offload(True),
            cuda_only=True,
            requires=tao,
        ),
        Config("AdamW8bit", "torchao_optim.AdamW8bit, fp32 params", _table("AdamW8bit"), table_name="AdamW8bit"),
        Config("AdamW4bit", "torchao_optim.AdamW4bit, fp32 params", _table("AdamW4bit"), table_name="AdamW4bit"),
        Config(
            "AdamW-factored",
            "torchao_optim.AdamW(state_format='factored'), fp32 params",
            _table("AdamW-factored"),
            table_name="AdamW-factored",
        ),
        Config(
            "AdamW-factored4",
            "torchao_optim.AdamW(state_format='factored4'), fp32 params",
            _table("AdamW-factored4"),
            table_name="AdamW-factored4",
        ),
        Config(
            "AdamW8bitSR-bf16",
            "torchao_optim.AdamW8bit(bf16_stochastic_round=True), bf16 params",
            _table("AdamW8bitSR"),
            bf16,
            table_name="AdamW8bitSR",
        ),
        Config("AdamW8bitSR-offload", "the same with offload_state=True", _ours_offload, bf16, cuda_only=True),
        Config(
            "AdamW8bitSR-backward",
            "AdamW8bit(bf16_stochastic_round=True), bf16 params, step_in_backward",
            _table("AdamW8bitSR"),
            bf16,
            in_backward=True,
            table_name="AdamW8bitSR",
        ),
        Config(
            "AdamW8bitSR-offload-backward",
            "the same with offload_state=True and step_in_backward",
            _ours_offload,
            bf16,
            in_backward=True,
            cuda_only=True,
        ),
    ]
    return {c.name: c for c in configs}


def skip_reason(config: Config, device: str) -> str | None:
    if config.cuda_only and not device.startswith("cuda"):
        return "runs on CUDA only"
    missing = optimizers.missing_package(config.table_name) if config.table_name else None
    if config.requires and not missing:
        try:
            importlib.import_module(config.requires[0])
        except Exception:
            missing = config.requires
    if missing:
        return f"cannot import {missing[0]} (pip install {missing[1]})"
    return None


# ---- memory readings -----------------------------------------------------------------------------------------
def _proc_bytes(path: str, key: str) -> int:
    """A ``key: <n> kB`` line of a /proc file, in bytes (0 where absent)."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _status_kb(field: str) -> int:
    return _proc_bytes("/proc/self/status", field)


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (VmHWM); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _meminfo(key: str) -> int:
    return _proc_bytes("/proc/meminfo", key)


def _host_used() -> int:
    """The machine's memory in use: MemTotal - MemAvailable (pinned pages included)."""
    return _meminfo("MemTotal") - _meminfo("MemAvailable")


def free_everything(device: str) -> None:
    """Give back what the last configuration left: Python garbage, compiled graphs, the CUDA caching allocator,
    the pinned-memory cache and glibc's free heap pages (so that the next RSS baseline is clean)."""
    gc.collect()
    if "torch._dynamo" in sys.modules:  # compiled graphs may hold the last configuration's tensors
        torch._dynamo.reset()
        gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for name in ("_accelerator_emptyHostCache", "_host_emptyCache", "_cuda_hostEmptyCache"):
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                break
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- one run -------------------------------------------------------------------------------------------------
def state_bytes(opt) -> int:
    """Optimizer-state bytes wherever they live; CPUOffloadOptimizer keeps one optimizer per parameter."""
    inner = list(getattr(opt, "optim_dict", {}).values())
    if inner or hasattr(opt, "d_opt"):
        d_opt = getattr(opt, "d_opt", None)
        return sum(optimizers.state_nbytes(o) for o in inner + ([d_opt] if d_opt is not None else []))
    return optimizers.state_nbytes(opt)


def run_once(config: Config, shapes: Sequence[Shape], device: str, warmup: int, iters: int, compile: bool) -> dict:
    """Build the parameters and the optimizer, run ``1 + warmup + iters`` iterations; the readings."""
    cuda = device.startswith("cuda")
    rss0, used0 = _status_kb("VmRSS"), _host_used()
    hwm_reset = _reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        alloc0 = torch.cuda.memory_allocated()
        try:
            torch.cuda.reset_peak_host_memory_stats()
        except Exception:
            pass
    model = ParamModel(shapes, config.dtype, device)
    opt = config.make(list(model.parameters()), compile)
    handle = torchao_optim.step_in_backward(model, opt) if config.in_backward else None
    used_peak, rss_peak = _host_used(), _status_kb("VmRSS")

    def iteration():
        model().backward()
        if handle is None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    first = optimizers.wall_time(iteration, device)
    for _ in range(warmup):
        iteration()
    times = []
    for _ in range(iters):
        times.append(optimizers.wall_time(iteration, device))
        used_peak, rss_peak = max(used_peak, _host_used()), max(rss_peak, _status_kb("VmRSS"))
    out = dict(
        layers=None,
        n_params=numel(shapes),
        n_tensors=len(shapes),
        first_iteration_s=first,
        iteration_ms=1e3 * statistics.median(times),
        iteration_ms_all=[1e3 * t for t in times],
        state_bytes=state_bytes(opt),
    )
    rss_peak = max(rss_peak, _status_kb("VmHWM") if hwm_reset else 0)
    out["host_rss_bytes"] = _status_kb("VmRSS") - rss0  # after the timed iterations
    out["host_rss_peak_bytes"] = rss_peak - rss0
    if cuda:
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated() - alloc0
        out["gpu_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
        out["host_used_peak_bytes"] = used_peak - used0  # sampled: the machine's drop in available memory
        try:
            stats = torch.cuda.host_memory_stats()  # the pinned allocator's peak, whatever its keys are called
            out["host_pinned_peak_bytes"] = max(
                [v for k, v in stats.items() if "bytes" in k and "peak" in k and ("allocated" in k or "reserved" in k)]
                or [0]
            )
        except Exception:
            out["host_pinned_peak_bytes"] = None
        # what the host limit is checked against: RSS may miss driver-mapped pinned pages, the available-memory
        # drop does not (on a machine of its own)
        out["host_bytes"] = max(
            out["host_rss_peak_bytes"], out["host_used_peak_bytes"], out["host_pinned_peak_bytes"] or 0
        )
        out["device_bytes"] = out["gpu_reserved_peak_bytes"]
    else:  # the device is the host: one memory, its peak RSS
        out["host_bytes"] = out["device_bytes"] = out["host_rss_peak_bytes"]
    if handle is not None:
        handle.remove()
    return out  # the model, the optimizer and their tensors go with this frame


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def measure(config: Config, shapes, device, warmup, iters, compile) -> dict:
    """``run_once``, with an out-of-memory error turned into ``{"oom": True}`` and everything freed after."""
    try:
        out = run_once(config, shapes, device, warmup, iters, compile)
        out["oom"] = False
    except Exception as err:  # noqa: BLE001
        if not is_oom(err):
            raise
        out = dict(
            oom=True,
            error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            n_params=numel(shapes),
        )
    free_everything(device)
    return out


# ---- the fit search ------------------------------------------------------------------------------------------
def linear_fit(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def predict(fits: dict[str, tuple[float, float]], budgets: dict[str, float], max_layers: int) -> tuple[int, str]:
    """The largest layer count every fitted memory keeps under its budget (at most ``max_layers``) and the
    memory that bounds it."""
    best, bound = max_layers, "max-layers"
    for key, (a, b) in fits.items():
        if b <= 0:  # this memory does not grow with the model
            continue
        layers = math.floor((budgets[key] - a) / b)
        if layers < best:
            best, bound = layers, key
    return max(best, 0), bound


def warm(config: Config, device: str, compile: bool) -> None:
    """One unmeasured run on small shapes, so that the imports and one-time set-up of the optimizer's first use
    (host memory that would otherwise count against the first measured size) are behind us."""
    measure(config, WARM_SHAPES, device, 0, 1, compile)


def search(
    config: Config, family: Llama, device: str, args, budgets: dict[str, float], limits: dict[str, float]
) -> dict:
    cuda = device.startswith("cuda")
    keys = ["device", "host"] if cuda else ["device"]
    runs = []
    for layers in args.fit_layers:
        r = measure(config, family.shapes(layers), device, args.fit_warmup, args.fit_iters, args.compile)
        r["layers"] = layers
        runs.append(r)
        print(f"  {layers} layers: " + _describe(r), flush=True)
        if r["oom"]:
            return dict(runs=runs, fit=None, predicted_layers=0, bound="device", largest=None)
    fits = {k: linear_fit([r["layers"] for r in runs], [r[f"{k}_bytes"] for r in runs]) for k in keys}
    predicted, bound = predict(fits, budgets, args.max_layers)
    result = dict(
        runs=runs,
        fit={k: dict(a=a, b=b) for k, (a, b) in fits.items()},
        predicted_layers=predicted,
        bound=bound,
        largest=None,
    )
    print(
        "  fit: "
        + ", ".join(f"{k} {a / 1e9:.2f} GB + {b / 1e9:.3f} GB/layer" for k, (a, b) in fits.items())
        + f"; predicted {predicted} layers ({bound} bound)",
        flush=True,
    )
    if not args.confirm or predicted < 1:
        return result
    layers = predicted
    for _ in range(args.max_retries + 1):
        if layers < 1:
            break
        if os.environ.get(ATTEMPT_FILE):  # for run_isolated: the size a killed process was trying
            with open(os.environ[ATTEMPT_FILE], "w") as fh:
                fh.write(str(layers))
        r = measure(config, family.shapes(layers), device, args.warmup, args.iters, args.compile)
        r["layers"] = layers
        runs.append(r)
        over = [k for k in keys if not r["oom"] and r[f"{k}_bytes"] > limits[k]]
        print(
            f"  confirm {layers} layers: " + _describe(r) + (f" (over the {over[0]} limit)" if over else ""), flush=True
        )
        if not r["oom"] and not over:
            result["largest"] = r
            break
        result["bound"] = over[0] if over else "device"
        layers -= 1
        if over:  # the fit undershot: refit with this size too and go straight to what it allows
            measured = [x for x in runs if not x["oom"]]
            fits = {k: linear_fit([x["layers"] for x in measured], [x[f"{k}_bytes"] for x in measured]) for k in keys}
            layers = min(layers, predict(fits, budgets, args.max_layers)[0])
    return result


def _describe(r: dict) -> str:
    if r["oom"]:
        return f"out of memory ({r['error']})"
    gb = lambda k: f"{r[k] / 1e9:.2f}"  # noqa: E731
    return (
        f"{r['n_params'] / 1e9:.3f}B params, {r['iteration_ms']:.1f} ms, device {gb('device_bytes')} GB, "
        f"host {gb('host_bytes')} GB, state {gb('state_bytes')} GB"
    )


# ---- output --------------------------------------------------------------------------------------------------
def print_fit_table(rows: list[dict], cuda: bool) -> None:
    mem = "GPU GB (reserved peak) | host GB" if cuda else "memory GB (peak RSS)"
    print(
        f"\n| config | largest layers | params (B) | {mem} | iteration ms | state GB | bound | "
        f"bytes/layer ({'GPU, host' if cuda else 'memory'}) |"
    )
    print("|---|---|---|---|" + ("---|" if cuda else "") + "---|---|---|---|")
    for row in rows:
        if row["status"] != "ok":
            print(f"| {row['name']} | {row['status']}: {row['reason']} |")
            continue
        s, big = row["search"], row["search"]["largest"]
        per_layer = ", ".join(f"{v['b'] / 1e9:.3g} GB" for v in (s["fit"] or {}).values())
        if big is None:
            print(
                f"| {row['name']} | predicted {s['predicted_layers']} (not confirmed) | | "
                + ("| " if cuda else "")
                + f"| | | {s['bound']} | {per_layer} |"
            )
            continue
        memory = (
            f"{big['device_bytes'] / 1e9:.1f} | {big['host_bytes'] / 1e9:.1f}"
            if cuda
            else f"{big['device_bytes'] / 1e9:.3f}"
        )
        print(
            f"| {row['name']} | {big['layers']} | {big['n_params'] / 1e9:.3g} | {memory} | "
            f"{big['iteration_ms']:.1f} | {big['state_bytes'] / 1e9:.2f} | {s['bound']} | {per_layer} |"
        )


def print_fixed_table(rows: list[dict], cuda: bool) -> None:
    print(
        "\n| config | iteration ms | "
        + ("GPU GB (allocated peak) | GPU GB (reserved peak) | host GB | " if cuda else "memory GB (peak RSS) | ")
        + "state GB | state bytes / param |"
    )
    print("|---|---|---|" + ("---|---|" if cuda else "") + "---|---|")
    for row in rows:
        if row["status"] != "ok":
            print(f"| {row['name']} | {row['status']}: {row['reason']} |")
            continue
        r = row["run"]
        if r["oom"]:
            print(f"| {row['name']} | out of memory |")
            continue
        memory = (
            f"{r['gpu_peak_bytes'] / 1e9:.2f} | {r['gpu_reserved_peak_bytes'] / 1e9:.2f} | {r['host_bytes'] / 1e9:.2f}"
            if cuda
            else f"{r['device_bytes'] / 1e9:.3f}"
        )
        state = f"{r['state_bytes'] / 1e9:.2f} | {r['state_bytes'] / r['n_params']:.3f}"
        print(f"| {row['name']} | {r['iteration_ms']:.1f} | {memory} | {state} |")


def offload_acceptance(rows: list[dict]) -> dict | None:
    """Issue 13, item 2, on the TinyLlama geometry: ours with ``offload_state=True`` within 100 ms an iteration
    and 3 GB of host memory, with torchao's CPUOffloadOptimizer of the same run beside it."""
    by_name = {r["name"]: r for r in rows if r["status"] == "ok" and not r["run"]["oom"]}
    ours = by_name.get("AdamW8bitSR-offload")
    if ours is None:
        return None
    r = ours["run"]
    out = dict(
        iteration_ms=r["iteration_ms"],
        host_gb=r["host_bytes"] / 1e9,
        passes=r["iteration_ms"] <= 100 and r["host_bytes"] <= 3e9,
    )
    for peer in ("TorchaoOffload", "AdamWTorchFused"):
        if peer in by_name:
            out[peer] = dict(
                iteration_ms=by_name[peer]["run"]["iteration_ms"], host_gb=by_name[peer]["run"]["host_bytes"] / 1e9
            )
    print(
        f"\noffload acceptance (<= 100 ms, <= 3 GB host): AdamW8bitSR-offload {out['iteration_ms']:.1f} ms, "
        f"{out['host_gb']:.2f} GB host: {'pass' if out['passes'] else 'FAIL'}"
    )
    return out


def plot(rows: list[dict], path: str, fixed: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    if fixed:
        ok = [r for r in rows if r["status"] == "ok" and not r["run"]["oom"]]
        panels = [
            ("iteration (ms)", [r["run"]["iteration_ms"] for r in ok]),
            ("device memory (GB)", [r["run"]["device_bytes"] / 1e9 for r in ok]),
            ("host memory (GB)", [r["run"]["host_bytes"] / 1e9 for r in ok]),
        ]
    else:
        ok = [r for r in rows if r["status"] == "ok" and r["search"]["largest"]]
        panels = [
            ("largest model (B params)", [r["search"]["largest"]["n_params"] / 1e9 for r in ok]),
            ("its iteration (ms)", [r["search"]["largest"]["iteration_ms"] for r in ok]),
        ]
    if not ok:
        print("nothing measured: no chart")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.35 * len(ok) + 1.5), squeeze=False)
    for ax, (label, values) in zip(axes[0], panels):
        ax.barh([r["name"] for r in ok], values)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    for ax in axes[0][1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


# ---- main ----------------------------------------------------------------------------------------------------
ATTEMPT_FILE = "BENCHMARK_MEMORY_ATTEMPT"  # environment variable: where a child writes the size it is running


def run_isolated(name: str, argv: list[str], max_retries: int = 3) -> dict:
    """Config ``name`` measured by this script in a fresh process (the same flags); its row of the results.
    Running out of host memory is not an exception but the kernel killing the process: it is then run again with
    ``--max-layers`` one below the size it was confirming, up to ``max_retries`` times."""
    killed: list[int] = []
    for _ in range(max_retries + 1):
        with tempfile.TemporaryDirectory(prefix="benchmark_memory_") as tmp:
            attempt = os.path.join(tmp, "attempt")
            # argparse keeps the last occurrence of a flag: these override the parent's
            cmd = [sys.executable, os.path.abspath(__file__)] + argv + ["--configs", name, "--out", tmp, "--no-isolate"]
            if killed:
                cmd += ["--max-layers", str(killed[-1] - 1)]
            proc = subprocess.run(cmd, env=dict(os.environ, **{ATTEMPT_FILE: attempt}))
            found = [f for f in os.listdir(tmp) if f.endswith(".json")]
            if proc.returncode == 0 and found:
                with open(os.path.join(tmp, found[0])) as fh:
                    row = json.load(fh)["results"][0]
                if killed:
                    row["killed_at_layers"] = killed
                return row
            if proc.returncode != -9 or not os.path.exists(attempt):
                break
            with open(attempt) as fh:
                killed.append(int(fh.read()))
            print(f"  {name}: killed at {killed[-1]} layers (out of host memory); again below that", flush=True)
    reason = f"the process measuring it exited with status {proc.returncode}" + (
        f" (killed at {killed} layers)" if killed else ""
    )
    print(f"[fail] {name}: {reason}")
    return dict(name=name, status="failed", reason=reason)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--geometry",
        default=None,
        choices=sorted(FAMILIES) + ["llama_1b"],
        help="llama70b (default on cuda): the fit search over Llama-2-70B layers; tiny (default on cpu): "
        "the same over a 0.18M-param-a-layer Llama; llama_1b: every config at TinyLlama-1.1B, no "
        "search",
    )
    ap.add_argument("--configs", default=None, help="comma list of: " + ",".join(config_table()) + " (default: all)")
    ap.add_argument("--device-gb", type=float, default=139.0, help="GPU memory limit (on a CPU: the memory limit)")
    ap.add_argument("--host-gb", type=float, default=128.0, help="host memory limit of the machine (CUDA)")
    ap.add_argument("--margin", type=float, default=0.97, help="the fit aims at this fraction of each limit")
    ap.add_argument("--fit-layers", default="1,2", help="the two (or more) layer counts the fit is measured at")
    ap.add_argument("--max-layers", type=int, default=80, help="the largest layer count tried (Llama-2-70B: 80)")
    ap.add_argument(
        "--confirm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the predicted size (stepping down a layer on running out of memory)",
    )
    ap.add_argument("--max-retries", type=int, default=3, help="layers the confirmation may step down")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations at the confirmed or fixed size")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fit-iters", type=int, default=2, help="timed iterations at the fit's sizes")
    ap.add_argument("--fit-warmup", type=int, default=1)
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="our optimizers' compile option (default: on with CUDA, off on a CPU)",
    )
    ap.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure each config in a process of its own (default: on with CUDA): host memory that a "
        "peer's pinned-memory cache keeps, and the GPU allocator's fragments, would otherwise count "
        "against the configs measured after it",
    )
    ap.add_argument("--out", default="results/memory")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)

    device = args.device
    cuda = device.startswith("cuda")
    if args.compile is None:
        args.compile = cuda
    geometry = args.geometry or ("llama70b" if cuda else "tiny")
    args.fit_layers = [int(x) for x in args.fit_layers.split(",")]
    table = config_table()
    names = args.configs.split(",") if args.configs else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        sys.exit(f"unknown configs: {unknown}; known: {', '.join(table)}")
    if not cuda:
        torch.set_num_threads(os.cpu_count() or 1)

    free_everything(device)
    limits = {"device": args.device_gb * 1e9}
    if cuda:
        free, _total = torch.cuda.mem_get_info()
        limits["device"] = min(limits["device"], free + torch.cuda.memory_reserved())
        # the host limit: the machine's, less what the process holds already, and no more than is available
        limits["host"] = min(args.host_gb * 1e9 - _status_kb("VmRSS"), _meminfo("MemAvailable"))
    budgets = {k: v * args.margin for k, v in limits.items()}
    env = dict(
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        date=time.strftime("%Y-%m-%d"),
        cpu_count=os.cpu_count(),
        host_total_bytes=_meminfo("MemTotal"),
        command=" ".join(
            ["python", "benchmarks/benchmark_memory.py"] + list(argv if argv is not None else sys.argv[1:])
        ),
    )
    for pkg in ("bitsandbytes", "torchao", "triton"):
        try:
            env[pkg] = importlib.import_module(pkg).__version__
        except Exception:
            pass
    print(
        f"# {env['date']} torch {env['torch']} on {env['device']}; geometry {geometry}; limits "
        + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in limits.items())
        + f" (aiming at {args.margin:.0%})"
    )

    rows = []
    isolate = cuda if args.isolate is None else args.isolate
    for name in names if isolate and len(names) > 1 else []:
        rows.append(run_isolated(name, argv))
    for name in [] if isolate and len(names) > 1 else names:
        config = table[name]
        row = dict(
            name=name,
            description=config.description,
            dtype=str(config.dtype).removeprefix("torch."),
            step_in_backward=config.in_backward,
        )
        reason = skip_reason(config, device)
        if reason:
            print(f"[skip] {name}: {reason}")
            rows.append(dict(row, status="skipped", reason=reason))
            continue
        print(f"## {name}: {config.description}", flush=True)
        try:
            warm(config, device, args.compile)
            if geometry == "llama_1b":
                r = measure(config, llama_1b_shapes(), device, args.warmup, args.iters, args.compile)
                print("  " + _describe(r), flush=True)
                rows.append(dict(row, status="ok", run=r))
            else:
                rows.append(
                    dict(row, status="ok", search=search(config, FAMILIES[geometry], device, args, budgets, limits))
                )
        except Exception as err:  # noqa: BLE001
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"[fail] {name}: {reason}")
            rows.append(dict(row, status="failed", reason=reason))
            free_everything(device)

    fixed = geometry == "llama_1b"
    (print_fixed_table if fixed else print_fit_table)(rows, cuda)
    result = dict(
        env=env,
        geometry=geometry,
        limits_bytes=limits,
        budgets_bytes=budgets,
        margin=args.margin,
        layer_params=None if fixed else numel(FAMILIES[geometry].shapes(1)) - numel(FAMILIES[geometry].shapes(0)),
        results=rows,
    )
    if fixed:
        result["offload_acceptance"] = offload_acceptance(rows)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"memory_{geometry}_{'cuda' if cuda else 'cpu'}")
    with open(stem + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"json: {stem}.json")
    plot(rows, stem + ".png", fixed)
    return result


if __name__ == "__main__":
    main()
