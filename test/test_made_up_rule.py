"""A rule written after the kernels and unknown to them (test/made_up_rule.py) is fused with no kernel edit: the C
step is built with its file's C source, Triton's kernels take its Triton update (in the interpreter, on a machine
without CUDA), and both store what its plain tensor update stores, bit for bit: parameters, codes and scales. That
update is run eagerly (``compile=False``), which for this rule's operations (products, sums, selects, no division or
square root) stores what the compiled path stores, bit for bit too (the slow test: it compiles for about 30 s)."""

import re
from pathlib import Path

import made_up_rule
import pytest
import torch
from made_up_rule import DECAYING_MOMENTUM, DecayingMomentum8bit

from torchao_optim.kernels.cpu import cpu_kernels, cpu_kernels_available, cpu_rule, cpu_rules
from torchao_optim.optim.fused import fused_available
from torchao_optim.state import QuantizedState

# a 2-D tensor with a partial last block, an odd size, and one below min_quant_size (fp32 state)
SHAPES = ((40, 70), (1001,), (50,))
STEPS = 3


def _train(executor: str):
    """Parameters and optimizer after STEPS steps on ``executor`` ("cpu": the fused C step; "triton": the fused Triton
    kernels; "compiled": the per-parameter compiled path; "eager": its update run eagerly), with the same gradients;
    the first group moves by the buffer, the second by its sign (the rule's option)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES + SHAPES]
    fused = {"cpu": None, "triton": True, "compiled": False, "eager": False}[executor]
    opt = DecayingMomentum8bit(
        [{"params": params[:3]}, {"params": params[3:], "signed": True}],
        lr=0.05,
        momentum=0.8,
        lr_decay=0.3,
        weight_decay=0.01,
        min_quant_size=256,
        fused=fused,
        compile=executor != "eager",
    )
    for step in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
            if step == 1:  # non-finite gradient elements are skipped alike
                p.grad.view(-1)[3], p.grad.view(-1)[-1] = float("nan"), float("inf")
        opt.step()
    if executor in ("cpu", "triton"):
        for group in opt.param_groups:
            plans = opt._plans[id(group)]
            assert plans["rest"] == [] and {plan.executor for plan in plans["plans"]} == {executor}
    return params, opt


def _assert_same(a, b):
    (params_a, opt_a), (params_b, opt_b) = a, b
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
        s, t = opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"]
        assert type(s) is type(t)
        if isinstance(s, QuantizedState):
            assert torch.equal(s.codes, t.codes) and torch.equal(s.absmax, t.absmax)
        else:
            assert torch.equal(s, t)
    assert isinstance(opt_a.state[params_a[0]]["momentum_buffer"], QuantizedState)


@pytest.fixture(scope="module")
def eager():
    return _train("eager")


@pytest.mark.skipif(not cpu_kernels_available(), reason="the fused CPU step could not be built (no C compiler)")
def test_the_c_step_builds_and_runs_a_rule_it_was_not_built_with(eager):
    assert "decaying_momentum" not in [name for name, _, _ in cpu_rules()]
    lib, index = cpu_rule(DECAYING_MOMENTUM)
    assert lib is not cpu_kernels() and index == 0  # a library of its own, built from its source
    _assert_same(_train("cpu"), eager)


@pytest.mark.skipif(not fused_available("cpu"), reason="needs Triton's interpreter")
def test_the_triton_kernels_run_a_rule_they_were_not_written_with(eager):
    _assert_same(_train("triton"), eager)


@pytest.mark.slow  # two graphs to compile, about 30 s on 2 cores
def test_the_compiled_path_stores_what_the_eager_update_stores(eager):
    _assert_same(_train("compiled"), eager)


def test_the_docs_worked_example_is_this_file():
    """docs/adding-a-rule.md shows test/made_up_rule.py in pieces (``...`` for lines it leaves out): each piece is the
    file's text, word for word, so the page stays what the tests run."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "adding-a-rule.md").read_text()
    source = Path(made_up_rule.__file__).read_text()
    marker = "# Fragment: a piece of test/made_up_rule.py\n"
    pieces = [b[len(marker) :] for b in re.findall(r"```python\n(.*?)```", page, re.S) if b.startswith(marker)]
    assert len(pieces) >= 6
    for piece in pieces:
        for part in re.split(r"^ *\.\.\.\n", piece, flags=re.M):
            assert part.strip("\n") in source, part
