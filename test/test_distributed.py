"""Beyond one process: FSDP2 (``fully_shard``), DDP and distributed checkpoints (DCP), on CPU.

Two kinds of tests. In this process, each rank of a 2-rank (or 4-rank) FSDP2 model is simulated in turn on
torch's fake process group (no communication; the optimizer needs none): the local parameters and states
after each step must be exactly the rows of single-process training's. Then real ranks: 2 processes on gloo
(``torch.multiprocessing``, started by a fork server, on a free port; a job that hangs is killed after
``TIMEOUT`` seconds and fails the test) train, save a DCP checkpoint, resume it on 2 ranks and on 1, and
write what they end with (whole parameters and states, gathered with ``full_tensor()``: a real all-gather of
quantized states) to a file that the tests compare with single-process training here.

The model has one parameter of each kind the block rule (``optim/sharded.py``) tells apart, with dim 0 sizes
that shard unevenly on two ranks:

- ``fc1.weight`` (96, 256): rows of 256 elements, blocks of 256, 48 rows per rank;
- ``fc2.weight`` (67, 96): rows of 96 elements, blocks of 32 (the largest of 256, 128, 64, 32 dividing 96),
  34 and 33 rows;
- ``fc3.weight`` (256, 67): rows of an odd 67 elements: no block fits, plain fp32 state;
- the biases: 1-D, plain fp32 state.

Every optimizer here runs eagerly (``compile=False``): the distributed code is the same whichever executor
runs the update (the update sees local tensors only), and compiling in every rank would take minutes
on a CPU; the fused executor is checked on shards in Triton's interpreter, on a smaller model.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import multiprocessing
import os
import socket
import tempfile
import time
import unittest

import expecttest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchao_optim import (
    AdamW,
    AdamW8bit,
    DTQ8bitTensor,
    Lion8bit,
    QuantizedState,
    SGD8bit,
    dequantize_state_dict,
    get_state_format,
    step_in_backward,
)
from torchao_optim.optim.fused import fused_available
from torchao_optim.optim.sharded import row_aligned_block_size
from torchao_optim.testing import SpreadProblem, assert_same_tensor

TIMEOUT = 180  # seconds for the 2-rank job, startup included
LR, WD, STEPS, MIN_QUANT = 1e-2, 0.1, 3, 1024
DISTRIBUTED = dist.is_available() and dist.is_gloo_available()


# ---- the problem: a model, per-step gradients, a global batch ---------------------------------------------
class Net(torch.nn.Module):
    def __init__(self, dims=(256, 96, 67, 256)):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@functools.cache
def _problem(shapes) -> SpreadProblem:
    return SpreadProblem(shapes)


def grads(model, step):
    """name -> the global gradient at ``step``, the shared problem's for the model's shapes: magnitudes spread over
    e^4 within each block, so that blockwise quantization matters."""
    named = list(model.named_parameters())
    whole = _problem(tuple(tuple(p.shape) for _, p in named)).grads(step)
    return {name: g for (name, _), g in zip(named, whole)}


def batch(step):
    gen = torch.Generator().manual_seed(200 + step)
    return torch.randn(16, 256, generator=gen), torch.randn(16, 256, generator=gen)


def optimizer(model, fused=False, cls=AdamW8bit, **kw):
    return cls(model.parameters(), lr=LR, weight_decay=WD, min_quant_size=MIN_QUANT, compile=False, fused=fused, **kw)


def reference_optimizer(model, fused=False, cls=AdamW8bit, **kw):
    """Single-process ``cls`` (AdamW8bit) with, for each parameter, the state layout the block rule gives it when
    sharded (without sharding, fc2.weight would take blocks of 256 and fc3.weight quantized state): a group per
    quantized parameter with its block size, one group of plain state for the rest."""
    default_block = get_state_format(kw.get("state_format", "dtq8")).default_block_size
    groups, plain = [], []
    for p in model.parameters():
        block_size = row_aligned_block_size(p.shape, default_block) if p.numel() >= MIN_QUANT else None
        if block_size is None:
            plain.append(p)
        else:
            groups.append({"params": [p], "block_size": block_size})
    return cls(
        groups + [{"params": plain, "state_format": "none"}],
        lr=LR,
        weight_decay=WD,
        min_quant_size=MIN_QUANT,
        compile=False,
        fused=fused,
        **kw,
    )


def set_grads(model, step):
    """Each rank's rows of the same whole gradients (the model's parameters are sharded along dim 0, or not)."""
    from torch.distributed.tensor import DTensor

    for name, g in grads(model, step).items():
        p = model.get_parameter(name)
        if isinstance(p, DTensor):
            # rows taken by hand: no communication (the fake process group has none), and nothing cached per
            # mesh (meshes of simulated ranks compare equal)
            rows = rows_of(dist.get_rank(p.device_mesh.get_group()), p.device_mesh.size(), len(g))
            g = DTensor.from_local(g[rows].contiguous(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        p.grad = g


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
        for key in ("exp_avg", "exp_avg_sq"):
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
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, job, out):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    try:
        result = job(out)
        if rank == 0:
            torch.save(result, os.path.join(out, f"{job.__name__}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(job, world, out):
    """Run ``job(out)`` on ``world`` gloo ranks and return what rank 0 returned."""
    # Not fork: a child forked from a process that has run torch ops can hang (OpenMP's thread pool). A fork
    # server that imports this module once, before any op, then forks the ranks: one import instead of two.
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload([__name__])
    ctx = mp.start_processes(
        _entry, args=(world, _free_port(), job, out), nprocs=world, join=False, start_method=method
    )
    deadline = time.monotonic() + TIMEOUT
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{job.__name__} on {world} ranks did not finish within {TIMEOUT} s")
    return torch.load(os.path.join(out, f"{job.__name__}.pt"), weights_only=True)


def two_ranks(out):
    """On 2 gloo ranks: FSDP2 on the gradients of :func:`grads` for 3 steps, a DCP checkpoint, 3 more steps;
    the checkpoint resumed on 2 ranks, and on 1 (rank 0 alone, on a mesh and a checkpoint group of its own);
    training on each rank's half of a global batch with FSDP2 and with DDP."""
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
    return result


