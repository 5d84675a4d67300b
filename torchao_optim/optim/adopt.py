"""Adopting the state found in ``optimizer.state``: it is the truth (docs/optimizers.md, "Editing the state").

Before a parameter steps, :func:`adopt_state` makes its state one the step can use, as torch.optim would use
it: what it lacks is created, a value in the optimizer's own form is used as it is, a value in another form is
converted as a checkpoint would be (:mod:`torchao_optim.optim.checkpoint`), and one that cannot be used is refused
by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchao_optim.optim.checkpoint import check_usable, checked_moment, checked_step
from torchao_optim.optim.sharded import local
from torchao_optim.optim.state_form import is_own_moment, new_state_tensor
from torchao_optim.state import QuantizedState

__all__ = ["adopt_state", "state_of"]


def state_of(optimizer, p: Tensor) -> dict:
    """``p``'s state dict, made empty where ``optimizer.state`` has none (a ``defaultdict`` as torch.optim's, or a
    plain dict a user put in its place)."""
    if p not in optimizer.state:
        optimizer.state[p] = {}
    state = optimizer.state[p]
    if not isinstance(state, dict):
        raise ValueError(
            f"{type(optimizer).__name__}: the state of {optimizer._where(p)} must be a dict, got {type(state).__name__}"
        )
    return state


def adopt_state(optimizer, p: Tensor, group, state: dict) -> None:
    """Make ``state`` one the step can use, as torch.optim would use it. What it lacks is created: a reset state
    gets its initial value (zeros; Adagrad's ``initial_accumulator_value``) and step 0, and a group may gain a key
    (SGD's momentum buffer when momentum is turned on). A value put in that is not in the form the optimizer keeps
    (a plain tensor where it keeps quantized codes; another dtype, device, format or block size) is converted as
    ``load_state_dict`` converts a checkpoint: the state then holds the converted tensor. A value that cannot be
    used raises ValueError naming the parameter and the key."""
    where = optimizer._where
    step = state.get("step")
    if step is None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    elif not (type(step) is Tensor and step.dtype == torch.float32 and step.dim() == 0 and step.device == p.device):
        check_usable(step, f"{where(p)}: state['step']")
        state["step"] = checked_step(p, step, where(p))
    for key in optimizer._state_keys(group, p):
        value = state.get(key)
        if value is None:
            fill = optimizer._initial_state_value(group, key)
            state[key] = new_state_tensor(optimizer, p, group, signed=optimizer._signed(key), fill=fill)
        elif not is_own_moment(optimizer, p, group, key, value):
            at = f"{where(p)}: state[{key!r}]"
            check_usable(value, at)
            state[key] = checked_moment(optimizer, p, group, key, value, at)
        elif isinstance(local(value), QuantizedState) and not local(value).is_meta:
            # the kernels trust a state's fields to fit its shape: a truncated one would be read past its end
            try:
                local(value).check_fields()
            except ValueError as err:
                raise ValueError(f"{where(p)}: state[{key!r}]: {err}") from None
