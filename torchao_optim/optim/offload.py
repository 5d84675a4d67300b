"""Optimizer state in host memory, in its low-bit form, streamed through the GPU a chunk at a time.

With ``offload_state=True`` an optimizer of ours keeps the states of its GPU parameters in page-locked host
buffers, one per parameter group and dtype (an *arena*: one holds the codes, another the fp32 scales and plain
states, since a checkpoint cannot hold views of one storage as two dtypes), laid out chunk after chunk. Each rank
of a sharded model (FSDP2) keeps its own shards' states. The GPU holds two *slots*, each the size of the largest
chunk. A step walks the chunks: a side stream copies chunk ``i + 2`` into the slot chunk
``i`` used as soon as chunk ``i``'s state has been copied back, the update of chunk ``i + 1`` runs meanwhile
on the current stream, and a second side stream copies each updated chunk back, so that both directions of
the PCIe link and the update overlap. The fused kernels read the slots exactly as they read GPU-resident
state: a chunk is a :class:`~torchao_optim.optim.fused.GroupPlan` whose state pointers are the slot's.

What crosses the link each step is the state's own bytes, both ways (8-bit Adam: about 2 B per parameter
each way); parameters and gradients stay on the GPU, where the update reads them. The GPU holds the two slots
(``2 * max(CHUNK_BYTES, the largest parameter's state)``), not the state.

Host memory is registered with the driver at its exact size (``cudaHostRegister``): torch's pinned-memory
allocator rounds every block up to a power of two, up to twice the state's bytes. The arena is unregistered
when it is dropped (a new plan, a loaded checkpoint).

Readers of the host state must wait for the copies back: ``state_dict()``, ``load_state_dict()`` and copies
of the optimizer do (:meth:`Slots.wait`); code that reads ``optimizer.state`` directly after a step calls
``torch.cuda.synchronize()`` first. In Triton's interpreter on the CPU (testing) the same plans run with
CPU slots and synchronous copies.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchao_optim.optim.fused import GroupPlan, plan_key
from torchao_optim.optim.sharded import is_dtensor, like_param, local
from torchao_optim.optim.snapshot import StateSnapshot
from torchao_optim.optim.state_form import new_state_tensor, offloads
from torchao_optim.rules import FusedRule
from torchao_optim.state import QuantizedState

__all__ = ["CHUNK_BYTES", "Slots", "OffloadChunk", "plan_offloaded", "pinned_empty", "state_nbytes"]

CHUNK_BYTES = 64 << 20  # state bytes per chunk (a parameter larger than that is a chunk of its own)
ALIGN = 64  # every field starts at a multiple of this many bytes, in the arena and in the slots


def _fields(state: Tensor) -> dict[str, Tensor]:
    """The plain tensors a state is made of: a quantized state's fields, or the state itself (for a DTensor
    state, its local shard's: each rank streams its own shards)."""
    state = local(state)
    return state.fields() if isinstance(state, QuantizedState) else {"": state}


def _rebuild(state: Tensor, fields: dict[str, Tensor]) -> Tensor:
    """``state`` over ``fields`` (a DTensor state stays a DTensor, its local shard over them)."""
    shard = local(state)
    rebuilt = shard._new(fields) if isinstance(shard, QuantizedState) else fields[""]
    return like_param(state, rebuilt) if is_dtensor(state) else rebuilt


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def state_nbytes(state: Tensor) -> int:
    """Bytes ``state`` takes in an arena or a slot (its fields, each aligned)."""
    return sum(_aligned(t.numel() * t.element_size()) for t in _fields(state).values())


