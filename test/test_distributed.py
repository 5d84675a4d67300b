"""Beyond one process: FSDP2 (``fully_shard``), HSDP, DDP and distributed checkpoints (DCP), on CPU.

Two kinds of tests. In this process, each rank of a 2-rank (or 4-rank) FSDP2 model is simulated in turn on torch's
fake process group (no communication; the optimizer needs none): the local parameters and states after each step
must be exactly the rows of single-process training's. Then real ranks: 2 or 4 processes on gloo
(``torch.multiprocessing``, started by a fork server, on a free port; a job that hangs is killed after ``TIMEOUT``
seconds and fails the test; a rank that crashes reports its Python stack, and its job runs once more, with a
warning: a crash that comes back fails the test) train, save DCP checkpoints and resume them on other numbers of
ranks, and write what they end with (whole parameters and states, gathered with ``full_tensor()``: a real all-gather
of quantized states) to a file that the tests compare with single-process training here. A :class:`Case` is one such
run of one optimizer, format and feature (HSDP, CPUOffloadPolicy, the step in backward, bf16 stochastic rounding,
the fused C step or the per-parameter path); each job batches several, since starting ranks is the cost. CI runs a
sample that has each of them once on 2 and on 4 ranks; ``--runslow`` runs every optimizer x every format x each
feature (``test_sweep``).

The model has one parameter of each kind the block rule (``optim/sharded.py``) tells apart, with dim 0 sizes
that shard unevenly on two ranks:

- ``fc1.weight`` (96, 256): rows of 256 elements, blocks of 256, 48 rows per rank;
- ``fc2.weight`` (67, 96): rows of 96 elements, blocks of 32 (the largest of 256, 128, 64, 32 dividing 96),
  34 and 33 rows;
- ``fc3.weight`` (256, 67): rows of an odd 67 elements: no block fits, plain fp32 state;
- the biases: 1-D, plain fp32 state.

Every optimizer here runs without compiling (``compile=False``): the distributed code is the same whichever
executor runs the update (the update sees local tensors only), and compiling in every rank would take minutes
on a CPU. The fused executors are checked on shards too: the C step (``fused=None``, the default on the CPU)
in the cases, Triton's kernels in Triton's interpreter on a smaller model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import functools
import math
import multiprocessing
import os
import signal
import socket
import tempfile
import textwrap
import time
import unittest
import unittest.mock
import warnings

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchao_optim import (
    Adagrad8bit,
    AdamW,
    AdamW8bit,
    AdEMAMix8bit,
    DTQ8bitTensor,
    Lion8bit,
    Muon8bit,
    QuantizedState,
    RMSprop8bit,
    SGD8bit,
    dequantize_state_dict,
    get_state_format,
    step_in_backward,
)
from torchao_optim.optim.fused import fused_available
from torchao_optim.optim.sharded import local, row_aligned_block_size
from torchao_optim.state.fourbit import FourBitRank1Tensor
from torchao_optim.testing import SpreadProblem, assert_same_tensor
from torchao_optim.testing.compare import same_tensor_problems

TIMEOUT = 180  # seconds for the 2-rank job, startup included
LR, WD, STEPS, MIN_QUANT = 1e-2, 0.1, 3, 1024
DISTRIBUTED = dist.is_available() and dist.is_gloo_available()


# ---- the problem: a model, per-step gradients, a global batch ---------------------------------------------
class Linear(torch.nn.Linear):
    def forward(self, x):
        if isinstance(x, tuple):
            # (coefficients of the weight, of the bias): a loss whose gradient is exactly the coefficients
            w, b = x
            return (self.weight * w).sum() + (self.bias * b).sum()
        return super().forward(x)


class Net(torch.nn.Module):
    def __init__(self, dims=(256, 96, 67, 256)):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1, self.fc2, self.fc3 = (Linear(a, b) for a, b in zip(dims, dims[1:]))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        if isinstance(x, dict):  # parameter name -> coefficients (see Linear)
            layers = (("fc1", self.fc1), ("fc2", self.fc2), ("fc3", self.fc3))
            return sum(layer((x[f"{name}.weight"], x[f"{name}.bias"])) for name, layer in layers)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@functools.cache
def _problem(shapes) -> SpreadProblem:
    return SpreadProblem(shapes)


def grads(model, step):
    """name -> the global gradient at ``step``, in the parameter's dtype: the shared problem's for the model's shapes,
    magnitudes spread over e^4 within each block, so that blockwise quantization matters."""
    named = list(model.named_parameters())
    whole = _problem(tuple(tuple(p.shape) for _, p in named)).grads(step)
    return {name: g.to(p.dtype) for (name, p), g in zip(named, whole)}


def batch(step):
    gen = torch.Generator().manual_seed(200 + step)
    return torch.randn(16, 256, generator=gen), torch.randn(16, 256, generator=gen)


def optimizer(model, fused=False, cls=AdamW8bit, **kw):
    return cls(model.parameters(), lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT, compile=False, fused=fused, **kw)


def sharded_block_size(shape, fmt: str) -> int | None:
    """The block size of the state of a parameter of global ``shape`` sharded along dim 0, in format ``fmt``; None
    for plain fp32 state: the block rule (``row_aligned_block_size``, tested on its own below), for every built-in
    format (a rank-1 format's scales are per row and per column, with the column maxima all-reduced, and its
    blockwise ``exp_avg`` follows the rule)."""
    if fmt == "none" or math.prod(shape) < MIN_QUANT or not get_state_format(fmt).row_shardable:
        return None
    return row_aligned_block_size(shape, get_state_format(fmt).default_block_size)


def column_block_size(shape, fmt: str, world: int) -> int | None:
    """The block size of the state of a parameter of global ``shape`` sharded along dim 1 (``Shard(1)``) over
    ``world`` ranks; None for plain fp32 state: the block rule's (:func:`sharded_block_size`) where it also divides
    every rank's first column and column count, in elements (torch's chunks of ``ceil(cols / world)`` columns), for
    a format whose scales each cover a block of one row (rank-1 scales span the columns: plain)."""
    block = sharded_block_size(shape, fmt)
    if block is None or not get_state_format(fmt).column_shardable:
        return None
    inner, chunk = math.prod(shape[2:]), -(-shape[1] // world)
    return block if all(min(shape[1], r * chunk) * inner % block == 0 for r in range(world + 1)) else None


# the ranks of a Case's tensor parallelism (mesh="tp"): its reference's layouts are those of 2 ranks
TP_WORLD = 2
# Net's dims for tensor parallelism: fc1.weight (96, 512), whose 2 column shards are whole blocks of 256
TP_DIMS = (512, 96, 67, 256)


def reference_optimizer(model, fused=False, cls=AdamW8bit, groups=None, tp_world=None, **kw):
    """Single-process ``cls`` (AdamW8bit) with, for each parameter, the state layout it takes when sharded (without
    sharding, fc2.weight would take blocks of 256 and fc3.weight quantized state): a group per parameter, with its
    block size or plain state, in the order of ``groups`` (the sharded optimizer's, by parameter name, with their
    options; default: one group of every parameter), so that each parameter keeps its position (stochastic
    rounding hashes it). ``tp_world``: the layouts of tensor parallelism over that many ranks instead
    (:func:`column_block_size` for matrices)."""
    fmt = kw.pop("state_format", "dtq8")  # the default of every cls here
    groups = groups or [{"params": [name for name, _ in model.named_parameters()]}]
    per_param = []
    for group in groups:
        for name in group["params"]:
            p = model.get_parameter(name)
            if tp_world is None or p.dim() < 2:
                block_size = sharded_block_size(p.shape, fmt)
            else:
                block_size = column_block_size(p.shape, fmt, tp_world)
            layout = {"state_format": fmt, "block_size": block_size} if block_size else {"state_format": "none"}
            per_param.append(dict(group, params=[p], **layout))
    opt = cls(per_param, lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT, compile=False, fused=fused, **kw)
    if fmt == "4bit_rank1" and fused is not False:
        opt.step = _rank1_per_parameter(opt.step)
    return opt


def _rank1_per_parameter(step):
    """``step`` with rank-1 states on the per-parameter path, as a sharded matrix's take (their column maxima span
    ranks): one process's fused C step would take them, and it rounds Adam's square root correctly where eager torch
    may not (by an ulp), so the parameters would differ."""

    @functools.wraps(step)
    def per_parameter(*args, **kwargs):
        with unittest.mock.patch.object(FourBitRank1Tensor, "fused_scale", None):
            return step(*args, **kwargs)

    return per_parameter


def shard_rows(p) -> slice:
    """The rows of ``p``'s global dim 0 that this rank's shard holds: FSDP2's chunks (:func:`rows_of`) along each
    ``Shard(0)`` mesh dimension in turn (one for FSDP2, the second of HSDP's two)."""
    from torch.distributed.tensor import Shard

    mesh, rows = p.device_mesh, slice(0, p.shape[0])
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            chunk = rows_of(dist.get_rank(mesh.get_group(dim)), mesh.size(dim), rows.stop - rows.start)
            rows = slice(rows.start + chunk.start, rows.start + chunk.stop)
    return rows


def shard_index(p) -> tuple:
    """The index of this rank's part of ``p``'s global tensor: its rows (:func:`shard_rows`), or under ``Shard(1)``
    (tensor parallelism, on one mesh dimension) its columns."""
    from torch.distributed.tensor import Shard

    columns = [dim for dim, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 1]
    if not columns:
        return (shard_rows(p),)
    mesh, dim = p.device_mesh, columns[0]
    return (slice(None), rows_of(dist.get_rank(mesh.get_group(dim)), mesh.size(dim), p.shape[1]))


def tensor_parallel(model, mesh=None):
    """``model`` with each matrix sharded along dim 1 (``Shard(1)``) over ``mesh`` (default: every rank) and every
    other parameter replicated: tensor parallelism's row-wise layers, each rank building its part (no
    communication)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu") if mesh is None else mesh
    rank, world = dist.get_rank(mesh.get_group()), mesh.size()
    for name, p in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        part = p.detach()[:, rows_of(rank, world, p.shape[1])] if p.dim() >= 2 else p.detach()
        placements = (Shard(1),) if p.dim() >= 2 else (Replicate(),)
        dt = as_dtensor(part.clone(), mesh, placements, p.shape, p.stride())
        setattr(model.get_submodule(module), attr, torch.nn.Parameter(dt))
    return model


def as_dtensor(local, mesh, placements, shape, stride):
    """``local`` (a shard of a tensor of global ``shape``) as a DTensor, where it is: as FSDP2 makes its sharded
    parameters and gradients (``DTensor.from_local`` would move it to the mesh's device)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def dtensor_like(p, local):
    """``local`` as a DTensor laid out like ``p`` (:func:`as_dtensor`)."""
    return as_dtensor(local, p.device_mesh, p.placements, p.shape, p.stride())


def set_grads(model, step):
    """Each rank's part of the same whole gradients (the model's parameters are sharded along dim 0 or dim 1, or
    not: :func:`shard_index`), taken by hand: no communication (the fake process group has none)."""
    from torch.distributed.tensor import DTensor

    for name, g in grads(model, step).items():
        p = model.get_parameter(name)
        p.grad = dtensor_like(p, g[shard_index(p)].contiguous()) if isinstance(p, DTensor) else g


def backward_to(model, step):
    """A backward through FSDP2 whose reduced gradients are exactly :func:`grads`: rank 0's loss has
    ``world * grads`` as its gradient, the other ranks' zero, and FSDP2 averages them (sums with zeros, and a
    division by a power of two: exact)."""
    scale = dist.get_world_size() if dist.get_rank() == 0 else 0
    device = next(model.parameters()).device_mesh.device_type  # where FSDP2 computes (host shards on GPUs too)
    model({name: (g * scale).to(device) for name, g in grads(model, step).items()}).backward()


def snapshot(model, opt):
    """Whole parameters and states (gathered from every rank: collective), keyed by parameter name."""
    from torch.distributed.tensor import DTensor

    def whole(t):
        # a copy: on a 1-rank mesh full_tensor() is the local tensor itself, which the next step changes
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for name, p in model.named_parameters():
        state = opt.state[p]
        out[name] = whole(p)
        for key in sorted(set(state) - {"step"}):
            out[f"{name}.{key}"] = whole(state[key])
        out[f"{name}.step"] = state["step"].clone()
    return out


def sharded(model, **kw):
    from torch.distributed.fsdp import fully_shard

    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def reference(steps, model=None, fused=False):
    """Single-process training on :func:`grads`: snapshots after ``STEPS`` steps ("mid") and at the end."""
    model = Net() if model is None else model
    opt = reference_optimizer(model, fused)
    snaps = {}
    for step in range(steps):
        if step == STEPS:
            snaps["mid"] = snapshot(model, opt)
        set_grads(model, step)
        opt.step()
    snaps["end"] = snapshot(model, opt)
    return snaps


def rows_of(rank, world, n):
    """The rows FSDP2 gives ``rank``: chunks of ceil(n / world), the last ones short or empty."""
    chunk = -(-n // world)
    return slice(min(n, rank * chunk), min(n, (rank + 1) * chunk))


@contextlib.contextmanager
def simulated_rank(rank, world):
    """This process as ``rank`` of ``world`` on torch's fake process group (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- 2-rank jobs -------------------------------------------------------------------------------------------
# what the ranks import, imported once by the fork server (see spawn)
PRELOAD = ["torchao_optim.testing", "torch.distributed.checkpoint", "torch.distributed.fsdp", "expecttest"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fault_file(out, rank):
    return os.path.join(out, f"fault.{rank}.txt")


def _entry(rank, world, port, job, out, args, timeout, backend):
    # a rank that crashes (a signal, not an exception) writes its Python stack here, for spawn() to report
    fault = open(_fault_file(out, rank), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(fault, all_threads=True)
    if "cuda" in backend:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        result = job(out, *args)
        if rank == 0:
            torch.save(result, os.path.join(out, f"{job.__name__}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(job, world, out, *args, timeout=TIMEOUT, backend="gloo"):
    """Run ``job(out, *args)`` on ``world`` ranks (a process group of ``backend``) and return what rank 0
    returned; fail after ``timeout`` seconds. A rank killed by a signal (a crash, not an exception) fails the job
    with each rank's Python stack; the job runs once more first, with a warning that carries those stacks: a crash
    that comes back fails, one that does not is reported, not hidden."""
    try:
        return _spawn_once(job, world, os.path.join(out, "first"), args, timeout, backend)
    except mp.ProcessExitedException as e:
        if e.signal_name is None:
            raise
        warnings.warn(f"{job.__name__} on {world} ranks crashed; running it again: {e}", stacklevel=2)
    return _spawn_once(job, world, os.path.join(out, "again"), args, timeout, backend)


def _spawn_once(job, world, out, args, timeout, backend):
    # Not fork: a child forked from a process that has run torch ops can hang (OpenMP's thread pool). A fork
    # server that imports torch and the packages the jobs use once, before any op, then forks the ranks, which
    # import only this module (on 2 cores, 4 ranks importing torch at once took 20 s). This module too where the
    # fork server finds it: Python 3.11's does not take the parent's sys.path, where pytest put this directory.
    # CUDA jobs are spawned: importing the kernels can initialize CUDA, and a process forked after that cannot use it.
    os.makedirs(out)
    forkable = "cuda" not in backend and "forkserver" in mp.get_all_start_methods()
    method = "forkserver" if forkable else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload([*PRELOAD, __name__])
    ctx = mp.start_processes(
        _entry,
        args=(world, _free_port(), job, out, args, timeout, backend),
        nprocs=world,
        join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{job.__name__} on {world} ranks did not finish within {timeout} s")
    except mp.ProcessExitedException as e:
        stacks = []
        for rank in range(world):
            text = ""
            with contextlib.suppress(OSError), open(_fault_file(out, rank)) as f:
                text = f.read().strip()
            if text:
                stacks.append(f"rank {rank}:\n{text}")
        raise mp.ProcessExitedException(
            "\n\n".join([str(e), *stacks]), e.error_index, e.error_pid, e.exit_code, e.signal_name
        ) from e
    return torch.load(os.path.join(out, f"{job.__name__}.pt"), weights_only=True)


def two_ranks(out, cases=(), reshard=()):
    """On 2 gloo ranks: FSDP2 on the gradients of :func:`grads` for 3 steps, a DCP checkpoint, 3 more steps;
    the checkpoint resumed on 2 ranks, and on 1 (rank 0 alone, on a mesh and a checkpoint group of its own);
    training on each rank's half of a global batch with FSDP2 and with DDP; then each of ``cases``
    (:func:`run_cases`), and each of ``reshard`` resharded 2 -> 1 -> 2 (:func:`resharded`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh

    ckpt = os.path.join(out, "ckpt")
    result = {}
    model = sharded(Net())
    opt = optimizer(model)
    for step in range(2 * STEPS):
        if step == STEPS:
            result["mid"] = snapshot(model, opt)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_grads(model, step)
        opt.step()
    result["end"] = snapshot(model, opt)

    alone = dist.new_group([0])  # every rank creates it; only rank 0 is in it
    for world in (2, 1):
        if world == 1 and dist.get_rank() != 0:
            continue
        group = alone if world == 1 else None
        model = sharded(Net(), mesh=DeviceMesh.from_group(alone, "cpu")) if world == 1 else sharded(Net())
        opt = optimizer(model)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt, process_group=group)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        result[f"loaded_on_{world}"] = snapshot(model, opt)
        for step in range(STEPS, 2 * STEPS):
            set_grads(model, step)
            opt.step()
        result[f"resumed_on_{world}"] = snapshot(model, opt)
    dist.barrier()

    rank, world = dist.get_rank(), dist.get_world_size()
    for kind in ("fsdp", "ddp"):
        model = sharded(Net()) if kind == "fsdp" else torch.nn.parallel.DistributedDataParallel(Net())
        opt = optimizer(model)
        for step in range(STEPS):
            x, y = batch(step)
            rows = rows_of(rank, world, len(x))
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
        result[f"train_{kind}"] = snapshot(model.module if kind == "ddp" else model, opt)
    # the same FSDP2 training with the step in backward: each sharded parameter steps in its hook, after its
    # gradient has been reduce-scattered
    model = sharded(Net())
    opt = optimizer(model)
    step_in_backward(model, opt)
    for step in range(STEPS):
        x, y = batch(step)
        rows = rows_of(rank, world, len(x))
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        assert all(p.grad is None for p in model.parameters())
    result["train_fsdp_in_backward"] = snapshot(model, opt)
    result["cases"] = run_cases(cases)
    result["reshard"] = reshard_cases(os.path.join(out, "reshard"), reshard) if reshard else []
    return result


# ---- cases: one optimizer, format and feature, sharded, against single-process training -------------------
OPTIMIZERS = {
    "AdamW": (AdamW, {}),
    "SGD8bit": (SGD8bit, {"momentum": 0.9}),
    "Lion8bit": (Lion8bit, {}),
    "Muon8bit": (Muon8bit, {}),
    "Adagrad8bit": (Adagrad8bit, {"lr_decay": 0.01}),
    # with momentum: the two-state rule (square_avg unsigned, momentum_buffer signed)
    "RMSprop8bit": (RMSprop8bit, {"momentum": 0.9}),
    # three states: the fused kernels' third state (the C step's on CPU ranks)
    "AdEMAMix8bit": (AdEMAMix8bit, {"t_alpha": 2, "t_beta3": 2}),
}
# each optimizer's state that is never negative (rank-1 scaled in "4bit_rank1", factored in "factored" and
# "factored4"), and a signed one, where it has one
UNSIGNED_KEY = {"AdamW": "exp_avg_sq", "Adagrad8bit": "sum", "RMSprop8bit": "square_avg", "AdEMAMix8bit": "exp_avg_sq"}
SIGNED_KEY = {
    "AdamW": "exp_avg",
    "Lion8bit": "exp_avg",
    "Adagrad8bit": "sum",
    "RMSprop8bit": "momentum_buffer",
    "AdEMAMix8bit": "exp_avg_slow",
}
FORMATS = ("none", "dtq8", "4bit", "fp8", "4bit_rank1", "factored", "factored4")
# the formats whose never-negative state of a matrix keeps per-row and per-column numbers, the column ones all-reduced
# by the step (optim/sharded_columns.py): rank-1 maxima, factored means
ROW_SCALED = ("4bit_rank1", "factored", "factored4")


@dataclasses.dataclass(frozen=True)
class Case:
    """Training :class:`Net` sharded, on the gradients of :func:`grads`: after ``STEPS`` steps its whole parameters
    and states must be bit for bit those of single-process training (:func:`case_reference`)."""

    opt: str = "AdamW"  # a key of OPTIMIZERS
    fmt: str = "dtq8"  # state_format
    # "fsdp": fully_shard over every rank (Shard(0)); "hsdp": a 2 x (world / 2) mesh, replicate x shard; "tp":
    # tensor parallelism over every rank (:func:`tensor_parallel`: matrices Shard(1), the rest replicated), with
    # gradients set by hand (grads="set"), compared with the layouts of TP_WORLD ranks
    mesh: str = "fsdp"
    offload: bool = False  # fully_shard(offload_policy=CPUOffloadPolicy())
    # "fused": fused=None, the fused C step; "eager": fused=False, per parameter; "offload_state": offload_state=True,
    # the fused Triton kernels (Triton's interpreter on the CPU) over each rank's shards streamed from host memory
    executor: str = "fused"
    # "set": each rank's rows of the gradients set by hand (set_grads); "backward": reduced by FSDP2 in backward
    # (backward_to), then step(); "in_backward": the same backward, with step_in_backward
    grads: str = "set"
    bf16: bool = False  # bf16 parameters, with bf16_stochastic_round=True
    dims: tuple = (256, 96, 67, 256)  # Net's

    def __str__(self):
        features = [self.mesh, self.executor, self.grads] + ["offload"] * self.offload + ["bf16"] * self.bf16
        features += [] if self.dims == Case.dims else ["x".join(map(str, self.dims))]
        return "-".join([self.opt, self.fmt, *features])


# The matrices Muon8bit orthogonalizes in the cases: fc1.weight (96, 256) and fc2.weight (67, 96), whose rows
# shard unevenly on 4 ranks (24 each; 17, 17, 17, 16) and on 2 (48 each; 34, 33). fc3.weight takes the AdamW fallback.
MUON_MATRICES = ("fc1.weight", "fc2.weight")


def case_groups(case):
    """The optimizer's parameter groups, by parameter name. Muon8bit: :data:`MUON_MATRICES` orthogonalized, in a
    group of their own; fc3.weight in a group with ``use_muon=False`` (the AdamW fallback on a sharded matrix);
    the 1-D parameters in a group of their own (the AdamW fallback, as on one process)."""
    names = [name for name, _ in Net().named_parameters()]
    if case.opt != "Muon8bit":
        return [{"params": names}]
    return [
        {"params": list(MUON_MATRICES)},
        {"params": [n for n in names if n.endswith("weight") and n not in MUON_MATRICES], "use_muon": False},
        {"params": [n for n in names if n.endswith("bias")]},
    ]


def case_options(case):
    cls, options = OPTIMIZERS[case.opt]
    fused = {"fused": None, "eager": False, "offload_state": True}[case.executor]
    options = dict(options, state_format=case.fmt, bf16_stochastic_round=case.bf16)
    return cls, fused, dict(options, offload_state=True) if case.executor == "offload_state" else options


def case_model(case, mesh=None):
    """:class:`Net` (in bf16 for ``case.bf16``), sharded on ``mesh`` (default: every rank) as ``case`` says."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = Net(case.dims).to(torch.bfloat16) if case.bf16 else Net(case.dims)
    if case.mesh == "tp":
        return tensor_parallel(model, mesh)
    # pinned host memory where a GPU copies gradients into it (the policy's default)
    pin = mesh is not None and mesh.device_type == "cuda"
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=pin)} if case.offload else {}
    return sharded(model, mesh=mesh, **policy)


def case_optimizer(model, case):
    cls, fused, options = case_options(case)
    groups = [dict(g, params=[model.get_parameter(n) for n in g["params"]]) for g in case_groups(case)]
    opt = cls(groups, lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT, compile=False, fused=fused, **options)
    if case.grads == "in_backward":
        step_in_backward(model, opt)
    return opt


def case_train(model, opt, case, steps):
    for step in steps:
        if case.grads == "set":
            set_grads(model, step)
        else:
            backward_to(model, step)
        if case.grads != "in_backward":
            opt.step()
            opt.zero_grad()


def case_snapshot(model, opt):
    """:func:`snapshot`, with how the steps ran: ``explain()`` and how many parameters the fused plans stepped
    and left to the per-parameter path (the plans of step() and those of each parameter stepped in backward);
    and the states not laid out as their parameters (mesh, placements, global shape)."""
    caches = list(opt._plans.values()) + [cache for _, cache in (opt._in_backward or {}).values()]
    fused = sum(len(plan.params) for cache in caches for plan in cache.get("plans", ()))
    rest = sum(len(cache.get("rest", ())) for cache in caches)
    misplaced = [
        f"{name}.{key}: {tuple(value.placements)}"
        for name, p in model.named_parameters()
        for key, value in opt.state[p].items()
        if key != "step"
        and (value.device_mesh, value.placements, value.shape) != (p.device_mesh, p.placements, p.shape)
    ]
    return dict(snapshot(model, opt), explain=opt.explain(), plans=(fused, rest), misplaced=misplaced)


@contextlib.contextmanager
def counting_orthogonalizations():
    """Within: the shapes of the matrices this rank orthogonalizes (Muon8bit's Newton-Schulz runs), listed."""
    from torchao_optim.optim import muon

    real, shapes = muon.orthogonalize, []

    def counted(g, *args, **kw):
        shapes.append(tuple(g.shape))
        return real(g, *args, **kw)

    muon.orthogonalize = counted
    try:
        yield shapes
    finally:
        muon.orthogonalize = real


def run_cases(cases, steps=STEPS, device="cpu") -> list:
    """Each of ``cases`` on every rank (HSDP on a 2 x (world / 2) mesh), on meshes of ``device``:
    :func:`case_snapshot` after ``steps``, with the shapes of the matrices each rank orthogonalized (Muon8bit)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    meshes = {"fsdp": init_device_mesh(device, (world,)) if device != "cpu" else None, "tp": None}
    if any(case.mesh == "hsdp" for case in cases):
        meshes["hsdp"] = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    results = []
    for case in cases:
        model = case_model(case, meshes[case.mesh])
        opt = case_optimizer(model, case)
        with counting_orthogonalizations() as shapes:
            case_train(model, opt, case, range(steps))
        orthogonalized = [None] * world
        dist.all_gather_object(orthogonalized, shapes)
        results.append(dict(case_snapshot(model, opt), orthogonalized=orthogonalized))
    return results


def reshard_worlds(world) -> tuple:
    """The numbers of ranks a checkpoint is resharded through in a job of ``world`` ranks."""
    return (4, 2, 1, 4) if world == 4 else (2, 1, 2)


def resharded(case, out, groups, worlds=(4, 2, 1, 4)) -> dict:
    """``case`` trained on each of ``worlds`` ranks in turn (``groups``: their process groups, None for every
    rank), ``STEPS`` steps each, each time resuming the DCP checkpoint the ranks before saved:
    :func:`case_snapshot` after each load and each stage, with the shapes of the matrices each rank
    orthogonalized in the stage (Muon8bit)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh

    result, ckpt = {}, None
    for stage, world in enumerate(worlds):
        saved = os.path.join(out, f"{case}-{stage}")
        if dist.get_rank() < world:
            group = groups[world]
            model = case_model(case, DeviceMesh.from_group(group, "cpu") if group is not None else None)
            opt = case_optimizer(model, case)
            if ckpt is not None:
                msd, osd = get_state_dict(model, opt)
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt, process_group=group)
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
                result[f"loaded_{stage}"] = case_snapshot(model, opt)
            with counting_orthogonalizations() as shapes:
                case_train(model, opt, case, range(stage * STEPS, (stage + 1) * STEPS))
            orthogonalized = [None] * world
            dist.all_gather_object(orthogonalized, shapes, group=group)
            result[f"stage_{stage}"] = dict(case_snapshot(model, opt), orthogonalized=orthogonalized)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=saved, process_group=group)
        ckpt = saved
        dist.barrier()
    return result


def cases_job(out, cases, reshard=(), device="cpu", extras=()):
    """Each of ``cases`` (:func:`run_cases`, on meshes of ``device``), then each of ``reshard`` resharded
    4 -> 2 -> 1 -> 4, or 2 -> 1 -> 2 on 2 ranks (:func:`resharded`), then each job of ``extras``."""
    result = {"cases": run_cases(cases, device=device)}
    if reshard:
        result["reshard"] = reshard_cases(out, reshard)
    result["extras"] = [job() for job in extras]
    return result


class TPShapes(torch.nn.Module):
    """Matrices whose columns tensor parallelism splits (:func:`tensor_parallel`) on block boundaries, or not, on 2 and
    4 ranks (:func:`column_block_size`): ``both`` (8, 3, 64), rows of 192 in blocks of 64 (128 for 4-bit's 128),
    columns 2 + 1 on 2 ranks and 1 + 1 + 1 + 0 on 4; ``two`` (16, 512), 256 columns each on 2 ranks (128 on 4: not a
    whole 256-element block); ``four`` (8, 6, 64), rows of 384 in blocks of 128, 3 columns (192 elements) each on 2
    ranks, 2 + 2 + 2 + 0 on 4; ``neither`` (67, 96), blocks of 32, 48 or 24 columns; and a vector, ``bias``."""

    SHAPES = {"both": (8, 3, 64), "two": (16, 512), "four": (8, 6, 64), "neither": (67, 96), "bias": (96,)}

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        for name, shape in self.SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1))


