"""The fused group step: each parameter group is one kernel launch per plan, whatever its shapes and formats.

The planner reads each state's :class:`~torchao_optim.state.layout.StateLayout` (``fast_path_layout()``)
and nothing else about its format: any format that describes itself that way is fused, including one
written after the kernels. Parameters are bucketed into plans by (the update rule and the layouts of the one
to three states it carries, device, param dtype, grad dtype); a :class:`GroupPlan` holds the device tables one
launch reads (pointers, sizes, the program -> (tensor, block) map, the encoder tables) and the plan's step
counts, to which each parameter's ``state["step"]`` is an alias. Plans are rebuilt only when the set of
parameters with gradients changes. Gradients move (``zero_grad(set_to_none=True)`` frees them), so their
addresses are a table of their own, refreshed with one non-blocking copy from pinned memory when one moved.

A DTensor parameter (FSDP2) is planned through its local shard: the pointers, sizes and layouts are those of
the local parameter, gradient and states (whole blocks on every rank, see :mod:`torchao_optim.optim.sharded`).

On the CPU a plan is the same data, run by one call of the C step (:mod:`torchao_optim.kernels.cpu`); with
``fused=True`` and ``TRITON_INTERPRET=1`` set before Triton is imported, by the Triton kernels in Triton's
interpreter instead (slow, and meant for testing). Parameters no plan covers (a format without a layout,
non-contiguous tensors, devices with neither executor, a rule the executor has no form of: on CUDA, a rule without a
Triton update) take the per-parameter compiled path.
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch
from torch import Tensor

from torchao_optim.kernels import triton_interpreter
from torchao_optim.kernels.tables import flat_shift, layout_tables
from torchao_optim.optim import launch
from torchao_optim.optim.sharded import local
from torchao_optim.optim.sharded_columns import spans_ranks
from torchao_optim.optim.snapshot import StateSnapshot, storages
from torchao_optim.rules import FusedRule
from torchao_optim.state.layout import PLAIN_FP32

__all__ = ["fused_available", "GroupPlan", "plan_group", "rule_for", "check_state_shapes", "triton_refusal"]

_GRAD = operator.attrgetter("grad")
ITERS = 8  # register tiles per program, walked one at a time
PREFETCH = True  # issue the next tile's loads before computing the current one
# The two-state update kernels (Adam's) start as programmatic dependents of the kernel before them (CUDA, compute
# capability 9.0 and later): their launch and first loads overlap the coefficients kernel, or the previous plan's
# update.
PDL = True
NUM_WARPS = 1  # one warp per 256-element tile: a block's absmax is a warp reduction, no shared memory
MAXNREG = None  # where set, the register cap of every two- and three-state kernel instead of REGISTER_CAPS' (0: none)
# Register caps per thread for adam_kernel, by (bits per code, parameter bytes): ptxas's own choice (96 registers for
# these) leaves fewer warps per SM to hide the latency of the table loads. Measured on an H200 with
# benchmarks/tune_fused.py, TinyLlama geometry (the figures are in benchmarks/README.md): 8-bit
# bf16 4.5% faster than uncapped, 4-bit bf16 6.5%, and 4-bit fp32 6.8% faster than under its earlier cap of 104.
# 8-bit fp32 gained 2-3.5% in one measurement, near the spread between runs, and its best cap spills with Triton
# 3.9 (benchmarks/count_instructions.py reports it), so it is left to the compiler. A plan whose kernel spills
# under its cap (another rule's update, larger than Adam's) drops it after its first launch (optim.launch).
REGISTER_CAPS = {(8, 2): 80, (4, 2): 80, (4, 4): 80}
# Register caps of a two-state plan that takes its factored sums in the step (FOLD_ROWS), by parameter bytes:
# ptxas's choice (148-168 registers) leaves 8-12 one-warp programs an SM, too few to hide the strip's loads. Measured
# on an H100 with benchmarks/tune_fused.py (--maxnreg), TinyLlama geometry, no spills: "factored" fp32 5.85 -> 5.54
# ms under 128, bf16 4.21 -> 3.58 under 96; "factored4" fp32 5.65 -> 5.03, bf16 3.46 -> 3.07 (benchmarks/README.md).
FOLD_CAPS = {4: 128, 2: 96}
FP32_BLOCK = 256  # elements per block when neither state is quantized
MIN_TILE = 256  # elements per register tile at least: smaller quantization blocks share a tile (4-bit: two)
MAX_BLOCK = 4096  # a program holds one block in registers (two with PREFETCH)
# A plan with fewer programs than this walks fewer tiles per program (ITERS halved until it has as many, or one
# tile each): its programs walk their tiles one after another, so a small plan on a large GPU is latency-bound.
# None: 8 per SM on CUDA (an H200 holds about 24 one-warp programs per SM), none elsewhere (Triton's interpreter
# runs programs one at a time). Measured on an H200 (benchmarks/README.md): ViT-B's plan of its 1-D tensors
# (fp32 state), 125 programs of 8 tiles, took 7.5 us.
MIN_PROGRAMS: int | None = None
# The last tiles of a plan, in launch order, go one per program. Programs start in about the order of their ids, so
# the last ones to start are the plan's tail: as SMs run out of programs, those still running hold them. Short
# programs there end the kernel closer together (ITERS tiles per program elsewhere keep their fixed costs shared).
# None: TAIL_TILES_PER_SM per SM on CUDA, none elsewhere.
TAIL_TILES: int | None = None
TAIL_TILES_PER_SM = 32
# A plan of two or three states whose matrix scales are all factored, every matrix's rows whole tiles, takes its
# factored sums in the step kernel (adam_kernel's FOLD), with no first pass: each program walks a strip one tile wide
# down FOLD_ROWS rows (a matrix's last strips, fewer), adding a tile's total to its row's sum and holding its column
# sums until the strip ends, so the column sums cost one atomic addition per FOLD_ROWS elements. 0: always a first pass.
# On an H100 (benchmarks/README.md, "factored sums in the step"): TinyLlama's factored steps 32-45% faster than with
# the first pass; 8, 16, 32 and 64 rows within 6% of each other, 32 and 64 the fastest.
FOLD_ROWS = 32
# The scale kinds (StateLayout.scale) each fused executor reads
SCALES_READ = {"cpu": ("block", "rank1", "factored"), "triton": ("block", "rank1", "factored")}


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401

        from torchao_optim.kernels import triton_adam  # noqa: F401
    except Exception:
        return False
    return True


def fused_available(device: torch.device | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (default: on some device of this machine): a CUDA device, or
    the CPU in Triton's interpreter; Triton is imported only then (the C step needs none of it)."""
    if device is None:
        return fused_available("cuda") or fused_available("cpu")
    device = torch.device(device)
    here = (device.type == "cuda" and torch.cuda.is_available()) or (device.type == "cpu" and triton_interpreter())
    return here and _triton_importable()


