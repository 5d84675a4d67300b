"""Hyperparameters as a device tensor: changing one never recompiles a graph and never syncs the host.

Both executors read a group's hyperparameters (lr first, then the rule's own, in the order the optimizer's
``_hyperparam_values`` gives) from one float64 tensor per group and device. It is refilled in place, and only
where a value changed, so a learning-rate schedule costs a fill per step; a tensor lr already on the device is
copied there without reading it on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["HyperparamTensors"]


class HyperparamTensors:
    """One float64 tensor per (param group, device), with the values it was last filled with."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[list, Tensor]] = {}

    def clear(self) -> None:
        self._entries.clear()

    def get(self, group: dict, values: Sequence[Any], device: torch.device) -> Tensor:
        """``values`` as the group's tensor on ``device``, refilled only where a value changed."""
        entry = self._entries.get((id(group), device))
        if entry is None:
            entry = self._entries[(id(group), device)] = (
                [None] * len(values),
                torch.zeros(len(values), dtype=torch.float64, device=device),
            )
        cached, hp = entry
        for i, value in enumerate(values):
            if isinstance(value, Tensor):
                if value.device == device:
                    hp[i].copy_(value.reshape(()))
                    cached[i] = None
                    continue
                value = value.item()  # a CPU tensor: reading it costs no device sync
            if cached[i] != value:
                hp[i].fill_(value)
                cached[i] = value
        return hp