class EdgeShards(torch.nn.Module):
    """Rank-1 scaled (or factored) matrices whose shards are edge cases on 4 ranks: ``pos`` (1, 8, 512), a matrix of
    8 rows of 512 whose dim 0 has one index (rank 0 holds all of it, the other ranks nothing), and ``small`` (3, 512):
    a row on each of ranks 0-2 (a one-row shard is one row of the matrix, not a vector), none on rank 3."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.pos = torch.nn.Parameter(torch.randn(1, 8, 512, generator=gen) * 0.1)
        self.small = torch.nn.Parameter(torch.randn(3, 512, generator=gen) * 0.1)


def edge_shards(model=None, fmt="4bit_rank1") -> dict:
    """AdamW with ``fmt`` (a ROW_SCALED format) on :class:`EdgeShards`, fully sharded over every rank (or ``model`` as
    it is, on one process): :func:`snapshot` after ``STEPS`` steps on :func:`grads`, gathered whole ("trained"); and
    of a new optimizer that loaded its state dict dequantized (fp32 states, quantized anew: "reloaded")."""
    from torch.distributed.fsdp import fully_shard

    one_process = model is not None
    model = fully_shard(EdgeShards()) if model is None else model
    options = dict(lr=LR, weight_decay=WD, state_format=fmt, min_quant_size=MIN_QUANT, compile=False)
    opt = AdamW(model.parameters(), **options)
    if one_process and fmt == "4bit_rank1":  # the path sharded matrices take
        opt.step = _rank1_per_parameter(opt.step)
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
    reloaded = AdamW(model.parameters(), **options)
    reloaded.load_state_dict(dequantize_state_dict(opt.state_dict()))
    return {"trained": snapshot(model, opt), "reloaded": snapshot(model, reloaded)}


def reshard_cases(out, reshard) -> list:
    """Each of ``reshard`` resharded through :func:`reshard_worlds` (:func:`resharded`), on 4 or 2 ranks."""
    world = dist.get_world_size()
    if world not in (2, 4):
        raise ValueError(f"resharding runs on 4 ranks (4 -> 2 -> 1 -> 4) or 2 (2 -> 1 -> 2), not {world}")
    groups = {world: None, 1: dist.new_group([0])}  # every rank creates each
    if world == 4:
        groups[2] = dist.new_group([0, 1])
    return [resharded(case, out, groups, reshard_worlds(world)) for case in reshard]


def case_reference(case, stages=1) -> list:
    """Single-process training for ``case``: its snapshot after each ``STEPS`` steps, ``stages`` times."""
    cls, fused, options = case_options(case)
    options.pop("offload_state", None)  # the same bits as state on the device
    model = Net(case.dims).to(torch.bfloat16) if case.bf16 else Net(case.dims)
    tp_world = TP_WORLD if case.mesh == "tp" else None
    opt = reference_optimizer(model, fused, cls, groups=case_groups(case), tp_world=tp_world, **options)
    snaps = []
    for stage in range(stages):
        for step in range(stage * STEPS, (stage + 1) * STEPS):
            set_grads(model, step)
            opt.step()
        snaps.append(snapshot(model, opt))
    return snaps


def case_problems(case, ours, ref, what="", stepped=True) -> list[str]:
    """What differs between a sharded run's :func:`case_snapshot` and single-process training's snapshot: every
    tensor, bit for bit; and, where it ``stepped``, how: every parameter on the fused C step (``explain()`` says so
    and the plans stepped them all) or, for ``executor="eager"``, on the per-parameter path."""
    what = f"{case}{what}"
    problems = []
    if sorted(k for k in ours if k not in ("explain", "plans", "misplaced", "orthogonalized")) != sorted(ref):
        problems.append(f"{what}: keys {sorted(ours)} != {sorted(ref)}")
    for key in ref:
        if key in ours:
            problems += same_tensor_problems(ours[key], ref[key], f"{what}: {key}")
    if ours["misplaced"]:
        problems.append(f"{what}: states not laid out as their parameters: {ours['misplaced']}")
    if case.opt == "Muon8bit" and "orthogonalized" in ours:
        # each matrix orthogonalized once per step in each replica group, on the rank of the group that owns it:
        # MUON_MATRICES[i] on rank i modulo the ranks that split the rows (every rank of an HSDP replica group)
        world = len(ours["orthogonalized"])
        size = world // 2 if case.mesh == "hsdp" else world
        shapes = [tuple(Net(case.dims).get_parameter(name).shape) for name in MUON_MATRICES]
        for rank, done in enumerate(ours["orthogonalized"]):
            owned = [shape for i, shape in enumerate(shapes) if i % size == rank % size] * STEPS
            if sorted(done) != sorted(owned):
                problems.append(f"{what}: rank {rank} orthogonalized {done}, expected {owned}")
    routes = [line for line in ours["explain"].splitlines() if line.startswith("  ")]
    n_params = sum(1 for _ in Net(case.dims).parameters())
    # rank-1 scaled and factored states (the never-negative state of a matrix in ROW_SCALED formats): the
    # per-parameter path, which all-reduces their column statistics, on every rank and executor (as on one process,
    # where the fused kernels do not read them); every other parameter the fused C step (Muon's matrices too: their
    # momentum fused, their directions gathered for Newton-Schulz after the launch)
    unsigned = UNSIGNED_KEY.get(case.opt, "exp_avg_sq")
    rank1 = sum(1 for k, v in ours.items() if k.endswith("." + unsigned) and getattr(v, "rows", 0))
    if not stepped:
        pass
    elif case.executor == "fused":
        spanning = [line for line in routes if "column statistics (rank-1 maxima, factored means) span ranks" in line]
        others = [line for line in routes if line not in spanning]
        if not routes or not all(line.startswith("  fused C step:") for line in others):
            problems.append(f"{what}: not every parameter takes the fused C step:\n{ours['explain']}")
        expected = (n_params - rank1, rank1)
        if ours["plans"] != expected:
            problems.append(f"{what}: (fused, not fused) parameters {ours['plans']}, expected {expected}")
    elif case.executor == "offload_state":
        if not routes or not all("state streamed from host memory" in line for line in routes):
            problems.append(f"{what}: not every parameter's state is streamed from host memory:\n{ours['explain']}")
    elif not all("per-parameter path, eager" in line for line in routes):
        problems.append(f"{what}: not every parameter takes the per-parameter path:\n{ours['explain']}")
    # AdamW's fc1 and fc2 (fc3's rows of 67 take no block: plain state); Muon orthogonalizes them instead
    if (case.fmt in ROW_SCALED and case.opt in UNSIGNED_KEY and case.dims == Case.dims) != (rank1 == 2):
        problems.append(f"{what}: {rank1} rank-1 scaled or factored states")
    # the reference's layouts come from the block rule: every format quantizes fc1.weight
    key = "fc1.weight." + SIGNED_KEY.get(case.opt, "momentum_buffer")
    quantized = isinstance(ours.get(key), QuantizedState)
    if quantized != (case.fmt != "none"):
        problems.append(f"{what}: {key} is a {type(ours.get(key)).__name__}")
    return problems


# ---- the tests --------------------------------------------------------------------------------------------
def crashes(out, times):
    """Rank 1 kills itself with SIGSEGV in its first ``times`` attempts (:func:`spawn`'s folders), as a crash in
    native code would; rank 0 returns its rank's sum with rank 1's."""
    attempts = ("first", "again")[:times]
    if dist.get_rank() == 1 and os.path.basename(out) in attempts:
        os.kill(os.getpid(), signal.SIGSEGV)
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {"total": total}


class TestSpawn(unittest.TestCase):
    """The harness the real-rank tests stand on: a rank that crashes names its Python stack, and the job's one
    retry reports the first crash, and fails where the crash comes back."""

    def test_a_crash_once_is_run_again_and_reported(self):
        with tempfile.TemporaryDirectory() as out, self.assertWarnsRegex(UserWarning, "crashes on 2 ranks") as w:
            result = spawn(crashes, 2, out, 1)
        self.assertEqual(result["total"].item(), 3.0)  # the second run's, on both ranks
        self.assertIn("rank 1:\nFatal Python error: Segmentation fault", str(w.warning))
        self.assertIn(" in crashes", str(w.warning))  # the crashed rank's Python frame

    def test_a_crash_that_comes_back_fails(self):
        with tempfile.TemporaryDirectory() as out, self.assertWarns(UserWarning):
            with self.assertRaisesRegex(mp.ProcessExitedException, "(?s)SIGSEGV.*rank 1:.* in crashes"):
                spawn(crashes, 2, out, 2)


class TestBlockRule(expecttest.TestCase):
    def test_block_rule(self):
        # from the global shape only: the format's block, halved while it does not divide the row, to 1/8 of it
        shapes = [(96, 256), (67, 96), (256, 67), (4096,), (8, 4, 8), (3, 100), (5, 5632), (3, 2, 16)]
        self.assertEqual([row_aligned_block_size(s, 256) for s in shapes], [256, 32, None, None, 32, None, 256, 32])
        self.assertEqual(row_aligned_block_size((10, 48), 128), 16)  # a 4-bit format's 128: down to 16
        self.assertIsNone(row_aligned_block_size((10, 8), 128))


class TestColumnSlices(expecttest.TestCase):
    """The op table's columns of a quantized state (``Shard(1)``'s DCP loads and ``full_tensor()``): whole blocks of
    each row, as views that writes go through; anything else refused by name."""

    def test_columns_are_whole_blocks_and_views(self):
        x = torch.randn(5, 8, 16, generator=torch.Generator().manual_seed(0))  # rows of 128: blocks of 32
        for fmt in ("dtq8", "4bit", "fp8"):
            cls = get_state_format(fmt)
            whole = cls.from_float(x, signed=True, block_size=32)
            cols = cls.from_float(x[:, 2:6].contiguous(), signed=True, block_size=32)  # elements 32:96 of a row
            assert_same_tensor(self, whole[:, 2:6].compact(), cols, fmt)
            self.assertTrue(torch.equal(whole[:, 2:6].dequantize(), cols.dequantize()), fmt)
            self.assertTrue(torch.equal(whole[:, 2:6][1:3].dequantize(), cols.dequantize()[1:3]), fmt)
            # a write into a slice of columns lands in the whole state (DCP copies into these views)
            state = cls.zeros((5, 8, 16), signed=True, block_size=32)
            state[:, 2:6].copy_(cols)
            assert_same_tensor(self, state[:, 2:6].compact(), cols, fmt)
            self.assertEqual(state.dequantize()[:, :2].abs().max().item(), 0.0, fmt)
            state[:, 2:4].zero_()
            self.assertEqual(state.dequantize()[:, 2:4].abs().max().item(), 0.0, fmt)
            # concatenated and padded along dim 1 (an all-gather of Shard(1) shards)
            assert_same_tensor(self, torch.cat([whole[:, :2], whole[:, 2:6], whole[:, 6:]], dim=1), whole, fmt)
            padded = torch.nn.functional.pad(whole[:, :6].clone(), (0, 0, 0, 2))
            self.assertTrue(torch.equal(padded.dequantize()[:, :6], whole.dequantize()[:, :6]), fmt)
        errors = []
        # off block boundaries; and a state whose scales are per row and per column (fp8's whole state, from the
        # loop, slices on boundaries)
        rank1 = get_state_format("4bit_rank1").zeros((4, 64), signed=False)
        for state, index in ((whole, slice(1, 6)), (whole, slice(0, 2)), (rank1, slice(0, 32))):
            try:
                state[:, index]
            except (ValueError, NotImplementedError) as err:
                errors.append(textwrap.fill(f"{type(err).__name__}: {err}", 100))
        self.assertExpectedInline(
            "\n".join(errors),
            """\
