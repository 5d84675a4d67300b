"""The training problem the optimizer tests share: initial parameters and a gradient for every step.

:class:`SpreadProblem` gives each element the gradient ``scale * (direction + 2 * noise)``: a consistent
direction under noise, with a per-element magnitude spread over e^4 (about 55x) within each block, as in real
layers, so that blockwise quantization (one scale per block of elements) matters. Everything is drawn on the
CPU from seeded generators: the same problem on every device, in every process, for every optimizer that
trains it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SpreadProblem"]


class SpreadProblem:
    """Parameters of ``shapes`` and their gradients at every step, a pure function of ``seed``.

    ``init`` holds the initial values; :meth:`params` gives fresh ``nn.Parameter`` copies of them,
    :meth:`grads` the gradients of a step and :meth:`train` steps an optimizer on them. Seed 0 draws the
    parameters from generator seed 0, the scales and directions from seed 1 and step ``k``'s noise from seed
    ``100 + k``; seed ``s`` uses ``2s``, ``2s + 1`` and ``100 + 1000 s + k``.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], seed: int = 0):
        self.shapes = [torch.Size(s) for s in shapes]
        self.seed = seed
        gen = torch.Generator().manual_seed(2 * seed)
        self.init = [torch.randn(s, generator=gen) for s in self.shapes]
        gen.manual_seed(2 * seed + 1)
        self.scale, self.direction = [], []
        for s in self.shapes:
            self.scale.append(torch.empty(s).uniform_(-3, 1, generator=gen).exp())
            self.direction.append(torch.randn(s, generator=gen))

    def params(self, device=None, dtype=torch.float32) -> list[torch.nn.Parameter]:
        """New parameters holding the initial values, on ``device`` (default: the CPU) in ``dtype``."""
        return [torch.nn.Parameter(t.to(device=device, dtype=dtype, copy=True)) for t in self.init]

    def grads(self, step: int, device=None) -> list[torch.Tensor]:
        """The gradients of step ``step`` (fp32, on ``device``), one per parameter."""
        gen = torch.Generator().manual_seed(100 + 1000 * self.seed + step)
        return [
            (scale * (direction + 2 * torch.randn(scale.shape, generator=gen))).to(device)
            for scale, direction in zip(self.scale, self.direction)
        ]

    def train(self, opt, params, steps: int, start: int = 0, sched=None):
        """Steps ``start`` to ``start + steps - 1`` of ``opt`` on ``params``: each parameter gets its gradient
        (in its dtype, on its device), then ``opt.step()`` and, if given, ``sched.step()``. Returns ``params``."""
        for k in range(start, start + steps):
            for p, g in zip(params, self.grads(k)):
                p.grad = g.to(device=p.device, dtype=p.dtype)
            opt.step()
            if sched is not None:
                sched.step()
        return params
