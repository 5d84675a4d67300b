"""The executors' dispatch: which parameters step, and which executor steps each.

A group's parameters with gradients (and their adopted states, :mod:`~torchao_optim.optim.adopt`) go first to
the fused plans of the group's rule (:mod:`~torchao_optim.optim.fused`: Triton's kernels on CUDA, the C step on the
CPU), with ``offload_state`` through the GPU window (:mod:`~torchao_optim.optim.offload`); whatever no plan covers
takes the per-parameter compiled path (:mod:`~torchao_optim.optim.compiled_path`). On CUDA the launches may be
replayed from a CUDA graph (:mod:`~torchao_optim.optim.replay`). The same functions serve ``step()``, the operator
a ``torch.compile``'d step calls (:mod:`~torchao_optim.optim.traced`) and stepping in backward.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import Tensor

from torchao_optim.optim.adopt import adopt_state, state_of
from torchao_optim.optim.checks import check_grad
from torchao_optim.optim.compiled_path import step_compiled
from torchao_optim.optim.fused import _GRAD, plan_group
from torchao_optim.optim.replay import replay_device, run_replayed
from torchao_optim.optim.sharded import local
from torchao_optim.optim.snapshot import StateSnapshot, same_objects
from torchao_optim.optim.state_form import offloads, state_tensors

__all__ = ["init_group", "params_with_grad", "step_group", "step_group_with"]

_LAYOUT = operator.attrgetter("layout")
_IS_NONE = functools.partial(operator.is_, None)
_STRIDED = functools.partial(operator.is_, torch.strided)


def params_with_grad(optimizer, group) -> tuple[list[Tensor], list[dict]]:
    """The group's parameters that have a gradient, and their states (created on first use, adopted where a user
    changed them). The lists are reused while the same parameters have gradients, the group's state keys are the
    same and the state holds the same objects (``optim/snapshot.py``): a step then costs a few passes over the
    parameters in C."""
    # (map over C functions: this runs on every step, before any launch, for every parameter)
    grads = list(map(_GRAD, group["params"]))
    present = [g for g in grads if g is not None]
    key = (
        tuple(map(id, group["params"])),
        len(present) == len(grads) or tuple(map(_IS_NONE, grads)),
        optimizer._state_keys(group),
    )
    with_grad = optimizer._with_grad
    cached = with_grad.get(id(group))
    if cached is not None and cached[0] == key:
        params, states, snapshot = cached[1:]
        if not snapshot.holds(optimizer.state):
            if not same_objects(tuple(map(optimizer.state.get, params)), states):
                cached = None  # a state dict replaced or removed: collect them again
            else:  # the same dicts (another's changed, or some value): adopt them, keep the lists
                for p, state in zip(params, states):
                    adopt_state(optimizer, p, group, state)
                with_grad[id(group)] = (key, params, states, StateSnapshot(states, optimizer.state))
    else:
        cached = None
    if cached is not None:
        # The gradients may be new tensors every step; torch checks that a gradient's dtype is its parameter's,
        # but a sparse one may replace a dense one. A sparse gradient has no address (nor has a DTensor's, checked
        # by layout): taking the addresses, which the fused plans need, checks it.
        try:
            optimizer._grad_addresses[id(group)] = (params, tuple(map(Tensor.data_ptr, present)))
            return params, states
        except RuntimeError:
            optimizer._grad_addresses.pop(id(group), None)
            if all(map(_STRIDED, map(_LAYOUT, present))):
                return params, states
    params, states = [], []
    name = type(optimizer).__name__
    for p, grad in zip(group["params"], grads):
        if grad is None:
            continue
        check_grad(name, p, grad)
        state = state_of(optimizer, p)
        adopt_state(optimizer, p, group, state)
        params.append(p)
        states.append(state)
    with_grad[id(group)] = (key, params, states, StateSnapshot(states, optimizer.state))
    return params, states


def step_group(optimizer, group, params: list[Tensor], states: list[dict], plan_cache, replay: bool = False) -> None:
    """The step of ``params`` (of ``group``, all with gradients): fused plans (cached in the dict ``plan_cache()``
    gives, while the same list comes back), then the compiled path for the rest. With ``replay``, the launches may
    be replayed from a CUDA graph."""
    rest = range(len(params))
    rule = optimizer._fused_rule(group) if params and optimizer._fused else None
    rounding_flag = dict(stochastic_round=group["bf16_stochastic_round"])
    if rule is not None and optimizer._offload_state:
        offloaded = [i for i in rest if offloads(optimizer, params[i])]
        if offloaded:
            chosen = ([params[i] for i in offloaded], [states[i] for i in offloaded])
            flags = dict(optimizer._launch_flags(group), **rounding_flag)
            optimizer._offload.step(optimizer, group, *chosen, rule, plan_cache, flags)
        rest, rule = [i for i in rest if not offloads(optimizer, params[i])], None  # the others: compiled path
    plans = []
    # the fused path's table of gradient addresses: refreshed here, outside any graph that replays it
    addresses = optimizer._grad_addresses.get(id(group)) if replay else None
    addresses = addresses[1] if addresses is not None and addresses[0] is params else None
    if rule is not None:
        interpreter, rounding = optimizer._interpreter, optimizer._rounding
        plans, rest = plan_group(plan_cache(), params, states, rule, interpreter, rounding)
        if not all([plan.refresh_grads(addresses) for plan in plans]):  # a gradient moved, not contiguous
            plan_cache().clear()
            plans, rest = plan_group(plan_cache(), params, states, rule, interpreter, rounding)
            for plan in plans:
                plan.refresh_grads(addresses)
    if rest and optimizer._capturable:
        p = params[rest[0]]
        raise ValueError(
            f"{type(optimizer).__name__}(capturable=True): a parameter of shape {tuple(p.shape)} "
            f"({p.dtype}, {p.device}) is not covered by the fused CUDA path, so the step "
            f"cannot be captured in a CUDA graph (see docs/optimizers.md, 'capturable')"
        )
    compiled = ([params[i] for i in rest], [states[i] for i in rest])

    def work():
        for plan in plans:
            hyperparams, flags = optimizer._launch_settings(group, plan.params[0].device, plan.rule)
            plan.launch(hyperparams, refresh=False, **flags, **rounding_flag)
        if compiled[0]:
            step_compiled(optimizer, *compiled, group)
        optimizer._finish_step(group, [plan for plan in plans if plan.directions is not None])

    device = None
    if replay and (not compiled[0] or optimizer._update.enabled):
        device = replay_device(optimizer, group, params)
    if device is None:
        return work()
    run_replayed(optimizer, group, params, plans, compiled, rest, addresses, work, device, plan_cache)


def init_group(optimizer, group, params: list[Tensor], grads: list[Tensor], tensors: list[Tensor]) -> int:
    """Fill the lists with ``group``'s parameters that have a gradient, their gradients and the tensors that hold
    their states (created here on the first step). Under torch.compile, dynamo runs this on the real objects
    instead of tracing it, as it does torch.optim's ``_init_group``."""
    ps, states = params_with_grad(optimizer, group)
    rule = optimizer._fused_rule(group) if ps and optimizer._fused and not optimizer._offload_state else None
    rest = range(len(ps))
    if rule is not None:  # plan now: a new plan re-points state["step"], which would recompile the next step
        plans = optimizer._group_plans(group)
        _, rest = plan_group(plans, ps, states, rule, optimizer._interpreter, optimizer._rounding)
    # and make now the device tensors the step keeps (a CUDA graph's pool must not own them)
    for device in {p.device for p in ps}:
        optimizer._hyperparams(group, device)
        if group["bf16_stochastic_round"]:
            optimizer._rounding_rows.get(optimizer, [ps[i] for i in rest if ps[i].device == device], device)
    params.extend(ps)
    grads.extend(p.grad for p in ps)
    tensors.extend(state_tensors(optimizer, group, ps, states))
    return len(ps)