ValueError: Fp8Tensor: columns [1:6] of shape (5, 8, 16) cover elements [16:96] of each row of 128,
which are not whole blocks of the row (block_size=32); slicing along dim 1 keeps every block whole
NotImplementedError: FourBitRank1Tensor: slicing is supported along dim 0 with step 1 only, got
dim=1, step=1""",
        )


def assertShardOf(test, ours, ref, rows, what):
    """``ours`` (a local parameter or state) is exactly ``rows`` of ``ref`` (the single-process one)."""
    if isinstance(ref, QuantizedState):
        test.assertIs(type(ours), type(ref), what)
        test.assertEqual(ours.attrs(), ref.attrs(), what)
        row, bs = math.prod(ref.shape[1:]), ref.block_size
        first, last = rows.start * row, rows.stop * row
        test.assertEqual((first % bs, last % bs), (0, 0), f"{what}: rows are not whole blocks")
        per_byte = 8 // ref.fast_path_layout().bits  # 4-bit codes: two per byte
        ref = type(ref)(
            (rows.stop - rows.start,) + tuple(ref.shape[1:]),
            ref.dtype,
            codes=ref.codes[first // per_byte : last // per_byte],
            absmax=ref.absmax[first // bs : last // bs],
            **ref.attrs(),
        )
        assert_same_tensor(test, ours, ref, what)
    else:
        assert_same_tensor(test, ours, ref.detach()[rows], what)


def assertColumnsOf(test, ours, ref, cols, what):
    """``ours`` (a local parameter or state) is exactly columns ``cols`` of ``ref`` (the single-process one): for a
    quantized ``ref``, the codes and scales of those columns of each row, which must be whole blocks."""
    if isinstance(ref, QuantizedState):
        rows, inner, bs = ref.shape[0], math.prod(ref.shape[2:]), ref.block_size
        first, last = cols.start * inner, cols.stop * inner  # elements of each row
        test.assertEqual((first % bs, last % bs), (0, 0), f"{what}: columns are not whole blocks")
        per_byte = 8 // ref.fast_path_layout().bits  # 4-bit codes: two per byte
        codes = ref.codes.view(rows, -1)[:, first // per_byte : last // per_byte].reshape(-1)
        absmax = ref.absmax.view(rows, -1)[:, first // bs : last // bs].reshape(-1)
        shape = (rows, cols.stop - cols.start, *ref.shape[2:])
        ref = type(ref)(shape, ref.dtype, codes=codes, absmax=absmax, **ref.attrs())
        assert_same_tensor(test, ours, ref, what)
    else:
        assert_same_tensor(test, ours, ref.detach()[:, cols], what)


@unittest.skipUnless(DISTRIBUTED, "torch.distributed is not available")
class TestShardedStep(expecttest.TestCase):
    """Each rank of an FSDP2 model simulated in this process: its local parameters and states are, after every
    step, exactly its rows of single-process training on the same gradients (the update is elementwise and
    every shard is whole blocks), uneven and empty shards included."""

    def check_ranks(self, world, make_model, steps=STEPS, fused=False, opt_kw=None, offload_state=False, **shard_kw):
        """``world`` simulated ranks train ``make_model()`` sharded; each rank's parameters and states must be its
        rows of single-process training's, bit for bit (``offload_state``: the sharded optimizer's only, so that
        it is checked against state on the device). Returns the last rank's model and optimizer."""
        opt_kw = opt_kw or {}
        ref_model = make_model()
        ref_opt = reference_optimizer(ref_model, fused, **opt_kw)
        for step in range(steps):
            set_grads(ref_model, step)
            ref_opt.step()
        ref_state = {name: ref_opt.state[p] for name, p in ref_model.named_parameters()}
        for rank in range(world):
            with simulated_rank(rank, world):
                model = sharded(make_model(), **shard_kw)
                opt = optimizer(model, fused, **opt_kw, **({"offload_state": True} if offload_state else {}))
                for step in range(steps):
                    set_grads(model, step)
                    opt.step()
                for name, p in model.named_parameters():
                    rows = rows_of(rank, world, p.shape[0])
                    assertShardOf(self, p.to_local(), ref_model.get_parameter(name), rows, f"rank {rank} {name}")
                    for key in sorted(set(opt.state[p]) - {"step"}):
                        state = opt.state[p][key]
                        self.assertEqual((state.shape, state.placements), (p.shape, p.placements))
                        assertShardOf(self, state.to_local(), ref_state[name][key], rows, f"rank {rank} {name} {key}")
                    if fused and not offload_state:  # (offloaded, a parameter no kernel covers is refused)
                        plans = opt._plans[id(opt.param_groups[0])]
                        self.assertEqual(plans["rest"], [], "parameters left to the compiled path")
        return model, opt

    def test_two_ranks_uneven(self):
        self.check_ranks(2, Net)

    def test_other_formats_and_optimizers(self):
        # the op table and the block rule serve every row-shardable format and every optimizer of ours
        for opt_kw in (
            dict(cls=AdamW, state_format="4bit"),
            dict(cls=AdamW, state_format="fp8"),
            dict(cls=SGD8bit, momentum=0.9),
            dict(cls=Lion8bit),
        ):
            with self.subTest(**{k: getattr(v, "__name__", v) for k, v in opt_kw.items()}):
                self.check_ranks(2, Net, steps=3, opt_kw=opt_kw)

    def test_four_ranks_with_an_empty_shard(self):
        # fc2.weight (3, 512) has 3 rows: ranks 0-2 hold one each, rank 3 none (empty states, that still step)
        self.check_ranks(4, lambda: Net((64, 512, 3, 64)))

    def test_cpu_offload(self):
        # CPUOffloadPolicy keeps the sharded parameters, gradients and states on the CPU, where the step runs
        from torch.distributed.fsdp import CPUOffloadPolicy

        self.check_ranks(2, Net, offload_policy=CPUOffloadPolicy(pin_memory=False))

    def test_load_a_single_process_state_dict(self):
        # A whole state of the global shape (a checkpoint saved without sharding): each rank keeps its rows,
        # exactly where the layouts agree (fc1.weight, blocks of 256), converted where they do not (fc2.weight:
        # blocks of 256 saved, 32 sharded; fc3.weight: quantized saved, plain sharded).
        model = Net()
        opt = optimizer(model)
        for step in range(STEPS):
            set_grads(model, step)
            opt.step()
        saved = opt.state_dict()
        for rank in range(2):
            with simulated_rank(rank, 2):
                ours = sharded(Net())
                ours_opt = optimizer(ours)
                ours_opt.load_state_dict(saved)
                for name, p in ours.named_parameters():
                    rows = rows_of(rank, 2, p.shape[0])
                    for key in ("exp_avg", "exp_avg_sq"):
                        whole, state = opt.state[model.get_parameter(name)][key], ours_opt.state[p][key]
                        what = f"rank {rank} {name} {key}"
                        self.assertEqual((state.shape, state.placements), (p.shape, p.placements), what)
                        if name == "fc1.weight":
                            assertShardOf(self, state.to_local(), whole, rows, what)
                            continue
                        local = state.to_local()
                        expected = whole.dequantize()[rows] if isinstance(whole, QuantizedState) else whole[rows]
                        if isinstance(local, QuantizedState):
                            self.assertEqual(local.block_size, 32, what)
                            expected = type(local).from_float(expected, **local.attrs())
                        assert_same_tensor(self, local, expected, what)
                plain = dequantize_state_dict(ours_opt.state_dict())["state"][0]["exp_avg"]  # fc1.weight
                self.assertEqual((type(plain.to_local()), plain.placements), (torch.Tensor, ours.fc1.weight.placements))
                self.assertTrue(
                    torch.equal(plain.to_local(), ours_opt.state[ours.fc1.weight]["exp_avg"].to_local().dequantize())
                )

    def test_load_a_single_process_rank1_state_dict(self):
        # A whole "4bit_rank1" state (saved without sharding, in blocks of 32 as sharded) splits among ranks with no
        # collective: each rank keeps its rows' codes and row maxima and the whole tensor's column maxima, exactly
        # its rows of the whole state (fc2.weight: rows 0-33 and 34-66). A plain fp32 state (fc1.weight's, here) is
        # quantized whole first, then split.
        options = dict(cls=AdamW, state_format="4bit_rank1", block_size=32)
        model = Net()
        opt = optimizer(model, **options)
        set_grads(model, 0)
        opt.step()
        saved = opt.state_dict()
        fc1 = saved["state"][0]
        fc1["exp_avg_sq"] = fc1["exp_avg_sq"].dequantize()
        whole = {
            "fc1.weight": get_state_format("4bit_rank1").from_float(fc1["exp_avg_sq"], signed=False, block_size=32),
            "fc2.weight": opt.state[model.fc2.weight]["exp_avg_sq"],
        }
        for rank in range(2):
            with simulated_rank(rank, 2):
                ours = sharded(Net())
                ours_opt = optimizer(ours, **options)
                ours_opt.load_state_dict(saved)
                for name, state in whole.items():
                    rows = rows_of(rank, 2, state.shape[0])
                    local = ours_opt.state[ours.get_parameter(name)]["exp_avg_sq"].to_local()
                    assert_same_tensor(self, local, state[rows.start : rows.stop].clone(), f"rank {rank} {name}")
                    self.assertEqual(local.absmax.shape, (local.rows + state.shape[1],))

    @unittest.skipUnless(fused_available("cpu"), "the fused executor needs Triton (its interpreter on the CPU)")
    def test_fused_executor_on_shards(self):
        # Triton's interpreter is slow: a small model; fc1.weight (23, 64) quantized in blocks of 64, 12 and 11
        # rows; the rest in plain state (odd rows, or below min_quant_size)
        self.check_ranks(2, lambda: Net((64, 23, 64, 4)), steps=2, fused=True)

    @unittest.skipUnless(fused_available("cpu"), "the fused executor needs Triton (its interpreter on the CPU)")
    def test_offloaded_state_on_shards(self):
        # offload_state=True (in Triton's interpreter here; on CUDA through the GPU window: test_offload.py): each
        # rank keeps its own shards' states in one host arena of their bytes alone, with the bits of state kept on
        # the device; a state_dict loaded into a new offloaded optimizer continues as the first one does.
        from torchao_optim.optim.offload import state_nbytes

        model, opt = self.check_ranks(2, lambda: Net((64, 23, 64, 4)), steps=2, fused=True, offload_state=True)
        with simulated_rank(1, 2):
            chunks = opt._plans[id(opt.param_groups[0])]["chunks"]
            arena = sum(c.nbytes for c in chunks)
            offloaded = [opt.state[p] for p in model.parameters() if "exp_avg" in opt.state[p]]
            self.assertEqual(arena, sum(state_nbytes(s[k]) for s in offloaded for k in ("exp_avg", "exp_avg_sq")))
            self.assertEqual(
                sum(local(s["exp_avg"]).numel() for s in offloaded), sum(local(p).numel() for p in model.parameters())
            )
            again = optimizer(model, True, offload_state=True)
            again.load_state_dict(opt.state_dict())
            params = [p.detach().to_local().clone() for p in model.parameters()]
            for o in (opt, again):
                with torch.no_grad():
                    for p, start in zip(model.parameters(), params):
                        p.to_local().copy_(start)
                set_grads(model, 2)
                o.step()
                if o is opt:
                    first = [p.detach().to_local().clone() for p in model.parameters()]
            for p, q in zip(model.parameters(), first):
                self.assertTrue(torch.equal(p.to_local(), q))

    def test_cpu_offload_policy_on_a_gpu_mesh(self):
        # What CPUOffloadPolicy makes on GPUs: parameters and gradients whose shards are in host memory, on a mesh
        # of device type "cuda" (built as FSDP2 builds them: fully_shard on a CUDA mesh needs a GPU). The states
        # stay in host memory with their parameters (DTensor.from_local would move them to the mesh's device),
        # every parameter takes the fused C step, and each rank's parameters and states are its rows of
        # single-process fused CPU training's, bit for bit.
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard

        ref_model = Net()
        ref_opt = reference_optimizer(ref_model, fused=None)
        for step in range(STEPS):
            set_grads(ref_model, step)
            ref_opt.step()
        for rank in range(2):
            with simulated_rank(rank, 2):
                mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
                model = Net()
                for module in (model.fc1, model.fc2, model.fc3):
                    for name, p in list(module.named_parameters()):
                        shard = p.detach()[rows_of(rank, 2, len(p))].clone()
                        dt = as_dtensor(shard, mesh, (Shard(0),), p.shape, p.stride())
                        setattr(module, name, torch.nn.Parameter(dt))
                opt = optimizer(model, fused=None)
                for step in range(STEPS):
                    set_grads(model, step)
                    opt.step()
                routes = [line for line in opt.explain().splitlines() if line.startswith("  ")]
                self.assertTrue(all(line.startswith("  fused C step:") for line in routes), opt.explain())
                self.assertEqual(opt._plans[id(opt.param_groups[0])]["rest"], [])
                for name, p in model.named_parameters():
                    rows = rows_of(rank, 2, p.shape[0])
                    assertShardOf(self, p.to_local(), ref_model.get_parameter(name), rows, f"rank {rank} {name}")
                    for key in ("exp_avg", "exp_avg_sq"):
                        state, what = opt.state[p][key], f"rank {rank} {name} {key}"
                        self.assertEqual((state.device_mesh, state.to_local().device.type), (mesh, "cpu"), what)
                        assertShardOf(
                            self, state.to_local(), ref_opt.state[ref_model.get_parameter(name)][key], rows, what
                        )

    def test_tensor_parallel_quantized_where_blocks_fit_columns(self):
        # Tensor parallelism: matrices sharded along dim 1 (Shard(1)), the rest replicated, on 2 and 4 ranks. A
        # matrix's state is quantized, with the block rule's blocks, where every block lies within one rank's
        # columns (column_block_size: a condition on the mesh's size too), else kept plain; each rank's state is
        # its columns of single-process training's with those layouts, bit for bit (codes and scales of the same
        # blocks), on the fused C step. TPShapes has a matrix quantized on both meshes, one on 2 ranks only, one
        # on 4 only (3 columns of 64: 2 + 1 on 2 ranks, 1 + 1 + 1 + 0 on 4, an empty shard), and one on neither.
        # (Muon8bit refuses such a matrix: test_muon_refuses_a_sharding_it_cannot_gather; real ranks and DCP
        # resharding: TestTwoRanks.test_tensor_parallel_*.)
        combos = [("AdamW", fmt, 2) for fmt in FORMATS] + [("SGD8bit", "dtq8", 2), ("Lion8bit", "4bit", 2)]
        combos += [("AdamW", "dtq8", 4), ("AdamW", "4bit_rank1", 4)]
        layouts = {}
        for name, fmt, world in combos:
            cls, options = OPTIMIZERS[name]
            ref_model = TPShapes()
            ref_opt = reference_optimizer(ref_model, None, cls, tp_world=world, state_format=fmt, **options)
            for step in range(STEPS):
                set_grads(ref_model, step)
                ref_opt.step()
            for rank in range(world):
                what = f"{name} {fmt} rank {rank} of {world}"
                with simulated_rank(rank, world):
                    model = tensor_parallel(TPShapes())
                    opt = optimizer(model, fused=None, cls=cls, state_format=fmt, **options)
                    for step in range(STEPS):
                        set_grads(model, step)
                        opt.step()
                    routes = [line for line in opt.explain().splitlines() if line.startswith("  ")]
                    self.assertTrue(all(line.startswith("  fused C step:") for line in routes), opt.explain())
                    for pname, p in model.named_parameters():
                        ref_p = ref_model.get_parameter(pname)
                        where = shard_index(p)
                        assert_same_tensor(self, p.to_local(), ref_p.detach()[where], f"{what} {pname}")
                        for key in sorted(set(ref_opt.state[ref_p]) - {"step"}):
                            state, ref_state = opt.state[p][key], ref_opt.state[ref_p][key]
                            self.assertEqual((state.shape, state.placements), (p.shape, p.placements), what)
                            if p.dim() < 2:  # replicated: the whole state on every rank
                                assert_same_tensor(self, state.to_local(), ref_state, f"{what} {pname} {key}")
                            else:
                                assertColumnsOf(self, state.to_local(), ref_state, where[1], f"{what} {pname} {key}")
                        if name == "AdamW" and rank == 0:
                            state = opt.state[p]["exp_avg"].to_local()
                            block = getattr(state, "block_size", "plain")
                            layouts.setdefault(f"{fmt} on {world}", []).append(f"{pname} {block}")
        self.assertExpectedInline(
            "\n".join(f"{k}: {', '.join(v)}" for k, v in layouts.items()),
            """\
none on 2: both plain, two plain, four plain, neither plain, bias plain
dtq8 on 2: both 64, two 256, four plain, neither plain, bias plain
4bit on 2: both 64, two 128, four plain, neither plain, bias plain
fp8 on 2: both 64, two 256, four plain, neither plain, bias plain
4bit_rank1 on 2: both plain, two plain, four plain, neither plain, bias plain
factored on 2: both plain, two plain, four plain, neither plain, bias plain
factored4 on 2: both plain, two plain, four plain, neither plain, bias plain
dtq8 on 4: both 64, two plain, four 128, neither plain, bias plain
4bit_rank1 on 4: both plain, two plain, four plain, neither plain, bias plain""",
        )

    def test_tensor_parallel_loads_a_single_process_state_dict(self):
        # A whole state of the global shape: each Shard(1) rank keeps its columns, exactly where the layouts agree
        # (TPShapes.two: blocks of 256 on one process and on 2 ranks), else quantized anew from them (both: blocks of
        # 64 under tensor parallelism), or plain (four, neither)
        ref_model = TPShapes()
        ref_opt = AdamW(ref_model.parameters(), lr=LR, min_quant_size=MIN_QUANT, compile=False, state_format="dtq8")
        set_grads(ref_model, 0)
        ref_opt.step()
        for rank in range(2):
            with simulated_rank(rank, 2):
                model = tensor_parallel(TPShapes())
                opt = AdamW(model.parameters(), lr=LR, min_quant_size=MIN_QUANT, compile=False, state_format="dtq8")
                opt.load_state_dict(ref_opt.state_dict())
                for name, p in model.named_parameters():
                    ref_state = ref_opt.state[ref_model.get_parameter(name)]["exp_avg"]
                    state, where = opt.state[p]["exp_avg"].to_local(), shard_index(p)
                    if name == "two":
                        assertColumnsOf(self, state, ref_state, where[1], f"rank {rank} {name}")
                        continue
                    part = ref_state.dequantize()[where].contiguous() if name != "bias" else ref_state
                    if name == "both":
                        part = DTQ8bitTensor.from_float(part, signed=True, block_size=64)
                    assert_same_tensor(self, state, part, f"rank {rank} {name}")

    def test_muon_refuses_a_sharding_it_cannot_gather(self):
        # Muon8bit gathers a matrix split by rows along one mesh dimension (FSDP2, HSDP: TestTwoRanks,
        # TestFourRanks). Others are refused when the optimizer is built, before any step could update some
        # parameters and then fail on this one: columns (tensor parallelism's Shard(1)), and rows split along two
        # mesh dimensions.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard

        errors = []
        with simulated_rank(0, 4):
            for shape, placements in (((4,), (Shard(1),)), ((2, 2), (Shard(0), Shard(0)))):
                mesh = init_device_mesh("cpu", shape)
                weight, bias = torch.zeros(96, 256), torch.zeros(96)
                local = weight[:24] if placements[0] == Shard(0) else weight[:, :64]
                p = torch.nn.Parameter(as_dtensor(local.clone(), mesh, placements, weight.shape, weight.stride()))
                replicated = (Replicate(),) * len(shape)
                b = torch.nn.Parameter(as_dtensor(bias.clone(), mesh, replicated, bias.shape, bias.stride()))
                with self.assertRaises(ValueError) as caught:
                    Muon8bit([b, p], lr=LR, compile=False)
                errors.append(textwrap.fill(str(caught.exception), 100))
                # as the AdamW fallback's, it is accepted
                Muon8bit([{"params": [b]}, {"params": [p], "use_muon": False}], lr=LR, compile=False)
        self.assertExpectedInline(
            "\n".join(errors),
            """\
param group 0: Muon8bit cannot orthogonalize the parameter of shape (96, 256) sharded as
(Shard(dim=1),): it gathers matrices split by rows along one mesh dimension (Shard(0), every other
mesh dimension Replicate()). Give it to the AdamW fallback (use_muon=False in its param group)
param group 0: Muon8bit cannot orthogonalize the parameter of shape (96, 256) sharded as
(Shard(dim=0), Shard(dim=0)): it gathers matrices split by rows along one mesh dimension (Shard(0),
every other mesh dimension Replicate()). Give it to the AdamW fallback (use_muon=False in its param
group)""",
        )


