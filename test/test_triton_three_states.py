"""The Triton kernel's three-state form (``adam_kernel`` with ``N_STATES=3``): AdEMAMix, Adam with amsgrad and
centered RMSprop with momentum, fused on CUDA as on the CPU.

Each rule's Triton element update is the same fp32 operations in the same order as its C update and its plain update
(square roots and divisions correctly rounded), so in Triton's interpreter (conftest.py, on a machine without CUDA)
the kernel stores what the fused C step stores, bit for bit: parameters, codes, scales and plain states, a non-finite
gradient element skipped alike. The C step is itself held to the compiled path (test_cpu_step.py: the codes bit for
bit, parameters within fp32 rounding of eager torch, whose vectorized square root is not correctly rounded); the
slow test holds the kernel to the compiled path itself. Two-state plans are untouched: the two-state kernel compiles
to the same SASS as before the third state existed (benchmarks/count_instructions.py).
"""

import pytest
import torch

from torchao_optim import Adam, AdamW, AdEMAMix8bit, RMSprop8bit
from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim.fused import fused_available
from torchao_optim.state import QuantizedState

pytestmark = [
    pytest.mark.skipif(not fused_available("cpu"), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"),
    pytest.mark.skipif(not cpu_kernels_available(), reason="the fused CPU step could not be built (no C compiler)"),
]

# Whole blocks (two 8-bit blocks, four 4-bit ones in two tiles), a 2-D tensor with a partial last block, one below
# min_quant_size (fp32 state): small, for the interpreter
SHAPES = ((4, 128), (3, 100), (50,))
STEPS = 3
FORMATS = ("dtq8", "4bit", "none")  # 8-bit and 4-bit codes, fp32 state

RULES = {
    "ademamix": lambda ps, **kw: AdEMAMix8bit(ps, lr=1e-2, weight_decay=0.1, **kw),
    "ademamix-schedulers-maximize": lambda ps, **kw: AdEMAMix8bit(
        ps, lr=1e-2, betas=(0.9, 0.99, 0.98), alpha=3.0, t_alpha=2, t_beta3=3, maximize=True, **kw
    ),
    "adamw-amsgrad": lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
    "adam-amsgrad-l2-maximize": lambda ps, **kw: Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, **kw),
    "rmsprop-centered-momentum": lambda ps, **kw: RMSprop8bit(
        ps, lr=1e-3, alpha=0.9, momentum=0.9, centered=True, weight_decay=1e-3, maximize=True, **kw
    ),
}
RULE_NAMES = {
    "ademamix": "ademamix",
    "ademamix-schedulers-maximize": "ademamix",
    "adamw-amsgrad": "adam_amsgrad",
    "adam-amsgrad-l2-maximize": "adam_amsgrad",
    "rmsprop-centered-momentum": "rmsprop_centered_momentum",
}


def _train(name, executor, fmt, dtype=torch.float32, compile=False, **kw):
    """Parameters and optimizer after STEPS steps of rule ``name`` on ``executor`` ("triton": the Triton kernels, in the
    interpreter; "cpu": the C step; "compiled": the per-parameter compiled path, compiled with ``compile``), with the
    same gradients (magnitudes over four decades; at the second step a NaN and an infinity)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    fused = {"triton": True, "cpu": None, "compiled": False}[executor]
    opt = RULES[name](params, state_format=fmt, min_quant_size=256, fused=fused, compile=compile, **kw)
    for step in range(STEPS):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 10 ** torch.empty(p.shape).uniform_(-4, 0, generator=gen)
            if step == 1:  # non-finite gradient elements are skipped alike
                g.view(-1)[3], g.view(-1)[-1] = float("nan"), float("inf")
            p.grad = g.to(dtype)
        opt.step()
    plans = opt._plans.get(id(opt.param_groups[0]), {"plans": [], "rest": list(range(len(params)))})
    if executor == "compiled":
        assert plans["plans"] == []
    else:
        assert plans["rest"] == [] and {plan.executor for plan in plans["plans"]} == {executor}
        assert {plan.rule.name for plan in plans["plans"]} == {RULE_NAMES[name]}
        assert {len(plan.layouts) for plan in plans["plans"]} == {3}
    return params, opt


def _assert_same(a, b):
    """Parameters and every state of two runs bit for bit: codes and scales of a quantized state, a plain state's
    values; the step counts."""
    (params_a, opt_a), (params_b, opt_b) = a, b
    quantized = 0
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q), f"parameter of shape {tuple(p.shape)}: max diff {(p - q).abs().max().item():.3g}"
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys() and len(sa) == 4  # three states and the step
        for key in sa:
            x, y = sa[key], sb[key]
            assert type(x) is type(y), key
            if isinstance(x, QuantizedState):
                quantized += 1
                for name in x.__tensor_flatten__()[0]:
                    assert torch.equal(getattr(x, name), getattr(y, name)), (key, name, tuple(p.shape))
            elif key == "step":
                assert float(x) == float(y) == STEPS
            else:
                assert torch.equal(x, y), (key, tuple(p.shape))
    return quantized


# In CI (about 0.2-0.6 s a case) each rule in 8-bit, 4-bit and fp32 state (centered RMSprop with maximize and weight
# decay), and Adam's L2 weight decay (its update's other branch) in 8-bit; AdEMAMix's schedulers (coefficients, which
# the C step reads alike: test_cpu_step.py) and the other formats of the second samples with --runslow.
IN_CI = {(name, fmt) for name in ("ademamix", "adamw-amsgrad", "rmsprop-centered-momentum") for fmt in FORMATS}
IN_CI.add(("adam-amsgrad-l2-maximize", "dtq8"))


@pytest.mark.parametrize(
    "name,fmt",
    [
        pytest.param(name, fmt, marks=() if (name, fmt) in IN_CI else pytest.mark.slow)
        for name in RULES
        for fmt in FORMATS
    ],
)
def test_the_triton_kernel_stores_what_the_c_step_stores(name, fmt):
    quantized = _assert_same(_train(name, "triton", fmt), _train(name, "cpu", fmt))
    assert quantized == (0 if fmt == "none" else 6)  # the two larger parameters' three states


@pytest.mark.parametrize(
    "name",
    [
        "ademamix",
        pytest.param("adamw-amsgrad", marks=pytest.mark.slow),
        pytest.param("rmsprop-centered-momentum", marks=pytest.mark.slow),
    ],
)
def test_bf16_parameters_round_stochastically_as_on_the_c_step(name):
    """bf16 parameters and gradients with stochastic rounding: the same hash, key and element offsets as the C step,
    from the same fp32 values: the same bf16 parameters, and the same states."""
    a = _train(name, "triton", "dtq8", torch.bfloat16, bf16_stochastic_round=True)
    b = _train(name, "cpu", "dtq8", torch.bfloat16, bf16_stochastic_round=True)
    _assert_same(a, b)
    # and the rounding is stochastic: rounded to nearest, the parameters differ
    nearest = _train(name, "triton", "dtq8", torch.bfloat16)
    assert any(not torch.equal(p, q) for p, q in zip(a[0], nearest[0]))


@pytest.mark.slow  # compiles the per-parameter update: about a minute on 2 cores
@pytest.mark.parametrize("name", ["ademamix", "rmsprop-centered-momentum"])
def test_the_triton_kernel_stores_what_the_compiled_path_stores(name):
    _assert_same(_train(name, "triton", "dtq8"), _train(name, "compiled", "dtq8", compile=True))
