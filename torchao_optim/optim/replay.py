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
from torchao_optim.optim.snapshot import StateSnapshot

__all__ = ["ENABLED", "StepGraph", "Steady"]

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