class CaseChecks:
    """Checks of :class:`Case` runs: ``CASES`` (name -> case), run by the class's job, results in ``result``."""

    CASES: dict = {}

    def check_case(self, name):
        case = self.CASES[name]
        ours = self.result["cases"][list(self.CASES).index(name)]
        problems = case_problems(case, ours, case_reference(case)[0])
        if problems:
            self.fail("\n".join(problems))


@unittest.skipUnless(DISTRIBUTED, "torch.distributed with the gloo backend is not available")
class TestTwoRanks(CaseChecks, expecttest.TestCase):
    """Real ranks: one 2-rank gloo job (see :func:`two_ranks`), compared here."""

    # every optimizer and format, and each feature, once on 2 ranks (all of them: test_sweep, --runslow)
    CASES = {
        "sgd_4bit_offload": Case("SGD8bit", "4bit", offload=True),
        "lion_fp8_in_backward": Case("Lion8bit", "fp8", grads="in_backward"),
        "muon_rank1_in_backward": Case("Muon8bit", "4bit_rank1", grads="in_backward"),
        "adamw_dtq8_bf16": Case("AdamW", "dtq8", bf16=True),
        "adamw_none_bf16_eager": Case("AdamW", "none", bf16=True, executor="eager"),
        # tensor parallelism: fc1.weight (96, 512) quantized (256 columns each), fc2.weight (67, 96) plain (48
        # columns: not whole 32-element blocks), fc3.weight (256, 67) plain (no block fits its rows)
        "tp_sgd_fp8": Case("SGD8bit", "fp8", mesh="tp", dims=TP_DIMS),
    }
    # 2 -> 1 -> 2 ranks, through DCP checkpoints: AdamW with "4bit_rank1" (fc2.weight: 34 and 33 rows); Muon8bit
    # on a model whose fc2.weight (1, 512) rank 1 holds none of the rows of, and owns
    # Tensor parallelism trained on 2 ranks, then through DCP 2 -> 1 -> 2: fc1.weight (67, 512) and fc3.weight
    # (33, 512) quantized on 1 and on 2 ranks, fc2.weight (512, 67) plain on both
    RESHARD = [
        Case("AdamW", "4bit_rank1"),
        Case("Muon8bit", "dtq8", dims=(64, 512, 1, 64)),
        Case("AdamW", "dtq8", mesh="tp", dims=(512, 67, 512, 33)),
        Case("AdamW", "4bit", mesh="tp", dims=(512, 67, 512, 33)),
        Case("AdamW", "factored"),
    ]

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as out:
            cls.result = spawn(two_ranks, 2, out, list(cls.CASES.values()), cls.RESHARD)
        cls.ref = reference(2 * STEPS)

    def test_sgd8bit_4bit_cpu_offload_policy_fused_c_step(self):
        self.check_case("sgd_4bit_offload")

    def test_lion8bit_fp8_step_in_backward(self):
        # through FSDP2's reduce-scatter and its post-accumulate-grad hooks, bit for bit single-process training
        self.check_case("lion_fp8_in_backward")

    def test_muon8bit_step_in_backward_adamw_fallback_rank1(self):
        # each sharded matrix Muon orthogonalizes steps in its own hook, its gather and scatter with it (the hooks
        # run in the same order on every rank); Muon8bit's AdamW fallback on a sharded matrix (use_muon=False) and
        # on 1-D parameters, with "4bit_rank1" state (fc3.weight's rows of 67 take no block: plain state)
        self.check_case("muon_rank1_in_backward")

    def test_muon8bit_sharded_matrices_dcp_reshard_2_1_2(self):
        # Muon on matrices sharded by rows: the quantized momentum stays sharded; each matrix's direction is
        # gathered onto the rank that owns it (fc1.weight (512, 64) rank 0, fc2.weight (1, 512) rank 1, which holds
        # none of its rows: it sends none, gathers the matrix, orthogonalizes it and scatters it back; each rank
        # runs one Newton-Schulz per step, checked), and each rank gets its rows of the result. Bit for bit
        # single-process training: the momentum and the update are elementwise, Newton-Schulz is the same function
        # of the same bits, and the collectives move them exactly (fp32 directions, the bf16 result Newton-Schulz
        # returns). Then a DCP checkpoint loaded on 1 rank (no communication: the matrices are whole), another
        # loaded back on 2: after each load and each stage, bit for bit single-process training. (Uneven rows:
        # fc2.weight (67, 96) in test_muon8bit_step_in_backward_adamw_fallback_rank1 and
        # TestFourRanks.test_muon8bit_hsdp_cpu_offload.)
        problems = reshard_problems(self.RESHARD[1], self.result["reshard"][1], (2, 1, 2))
        if problems:
            self.fail("\n".join(problems))

    def test_rank1_dcp_reshard_2_1_2(self):
        # AdamW with "4bit_rank1" (fc2.weight: 34 and 33 rows, an uneven shard), trained on 2 ranks on the fused C
        # step but for its rank-1 states; saved by 2 ranks, loaded by 1 (each of its states from rows of both
        # saved shards), saved again and loaded by 2: bit for bit single-process training after every load and
        # every stage, the column maxima included
        problems = reshard_problems(self.RESHARD[0], self.result["reshard"][0], (2, 1, 2))
        if problems:
            self.fail("\n".join(problems))

    def test_factored_dcp_reshard_2_1_2(self):
        # AdamW with "factored" (fc1.weight's and fc2.weight's exp_avg_sq: row means of 48 and of 34 and 33 rows on
        # each rank, the whole tensor's column means from the ranks' fp64 column sums and row counts, all-reduced),
        # trained on 2 ranks; saved by 2, loaded by 1 (each state from rows of both saved shards: slices that keep
        # the column means), saved again and loaded by 2: bit for bit single-process training after every load and
        # every stage (the fp64 sums of 2, 1 and one process round to the same fp32 means)
        problems = reshard_problems(self.RESHARD[4], self.result["reshard"][4], (2, 1, 2))
        if problems:
            self.fail("\n".join(problems))
        stage = self.result["reshard"][4]["stage_2"]
        self.assertEqual([stage[f"fc{i}.weight.exp_avg_sq"].rows for i in (1, 2)], [96, 67])

    def test_tensor_parallel_sgd8bit_fp8(self):
        # Shard(1) on 2 gloo ranks: each quantized matrix's state is its columns of one process's (the layouts of
        # column_block_size), gathered whole with full_tensor() (an all-gather along dim 1 of quantized shards), on
        # the fused C step; fc2.weight's columns do not fall on block boundaries: plain state
        self.check_case("tp_sgd_fp8")
        ours = self.result["cases"][list(self.CASES).index("tp_sgd_fp8")]
        layouts = [type(ours[f"fc{i}.weight.momentum_buffer"]).__name__ for i in (1, 2, 3)]
        self.assertEqual(layouts, ["Fp8Tensor", "Tensor", "Tensor"])

    def test_tensor_parallel_adamw_dcp_reshard_2_1_2(self):
        # AdamW with dtq8 and 4-bit state, Shard(1) on 2 gloo ranks; saved by 2 ranks, loaded by 1 (each saved
        # shard's columns copied into a column slice of the new state: block-aligned views), saved again and loaded
        # by 2 (column slices of the saved whole state): bit for bit single-process training after every load and
        # every stage
        for i in (2, 3):
            problems = reshard_problems(self.RESHARD[i], self.result["reshard"][i], (2, 1, 2))
            if problems:
                self.fail("\n".join(problems))

    def test_bf16_stochastic_round(self):
        # each element rounds with the random bits of its index in the whole parameter: as on one process
        self.check_case("adamw_dtq8_bf16")
        self.check_case("adamw_none_bf16_eager")

    def assertSameSnapshot(self, ours, ref, what):
        self.assertEqual(sorted(ours), sorted(ref))
        for key in ref:
            assert_same_tensor(self, ours[key], ref[key], f"{what}: {key}")

    def test_fsdp_matches_single_process_exactly(self):
        self.assertSameSnapshot(self.result["mid"], self.ref["mid"], "after 3 steps")
        self.assertSameSnapshot(self.result["end"], self.ref["end"], "after 6 steps")
        self.assertIsInstance(self.result["end"]["fc1.weight.exp_avg"], DTQ8bitTensor)
        self.assertEqual(self.result["end"]["fc2.weight.exp_avg"].block_size, 32)
        self.assertIs(type(self.result["end"]["fc3.weight.exp_avg"]), torch.Tensor)

    def test_dcp_resume_on_two_ranks(self):
        self.assertSameSnapshot(self.result["loaded_on_2"], self.ref["mid"], "loaded")
        self.assertSameSnapshot(self.result["resumed_on_2"], self.ref["end"], "resumed")

    def test_dcp_resume_on_one_rank(self):
        # resharded: saved by 2 ranks, loaded by 1; the same codes, the same next steps, bit for bit
        self.assertSameSnapshot(self.result["loaded_on_1"], self.ref["mid"], "loaded")
        self.assertSameSnapshot(self.result["resumed_on_1"], self.ref["end"], "resumed")

    def test_step_in_backward_under_fsdp(self):
        # the hooks run on the sharded parameters once their gradients are reduced: bit for bit backward + step()
        self.assertSameSnapshot(self.result["train_fsdp_in_backward"], self.result["train_fsdp"], "in backward")

    def test_fsdp_and_ddp_training_match_single_process(self):
        # Forward and backward on each rank's half of the global batch. The averaged gradients differ from the
        # single-process ones by the fp32 rounding of another reduction order (about 1e-7 relative); that can
        # move an element across a quantization midpoint, changing its code by one step and its update by a
        # fraction of lr. Measured: at most 1e-4 of lr * steps (an element of fp32 state whose gradient is near 0,
        # where Adam's normalization magnifies rounding), 3e-6 on quantized state, 5e-8 on average. Bound: 1% for
        # every element, 1e-4 on average; a wrong shard, block or step count moves elements by about lr per step
        # (100%). DDP's
        # parameters are plain tensors: its reference is AdamW8bit with the usual layouts.
        for kind in ("fsdp", "ddp"):
            model = Net()
            opt = reference_optimizer(model) if kind == "fsdp" else optimizer(model)
            for step in range(STEPS):
                x, y = batch(step)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            ours = self.result[f"train_{kind}"]
            for name, p in model.named_parameters():
                err = (ours[name] - p.detach()).abs() / (LR * STEPS)
                where = f"{kind} {name}: max {err.max():.3g}, mean {err.mean():.3g} of lr * steps"
                self.assertLessEqual(err.max().item(), 0.01, where)
                self.assertLessEqual(err.mean().item(), 1e-4, where)
                self.assertIs(type(ours[f"{name}.exp_avg"]), type(opt.state[p]["exp_avg"]), where)


