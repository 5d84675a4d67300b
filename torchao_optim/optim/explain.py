"""``optimizer.explain()``: which executor each parameter takes, and why, so a user can see the fast path.

Per parameter group, parameters are counted by (executor, state, reason): the fused kernels (Triton's on CUDA, the
C step on the CPU, with ``offload_state`` streamed from host memory) or the per-parameter compiled path, and why a
parameter is not fused. The decision is the planner's own (:func:`~torchao_optim.optim.fused.unfused_reason`), made
from the states the optimizer holds or, before the first step, the ones it would create (on the meta device: no
memory is allocated).
"""

from __future__ import annotations

from torch import Tensor

from torchao_optim.optim.fused import fused_executor, rule_for, unfused_reason
from torchao_optim.optim.sharded import local
from torchao_optim.optim.state_form import block_size_for, format_for, new_state_tensor, offloads, plain_state_dtype

__all__ = ["explain", "route"]

_EXECUTORS = {"cpu": "fused C step", "triton": "fused Triton kernels"}


def _state_words(p: Tensor, group) -> str:
    fmt = format_for(p, group)
    if fmt is not None:
        return f"{group['state_format']} state, blocks of {block_size_for(p, group, fmt)}"
    dtype = str(plain_state_dtype(p)).removeprefix("torch.")
    if group["state_format"] == "none":
        return f"{dtype} state (state_format='none')"
    if p.numel() < group["min_quant_size"]:
        return f"{dtype} state (fewer than min_quant_size={group['min_quant_size']} elements)"
    return f"{dtype} state ({group['state_format']!r} cannot store this shape or sharding)"


def route(optimizer, p: Tensor, group) -> tuple[str, str, str]:
    """``(executor, state, why)`` for ``p`` of ``group``: how its next step runs."""
    keys = optimizer._state_keys(group, p)
    state = optimizer.state.get(p, {})
    states = {
        k: state[k]
        if isinstance(state.get(k), Tensor)
        else new_state_tensor(optimizer, p, group, optimizer._signed(k), "meta")
        for k in keys
    }
    grad = p.grad if p.grad is not None else p  # a gradient from autograd is laid out like its parameter
    words = _state_words(p, group)
    if not keys:
        return "no state to update", words, ""
    rule = rule_for(optimizer._fused_rule(group), p) if optimizer._fused else None
    why = unfused_reason(p, grad, states, rule, optimizer._interpreter)
    if optimizer._fused and rule is None:
        why = f"no fused kernel for this group's settings ({optimizer._unfused_reason(group)})"
    elif not optimizer._fused:
        why = "fused=False"
    if why is None:
        executor = _EXECUTORS[fused_executor(local(p), optimizer._interpreter)]
        if offloads(optimizer, p):
            executor += ", state streamed from host memory"
        return executor, words, ""
    compiled = "compiled path" if optimizer._update.enabled else "per-parameter path, eager (compile=False)"
    return compiled, words, why


def explain(optimizer) -> str:
    """A report, per parameter group, of how many parameters (and elements) take each executor with which state,
    and why a parameter is not fused."""
    lines = [f"{type(optimizer).__name__}: {len(optimizer.param_groups)} param group(s)"]
    for index, group in enumerate(optimizer.param_groups):
        counts: dict[tuple, list[int]] = {}
        names = group.get("param_names")
        examples: dict[tuple, str] = {}
        for i, p in enumerate(group["params"]):
            key = route(optimizer, p, group)
            n = counts.setdefault(key, [0, 0])
            n[0] += 1
            n[1] += p.numel()
            if key[2] and key not in examples:
                examples[key] = repr(names[i]) if names and i < len(names) else f"shape {tuple(p.shape)}"
        fmt = group.get("state_format")
        lines.append(f"param group {index} (state_format={fmt!r}, {len(group['params'])} parameters):")
        for (executor, state, why), (n, elements) in sorted(counts.items(), key=lambda kv: -kv[1][1]):
            line = f"  {executor}: {n} parameter(s), {elements:,} elements; {state}"
            if why:
                line += f"; not fused: {why} (e.g. {examples[(executor, state, why)]})"
            lines.append(line)
    return "\n".join(lines)
