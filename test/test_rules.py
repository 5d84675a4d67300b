"""Update rules are data: a kernel runs a rule by what the rule declares, and refuses, by name, one it was not
built for, never running another rule's arithmetic in its place.

The Triton kernels run in Triton's interpreter on a machine without CUDA (test/conftest.py sets it up); the C step
is built on first use."""

import dataclasses

import pytest
import torch
from c_only_rule import DECAYING_MOMENTUM_C_ONLY

from torchao_optim import Adagrad8bit, Adam, AdamW, AdEMAMix8bit, Lion8bit, RMSprop8bit, SGD8bit
from torchao_optim.kernels.cpu import cpu_kernels, cpu_kernels_available, cpu_rule, cpu_rules
from torchao_optim.optim import launch
from torchao_optim.optim.fused import fused_available, triton_refusal
from torchao_optim.rules import (
    ADAGRAD,
    ADAM,
    ADAM_AMSGRAD,
    ADEMAMIX,
    BUILT_IN_RULES,
    LION,
    RMSPROP,
    RMSPROP_CENTERED,
    RMSPROP_CENTERED_MOMENTUM,
    RMSPROP_MOMENTUM,
    SGD,
    FusedRule,
    sgd_coefficients,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_c = pytest.mark.skipif(not cpu_kernels_available(), reason="the fused CPU step could not be built")
needs_triton = pytest.mark.skipif(not fused_available(DEVICE), reason="needs Triton (CUDA or its interpreter)")
# one state, as SGD's, but a rule no kernel was built for
MADE_UP = FusedRule("made_up", ("momentum_buffer",), (True,), ("a", "b", "c", "d"), sgd_coefficients)


class MadeUpSGD(SGD8bit):
    """SGD's optimizer handing the fused kernels another rule, with the launch setting that rule names."""

    rule = MADE_UP

    def _fused_rule(self, group):
        return self.rule

    def _launch_flags(self, group):
        return dict(maximize=group["maximize"], **({self.rule.option: False} if self.rule.option else {}))


def _step_refused(fused, rule, match, error=NotImplementedError):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096, device=DEVICE)) for _ in range(2)]
    before = [p.detach().clone() for p in params]
    opt = type("Opt", (MadeUpSGD,), {"rule": rule})(params, lr=0.1, momentum=0.9, fused=fused, compile=False)
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.raises(error, match=match):
        opt.step()
    for p, b in zip(params, before):  # refused before anything was written
        assert torch.equal(p.detach(), b)


@needs_c
def test_every_built_in_rule_is_in_the_c_steps_table():
    table = {name: (states, coefs) for name, states, coefs in cpu_rules()}
    for rule in BUILT_IN_RULES:
        assert table[rule.c_name] == (len(rule.state_keys), rule.n_coefs)
        lib, index = cpu_rule(rule)
        assert lib is cpu_kernels() and cpu_rules()[index][0] == rule.c_name  # built once, together


@needs_c
@pytest.mark.skipif(DEVICE != "cpu", reason="the C step runs CPU parameters")
@pytest.mark.parametrize(
    "rule,match,error",
    [
        # the C function of a rule the package has, with other states: refused by the compiler, never run
        (
            dataclasses.replace(MADE_UP, c_source=ADAM.c_source, c_name=ADAM.c_name),
            r"(?s)rule 'made_up' could not be built: .*too few arguments to function .adam.",
            RuntimeError,
        ),
    ],
)
def test_the_c_step_refuses_a_rule_it_cannot_run(rule, match, error):
    _step_refused(None, rule, match, error)


@needs_c
def test_the_c_step_takes_one_to_three_states():
    rule = dataclasses.replace(RMSPROP_MOMENTUM, name="four", state_keys=("a", "b", "c", "d"), signed=(True,) * 4)
    with pytest.raises(NotImplementedError, match=r"rule 'four' carries 4 states \('a', 'b', 'c', 'd'\): .* one to 3"):
        cpu_rule(rule)


def test_the_triton_kernels_take_one_to_three_states():
    """Every built-in rule with a Triton update is one they take (three states: the two-state kernel's three-state
    form); a fourth state is refused by name, as a rule with no Triton update is."""
    for rule in BUILT_IN_RULES:
        if rule.triton_update is not None:
            assert triton_refusal(rule) is None, rule.name
    assert {len(r.state_keys) for r in BUILT_IN_RULES if r.triton_update is not None} == {1, 2, 3}
    four = dataclasses.replace(ADEMAMIX, name="four", state_keys=("a", "b", "c", "d"), signed=(True,) * 4)
    assert (
        triton_refusal(four)
        == "rule 'four' carries 4 states ('a', 'b', 'c', 'd'); the Triton kernels take one to three"
    )
    assert triton_refusal(DECAYING_MOMENTUM_C_ONLY) == (
        "rule 'decaying_momentum_c_only' has no Triton element update (FusedRule.triton_update)"
    )


