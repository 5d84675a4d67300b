"""Which state objects a cache was built from: the optimizer's state is the truth, caches only follow it.

``torch.optim`` lets users and frameworks edit ``optimizer.state`` between steps: reset it
(``opt.state.clear()``, ``opt.state[p] = {}``), replace a moment (``opt.state[p]["exp_avg"] = ...``), delete one
(also through ``state_dict()``'s dicts, which are the live ones), load a checkpoint. Everything the optimizer
keeps for speed (fused plans and their pointer tables, CUDA graphs, per-parameter plans in backward) was made
from particular state objects. A :class:`StateSnapshot` records them, and each step compares, by identity, what
the state holds now: a few passes over the parameters in C, no tensor is read. Any difference sends the step the
whole way, which adopts the new state (:meth:`~torchao_optim.optim.base.LowBitOptimizer._adopt_state`) and plans
again.

The caches also hold the storages of every tensor they point at (:func:`storages`), so that even a change this
cannot see (a state tensor's ``.data`` or ``set_`` replaced in place) never makes a kernel write freed memory.
"""
from __future__ import annotations

import operator
from itertools import chain
from typing import Iterable, List, Optional, Sequence, Tuple

from torch import Tensor

__all__ = ["StateSnapshot", "same_objects", "storages"]


def same_objects(a: Sequence, b: Sequence) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects, in order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _values(dicts: Sequence[dict], keys: Tuple[str, ...]) -> tuple:
    """Every ``dicts[i].get(key)``, key by key (missing: None)."""
    return tuple(chain.from_iterable(map(operator.methodcaller("get", key), dicts) for key in keys))


class StateSnapshot:
    """The state dicts of a list of parameters and their values under ``keys``, as they were."""

    __slots__ = ("dicts", "keys", "values")

    def __init__(self, dicts: Sequence[dict], keys: Tuple[str, ...]):
        self.dicts = tuple(dicts)
        self.keys = keys
        self.values = _values(self.dicts, keys)

    def same_values(self, dicts: Sequence[dict]) -> bool:
        """Whether ``dicts`` are the recorded dicts and hold the recorded values."""
        return same_objects(dicts, self.dicts) and same_objects(_values(self.dicts, self.keys), self.values)

    def holds(self, state_map, params: Iterable[Tensor]) -> bool:
        """Whether ``state_map`` (the optimizer's ``state``) still maps ``params`` to the recorded dicts holding
        the recorded values. Reads, never creates, an entry of a ``defaultdict``."""
        return self.same_values(tuple(map(state_map.get, params)))


def storages(tensors: Iterable[Optional[Tensor]]) -> List[object]:
    """The storages of ``tensors`` (None skipped): held by whoever points a kernel at their memory, so that the
    memory stays allocated while it may still be written."""
    return [t.untyped_storage() for t in tensors if t is not None]