def reshard_problems(case, result, worlds=(4, 2, 1, 4)) -> list[str]:
    """:func:`resharded`'s snapshots against single-process training: after each load, those of the steps before,
    and after each stage, those of its steps."""
    refs = case_reference(case, len(worlds))
    problems = []
    for stage, world in enumerate(worlds):
        if stage:
            problems += case_problems(case, result[f"loaded_{stage}"], refs[stage - 1], f": loaded on {world}", False)
        problems += case_problems(case, result[f"stage_{stage}"], refs[stage], f": trained on {world}")
    return problems


@unittest.skipUnless(DISTRIBUTED, "torch.distributed with the gloo backend is not available")
class TestFourRanks(CaseChecks, expecttest.TestCase):
    """Real ranks: one 4-rank gloo job (:func:`cases_job`): a :class:`Case` of each optimizer, format and feature,
    HSDP on a 2 x 2 mesh, and a DCP checkpoint resharded 4 -> 2 -> 1 -> 4; each bit for bit single-process
    training (all of them: test_sweep, --runslow)."""

    CASES = {
        "hsdp": Case("AdamW", "dtq8", mesh="hsdp"),
        "offload_4bit": Case("AdamW", "4bit", offload=True),
        "sgd_fp8_in_backward": Case("SGD8bit", "fp8", grads="in_backward"),
        "lion_rank1_bf16_eager": Case("Lion8bit", "4bit_rank1", bf16=True, executor="eager", grads="backward"),
        "muon_hsdp_offload": Case("Muon8bit", "dtq8", mesh="hsdp", offload=True),
        "hsdp_offload_bf16_in_backward": Case(
            "AdamW", "none", mesh="hsdp", offload=True, bf16=True, grads="in_backward"
        ),
        # the factored sums reduced over HSDP's shard dimension only (its replicas hold the same rows), by each
        # parameter's own step in its hook
        "rmsprop_factored4_hsdp_offload_in_backward": Case(
            "RMSprop8bit", "factored4", mesh="hsdp", offload=True, grads="in_backward"
        ),
    }
    RESHARD = Case("AdamW", "dtq8")

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as out:
            extras = [edge_shards, functools.partial(edge_shards, fmt="factored")]
            cls.result = spawn(cases_job, 4, out, list(cls.CASES.values()), [cls.RESHARD], "cpu", extras)

    def test_hsdp(self):
        # fully_shard on a (replicate 2, shard 2) mesh: states (Replicate(), Shard(0)), blocks from the global shape
        self.check_case("hsdp")

    def test_cpu_offload_policy_fused_c_step(self):
        self.check_case("offload_4bit")

    def test_sgd8bit_fp8_step_in_backward(self):
        self.check_case("sgd_fp8_in_backward")

    def test_lion8bit_rank1_bf16_stochastic_round(self):
        self.check_case("lion_rank1_bf16_eager")

    def test_muon8bit_hsdp_cpu_offload(self):
        # each replica group gathers each matrix onto its owner within its shard dimension; nothing crosses replicas
        self.check_case("muon_hsdp_offload")

    def test_hsdp_cpu_offload_bf16_step_in_backward(self):
        self.check_case("hsdp_offload_bf16_in_backward")

    def test_rmsprop8bit_factored4_hsdp_cpu_offload_step_in_backward(self):
        self.check_case("rmsprop_factored4_hsdp_offload_in_backward")

    def test_dcp_reshard_4_2_1_4(self):
        problems = reshard_problems(self.RESHARD, self.result["reshard"][0])
        if problems:
            self.fail("\n".join(problems))

    def test_rank1_empty_and_one_row_shards(self):
        # Empty shards take part in the all-reduce of the column maxima (with zeros) and in the gather, and
        # one-row shards keep their row: the same bits as one process (whose layouts these shapes do not change)
        # A state dict of fp32 DTensor states loads quantized with the column maxima all-reduced (each rank holds only
        # its rows of them): as one process quantizes the whole.
        self.check_edge_shards(0, "4bit_rank1")

    def test_factored_empty_and_one_row_shards(self):
        # As for rank-1 scales, with the column sums and row counts: an empty shard adds none, a one-row shard keeps
        # one row's mean (fewer rows than a factored matrix of its own would take), and a state dict of fp32 DTensor
        # states loads with the sums all-reduced: the same bits as one process
        self.check_edge_shards(1, "factored")

    def check_edge_shards(self, index, fmt):
        ref = edge_shards(EdgeShards(), fmt)
        ours = self.result["extras"][index]
        self.assertEqual((ours["trained"]["pos.exp_avg_sq"].rows, ours["trained"]["small.exp_avg_sq"].rows), (8, 3))
        self.assertIs(type(ours["reloaded"]["small.exp_avg_sq"]), get_state_format(fmt))
        problems = [
            p for what in ref for key in ref[what] for p in same_tensor_problems(ours[what][key], ref[what][key], key)
        ]
        if problems:
            self.fail("\n".join(problems))


