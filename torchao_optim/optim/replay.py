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
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

__all__ = ["ENABLED", "StepGraph"]

ENABLED = True
REPEATS = 2  # steps with the same signature before capturing: the first ones compile and settle the caches


class StepGraph:
    """The captured step of one parameter group on one CUDA device, and the signature it was captured for."""

    def __init__(self):
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.signature: Any = None
        self.keep: Any = None  # the objects whose ids the signature holds: alive, so no id is reused
        self.seen: Any = None
        self.repeats = 0
        self.failed = False

    def run(self, signature, keep, work: Callable[[], None], device: torch.device) -> None:
        """Do ``work`` (the group's launches) for this step: replayed, captured and replayed, or called."""
        if self.failed or not ENABLED:
            return work()
        if self.graph is not None and signature == self.signature:
            self._replay(device)
            return None
        self.graph = self.signature = self.keep = None  # stale: whatever it captured may have moved
        self.repeats = self.repeats + 1 if signature == self.seen else 1
        self.seen = signature
        if self.repeats <= REPEATS:
            return work()
        graph = self._capture(work, device)
        if graph is None:
            return work()
        self.graph, self.signature, self.keep = graph, signature, keep
        self._replay(device)
        return None

    def _replay(self, device: torch.device) -> None:
        """On the current stream of ``device`` (a graph is launched on the current device's stream)."""
        if device.index is None or device.index == torch.cuda.current_device():
            self.graph.replay()
        else:
            with torch.cuda.device(device):
                self.graph.replay()

    def _capture(self, work: Callable[[], None], device: torch.device) -> Optional[torch.cuda.CUDAGraph]:
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
                warnings.warn(f"torchao_optim: could not capture a parameter group's step in a CUDA graph "
                              f"({type(err).__name__}: {reason}); it steps without one from now on (correct, with "
                              f"more host time per step)", RuntimeWarning, stacklevel=4)
                return None
            finally:
                torch.cuda.current_stream().wait_stream(stream)
        return graph