def step_group_with(optimizer, group, params: list[Tensor], grads: list[Tensor], tensors: list[Tensor]) -> None:
    """The step of ``group`` run by the ``torchao_optim::step_`` operator of a compiled step: with ``grads`` as the
    gradients (a compiled graph may hand over copies), and writing into ``params`` and ``tensors`` where they are
    copies of the optimizer's own (see optim/traced.py)."""
    own = [p for p in group["params"] if p.grad is not None]
    if len(own) != len(params) or len(grads) != len(params):
        raise RuntimeError(
            f"{type(optimizer).__name__}: a compiled step was traced for {len(params)} parameters with "
            f"gradients in param group {optimizer.param_groups.index(group)}, which now has {len(own)}"
        )
    saved = [p.grad for p in own]
    try:
        for p, g in zip(own, grads):
            if p.grad is not g:
                p.grad = g
        own, states = params_with_grad(optimizer, group)
        own_tensors = state_tensors(optimizer, group, own, states)
        step_group(optimizer, group, own, states, lambda: optimizer._group_plans(group))
    finally:
        for p, g in zip(own, saved):
            p.grad = g
    for mine, theirs in zip([local(p) for p in own] + own_tensors, [local(p) for p in params] + list(tensors)):
        if mine.data_ptr() != theirs.data_ptr():
            theirs.copy_(mine)
