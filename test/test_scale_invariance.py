"""Small gradients train as large ones do: Adam's step with eps 0 does not depend on the gradients' scale, and every
built-in state format keeps that exactly.

Scaling every gradient by a power of two scales ``exp_avg`` by it and ``exp_avg_sq`` by its square, exactly in fp32
(no value leaves the normal range here), and each block's (or row's and column's) scale with them: the codes, and so
the parameter's trajectory, are the same bit for bit. A floor on the block scales breaks this: torchao's low-bit
states clip each block's absmax at 1e-12, which holds the second moment of a block of gradients under about 1e-6
above its value and shrinks their steps (benchmarks/README.md, "Small gradients"). Both the fused CPU step and the
per-parameter update are held to it, for Adam's two states and AdEMAMix's three.
"""

import pytest
import torch

from torchao_optim import AdamW, AdEMAMix8bit
from torchao_optim.kernels import cpu

FORMATS = ("dtq8", "4bit", "4bit_rank1", "fp8", "factored", "factored4")
# Gradients of order 1e-6 and 1.5e-8 (rows of 1e-10 and 1.5e-12): second moments down to about 1e-28, under
# torchao's floor and above the smallest normal fp32 (1.2e-38), below which a square is no longer exact
SCALES = (2.0**-20, 2.0**-26)
STEPS = 5


def _trajectory(make, fused: bool | None, fmt: str, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((16, 256), (1000,))]
    opt = make(params, fused=fused, compile=False, state_format=fmt, min_quant_size=0)
    assert opt._fused == (fused is not False)
    for _ in range(STEPS):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            g.view(g.shape[0], -1)[:4] *= 1e-4  # rows of smaller gradients beside the rest, in the same matrix
            p.grad = g * scale
        opt.step()
    return [p.detach().clone() for p in params]


RULES = {
    "adamw": lambda ps, **kw: AdamW(ps, lr=1e-2, eps=0.0, weight_decay=0.1, **kw),
    "ademamix": lambda ps, **kw: AdEMAMix8bit(ps, lr=1e-2, eps=0.0, **kw),
}
# fused=None takes the C step on a CPU; True, Triton's kernels (here in its interpreter: slow, so one format and rule
# in CI, the rest with --runslow)
CPU_STEP = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="the fused CPU step could not be built")
CASES = [
    pytest.param(fmt, rule, fused, id=f"{fmt}-{rule}-{name}", marks=marks)
    for fmt in FORMATS
    for rule in RULES
    for fused, name, marks in (
        (None, "cpu-step", CPU_STEP),
        (False, "per-parameter", ()),
        (True, "triton", () if (fmt, rule) == ("4bit", "adamw") else pytest.mark.slow),
    )
]


@pytest.mark.parametrize("fmt,rule,fused", CASES)
def test_gradients_scaled_by_a_power_of_two_take_the_same_steps(fmt, rule, fused):
    reference = _trajectory(RULES[rule], fused, fmt, 1.0)
    for scale in SCALES:
        for got, want in zip(_trajectory(RULES[rule], fused, fmt, scale), reference):
            assert torch.equal(got, want), f"{fmt}, gradients x {scale}: the parameters differ"