@unittest.skipUnless(DISTRIBUTED and torch.cuda.is_available(), "needs a CUDA device (and gloo for host tensors)")
class TestCudaMesh(CaseChecks, expecttest.TestCase):
    """CPUOffloadPolicy on GPUs: fully_shard on a CUDA mesh (one rank per GPU, two at most; NCCL, and gloo for
    what is in host memory) with the shards, their gradients and the states in host memory. The states stay
    there, every parameter takes the fused C step, and training is bit for bit single-process fused CPU
    training on the same gradients (reduced through FSDP2's reduce-scatter on the GPUs, in backward)."""

    CASES = {
        "adamw_backward": Case("AdamW", "dtq8", offload=True, grads="backward"),
        "adamw_4bit_bf16_in_backward": Case("AdamW", "4bit", offload=True, bf16=True, grads="in_backward"),
        "sgd_fp8": Case("SGD8bit", "fp8", offload=True),
        "lion_backward": Case("Lion8bit", "dtq8", offload=True, grads="backward"),
        "muon_backward": Case("Muon8bit", "dtq8", offload=True, grads="backward"),
    }

    @classmethod
    def setUpClass(cls):
        from torchao_optim.kernels.cpu import cpu_dtypes

        if not cpu_dtypes():
            raise unittest.SkipTest("the fused CPU step could not be built here (python -m torchao_optim says why)")
        world = min(2, torch.cuda.device_count())
        with tempfile.TemporaryDirectory() as out:
            cases = list(cls.CASES.values())
            cls.result = spawn(cases_job, world, out, cases, (), "cuda", backend="cpu:gloo,cuda:nccl")

    def test_adamw_dtq8(self):
        self.check_case("adamw_backward")

    def test_adamw_4bit_bf16_stochastic_round_step_in_backward(self):
        self.check_case("adamw_4bit_bf16_in_backward")

    def test_sgd8bit_and_lion8bit(self):
        self.check_case("sgd_fp8")
        self.check_case("lion_backward")

    def test_muon8bit(self):
        # the sharded matrices' collectives on the GPUs (NCCL), their Newton-Schulz in host memory
        self.check_case("muon_backward")