def _alias0d(base: Tensor, i: int) -> Tensor:
    """Element i of ``base`` as a 0-d tensor sharing its storage, with no view relation (see adam._alias)."""
    return base.new_empty(0).set_(base.untyped_storage(), base.storage_offset() + i, (), ())


def _state_layout(state) -> object | None:
    """:data:`PLAIN_FP32` for a plain contiguous fp32 state, the format's layout if it has one the kernels take, or
    None."""
    state = local(state)
    if type(state) is Tensor:
        return PLAIN_FP32 if state.dtype == torch.float32 and state.is_contiguous() else None
    get_layout = getattr(state, "fused_layout", None) or getattr(state, "fast_path_layout", None)
    layout = get_layout() if get_layout is not None else None
    if layout is None:
        return None
    bs = layout.block_size
    return layout if bs & (bs - 1) == 0 and bs <= MAX_BLOCK else None


def plan_key(p: Tensor, state, rule: FusedRule | None, interpreter: bool = False) -> tuple | None:
    """What a plan's parameters share, or None if no fused kernel can update ``p`` with ``rule`` (None: no kernel
    implements the group's rule; :func:`unfused_reason` says why). CPU parameters go to the C kernels of
    :mod:`torchao_optim.kernels.cpu`, or with ``interpreter`` (and ``TRITON_INTERPRET=1``) to the Triton kernels in
    Triton's interpreter, for testing them. A DTensor parameter is planned through its local shard."""
    if spans_ranks(p, state):
        return None
    p, grad = local(p), local(p.grad)
    why, executor, layouts = _refusal(p, grad, state, rule, interpreter)
    if why is not None:
        return None
    blocks = {x.block_size for x in layouts if x.quantized}
    # a rule whose output is a direction writes it in fp32, whatever the parameter's dtype
    dtype = p.dtype if rule.output == "param" else torch.float32
    return (rule, layouts, blocks.pop() if blocks else FP32_BLOCK, p.device, dtype, grad.dtype, executor)


def rule_for(rule, p: Tensor) -> FusedRule | None:
    """The rule that updates ``p``: an optimizer's ``_fused_rule(group)`` gives one rule for its group, or a callable
    that picks each parameter's (Muon8bit's: Muon for the matrices it orthogonalizes, AdamW for the rest)."""
    return rule(p) if callable(rule) else rule


def unfused_reason(p: Tensor, grad: Tensor, state, rule: FusedRule | None, interpreter: bool = False) -> str | None:
    """Why no fused kernel can update ``p`` (with gradient ``grad`` and states ``state``, a dict) with ``rule``, or
    None where one can: what :func:`plan_key` decides, in words (``optimizer.explain()``)."""
    if spans_ranks(p, state):
        return _SPANS_RANKS
    return _refusal(local(p), local(grad), state, rule, interpreter)[0]


# on every rank, an empty shard's too: the step all-reduces the column statistics (optim/sharded_columns.py)
_SPANS_RANKS = (
    "its state's column statistics (rank-1 maxima, factored means) span ranks: the per-parameter path all-reduces them"
)


def fused_executor(p: Tensor, interpreter: bool = False) -> str:
    """Which fused kernels would step ``p``: ``"cpu"`` (the C step), ``"triton"`` (CUDA, or Triton's interpreter)."""
    return "cpu" if p.device.type == "cpu" and not (interpreter and triton_interpreter()) else "triton"


