"""Per-parameter overrides: keep chosen parameters' state in another format, or in fp32, by one line.

:func:`overrides` turns a model and a few rules into parameter groups that any optimizer takes (ours, or a
stock one given to :func:`~torchao_optim.quantize_optimizer_state`, which reads a group's ``state_format``,
``block_size`` and ``min_quant_size`` too)::

    groups = torchao_optim.overrides(model, {"*embed*": "none", torch.nn.LayerNorm: "none"})
    opt = torchao_optim.AdamW8bit(groups, lr=1e-3)

A rule's key is a parameter (that tensor), a module type (the parameters a module of that type holds itself,
not its children's) or a name pattern (``fnmatch`` on the parameter's qualified name, as
``model.named_parameters()`` gives it). Its value is a format name (``"none"``: fp32 state) or a dict of group
options (``{"state_format": "none", "weight_decay": 0.0}``, ``{"use_muon": False}``). A parameter takes the
value of the first rule that matches it (a parameter key before every other), else bitsandbytes' override for
it (below), else none: it goes to the default group, which has only the options given as ``defaults``.

bitsandbytes' convention is honoured where bitsandbytes is installed: ``bnb.nn.StableEmbedding`` (and
``GlobalOptimManager.get_instance().register_module_override(module, "weight", {"optim_bits": 32})`` or
``register_override``) asks for 32-bit state for a parameter; that becomes ``state_format="none"``, and
``min_8bit_size`` becomes ``min_quant_size``. Other keys of such an override (lr, betas, eps, weight_decay) are
passed on as group options.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["overrides", "bitsandbytes_overrides"]

_BNB_PASSED_ON = ("lr", "betas", "eps", "weight_decay")


def _options(value: Any, key: Any) -> dict[str, Any]:
    if isinstance(value, str):
        return {"state_format": value}
    if isinstance(value, Mapping) and "params" not in value:
        return dict(value)
    raise ValueError(
        f"override for {key!r}: expected a state format name or a dict of group options (without "
        f"'params'), got {value!r}"
    )


def _check_key(key: Any) -> None:
    if isinstance(key, (str, Tensor)) or (isinstance(key, type) and issubclass(key, torch.nn.Module)):
        return
    raise ValueError(
        f"override key {key!r}: expected a name pattern (str), a module type (a torch.nn.Module "
        f"subclass) or a parameter"
    )


def bitsandbytes_overrides(model: torch.nn.Module) -> dict[int, dict[str, Any]]:
    """``{id(parameter): group options}`` from bitsandbytes' ``GlobalOptimManager`` for ``model``'s parameters,
    or ``{}`` without bitsandbytes. ``optim_bits=32`` means fp32 state (``state_format="none"``)."""
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except Exception:  # not installed, or it fails to load (no GPU library): nothing to honour
        return {}
    manager = GlobalOptimManager.get_instance()
    found: dict[int, dict[str, Any]] = {}
    for module, name, config in getattr(manager, "module_weight_config_triple", []):
        p = getattr(module, name, None)
        if isinstance(p, Tensor):
            found.setdefault(id(p), {}).update(config)
    for pid, config in getattr(manager, "pid2config", {}).items():
        found.setdefault(pid, {}).update(config)
    ours = {id(p) for p in model.parameters()}
    out = {}
    for pid, config in found.items():
        if pid not in ours:
            continue
        options = {k: v for k, v in config.items() if k in _BNB_PASSED_ON}
        if config.get("optim_bits") == 32:
            options["state_format"] = "none"
        if "min_8bit_size" in config:
            options["min_quant_size"] = int(config["min_8bit_size"])
        if options:
            out[pid] = options
    return out


def overrides(
    model: torch.nn.Module,
    rules: Mapping[Any, Any] | None = None,
    *,
    bitsandbytes: bool = True,
    defaults: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Parameter groups for ``model`` with the state of chosen parameters stored otherwise.

    Args:
        model: the module whose parameters (``named_parameters()``, shared ones once) are grouped.
        rules: ``{key: value}``; a key is a parameter, a module type or a name pattern, a value a format name
            (``"none"`` for fp32 state) or a dict of group options. The first matching rule wins; a parameter
            key wins over the others.
        bitsandbytes: honour bitsandbytes' ``GlobalOptimManager`` overrides (``StableEmbedding``) where it is
            installed, for parameters no rule matches. Default: ``True``.
        defaults: options of the group of parameters nothing matches (none: the optimizer's defaults).

    Returns:
        A list of groups, ``{"params": [(name, parameter), ...], **options}``: the default group first (left out
        when empty), then one per distinct override, each in the model's parameter order.
    """
    rules = dict(rules or {})
    for key in rules:
        _check_key(key)
    by_param = {id(k): _options(v, k) for k, v in rules.items() if isinstance(k, Tensor)}
    ordered = [(k, _options(v, k)) for k, v in rules.items() if not isinstance(k, Tensor)]
    owner: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    bnb = bitsandbytes_overrides(model) if bitsandbytes else {}

    groups: dict[Any, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        options = by_param.get(id(p))
        if options is None:
            for key, opts in ordered:
                hit = fnmatch.fnmatchcase(name, key) if isinstance(key, str) else isinstance(owner.get(id(p)), key)
                if hit:
                    options = opts
                    break
        if options is None:
            options = bnb.get(id(p))
        if options is None:
            options = dict(defaults or {})
        label = repr(sorted(options.items(), key=lambda kv: kv[0]))
        group = groups.setdefault(label, dict(options, params=[]))
        group["params"].append((name, p))
    default_label = repr(sorted(dict(defaults or {}).items(), key=lambda kv: kv[0]))
    first = [groups.pop(default_label)] if default_label in groups else []
    return first + list(groups.values())