@needs_triton
@pytest.mark.parametrize(
    "rule,match",
    [
        (
            dataclasses.replace(SGD, name="made_up", coefficient_names=("a",) * 5),
            r"'made_up' has 5 coefficients .* reads 4",
        ),
    ],
)
def test_the_triton_kernels_refuse_a_rule_they_were_not_built_for(rule, match):
    _step_refused(True, rule, match)


@pytest.mark.skipif(not (cpu_kernels_available() or fused_available(DEVICE)), reason="no fused executor here")
def test_a_rule_without_the_executors_form_takes_the_compiled_path():
    """A rule that gives an executor nothing to run (no C update for the C step, no Triton update for the Triton
    kernels) is not planned there: its parameters take the compiled path, which runs the optimizer's own update,
    and explain() names what the rule lacks. The launches refuse it too, should a plan reach them."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096, device=DEVICE)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = MadeUpSGD(params, lr=0.1, momentum=0.9, compile=False)
    plain = SGD8bit(twins, lr=0.1, momentum=0.9, compile=False, fused=False)
    lacks = "C update (FusedRule.c_source)" if DEVICE == "cpu" else "Triton element update"  # fused=None
    assert f"not fused: rule 'made_up' has no {lacks}" in opt.explain()
    for p, q in zip(params, twins):
        p.grad = q.grad = torch.randn_like(p)
    opt.step()
    plain.step()
    assert opt._plans[id(opt.param_groups[0])]["plans"] == []
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
    with pytest.raises(NotImplementedError, match="'made_up' declares no C update"):
        cpu_rule(MADE_UP)
    with pytest.raises(NotImplementedError, match="'made_up' declares no Triton element update"):
        launch._triton_update(MADE_UP, 1, 4)


def test_a_rules_signs_match_its_states():
    with pytest.raises(ValueError, match="2 state keys"):
        FusedRule("r", ("a", "b"), (True,), ("c",), sgd_coefficients)
    with pytest.raises(ValueError, match="c_source and c_name go together"):
        FusedRule("r", ("a",), (True,), ("c",), sgd_coefficients, c_name="r")
    with pytest.raises(ValueError, match="c_name must be a C identifier, got 'r r'"):
        FusedRule("r", ("a",), (True,), ("c",), sgd_coefficients, c_source="", c_name="r r")
    params = [torch.nn.Parameter(torch.zeros(2))]
    for opt, rule in (
        (AdamW(params), ADAM),
        (Adam(params), ADAM),
        (SGD8bit(params, momentum=0.9), SGD),
        (Lion8bit(params), LION),
        (Adagrad8bit(params), ADAGRAD),
        (RMSprop8bit(params), RMSPROP),
        (RMSprop8bit(params, momentum=0.9), RMSPROP_MOMENTUM),
        (RMSprop8bit(params, centered=True), RMSPROP_CENTERED),
        (RMSprop8bit(params, momentum=0.9, centered=True), RMSPROP_CENTERED_MOMENTUM),
        (AdamW(params, amsgrad=True), ADAM_AMSGRAD),
        (Adam(params, amsgrad=True), ADAM_AMSGRAD),
        (AdEMAMix8bit(params), ADEMAMIX),
    ):
        assert opt._fused_rule(opt.param_groups[0]) is rule
        assert tuple(opt._signed(k) for k in rule.state_keys) == rule.signed


@pytest.mark.skipif(not (cpu_kernels_available() or fused_available(DEVICE)), reason="no fused executor here")
def test_a_launch_setting_the_rule_does_not_take_is_refused():
    """SGD8bit hands its kernels ``nesterov``; a rule without that option would ignore it."""
    rule = dataclasses.replace(SGD, name="made_up", option=None)
    opt = type("Opt", (SGD8bit,), {"_fused_rule": lambda self, group: rule})(
        [torch.nn.Parameter(torch.randn(4096, device=DEVICE))], lr=0.1, momentum=0.9, compile=False
    )
    opt.param_groups[0]["params"][0].grad = torch.ones(4096, device=DEVICE)
    with pytest.raises(TypeError, match=r"rule 'made_up' takes no launch setting \['nesterov'\]"):
        opt.step()
