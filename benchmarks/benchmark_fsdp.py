"""FSDP2: AdamW8bit on parameters sharded with ``fully_shard`` over every rank of a ``torchrun`` job.

Two parts, both on by default:

- ``--check``: parity and resume. A small MLP with uneven shards trained on the same whole gradients as a
  single-process reference on rank 0 (with the layouts the block rule gives each parameter): parameters and
  states must be equal bit for bit after 6 steps; the same MLP trained end to end on each rank's share of a
  global batch must stay within rounding of the reference (see test/test_distributed.py for the bounds); a
  DCP checkpoint saved after 3 steps and loaded into a fresh model must resume bit for bit.
- ``--bench``: the optimizer step of a sharded geometry (default TinyLlama-1.1B, fp32 parameters): first step
  (compiling included), median step time (CUDA events; the slowest rank's median), optimizer state bytes per
  rank and the step's transient peak memory, for AdamW8bit (fused and compiled executors, and with
  ``offload_state=True`` on GPUs), AdamW4bit, AdamW with ``"4bit_rank1"`` state, Muon8bit (its matrices'
  directions gathered onto their owners, orthogonalized there and scattered back; the embedding and the head on
  its AdamW fallback), torch's AdamW (fused, foreach) and, when importable, torchao's AdamW8bit: all under the
  same FSDP2 sharding.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/benchmark_fsdp.py            # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/benchmark_fsdp.py --device cpu --geometry tiny  # CPU, gloo (smoke)

Rank 0 prints a markdown table and writes JSON to ``--out``. Exits with status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchao_optim  # noqa: E402
from torchao_optim.optim.sharded import row_aligned_block_size  # noqa: E402
from torchao_optim.state import QuantizedState  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_step import gpt25m_shapes, llama_1b_shapes  # noqa: E402
from optimizers import state_nbytes, time_call, wall_time  # noqa: E402

Shape = tuple[int, ...]
LR, WD, STEPS, MIN_QUANT = 1e-2, 0.1, 3, 1024


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


# ---- the check ---------------------------------------------------------------------------------------------
class MLP(torch.nn.Module):
    """Rows of 256 (blocks of 256), of 96 (blocks of 32), of an odd 67 (plain state); 96, 67 and 256 rows."""

    def __init__(self, device):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(256, 96), torch.nn.Linear(96, 67), torch.nn.Linear(67, 256)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.to(device)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def shard(model):
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer)
    return fully_shard(model)


def rows_of(rank: int, world: int, n: int) -> slice:
    chunk = -(-n // world)
    return slice(min(n, rank * chunk), min(n, (rank + 1) * chunk))


def set_grads(model, step: int) -> None:
    """Every rank takes its rows of the same whole gradients (drawn on the CPU, so identical everywhere)."""
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        g = torch.empty(p.shape).uniform_(-3, 1, generator=gen).exp() * torch.randn(p.shape, generator=gen)
        g = g.to(p.device)
        if isinstance(p, DTensor):
            rows = rows_of(dist.get_rank(p.device_mesh.get_group()), p.device_mesh.size(), len(g))
            g = DTensor.from_local(g[rows].contiguous(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        p.grad = g


def reference_optimizer(model):
    groups, plain = [], []
    for p in model.parameters():
        block_size = row_aligned_block_size(p.shape, 256) if p.numel() >= MIN_QUANT else None
        (plain.append(p) if block_size is None else groups.append({"params": [p], "block_size": block_size}))
    return torchao_optim.AdamW8bit(
        groups + [{"params": plain, "state_format": "none"}], lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT
    )


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, t in (("", p), (".exp_avg", opt.state[p]["exp_avg"]), (".exp_avg_sq", opt.state[p]["exp_avg_sq"])):
            out[name + key] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


def same(a, b) -> bool:
    if type(a) is not type(b) or a.shape != b.shape:
        return False
    if isinstance(a, QuantizedState):
        return a.attrs() == b.attrs() and all(
            torch.equal(x, y) for x, y in zip(a.fields().values(), b.fields().values())
        )
    return torch.equal(a, b)


def check(device, ckpt_dir) -> list[str]:
    """The parity and resume checks; returns what failed (on rank 0)."""
    failures = []
    model = shard(MLP(device))
    opt = torchao_optim.AdamW8bit(model.parameters(), lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT)
    for step in range(2 * STEPS):
        if step == STEPS:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
        set_grads(model, step)
        opt.step()
    ours = snapshot(model, opt)
    executor = "fused" if opt._plans else "compiled"

    resumed_model = shard(MLP(device))
    resumed_opt = torchao_optim.AdamW8bit(resumed_model.parameters(), lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT)
    msd, osd = get_state_dict(resumed_model, resumed_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    set_state_dict(resumed_model, resumed_opt, model_state_dict=msd, optim_state_dict=osd)
    for step in range(STEPS, 2 * STEPS):
        set_grads(resumed_model, step)
        resumed_opt.step()
    resumed = snapshot(resumed_model, resumed_opt)

    rank, world = dist.get_rank(), dist.get_world_size()
    trained = shard(MLP(device))
    train_opt = torchao_optim.AdamW8bit(trained.parameters(), lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT)
    batches = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(200 + step)
        x, y = (torch.randn(16 * world, 256, generator=gen).to(device) for _ in range(2))
        batches.append((x, y))
        rows = rows_of(rank, world, len(x))
        torch.nn.functional.mse_loss(trained(x[rows]), y[rows]).backward()
        train_opt.step()
        train_opt.zero_grad()
    trained_snap = snapshot(trained, train_opt)

    if rank == 0:
        ref_model = MLP(device)
        ref_opt = reference_optimizer(ref_model)
        for step in range(2 * STEPS):
            set_grads(ref_model, step)
            ref_opt.step()
        ref = snapshot(ref_model, ref_opt)
        failures += [f"parity ({executor}): {k}" for k in ref if not same(ours[k], ref[k])]
        failures += [f"DCP resume: {k}" for k in ref if not same(resumed[k], ref[k])]
        ref_model = MLP(device)
        ref_opt = reference_optimizer(ref_model)
        for x, y in batches:
            torch.nn.functional.mse_loss(ref_model(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for name, p in ref_model.named_parameters():
            err = (trained_snap[name] - p.detach()).abs() / (LR * STEPS)
            log(f"  end to end, {name}: max {err.max():.3g}, mean {err.mean():.3g} of lr * steps")
            if err.max() > 0.01 or err.mean() > 1e-4:
                failures.append(f"end-to-end training: {name} max {err.max():.3g} mean {err.mean():.3g}")
        log(
            f"check on {world} ranks ({device}, executor {executor}): "
            f"{'PASS' if not failures else 'FAIL: ' + '; '.join(failures[:8])}"
        )
    return failures


# ---- the benchmark -----------------------------------------------------------------------------------------
GEOMETRIES: dict[str, Callable[[], list[Shape]]] = {
    "llama_1b": llama_1b_shapes,
    "gpt25m": gpt25m_shapes,
    "tiny": lambda: [(1000, 64), (64,)] + [(256, 64), (64, 256), (64,)] * 2 + [(1000, 64)],
}


class Layer(torch.nn.Module):
    def __init__(self, shapes, device, dtype, gen):
        super().__init__()
        self.params = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device=device, dtype=dtype)) for s in shapes]
        )


class Stack(torch.nn.Module):
    """The layers (fully_shard refuses a bare ModuleList); the benchmark never runs a forward."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