# ---- the tests --------------------------------------------------------------------------------------------
class TestBlockRule(expecttest.TestCase):
    def test_block_rule(self):
        # from the global shape only: the format's block, halved while it does not divide the row, to 1/8 of it
        shapes = [(96, 256), (67, 96), (256, 67), (4096,), (8, 4, 8), (3, 100), (5, 5632), (3, 2, 16)]
        self.assertEqual([row_aligned_block_size(s, 256) for s in shapes], [256, 32, None, None, 32, None, 256, 32])
        self.assertEqual(row_aligned_block_size((10, 48), 128), 16)  # a 4-bit format's 128: down to 16
        self.assertIsNone(row_aligned_block_size((10, 8), 128))


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


@unittest.skipUnless(DISTRIBUTED, "torch.distributed is not available")
class TestShardedStep(expecttest.TestCase):
    """Each rank of an FSDP2 model simulated in this process: its local parameters and states are, after every
    step, exactly its rows of single-process training on the same gradients (the update is elementwise and
    every shard is whole blocks), uneven and empty shards included."""

    def check_ranks(self, world, make_model, steps=STEPS, fused=False, opt_kw=None, **shard_kw):
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
                opt = optimizer(model, fused, **opt_kw)
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
                    if fused:
                        plans = opt._plans[id(opt.param_groups[0])]
                        self.assertEqual(plans["rest"], [], "parameters left to the compiled path")

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

    @unittest.skipUnless(fused_available("cpu"), "the fused executor needs Triton (its interpreter on the CPU)")
    def test_fused_executor_on_shards(self):
        # Triton's interpreter is slow: a small model; fc1.weight (23, 64) quantized in blocks of 64, 12 and 11
        # rows; the rest in plain state (odd rows, or below min_quant_size)
        self.check_ranks(2, lambda: Net((64, 23, 64, 4)), steps=2, fused=True)


@unittest.skipUnless(DISTRIBUTED, "torch.distributed with the gloo backend is not available")
class TestTwoRanks(expecttest.TestCase):
    """Real ranks: one 2-rank gloo job (see :func:`two_ranks`), compared here."""

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as out:
            cls.result = spawn(two_ranks, 2, out)
        cls.ref = reference(2 * STEPS)

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


if __name__ == "__main__":
    unittest.main()