# ---- the whole cross product (--runslow) ------------------------------------------------------------------
# each feature alone, and with HSDP and with CPUOffloadPolicy (HSDP on 4 ranks only)
SWEEP_FEATURES = [
    dict(mesh, **feature)
    for mesh in ({}, {"mesh": "hsdp"}, {"offload": True})
    for feature in ({}, {"executor": "eager"}, {"grads": "backward"}, {"grads": "in_backward"}, {"bf16": True})
]
SWEEP_TIMEOUT = 1800  # seconds for one world's job (measured on 2 busy CPU cores: 81 s on 2 ranks, 217 s on 4)


# offload_state=True streams the fused kernels' state (Triton's interpreter on the CPU): the optimizers whose every
# parameter the fused kernels step
OFFLOADED = ("AdamW", "SGD8bit", "Lion8bit", "Adagrad8bit", "RMSprop8bit")


def fused_layout(fmt: str) -> bool:
    """Whether the fused kernels read ``fmt``'s state of a matrix (rank-1 scales they do not)."""
    return get_state_format(fmt).zeros((64, 256), signed=False).fast_path_layout() is not None


def sweep_cases(world) -> list:
    """Every optimizer x every format x each of SWEEP_FEATURES (HSDP on 4 ranks), and offloaded state."""
    meshes = ("fsdp", "hsdp") if world == 4 else ("fsdp",)
    return [
        Case(opt, fmt, **feature)
        for opt in OPTIMIZERS
        for fmt in FORMATS
        for feature in SWEEP_FEATURES
        if feature.get("mesh") != "hsdp" or world == 4
    ] + [
        Case(opt, fmt, mesh=mesh, executor="offload_state")
        for opt in OFFLOADED
        for fmt in FORMATS
        if fmt == "none" or fused_layout(fmt)  # (rank-1 scales: no fused layout to stream)
        for mesh in meshes
    ]


