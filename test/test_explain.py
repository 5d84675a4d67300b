"""``optimizer.explain()`` and ``python -m torchao_optim``: what a user reads to see whether they are on the fast
path, and what a bug report needs. explain() must agree with where the step actually sends each parameter."""

import os
import subprocess
import sys

import pytest
import torch
from c_only_rule import DecayingMomentumCOnly8bit

import torchao_optim
from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim.fused import fused_available

requires_c = pytest.mark.skipif(not cpu_kernels_available(), reason="the fused CPU step cannot be built here")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


def _fused_params(opt):
    """The parameters the last step put in a fused plan."""
    return {id(p) for cache in opt._plans.values() for plan in cache.get("plans", ()) for p in plan.params}


@requires_c
def test_explain_matches_where_the_step_sends_each_parameter():
    model = _model()
    odd = torch.nn.Parameter(torch.randn(70, 130).t())  # not contiguous: the compiled path
    params = list(model.parameters())
    opt = torchao_optim.AdamW(params + [odd], min_quant_size=1024, compile=False)
    before = opt.explain()
    model(torch.randn(4, 128)).sum().backward()
    odd.grad = torch.randn(70, 130).t()
    opt.step()
    assert opt.explain() == before  # the same decision before the first step (states on meta) and after
    fused = _fused_params(opt)
    group = opt.param_groups[0]
    for p in params + [odd]:
        executor, _, why = torchao_optim.optim.explain.route(opt, p, group)
        assert (id(p) in fused) == executor.startswith("fused"), (tuple(p.shape), executor, why)
    assert "not fused: the parameter is not contiguous (e.g. shape (130, 70))" in before
    assert "dtq8 state, blocks of 256" in before
    assert "float32 state (fewer than min_quant_size=1024 elements)" in before


def test_explain_names_the_setting_that_turns_the_fused_path_off():
    model = _model()
    assert "fused=False" in torchao_optim.AdamW8bit(model.parameters(), fused=False).explain()
    text = torchao_optim.AdamW8bit(model.parameters(), fused=False, compile=False).explain()
    assert "per-parameter path, eager (compile=False)" in text and "fused=False" in text
    # rank-1 scales and factored statistics: the fused C step and the Triton kernels (here in Triton's interpreter)
    # read them
    for fmt in ("4bit_rank1", "factored"):
        text = torchao_optim.AdamW(model.parameters(), state_format=fmt, min_quant_size=0).explain()
        assert "fused C step: 6 parameter(s)" in text and "not fused" not in text
        if fused_available("cpu"):
            text = torchao_optim.AdamW(model.parameters(), state_format=fmt, min_quant_size=0, fused=True).explain()
            assert "not fused" not in text
    text = torchao_optim.SGD8bit(model.parameters(), momentum=0.0).explain()
    assert "no state to update" in text


def test_explain_counts_every_parameter_of_every_group():
    model = _model()
    decay, rest = [model[0].weight, model[2].weight], [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    opt = torchao_optim.AdamW8bit([{"params": decay}, {"params": rest, "weight_decay": 0.0}], min_quant_size=0)
    text = opt.explain()
    assert "2 param group(s)" in text
    for index, group in enumerate(opt.param_groups):
        block = text.split(f"param group {index} ")[1].split("param group")[0]
        counted = sum(int(line.split(": ", 1)[1].split(" parameter")[0]) for line in block.splitlines()[1:] if line)
        assert counted == len(group["params"])


def _report(env=None):
    return subprocess.run(
        [sys.executable, "-m", "torchao_optim"], capture_output=True, text=True, env=env, timeout=300, check=True
    ).stdout


def test_bug_report_names_versions_executors_and_caches():
    out = _report()
    assert f"torch {torch.__version__}" in out
    assert f"torchao_optim {torchao_optim.__version__}" in out
    assert "CPU (C step): " in out and "CUDA (Triton kernels): " in out
    assert "cache directories: C step " in out
    assert "state formats: " in out and "dtq8" in out


def test_bug_report_says_why_the_cpu_step_is_missing(tmp_path):
    # no compiler on PATH, and an empty cache: the C step cannot be built, and the report says so and why
    env = dict(os.environ, PATH=str(tmp_path), TORCHAO_OPTIM_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("CC", None)
    out = _report(env)
    assert "CPU (C step): not here (RuntimeError: no C compiler found" in out
    assert "C compiler: none found" in out


@requires_c
def test_muon_explain_matches_where_the_step_sends_each_parameter():
    # Muon8bit's group runs two rules: Muon's momentum for its matrices, Adam's for its AdamW fallback; both take the
    # fused step, and explain() says so for each parameter, before the first step and after
    model = _model()
    opt = torchao_optim.Muon8bit(model.parameters(), lr=1e-3, compile=False)
    report = opt.explain()
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    assert opt.explain() == report
    fused = _fused_params(opt)
    assert all(id(p) in fused for p in model.parameters())
    rules = {plan.rule.name for cache in opt._plans.values() for plan in cache["plans"]}
    assert rules == {"muon", "adam"}
    assert "fused C step" in report and "not fused" not in report and "(missing)" not in report


# The rules of three states, which both fused kernel families take (the Triton kernel in its three-state form),
# centered RMSprop without momentum (two states), and the made-up rule with its update in C only (the C step alone):
# (make, rule, whether the Triton kernels take it)
BEYOND_TWO_STATES = [
    (lambda ps, **kw: torchao_optim.AdEMAMix8bit(ps, **kw), "ademamix", True),
    (
        lambda ps, **kw: torchao_optim.RMSprop8bit(ps, momentum=0.9, centered=True, **kw),
        "rmsprop_centered_momentum",
        True,
    ),
    (lambda ps, **kw: torchao_optim.AdamW8bit(ps, amsgrad=True, **kw), "adam_amsgrad", True),
    (lambda ps, **kw: torchao_optim.RMSprop8bit(ps, centered=True, **kw), "rmsprop_centered", True),
    (lambda ps, **kw: DecayingMomentumCOnly8bit(ps, min_quant_size=0, **kw), "decaying_momentum_c_only", False),
]


@requires_c
@pytest.mark.parametrize("make,name,triton", BEYOND_TWO_STATES, ids=[name for _, name, _ in BEYOND_TWO_STATES])
def test_three_state_rules_and_a_rule_in_c_only_go_where_explain_says(make, name, triton):
    """On the CPU the C step runs each; the Triton kernels (CUDA, here Triton's interpreter) run the rules of three
    states, and leave the rule in C only to the compiled path, saying why; the step goes where explain() says."""
    executors = [(None, "fused C step", None)]
    if fused_available("cpu"):  # Triton's interpreter: the Triton kernels' planning, as on CUDA
        if triton:
            executors.append((True, "fused Triton kernels", None))
        else:
            why = f"rule {name!r} has no Triton element update (FusedRule.triton_update)"
            executors.append((True, "per-parameter path, eager", why))
    for fused, executor, why in executors:
        model = _model()
        opt = make(model.parameters(), compile=False, fused=fused)
        report = opt.explain()
        assert opt._fused_rule(opt.param_groups[0]).name == name
        model(torch.randn(4, 128)).sum().backward()
        opt.step()
        assert opt.explain() == report
        for line in report.splitlines()[2:]:
            assert line.startswith(f"  {executor}"), report
            assert (why is None) == ("not fused" not in line), report
            assert why is None or f"not fused: {why}" in line, report
        n_fused = len(_fused_params(opt))
        assert n_fused == (len(list(model.parameters())) if fused is None or triton else 0)
