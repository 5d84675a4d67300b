"""A parameter group's CUDA step replayed from a CUDA graph.

A step's device work is a handful of launches per group on the fused path and a few per parameter on the
compiled path; issuing them from Python costs more host time than a small model's kernels take on the GPU
(ViT-B: about 0.26 ms of host time for the fused path's 0.4 ms of kernels, and most of a compiled step). Once
a group has stepped twice in a row with the same *signature* (which parameters and states, where the tensors
the launches read directly live, the group's settings other than its numbers), its launches are captured in
one CUDA graph and from then on replayed with a single call, for as long as the signature stays the same.

What a graph reads by address stays correct between replays: the hyperparameters are a device tensor refilled
in place before each replay (so an lr changed every step replays the same graph), the step counts and states
are updated in place, and the fused path's gradient addresses live in a device table refreshed before each
replay. Anything else changing (a gradient of the compiled path moving, a parameter's storage replaced, a state
loaded, a flag such as ``maximize`` set) changes the signature: the graph is dropped and the group steps from
Python again until the new signature has repeated. A graph that cannot be captured is reported once with a
warning, and the group steps from Python from then on.

Not used inside a CUDA graph capture of the user's own (``capturable=True``), under ``torch.compile``, for
DTensor (FSDP2) parameters, with ``offload_state`` or when stepping in backward. ``ENABLED = False`` turns it
off; results are bit-identical either way.

A replayed step whose group then steps again unchanged takes a shorter road (:class:`Steady`): what the
signature and the fused plans depend on is checked in a few passes over the parameters in C (the gradients'
addresses, which also say that every parameter has one; the parameters' ids and addresses; the group's
settings and the optimizer's state by identity), and the graph is replayed. Anything else goes the whole way, which
decides again.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torchao_optim.optim.fused import _GRAD
from torchao_optim.optim.sharded import is_dtensor
from torchao_optim.optim.snapshot import StateSnapshot
from torchao_optim.optim.state_form import state_tensors

__all__ = ["ENABLED", "StepGraph", "Steady", "replay_device", "replay_steady", "run_replayed"]

ENABLED = True
REPEATS = 2  # steps with the same signature before capturing: the first ones compile and settle the caches


class StepGraph:
    """The captured step of one parameter group on one CUDA device, and the signature it was captured for."""

    def __init__(self):
        self.graph: torch.cuda.CUDAGraph | None = None
        self.signature: Any = None
        self.keep: Any = None  # the objects whose ids the signature holds: alive, so no id is reused
        self.seen: Any = None
        self.repeats = 0
        self.failed = False
        self.steady: Steady | None = None  # set by the optimizer after a replay it may repeat unchecked

    def run(self, signature, keep, work: Callable[[], None], device: torch.device) -> bool:
        """Do ``work`` (the group's launches) for this step: replayed, captured and replayed, or called.
        Returns whether the graph was replayed."""
        self.steady = None
        if self.failed or not ENABLED:
            work()
            return False
        if self.graph is not None and signature == self.signature:
            self._replay(device)
            return True
        self.graph = self.signature = self.keep = None  # stale: whatever it captured may have moved
        self.repeats = self.repeats + 1 if signature == self.seen else 1
        self.seen = signature
        graph = self._capture(work, device) if self.repeats > REPEATS else None
        if graph is None:
            work()
            return False
        self.graph, self.signature, self.keep = graph, signature, keep
        self._replay(device)
        return True

    def again(self) -> None:
        """Replay the graph for a step that :class:`Steady` found unchanged."""
        self._replay(self.steady.device)

    def _replay(self, device: torch.device) -> None:
        """On the current stream of ``device`` (a graph is launched on the current device's stream)."""
        if device.index is None or device.index == torch.cuda.current_device():
            self.graph.replay()
        else:
            with torch.cuda.device(device):
                self.graph.replay()

    def _capture(self, work: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph | None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(stream):
                    # thread_local: other threads (a data loader's pinning thread) may use CUDA meanwhile
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        work()
                    finally:
                        graph.capture_end()
            except Exception as err:  # noqa: BLE001 - any failure means: step from Python, as before
                self.failed = True
                reason = " ".join(str(err).split())[:300]
                warnings.warn(
                    f"torchao_optim: could not capture a parameter group's step in a CUDA graph "
                    f"({type(err).__name__}: {reason}); it steps without one from now on (correct, with "
                    f"more host time per step)",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return None
            finally:
                torch.cuda.current_stream().wait_stream(stream)
        return graph


class Steady:
    """A parameter group's replayed step as it was, for the next step to compare against cheaply.

    Recorded only for a group whose every parameter has a gradient and is stepped by the fused plans (a
    compiled step reads tensors by address that these checks do not cover). ``data_keys``: the group's keys
    whose values are numbers the hyperparameter tensor carries (refilled before every replay, so not
    compared); every other key's value must be the very same object.
    """

    def __init__(
        self,
        group: dict,
        param_addresses: tuple,
        grad_addresses: tuple,
        plans: Sequence,
        device: torch.device,
        data_keys: set,
        snapshot: StateSnapshot,
    ):
        self.snapshot = snapshot  # the optimizer's state as the plans were made from it (optim/snapshot.py)
        self.params = group["params"]
        self.ids = tuple(map(id, self.params))
        self.param_addresses = param_addresses
        self.grad_addresses = grad_addresses
        self.plans = plans
        self.aligned = tuple(plan.grads_aligned for plan in plans)
        self.device = device
        self.keys = tuple(group)
        positions = [i for i, k in enumerate(self.keys) if k != "params" and k not in data_keys]
        self.settings = self._pick(positions)
        self.values = self.settings(tuple(group.values()))

    @staticmethod
    def _pick(positions):
        """Values at ``positions`` of a tuple, as a tuple (also for one position or none)."""
        if len(positions) == 1:
            return lambda values, i=positions[0]: (values[i],)
        return operator.itemgetter(*positions) if positions else (lambda values: ())

    def grads_if_unchanged(self, group: dict) -> tuple[tuple, tuple] | None:
        """The gradients of ``group``'s parameters and their addresses if nothing the recorded step depended on
        differs, else None. (The gradients may have moved, or become views: the plans' refresh_grads follows
        the first and refuses the second, from these same tensors: each ``p.grad`` is read once a step.)"""
        params = group["params"]
        if params is not self.params or tuple(group) != self.keys:
            return None
        grads = tuple(map(_GRAD, params))
        try:  # a parameter without a gradient (None) or with a sparse one has no address
            addresses = tuple(map(Tensor.data_ptr, grads))
        except (TypeError, RuntimeError):
            return None
        if (
            tuple(map(id, params)) != self.ids
            or tuple(map(Tensor.data_ptr, params)) != self.param_addresses
            or not all(map(operator.is_, self.settings(tuple(group.values())), self.values))
        ):
            return None
        return grads, addresses


def replay_steady(optimizer, group) -> bool:
    """Step ``group`` by replaying its graph if its last step was replayed and nothing that step depended on has
    changed (:class:`Steady`); False where the whole way must decide."""
    graph = optimizer._graphs.get(id(group))
    steady = graph.steady if graph is not None else None
    if steady is None or not ENABLED:
        return False
    found = steady.grads_if_unchanged(group)
    if found is None or steady.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    cache = optimizer._plans.get(id(group), {})
    if cache.get("plans") is not steady.plans:
        return False  # planned again since (a step traced by torch.compile plans through the same cache)
    with_grad = optimizer._with_grad.get(id(group))
    if with_grad is None or with_grad[3] is not steady.snapshot or not steady.snapshot.holds(optimizer.state):
        return False  # a state replaced, removed or reset: the whole way adopts it and plans again
    # the plans' tables follow moved gradients (outside the graph); a gradient that is not contiguous, moved or a
    # view at the same address, sends the step the full way, which plans its parameter again
    grads, addresses = found
    if not all([plan.refresh_grads(addresses, grads) for plan in steady.plans]):
        return False
    if addresses != steady.grad_addresses:
        if tuple(plan.grads_aligned for plan in steady.plans) != steady.aligned:
            return False  # the graph was captured for the other alignment: the signature differs
        steady.grad_addresses = addresses
    optimizer._hyperparams(group, steady.device)
    graph.again()
    return True


def replay_device(optimizer, group, params: list[Tensor]) -> torch.device | None:
    """The CUDA device whose graph may replay the step of ``params`` (``group``'s with gradients), or None where
    none may: see this module's docstring for when."""
    if not params or not ENABLED or optimizer._offload_state or optimizer._in_backward is not None:
        return None
    cached = optimizer._replayable.get(id(group))
    if cached is None or cached[0] is not params:  # decided once per list of parameters
        device = params[0].device
        if device.type != "cuda" or any(p.device != device or is_dtensor(p) for p in params):
            device = None
        cached = optimizer._replayable[id(group)] = (params, device)
    if cached[1] is None or torch.cuda.is_current_stream_capturing():
        return None
    return cached[1]


def run_replayed(optimizer, group, params, plans, compiled, rest, addresses, work, device, plan_cache) -> None:
    """Do ``work`` (the step of ``params``: the fused ``plans``, then the compiled path for ``compiled``, the
    parameters at ``rest``) through ``group``'s :class:`StepGraph` on ``device``, under the step's signature; and
    record a :class:`Steady` where the next step may take the short way."""
    # Outside the graph too: the hyperparameters, refilled in place where a number changed; then what says whether
    # the graph still holds.
    optimizer._hyperparams(group, device)
    # The numbers the hyperparameter tensor carries are data (refilled above); a tensor is read by address;
    # anything else the step may read as a constant (a flag, Muon's eps): it is part of the signature.
    data = {id(x) for x in optimizer._hyperparam_values(group) if not isinstance(x, Tensor)}
    data_keys = {
        k for k, v in group.items() if id(v) in data or isinstance(v, tuple) and v and all(id(x) in data for x in v)
    }
    settings, tensors = [], []
    for k, v in group.items():
        if isinstance(v, Tensor):
            settings.append((k, id(v)))
            tensors.append(v)
        elif k != "params" and k not in data_keys:
            settings.append((k, v))
    if compiled[0]:  # what the compiled path's kernels read by address: parameters, gradients, states
        if addresses is None:
            addresses = tuple(map(Tensor.data_ptr, map(_GRAD, params)))
        read = (
            tuple(map(Tensor.data_ptr, compiled[0])),
            tuple(addresses[i] for i in rest),
            tuple(map(Tensor.data_ptr, state_tensors(optimizer, group, *compiled))),
        )
    else:
        read = ()
    signature = (
        id(params),
        tuple(settings),
        tuple(id(plan) for plan in plans),
        tuple(plan.grads_aligned for plan in plans),
        read,
    )
    graph = optimizer._graphs.setdefault(id(group), StepGraph())
    replayed = graph.run(signature, (params, plans, tensors), work, device)
    # replayed, fused only, every parameter with a gradient: the next step may take the short way, and the state it
    # was made from is the state now (checked once here; the short way checks only that nothing changed since)
    with_grad = optimizer._with_grad.get(id(group))
    if (
        replayed
        and not compiled[0]
        and addresses is not None
        and len(params) == len(group["params"])
        and with_grad is not None
        and with_grad[1] is params
        and with_grad[3].holds(optimizer.state)
    ):
        graph.steady = Steady(group, plan_cache()["addresses"], addresses, plans, device, data_keys, with_grad[3])