def triton_refusal(rule: FusedRule) -> str | None:
    """Why the Triton kernels cannot run ``rule`` (they take one to three states, through its Triton element update),
    or None where they can: its parameters then take the compiled path on CUDA, whatever the C step takes."""
    n = len(rule.state_keys)
    if n > 3:  # as the C step (kernels.cpu.MAX_STATES)
        return f"rule {rule.name!r} carries {n} states {rule.state_keys}; the Triton kernels take one to three"
    if rule.triton_update is None:
        return f"rule {rule.name!r} has no Triton element update (FusedRule.triton_update)"
    return None


def _refusal(p: Tensor, grad: Tensor, state, rule: FusedRule | None, interpreter: bool) -> tuple:
    """``(why not, executor, the states' layouts)``; ``why not`` is None where a fused kernel takes ``p``."""
    if rule is None:
        return "no fused kernel implements this group's update rule", None, None
    if not p.is_contiguous():
        return "the parameter is not contiguous", None, None
    if not grad.is_contiguous():
        return "its gradient is not contiguous", None, None
    executor = fused_executor(p, interpreter)
    if executor == "cpu":
        from torchao_optim.kernels.cpu import cpu_dtypes

        dtypes = cpu_dtypes()  # empty where the step could not be built
        if not dtypes:
            return "the fused CPU step could not be built here (python -m torchao_optim says why)", executor, None
        if rule.c_source is None:
            return f"rule {rule.name!r} has no C update (FusedRule.c_source) for the fused CPU step", executor, None
    else:
        if not fused_available(p.device):
            return f"no fused kernel runs on {p.device.type} here (Triton and a CUDA device)", executor, None
        why = triton_refusal(rule)
        if why is not None:
            return why, executor, None
        from torchao_optim.kernels.triton_adam import TRITON_DTYPES

        dtypes = TRITON_DTYPES
    if p.dtype not in dtypes or grad.dtype not in dtypes:
        return (
            f"{p.dtype} parameters with {grad.dtype} gradients (the kernels take {sorted(map(str, dtypes))})",
            executor,
            None,
        )
    layouts = tuple(_state_layout(state[k]) if k in state else None for k in rule.state_keys)
    for k, x in zip(rule.state_keys, layouts):
        if x is None:
            kind = type(local(state[k])).__name__ if k in state else "missing"
            return f"its state {k!r} ({kind}) has no layout the fused kernels read", executor, None
    if len({x.block_size for x in layouts if x.quantized}) > 1:
        return "its states have different block sizes", executor, None
    for k, x in zip(rule.state_keys, layouts):
        if x.scale not in SCALES_READ[executor]:
            return f"its state {k!r} has {x.scale} scales, which the {executor} kernels do not read", executor, None
    return None, executor, layouts


def _fields(state, layout) -> tuple[Tensor, Tensor | None]:
    """(codes or values, scales) of one state (its local shard's, for a DTensor): the tensors a kernel writes."""
    state = local(state)
    if not layout.quantized:
        return state, None
    return getattr(state, layout.codes), getattr(state, layout.scales)