def pinned_empty(nbytes: int) -> Tensor:
    """An uninitialized uint8 CPU tensor of exactly ``nbytes``, page-locked where CUDA is available (unregistered
    when this tensor object is freed: a view of it as another dtype does not keep it, a slice does)."""
    t = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    if torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        ptr = t.data_ptr()
        err = cudart.cudaHostRegister(ptr, t.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(
                f"offload_state: page-locking {nbytes} bytes of host memory failed (CUDA error "
                f"{int(err)}); the host may be short of memory"
            )
        weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


def _view(buffer: Tensor, offset: int, like: Tensor) -> Tensor:
    n = like.numel() * like.element_size()
    return buffer[offset : offset + n].view(like.dtype).view(like.shape)


class OffloadChunk:
    """One launch's parameters: their states' bytes in the arenas and the slot they run in. ``segments`` pairs
    each arena's part (a typed 1-D view of host memory) with the same bytes in the slot."""

    def __init__(self, plan: GroupPlan, segments: list[tuple[Tensor, Tensor]], slot: int, nbytes: int, arenas):
        self.plan, self.segments, self.slot, self.nbytes = plan, segments, slot, nbytes
        # the arenas themselves: a view as another dtype does not keep its base tensor, whose end unregisters
        # the host memory (pinned_empty)
        self.arenas = arenas

    def copy_in(self, non_blocking: bool) -> None:
        for host, device in self.segments:
            device.copy_(host, non_blocking=non_blocking)

    def copy_out(self, non_blocking: bool) -> None:
        for host, device in self.segments:
            host.copy_(device, non_blocking=non_blocking)


class Slots:
    """The two GPU buffers chunks run in, the streams that fill and drain them, and the events that order them."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes, self.device = nbytes, device
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.cuda = device.type == "cuda"
        self.free: list[torch.cuda.Event | None] = [None, None]  # the last copy back out of each slot
        # (chunk, event of its copy in) whose state a slot holds: a chunk still there, or prefetched, is not
        # copied in again (after its copy back, a slot holds the same bytes as the chunk's host memory)
        self.resident: list[tuple[OffloadChunk, torch.cuda.Event | None] | None] = [None, None]
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def wait(self) -> None:
        """Block the host until every copy back to the arenas has finished."""
        for event in self.free:
            if event is not None:
                event.synchronize()

    def forget(self) -> None:
        """The arenas are about to change (a new plan, a loaded checkpoint): no slot holds a chunk any more."""
        self.wait()
        self.resident = [None, None]

    def _load(self, c: OffloadChunk) -> torch.cuda.Event:
        """Copy ``c``'s state into its slot on the copy-in stream, once the slot's last copy back is done."""
        with torch.cuda.stream(self.h2d):
            if self.free[c.slot] is not None:
                self.h2d.wait_event(self.free[c.slot])
            c.copy_in(non_blocking=True)
            event = self.h2d.record_event()
        self.resident[c.slot] = (c, event)
        return event

    def _loaded(self, c: OffloadChunk) -> torch.cuda.Event | None:
        """The event after which ``c``'s state is in its slot, copying it in unless it is there already (None:
        it has been there since its last update)."""
        held = self.resident[c.slot]
        if held is not None and held[0] is c:
            return held[1]
        return self._load(c)

    def prefetch(self, c: OffloadChunk) -> None:
        """Start copying ``c`` in now (the chunk expected next: stepping in backward, one parameter at a time)."""
        if self.cuda:
            self._loaded(c)

    def run(self, chunks: Sequence[OffloadChunk], launch: Callable[[GroupPlan], None]) -> None:
        """Stream ``chunks`` through the slots: copy in, ``launch(chunk.plan)``, copy back."""
        if not self.cuda:  # Triton's interpreter on the CPU: the same data movement, synchronous
            for c in chunks:
                c.copy_in(non_blocking=False)
                launch(c.plan)
                c.copy_out(non_blocking=False)
            return
        main = torch.cuda.current_stream(self.device)
        loaded = [self._loaded(c) for c in chunks[:2]]
        for i, c in enumerate(chunks):
            # a chunk still in its slot: its last copy back must be done before the update rewrites the slot
            main.wait_event(loaded[i] if loaded[i] is not None else self.free[c.slot])
            launch(c.plan)
            updated = main.record_event()
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(updated)
                c.copy_out(non_blocking=True)
                self.free[c.slot] = self.d2h.record_event()
            self.resident[c.slot] = (c, None)  # its bytes, as its host memory will hold them
            if i + 2 < len(chunks):
                loaded.append(self._loaded(chunks[i + 2]))


def plan_offloaded(
    cache: dict,
    params: list[Tensor],
    states: list[dict],
    rule: FusedRule,
    slots: Slots,
    interpreter: bool,
    rounding,
    first_slot: int = 0,
) -> tuple[list[OffloadChunk], list[int]]:
    """The chunks that step ``params`` (all planned by :func:`~torchao_optim.optim.fused.plan_key`; their
    ``rule.state_keys`` states on the meta device where not yet created) from one arena, reused from
    ``cache`` while the same parameters have gradients under the same rule and the same slots; and the indexes
    of the parameters no fused kernel covers (then nothing is built: the caller refuses them).

    Building moves every state into a new arena (fresh ones as zeros) and replaces ``states[i][key]`` with a
    state over the arena; a parameter's ``"step"`` becomes an alias into its chunk's plan."""
    key = (rule, slots) + tuple(id(p) for p in params)
    if cache.get("offload_key") == key and cache["states"].same_values(states):
        return cache["chunks"], []
    keys = [plan_key(p, s, rule, interpreter) for p, s in zip(params, states)]
    rest = [i for i, k in enumerate(keys) if k is None]
    if rest:
        return [], rest
    slots.forget()  # the old arena may still be receiving the last step's copies
    buckets: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        buckets.setdefault(k, []).append(i)
    # greedy chunks of at most slots.nbytes, parameters in their group's order within each plan key
    layout: list[tuple[tuple, list[int], int]] = []  # (plan key, indexes, bytes)
    for k, idx in buckets.items():
        current: list[int] = []
        size = 0
        for i in idx:
            n = sum(state_nbytes(states[i][name]) for name in rule.state_keys)
            if current and size + n > slots.nbytes:
                layout.append((k, current, size))
                current, size = [], 0
            current.append(i)
            size += n
        layout.append((k, current, size))
    # one arena per dtype; in each, chunk after chunk; in a slot, a chunk's dtypes one after another
    fields = {
        i: [(name, f, t) for name in rule.state_keys for f, t in _fields(states[i][name]).items()]
        for _, idx, _ in layout
        for i in idx
    }
    dtypes = sorted({t.dtype for fs in fields.values() for _, _, t in fs}, key=str)
    sizes = {d: 0 for d in dtypes}  # bytes of each arena
    for fs in fields.values():
        for _, _, t in fs:
            sizes[t.dtype] += _aligned(t.numel() * t.element_size())
    arenas = {d: pinned_empty(n) for d, n in sizes.items()}  # uint8, viewed as d where read
    ends = dict.fromkeys(dtypes, 0)  # bytes of each arena taken by the chunks before
    chunks = []
    for j, (k, idx, size) in enumerate(layout):
        slot = (first_slot + j) % 2
        starts = dict(ends)
        offsets, slot_at, at = {}, {}, 0  # a field's byte offset in its arena's part of the chunk
        for d in dtypes:
            slot_at[d] = at
            part = sum(_aligned(t.numel() * t.element_size()) for i in idx for _, _, t in fields[i] if t.dtype == d)
            offsets[d] = 0
            at += part
            ends[d] += part
        shadows = []
        for i in idx:
            shadow = {"step": states[i]["step"]}
            for name in rule.state_keys:
                state = states[i][name]
                host, device = {}, {}
                source = _fields(_materialized(state, slots.device))
                for field, t in source.items():
                    d = t.dtype
                    host[field] = _view(arenas[d], starts[d] + offsets[d], t)
                    host[field].copy_(t)
                    device[field] = _view(slots.buffers[slot], slot_at[d] + offsets[d], t)
                    offsets[d] += _aligned(t.numel() * t.element_size())
                states[i][name] = _rebuild(state, host)
                shadow[name] = _rebuild(local(state), device)  # what the kernels read: the local shard's
            shadows.append(shadow)
        segments = []
        for d in dtypes:
            n = ends[d] - starts[d]
            if n:  # (a multiple of ALIGN bytes, so a whole number of elements)
                host = arenas[d][starts[d] : ends[d]].view(d)
                segments.append((host, slots.buffers[slot][slot_at[d] : slot_at[d] + n].view(d)))
        chunk_params = [params[i] for i in idx]
        # pdl=False: its update follows a copy into its slot, so it starts when everything before it is done
        plan = GroupPlan(k, chunk_params, shadows, rounding(chunk_params) if rounding is not None else None, pdl=False)
        for i, shadow in zip(idx, shadows):
            states[i]["step"] = shadow["step"]  # an alias into the plan's step counts
        chunks.append(OffloadChunk(plan, segments, slot, size, arenas))
    cache.clear()
    # recorded after the states were moved into the arena and their steps re-pointed at the plans' counters
    cache.update(offload_key=key, chunks=chunks, states=StateSnapshot(states))
    return chunks, []


def _materialized(state: Tensor, device: torch.device) -> Tensor:
    """``state`` holding data: a state created on the meta device (not yet stepped) as zeros, made on ``device``
    one at a time (each is copied into the arena, then freed)."""
    state = local(state)
    if not state.is_meta:
        return state
    if isinstance(state, QuantizedState):
        return type(state).zeros(state.shape, device=device, dtype=state.dtype, **state.attrs())
    return torch.zeros(state.shape, dtype=state.dtype, device=device)


class Offloader:
    """An optimizer's ``offload_state`` machinery: its GPU window (two slots, sized once for its largest
    parameter), and, when it steps in backward, the order the hooks ran in last time, to prefetch the next
    parameter's state while this one steps."""

    def __init__(self) -> None:
        self.slots: Slots | None = None
        self._next: dict[int, int] = {}  # id(param) -> id(the param stepped after it, last time)
        self._last: int | None = None

    def wait(self) -> None:
        """Before the host state is read or replaced: wait for the copies back, and forget which chunks the slots
        hold (the host copy may change under them)."""
        if self.slots is not None:
            self.slots.forget()

    def slots_for(self, optimizer, device: torch.device) -> Slots:
        """The window on ``device``: two slots of the largest chunk, sized once for every parameter of the
        optimizer (so that stepping parameter by parameter, in backward, never outgrows them)."""
        if self.slots is not None and self.slots.device != device:
            raise ValueError(
                f"{type(optimizer).__name__}(offload_state=True) streams state through one GPU; "
                f"parameters on {self.slots.device} and {device}: use one optimizer per device"
            )
        if self.slots is None:
            largest = 0
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if offloads(optimizer, p):
                        n = sum(
                            state_nbytes(new_state_tensor(optimizer, p, group, optimizer._signed(k)))
                            for k in optimizer._state_keys(group, p)
                        )
                        largest = max(largest, n)
            self.slots = Slots(max(CHUNK_BYTES, largest), device)
        return self.slots

    def step(self, optimizer, group, params: list[Tensor], states: list[dict], rule: FusedRule, plan_cache, flags):
        """The step of ``params`` (all offloaded) with their states streamed through the GPU in chunks."""
        device = params[0].device
        slots = self.slots_for(optimizer, device)
        first = optimizer._rounding(params[:1])[0][0]  # stepping one parameter at a time, they alternate slots
        chunks, rest = plan_offloaded(
            plan_cache(), params, states, rule, slots, optimizer._interpreter, optimizer._rounding, first_slot=first
        )
        if rest:
            refuse_unplanned(optimizer, params, states, rest)
        hp = optimizer._fused_hyperparams(group, device)
        slots.run(chunks, lambda plan: plan.launch(hp, **flags))
        in_backward = optimizer._in_backward
        if in_backward is not None:  # one parameter at a time: copy in the one backward reached next last time
            previous, self._last = self._last, id(params[0])
            if previous is not None:
                self._next[previous] = id(params[0])
            upcoming = in_backward.get(self._next.get(id(params[0])))
            if upcoming is not None and "chunks" in upcoming[1]:
                for chunk in upcoming[1]["chunks"]:
                    slots.prefetch(chunk)


def refuse_unplanned(optimizer, params: list[Tensor], states: list[dict], rest) -> None:
    """A parameter the fused path does not cover is refused by name (its states, not yet made, are dropped: the
    optimizer stays usable)."""
    for i in rest:
        for key in [k for k, v in states[i].items() if isinstance(v, Tensor) and v.is_meta]:
            del states[i][key]
    p = params[rest[0]]
    raise ValueError(
        f"{type(optimizer).__name__}(offload_state=True): a parameter of shape {tuple(p.shape)} "
        f"({p.dtype}, {p.device}{', a DTensor' if is_dtensor(p) else ''}) is not covered by the "
        f"fused CUDA path, through which offloaded state is streamed (see docs/bigger-models.md, "
        f"'Offloaded state')"
    )