# every optimizer x every format, and each optimizer with bf16 stochastic rounding and with CPUOffloadPolicy
RESHARD_SWEEP = (
    [Case(opt, fmt) for opt in OPTIMIZERS for fmt in FORMATS]
    + [Case(opt, "dtq8", bf16=True) for opt in OPTIMIZERS]
    + [Case(opt, "dtq8", offload=True) for opt in OPTIMIZERS]
    + [Case(opt, "dtq8", executor="offload_state") for opt in OFFLOADED]
)


@functools.cache
def sweep(world) -> dict:
    """The sweep's job on ``world`` ranks, run once per test session."""
    with tempfile.TemporaryDirectory() as out:
        reshard = RESHARD_SWEEP if world == 4 else []
        return spawn(cases_job, world, out, sweep_cases(world), reshard, timeout=SWEEP_TIMEOUT)


@pytest.mark.slow
@pytest.mark.skipif(not DISTRIBUTED, reason="torch.distributed with the gloo backend is not available")
@pytest.mark.parametrize(
    "world, case",
    [(w, c) for w in (2, 4) for c in sweep_cases(w)],
    ids=lambda x: str(x) if isinstance(x, Case) else f"{x}ranks",
)
def test_sweep(world, case):
    ours = sweep(world)["cases"][sweep_cases(world).index(case)]
    problems = case_problems(case, ours, case_reference(case)[0], f" on {world} ranks")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.skipif(not DISTRIBUTED, reason="torch.distributed with the gloo backend is not available")
@pytest.mark.parametrize("case", RESHARD_SWEEP, ids=str)
def test_sweep_dcp_reshard(case):
    problems = reshard_problems(case, sweep(4)["reshard"][RESHARD_SWEEP.index(case)])
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    unittest.main()