def _address(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class GroupPlan:
    """Device tables for one launch over ``params`` (all with the same :func:`plan_key`). ``pdl=False``: its Adam
    update never starts before the work queued ahead of it has finished (see :data:`PDL`)."""

    def __init__(
        self,
        key: tuple,
        params: list[Tensor],
        states: list[dict],
        rounding: list[tuple[int, int]] | None = None,
        pdl: bool = True,
    ):
        self.rule, self.layouts, self.block, device, param_dtype, grad_dtype, self.executor = key
        self.params = params  # as the optimizer holds them (DTensors under FSDP2): their .grad moves
        shards = [local(p) for p in params]
        self.sharded = any(s is not p for s, p in zip(shards, params))
        # A register tile: one quantization block, or several small ones (the kernel's fixed costs per tile, its loop
        # and the absmax reductions, are then shared by more elements). NUM_WARPS per 256 elements of a tile: larger
        # blocks get more threads, not more registers per thread.
        self.tile = max(self.block, MIN_TILE)
        numels = torch.tensor([p.numel() for p in shards], dtype=torch.int64)
        self.iters = spread_iters(numels, self.tile, _per_sm(MIN_PROGRAMS, 8, device))
        self.prefetch, self.num_warps = PREFETCH, max(1, NUM_WARPS * self.tile // 256)
        self.pdl = (
            pdl
            and PDL
            and self.executor == "triton"
            and device.type == "cuda"
            and not triton_interpreter()
            and torch.cuda.get_device_capability(device)[0] >= 9
        )
        # A rule whose output is a direction (FusedRule.output) writes it into a buffer of the plan's, one fp32 tensor
        # per parameter at a 16-byte boundary (the kernels' vector loads), read by the optimizer after the launch.
        self.directions = self._direction_buffers(shards, device) if self.rule.output == "direction" else None
        written = shards if self.directions is None else self.directions
        # one row per parameter: its address (or its direction's), then (codes or values, scales) of each state
        pointed = [
            [w] + [x for k, layout in zip(self.rule.state_keys, self.layouts) for x in _fields(s[k], layout)]
            for w, s in zip(written, states)
        ]
        rows = [list(map(_address, row)) for row in pointed]
        # the memory the tables point at stays allocated while the plan lives, whatever is done to the tensors
        self.keep = storages(t for row in pointed for t in row)
        self.ptrs = torch.tensor(rows, dtype=torch.int64).to(device)
        # params and codes at 16-byte boundaries (fresh allocations are): the kernel's loads become vectors
        self.aligned = all(r[0] % 16 == 0 and all(x % 16 == 0 for x in r[1::2]) for r in rows)
        self.grads_aligned = False
        self.grad_ptrs = torch.zeros(len(params), dtype=torch.int64, device=device)
        self.grad_key: tuple = ()
        self.captured_hosts: list[Tensor] = []  # host copies of grad_ptrs that a captured CUDA graph reads
        self.spare_host: Tensor | None = None  # pinned, made outside a capture for the next one
        # each program's tensor, first tile and number of tiles
        tail = _per_sm(TAIL_TILES, TAIL_TILES_PER_SM, device)
        prog_tensor, prog_block, prog_tiles = program_map(numels, self.tile, self.iters, tail)
        self.n_programs = len(prog_tensor)
        self.prog_tensor, self.prog_block, self.prog_tiles = (
            x.to(device) for x in (prog_tensor, prog_block, prog_tiles)
        )
        self.numels = numels.to(device)
        # One step counter per parameter, advanced by the coefficients kernel; state["step"] aliases it. The CPU
        # executor advances each state's own counter instead (a few microseconds there), so that a state shared
        # between processes (torch.multiprocessing, Hogwild) counts every process's steps.
        self.states = states
        self.use_counters(
            torch.stack([s["step"].to(device=device, dtype=torch.float32).reshape(()) for s in states]),
            torch.empty(len(params), self.rule.n_coefs, dtype=torch.float32, device=device),
        )
        # (step counts, coefficient rows) that this plan's launch advances and computes first: its own, or those of
        # every plan of its group on its device (None: another plan's launch computes them; _share_coefficients)
        self.coefs_for: tuple[Tensor, Tensor] | None = (self.steps, self.coefs)
        self.tables = sum((layout_tables(layout, device, self.executor) for layout in self.layouts), ())
        self.flat = tuple(flat_shift(layout, self.executor) for layout in self.layouts)  # the tables' encoder form
        # per state with rank-1 scales or factored (StateLayout.scale): each tensor's rows (int64, on the CPU: the C
        # step reads them); None for blockwise scales
        self.rows = tuple(
            torch.tensor([local(s[k]).rows for s in states], dtype=torch.int64) if layout.scale != "block" else None
            for k, layout in zip(self.rule.state_keys, self.layouts)
        )
        self.rank1 = None  # the Triton kernels' tables for rank-1 scales (_plan_rank1)
        self.fold_sums = False  # factored sums taken in the step kernel (_plan_rank1)
        self.row_tiles = 0  # rank-1 scales read by whole rows' tiles in the step kernel (_plan_rank1: 1 or 2)
        if self.executor == "triton" and any(r is not None for r in self.rows):
            self._plan_rank1(shards, states, device)
        # the caps were measured on the two-state kernel; the three-state one takes the compiler's choice but where
        # MAXNREG is set, and the one-state kernel always
        self.maxnreg = (
            register_cap(self.layouts, param_dtype.itemsize, self.fold_sums)
            if len(self.layouts) == 2 or (len(self.layouts) == 3 and MAXNREG is not None)
            else None
        )
        self.torch_param_dtype, self.torch_grad_dtype = param_dtype, grad_dtype
        if self.executor == "triton":
            from torchao_optim.kernels.triton_adam import TRITON_DTYPES

            self.param_dtype, self.grad_dtype = TRITON_DTYPES[param_dtype], TRITON_DTYPES[grad_dtype]
        # (position in the optimizer, element offset) per parameter: what stochastic rounding hashes
        self.round_info = (
            torch.tensor(rounding or [(i, 0) for i in range(len(params))], dtype=torch.int64).reshape(-1, 2).to(device)
        )
        self.bf16 = param_dtype == torch.bfloat16
        self.vec = 16 // param_dtype.itemsize  # elements of a 16-byte vector of the parameter: the kernels' layout

    @staticmethod
    def _direction_buffers(shards: list[Tensor], device: torch.device) -> list[Tensor]:
        """One fp32 buffer for the directions of ``shards``, as a view per tensor of its shape, each starting at a
        16-byte boundary."""
        spans = [-(-s.numel() // 4) * 4 for s in shards]
        flat = torch.empty(sum(spans), dtype=torch.float32, device=device)
        starts = itertools.accumulate(spans, initial=0)
        return [flat[a : a + s.numel()].view(s.shape) for a, s in zip(starts, shards)]

    def _plan_rank1(self, shards: list[Tensor], states: list[dict], device: torch.device) -> None:
        """What the Triton kernels read for states with scales over a whole matrix (rank-1 maxima, factored means):
        ``rank1`` (int64, a row per tensor: its matrix's rows, then each state's new statistics' address, 0 for a
        blockwise state), ``maxima`` (one fp32 buffer of every rank-1 state's new maxima) and ``sums`` (one fp64 buffer
        of every factored state's new row and column sums), both zeroed before each step, the first pass's program
        map, and the copies that make the new statistics the states' own after the step (``stats_into`` from
        ``stats_from``; a factored state's from ``means``, the sums over ``divisors``). A factored state's codes field
        is its column means; the pointer table points the kernels at ``columns`` instead, those means over their mean,
        made before each step (:meth:`normalize_columns`). ``fold_sums``: the step kernel takes the factored sums
        itself (:data:`FOLD_ROWS`), its programs strips (:func:`strip_map`), and there is no first pass."""
        from torchao_optim.kernels.triton_rank1 import stats_programs, stats_tile

        per_state = [r.tolist() if r is not None else None for r in self.rows]
        rows = next(r for r in per_state if r is not None)
        for key, r in zip(self.rule.state_keys, per_state):
            if r is not None and r != rows:  # (one format gives every state of a tensor the same rows)
                raise ValueError(f"state {key!r} reads its tensors as {r} rows, another state as {rows}")
        numels = [p.numel() for p in shards]
        if 0 in rows:
            raise ValueError("a tensor with rank-1 scales has no rows")
        cols = [n // r for r, n in zip(rows, numels)]
        # the first pass's tile (rows, columns, warps); every tile a whole row span in one block: its ALIGNED
        self.stats_tile_shape = stats_tile([layout.scale for layout in self.layouts])
        tile_cols = self.stats_tile_shape.cols
        self.tiles_aligned = all(c % tile_cols == 0 for c in cols) and self.block % tile_cols == 0
        n_states = len(self.layouts)
        factored = [layout.scale == "factored" for layout in self.layouts]
        n_rank1 = sum(r is not None and not f for r, f in zip(per_state, factored))
        # a rank-1 plan whose rows are whole step tiles: its step reads each tile's row and columns directly, and the
        # reciprocals of the new maxima (each matrix's maxima followed by theirs: rank1_inverses) instead of dividing
        self.row_tiles = int(n_rank1 > 0 and n_states in (2, 3) and all(c % self.tile == 0 for c in cols))
        host = self.ptrs.cpu()
        scales_at = [a for k in range(n_states) if per_state[k] is not None for a in host[:, 2 + 2 * k].tolist()]
        if self.row_tiles and all(r % 4 == 0 for r in rows) and all(a % 16 == 0 for a in scales_at):
            self.row_tiles = 2  # every matrix's columns' maxima (and their reciprocals) at 16-byte boundaries
        spread = 2 if self.row_tiles else 1
        self.maxima = torch.zeros((sum(rows) + sum(cols)) * n_rank1 * spread, device=device)
        self.sums = torch.zeros((sum(rows) + sum(cols)) * sum(factored), dtype=torch.float64, device=device)
        divisors = torch.empty_like(self.sums)
        # each factored matrix's columns over their mean, at 16-byte boundaries (the kernels' codes addresses are)
        spans = [-(-c // 4) * 4 for c in cols]
        self.columns = torch.zeros(sum(spans) * sum(factored), device=device)
        table, ptrs, self.stats_into, self.stats_from, column_rows = [], host, [], [], []
        at_max = at_sum = at_col = 0
        inverse_at = []  # where each rank-1 state's maxima start (their reciprocals follow them with row_tiles)
        for t, state in enumerate(states):
            r, c = rows[t], cols[t]
            entry = [r] + [0] * n_states
            for k, key in enumerate(self.rule.state_keys):
                if per_state[k] is None:
                    continue
                x = local(state[key])
                if factored[k]:
                    entry[1 + k] = self.sums[at_sum].data_ptr()
                    divisors[at_sum : at_sum + r], divisors[at_sum + r : at_sum + r + c] = c, r
                    self.stats_into += [getattr(x, self.layouts[k].scales), getattr(x, self.layouts[k].codes)]
                    self.stats_from += [(at_sum, r), (at_sum + r, c)]
                    columns = self.columns[at_col : at_col + c]
                    column_rows.append((getattr(x, self.layouts[k].codes).data_ptr(), columns.data_ptr(), c))
                    ptrs[t, 1 + 2 * k] = columns.data_ptr()
                    at_sum, at_col = at_sum + r + c, at_col + spans[t]
                else:
                    new = self.maxima[at_max : at_max + r + c]
                    entry[1 + k] = new.data_ptr()
                    self.stats_into.append(getattr(x, self.layouts[k].scales))
                    self.stats_from.append(new)
                    inverse_at.append(at_max)
                    at_max += (r + c) * spread
            table.append(entry)
        self.divisors = divisors
        if self.row_tiles:  # positions of every new maximum, and of its reciprocal (rows + cols further on)
            lengths = torch.tensor([r + c for r, c in zip(rows, cols) for _ in range(n_rank1)])
            src = torch.cat([torch.arange(at, at + n) for at, n in zip(inverse_at, lengths.tolist())])
            self.inverse_src = src.to(device)
            self.inverse_dst = (src + torch.repeat_interleave(lengths, lengths)).to(device)
        # (column means, their columns over their mean, column count) per factored matrix: normalize_columns' table
        self.column_table = torch.tensor(column_rows, dtype=torch.int64).to(device) if column_rows else None
        self.means = torch.empty(self.sums.shape, device=device)
        # a factored state's new means, as views of ``means`` ((offset, length) so far)
        self.stats_from = [self.means[x[0] : x[0] + x[1]] if isinstance(x, tuple) else x for x in self.stats_from]
        self.ptrs = ptrs.to(device)
        self.rank1 = torch.tensor(table, dtype=torch.int64).to(device)
        # factored sums in the step (FOLD_ROWS above): its programs are strips, not runs of consecutive tiles, and
        # there is no first pass; else the first pass's programs
        self.fold_sums = FOLD_ROWS > 0 and n_rank1 == 0 and n_states in (2, 3) and all(c % self.tile == 0 for c in cols)
        if self.fold_sums:
            maps = strip_map(rows, cols, self.tile, FOLD_ROWS)
            self.n_programs = len(maps[0])
            self.prog_tensor, self.prog_block, self.prog_tiles = (x.to(device) for x in maps)
        else:
            self.stats_tensor, self.stats_tile = (
                x.to(device)
                for x in stats_programs(
                    numels, rows, self.stats_tile_shape.rows, tile_cols, self.stats_tile_shape.strip
                )
            )

    def rank1_inverses(self) -> None:
        """With ``row_tiles``, after the first pass: each new maximum's reciprocal as a tile's encoding takes it
        (``quant.blockwise.lifted_reciprocal``, as ``FourBitRank1Tensor`` takes it of each element's scale), written
        after its matrix's maxima. An element's scale is the smaller of its row's and column's maxima, so its
        reciprocal is the reciprocal of that one: the step selects it, bit for bit the division it spares."""
        if self.row_tiles:
            from torchao_optim.quant.blockwise import lifted_reciprocal

            self.maxima[self.inverse_dst] = lifted_reciprocal(self.maxima[self.inverse_src])[1]

    def normalize_columns(self) -> None:
        """Each factored matrix's column means over their mean into ``columns``, which the kernels read in place of
        codes, as the C step makes them: one launch of ``triton_rank1.normalize_columns_kernel``."""
        if self.column_table is not None:
            from torchao_optim.kernels.triton_rank1 import normalize_columns_kernel

            normalize_columns_kernel[(len(self.column_table),)](self.column_table, BLOCK=1024, num_warps=4)

    def store_statistics(self) -> None:
        """The new maxima and means become the states' own, once every tile has decoded with the old ones."""
        if self.sums.numel():
            self.means.copy_(self.sums / self.divisors)
        torch._foreach_copy_(self.stats_into, self.stats_from)

    def use_counters(self, steps: Tensor, coefs: Tensor) -> None:
        """Hold the step counts in ``steps`` (each state's ``"step"`` then aliases its element, except on the CPU
        executor) and the coefficient rows in ``coefs``."""
        self.steps, self.coefs = steps, coefs
        if self.executor != "cpu":
            for i, s in enumerate(self.states):
                s["step"] = _alias0d(steps, i)

    def rounds(self, stochastic_round: bool) -> bool:
        """Whether the kernel writes the parameters with stochastic rounding: asked for, and bf16 parameters."""
        return bool(stochastic_round) and self.bf16

    def _grads(self):
        """The gradients the kernel reads, in the plan's order (a DTensor's local shard), as an iterator."""
        grads = map(_GRAD, self.params)
        return map(local, grads) if self.sharded else grads

    def refresh_grads(self, group_addresses: tuple | None = None, group_grads: tuple | None = None) -> bool:
        """Point the kernel at the gradients' current addresses (a copy only when one moved). Returns False,
        changing nothing, when a gradient is not contiguous (one that moved, or a view put in its place at the
        same address, as ``p.grad = p.grad.t()``): the kernel would misread it, the parameter must be planned
        again (it then takes the compiled path). ``group_addresses``, ``group_grads``: the addresses of the
        gradients of the list the plan was made from, in its order, and those gradients, where the caller has
        them (this runs before the step's first launch, for every parameter: reading ``p.grad`` costs more
        than the checks)."""
        grads = self.pick(group_grads) if group_grads is not None and not self.sharded else tuple(self._grads())
        if not all(map(Tensor.is_contiguous, grads)):
            return False
        if group_addresses is not None and not self.sharded:
            key = self.pick(group_addresses)
        else:
            key = tuple(map(Tensor.data_ptr, grads))
        if key != self.grad_key:
            host = torch.tensor(key, dtype=torch.int64)
            if self.grad_ptrs.is_cuda:  # pinned: the copy does not wait; the host allocator keeps it alive
                if torch.cuda.is_current_stream_capturing():
                    # A CUDA graph replays this copy from the same host memory: it must be kept and never
                    # changed, and pinned memory is not allocated while capturing: the spare made beforehand.
                    spare = self.spare_host if self.spare_host is not None else host.pin_memory()
                    host = spare.copy_(host)
                    self.captured_hosts.append(host)
                    self.spare_host = None
                else:
                    host = host.pin_memory()
                    if self.spare_host is None:
                        self.spare_host = torch.empty_like(host).pin_memory()
            self.grad_ptrs.copy_(host, non_blocking=True)
            self.grad_key = key
            self.grads_aligned = all(k % 16 == 0 for k in key)
        return True

    def launch(self, hyperparams: Tensor, refresh: bool = True, **flags) -> None:
        """One step of every parameter of the plan, by its executor's kernel (:func:`torchao_optim.optim.launch.run`:
        ``hyperparams`` as the rule's coefficients take them, and the optimizer's launch flags).
        ``refresh=False``: the caller has just called :meth:`refresh_grads`."""
        if refresh and not self.refresh_grads():
            p, g = next((p, g) for p, g in zip(self.params, self._grads()) if not g.is_contiguous())
            raise RuntimeError(
                f"a parameter of shape {tuple(local(p).shape)} has a non-contiguous gradient (strides "
                f"{g.stride()}), which this fused step cannot read; make it contiguous"
            )
        launch.run(self, hyperparams, **flags)


def _programs(numels: Tensor, span: int) -> Tensor:
    """Programs per tensor of ``numels`` elements, each walking ``span`` elements (a tensor's last, fewer)."""
    return (numels + span - 1) // span


def program_map(numels: Tensor, tile: int, iters: int, tail_tiles: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The programs of a plan of tensors of ``numels`` elements in ``tile``-element tiles: each program's tensor,
    first tile and number of tiles (int32). Programs of ``iters`` tiles (a tensor's last, fewer), except the plan's
    last ``tail_tiles`` tiles (in the order of the tensors), one per program."""
    tiles = _programs(numels, tile)
    cut = max(int(tiles.sum()) - tail_tiles, 0)  # tiles before the tail, over all tensors
    before = (cut - (torch.cumsum(tiles, 0) - tiles)).clamp(0).minimum(tiles)  # each tensor's tiles before it
    tensors, firsts, counts = [], [], []
    for t, (n, b) in enumerate(zip(tiles.tolist(), before.tolist())):
        first = torch.cat([torch.arange(0, b, iters), torch.arange(b, n)])
        count = torch.cat([(b - torch.arange(0, b, iters)).clamp(max=iters), torch.ones(n - b, dtype=torch.int64)])
        tensors.append(torch.full(first.shape, t))
        firsts.append(first)
        counts.append(count)
    return tuple(
        torch.cat(xs).to(torch.int32) if xs else torch.zeros(0, dtype=torch.int32) for xs in (tensors, firsts, counts)
    )


def strip_map(rows: list[int], cols: list[int], tile: int, strip_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """The programs of a plan of matrices of ``rows`` x ``cols`` (each ``cols`` a multiple of ``tile``) as strips: each
    program's tensor, first tile and number of tiles (int32), its tiles one tile wide down ``strip_rows`` rows (a
    matrix's last strips, fewer), ``cols // tile`` tiles apart. Strips side by side (the same rows) are consecutive
    programs."""
    tensors, firsts, counts = [], [], []
    for t, (r, c) in enumerate(zip(rows, cols)):
        across = c // tile
        starts = torch.arange(0, r, strip_rows)
        firsts.append((starts[:, None] * across + torch.arange(across)).flatten())
        counts.append((r - starts).clamp(max=strip_rows).repeat_interleave(across))
        tensors.append(torch.full(firsts[-1].shape, t))
    return tuple(torch.cat(xs).to(torch.int32) for xs in (tensors, firsts, counts))


def spread_iters(numels: Tensor, tile: int, min_programs: int) -> int:
    """Tiles per program for a plan of tensors of ``numels`` elements: :data:`ITERS`, halved while the plan would
    have fewer than ``min_programs`` programs (down to one tile each)."""
    iters = ITERS
    while iters > 1 and int(_programs(numels, tile * iters).sum()) < min_programs:
        iters //= 2
    return iters


def _per_sm(setting: int | None, per_sm: int, device: torch.device) -> int:
    """``setting`` where set, else ``per_sm`` for each SM of a CUDA device (0 elsewhere): :data:`MIN_PROGRAMS` and
    :data:`TAIL_TILES`."""
    if setting is not None:
        return setting
    if device.type != "cuda":
        return 0
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def _share_coefficients(plans: list[GroupPlan]) -> None:
    """One coefficients launch for every plan of a group on a device whose rule has a Triton coefficients kernel
    (Adam's; the Triton executor's), made by the first one's launch (the plans of a group are launched together, in
    order): their step counts and coefficient rows become slices of one buffer each. Each launch is a kernel the next
    one waits for (about 2 us on an H200, on a step of ViT-B's 0.3 ms with its two plans, quantized states and the
    plain states of its 1-D tensors)."""
    by_device: dict[torch.device, list[GroupPlan]] = {}
    for plan in plans:
        if plan.executor == "triton" and plan.rule.triton_coefficients is not None:
            by_device.setdefault(plan.steps.device, []).append(plan)
    for same in by_device.values():
        if len(same) < 2:
            continue
        steps = torch.cat([plan.steps for plan in same])
        coefs = torch.cat([plan.coefs for plan in same])
        start = 0
        for plan in same:
            n = len(plan.params)
            plan.use_counters(steps[start : start + n], coefs[start : start + n])
            plan.coefs_for = None
            start += n
        same[0].coefs_for = (steps, coefs)


def register_cap(layouts, param_bytes: int, fold_sums: bool = False) -> int | None:
    """The register cap of a two-state plan (Adam's) whose states have ``layouts``: :data:`MAXNREG` where set; else,
    with scales over a whole matrix, :data:`FOLD_CAPS`' entry where the step takes the factored sums (``fold_sums``)
    and none otherwise (:data:`REGISTER_CAPS` were measured on blockwise scales); else :data:`REGISTER_CAPS`' entry
    for the narrowest codes (none when no state is quantized)."""
    if MAXNREG is not None:
        return MAXNREG or None
    if any(layout.scale != "block" for layout in layouts):
        return FOLD_CAPS.get(param_bytes) if fold_sums else None
    bits = [layout.bits for layout in layouts if layout.quantized]
    return REGISTER_CAPS.get((min(bits), param_bytes)) if bits else None


def _addresses(params: list[Tensor]) -> tuple:
    """The data addresses of ``params`` (their local shards' for DTensors): C calls only where it can."""
    try:
        return tuple(map(Tensor.data_ptr, params))
    except RuntimeError:  # a DTensor has no address of its own
        return tuple(local(p).data_ptr() for p in params)


def check_state_shapes(params: list[Tensor], states: list[dict], keys, rounding=None) -> None:
    """RuntimeError naming the first of ``params`` whose ``keys`` states (those it has) are not of its shape: its
    data was replaced (``p.data = ...``) after they were created. Run before a step changes anything, by both
    executors. ``rounding``: the optimizer's ``_rounding``, whose rows start with each parameter's position."""
    for p, s in zip(params, states):
        for k in keys:
            if k in s and local(s[k]).shape != local(p).shape:
                where = f"parameter {rounding([p])[0][0]}" if rounding is not None else "a parameter"
                raise RuntimeError(
                    f"{where} has shape {tuple(local(p).shape)} and a state {k!r} of shape "
                    f"{tuple(local(s[k]).shape)}: its data was replaced by a tensor of another shape "
                    f"after its state was created"
                )


def plan_group(
    cache: dict,
    params: list[Tensor],
    states: list[dict],
    rule,
    interpreter: bool = False,
    rounding=None,
) -> tuple[list[GroupPlan], list[int]]:
    """The plans covering what the fused kernels can update in ``params`` with ``rule`` (reused from ``cache``
    while the same parameters have gradients under the same rule), and the indexes of the parameters left to
    the compiled path. ``rule``: a :class:`FusedRule`, None, or a callable giving each parameter's
    (:func:`rule_for`)."""
    # The plans hold the parameters' addresses: a parameter whose storage was replaced (``p.data = ...``) is
    # planned again, not written at its old address.
    # They also hold the states' addresses: a state replaced, removed or reset (``optimizer.state`` is the truth) is
    # planned again too, from the state as it is now.
    addresses = _addresses(params)
    if cache.get("params") is params and cache.get("rule") == rule and cache.get("addresses") == addresses:
        if cache["states"].same_values(states):
            return cache["plans"], cache["rest"]  # the optimizer's list, unchanged
    key = (rule,) + tuple(id(p) for p in params)
    if cache.get("key") == key and cache.get("addresses") == addresses and cache["states"].same_values(states):
        cache["params"] = params
        return cache["plans"], cache["rest"]
    rules = [rule_for(rule, p) for p in params]
    for r in set(rules) - {None}:
        chosen = [i for i, x in enumerate(rules) if x == r]
        check_state_shapes([params[i] for i in chosen], [states[i] for i in chosen], r.state_keys, rounding)
    buckets: dict[tuple, list[int]] = {}
    rest = []
    for i, (p, s) in enumerate(zip(params, states)):
        k = plan_key(p, s, rules[i], interpreter)
        if k is None:
            rest.append(i)
        else:
            buckets.setdefault(k, []).append(i)
    # rounding(params): (position, element offset) of each, for stochastic rounding (optim/base.py)
    plans = [
        GroupPlan(
            k,
            [params[i] for i in idx],
            [states[i] for i in idx],
            rounding([params[i] for i in idx]) if rounding is not None else None,
        )
        for k, idx in buckets.items()
    ]
    for plan, idx in zip(plans, buckets.values()):  # its parameters' positions in ``params``
        plan.pick = (lambda seq, i=idx[0]: (seq[i],)) if len(idx) == 1 else operator.itemgetter(*idx)
    _share_coefficients(plans)
    # recorded after the plans re-pointed each state's "step" at their counters
    cache.update(
        key=key, rule=rule, params=params, plans=plans, rest=rest, addresses=addresses, states=StateSnapshot(states)
    )
    return plans, rest