def sharded_params(shapes: list[Shape], device, dtype) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """The geometry as a model of layers, each ``fully_shard``-ed, and the root too: the first tensor (the
    embedding), the last two (final norm, head), and the rest in layers of 9 (TinyLlama's); gradients of the
    local shards' shapes. (How tensors are grouped decides FSDP's communication, not the optimizer's step.)"""
    gen = torch.Generator().manual_seed(0)
    middle = shapes[1:-2]
    chunks = [shapes[:1]] + [middle[i : i + 9] for i in range(0, len(middle), 9)] + [shapes[-2:]]
    model = Stack([Layer(c, device, dtype, gen) for c in chunks if c])
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = list(model.parameters())
    for p in params:
        local = p.to_local()
        p.grad = DTensor.from_local(
            torch.randn(local.shape, generator=gen).to(device=device, dtype=dtype) * 1e-3,
            p.device_mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
        )
    return model, params


def optimizers(device) -> dict[str, Callable]:
    f: dict[str, Callable] = {
        "ours_dtq8": lambda ps: torchao_optim.AdamW8bit(ps),
        "ours_4bit": lambda ps: torchao_optim.AdamW4bit(ps),
        # rank-1 scales: the per-parameter path, the column maxima all-reduced once per group and step
        "ours_4bit_rank1": lambda ps: torchao_optim.AdamW(ps, state_format="4bit_rank1"),
    }
    if device == "cuda":
        f["ours_dtq8_compiled"] = lambda ps: torchao_optim.AdamW8bit(ps, fused=False)
        # each rank's shards' state in host memory, streamed through the GPU every step
        f["ours_dtq8_offload_state"] = lambda ps: torchao_optim.AdamW8bit(ps, offload_state=True)
    # Muon for the geometry's matrices; the first and last tensors (embedding, head) on the AdamW fallback
    f["ours_muon8bit"] = lambda ps: torchao_optim.Muon8bit(
        [{"params": ps[1:-1]}, {"params": [ps[0], ps[-1]], "use_muon": False}]
    )
    f["torch_fused"] = lambda ps: torch.optim.AdamW(ps, fused=True)
    f["torch_foreach"] = lambda ps: torch.optim.AdamW(ps, foreach=True)
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        f["torchao_8bit"] = lambda ps: TorchaoAdamW8bit(ps)
    except Exception as err:  # ImportError, or a broken install
        log(f"[skip] torchao: {type(err).__name__}: {err}".splitlines()[0])
    return f


def slowest(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench(name, factory, shapes, device, dtype, steps, warmup) -> dict:
    torch._dynamo.reset()
    model, params = sharded_params(shapes, device, dtype)
    opt = factory(params)
    dist.barrier()
    first = wall_time(opt.step, device)
    for _ in range(warmup):
        opt.step()
    times = [time_call(opt.step, device) for _ in range(steps)]
    out = dict(
        name=name,
        first_step_s=slowest(first, device),
        step_ms=1e3 * slowest(statistics.median(times), device),
        state_bytes_per_rank=int(slowest(state_nbytes(opt), device)),
        params_per_rank=int(slowest(sum(p.to_local().numel() for p in params), device)),
    )
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        out["transient_peak_mb"] = slowest((torch.cuda.max_memory_allocated() - before) / 2**20, device)
    del opt, params, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--geometry", default="llama_1b", choices=sorted(GEOMETRIES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--optims", default="", help="comma-separated names (default: every one available)")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--no-bench", dest="bench", action="store_false")
    ap.add_argument("--out", default="results/fsdp")
    args = ap.parse_args(argv)

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    world = dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)
    log(
        f"torch {torch.__version__}, {world} ranks, {device}"
        + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
    )
    failures = []
    if args.check:
        failures = check(device, os.path.join(args.out, f"ckpt_{world}"))
    results = []
    if args.bench:
        shapes = GEOMETRIES[args.geometry]()
        dtype = getattr(torch, args.dtype)
        wanted = [n for n in args.optims.split(",") if n]
        for name, factory in optimizers(device).items():
            if wanted and name not in wanted:
                continue
            try:
                results.append(bench(name, factory, shapes, device, dtype, args.steps, args.warmup))
            except Exception as err:  # a peer that cannot run sharded: say so, go on
                log(f"[fail] {name}: {type(err).__name__}: {err}".splitlines()[0])
        n = sum(torch.Size(s).numel() for s in shapes)
        log(
            f"\n{args.geometry}, {n / 1e6:.1f}M params in {len(shapes)} tensors, {args.dtype}, FSDP2 over {world} "
            f"ranks; per rank: step time (slowest rank's median of {args.steps}), state, first step"
        )
        log(
            "| optimizer | step (ms) | state per rank (MB) | state bytes / local param | first step (s) |"
            + (" transient peak (MB) |" if device == "cuda" else "")
        )
        log("|---|---|---|---|---|" + ("---|" if device == "cuda" else ""))
        for r in results:
            log(
                f"| {r['name']} | {r['step_ms']:.2f} | {r['state_bytes_per_rank'] / 2**20:.1f} | "
                f"{r['state_bytes_per_rank'] / r['params_per_rank']:.2f} | {r['first_step_s']:.1f} |"
                + (f" {r['transient_peak_mb']:.0f} |" if device == "cuda" else "")
            )
    if dist.get_rank() == 0:
        path = os.path.join(args.out, f"fsdp_{args.geometry}_{args.dtype}_{world}x{device}.json")
        with open(path, "w") as f:
            json.dump(
                dict(
                    torch=torch.__version__,
                    world=world,
                    device=device,
                    geometry=args.geometry,
                    dtype=args.dtype,
                    check_failures=failures,
                    results=results,
                ),
                f,
                indent=1,
            )
        log(f"wrote {path}")
    failed = torch.tensor([len(failures)], device=device)
    dist.all_reduce(failed)
    dist.destroy_process_group()
    return 1 if failed.item() else 0


if __name__ == "__main__":
    sys.exit(main())
