"""What every optimizer of the library shares: the outline of a step.

:class:`LowBitOptimizer` is a ``torch.optim.Optimizer`` whose states are created in a registered format
(``state_format``). A step takes each parameter group's parameters with gradients, adopts their states from
``optimizer.state`` (the truth, :mod:`~torchao_optim.optim.adopt`), and dispatches them
(:mod:`~torchao_optim.optim.dispatch`): to the fused multi-tensor kernels where a plan covers them
(:mod:`~torchao_optim.optim.fused`), the rest down the per-parameter compiled path
(:mod:`~torchao_optim.optim.compiled_path`), on CUDA replayed from a graph where nothing changed
(:mod:`~torchao_optim.optim.replay`), with ``offload_state`` streamed through the GPU
(:mod:`~torchao_optim.optim.offload`). Arguments are checked in :mod:`~torchao_optim.optim.checks`, checkpoints in
:mod:`~torchao_optim.optim.checkpoint`.

A subclass (Adam, SGD, Lion, Muon, Adagrad, RMSprop) declares its state keys and their signs, checks its
hyperparameters, turns them into per-step coefficients (one row per parameter, float64, the one form both executors
read), names the fused rule that implements it and updates one parameter on the compiled path: the methods under
"what a subclass says" below.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim import dispatch, replay, traced
from torchao_optim.optim.adopt import adopt_state, state_of
from torchao_optim.optim.checkpoint import checked_state
from torchao_optim.optim.checks import (
    check_grad,
    check_group,
    check_number,
    check_offload,
    check_storage,
    check_torch_keywords,
)
from torchao_optim.optim.compiled import CompiledOrEager
from torchao_optim.optim.compiled_path import RoundingRows
from torchao_optim.optim.explain import explain
from torchao_optim.optim.fused import FusedRule, fused_available
from torchao_optim.optim.hyperparams import HyperparamTensors
from torchao_optim.optim.offload import Offloader
from torchao_optim.optim.replay import StepGraph
from torchao_optim.optim.sharded import element_offset, local
from torchao_optim.optim.snapshot import same_objects
from torchao_optim.state import get_state_format

__all__ = ["LowBitOptimizer", "check_number", "check_storage"]


# The storage and executor arguments every optimizer built on LowBitOptimizer takes, documented once: the last
# entries of its docstring's Args (:func:`storage_args`).
_STORAGE_ARGS = {
    "state_format": 'a registered format or ``"none"``. Default: ``"dtq8"``.',
    "block_size": "elements per quantization block; ``None`` takes the format's default.",
    "min_quant_size": "smaller parameters keep fp32 state. Default: ``4096``.",
    "compile": "compile each per-parameter update with ``torch.compile``; falls back to eager mode, with one "
    "warning, where compiling fails. Default: ``True``.",
    "fused": "update each parameter group with one multi-tensor call (the Triton kernels on CUDA, the fused C step "
    "on the CPU) wherever it runs, other parameters on the compiled path; ``True`` raises ``RuntimeError`` where "
    "neither can run; ``False`` turns it off. Default: ``None``.",
    "foreach": "accepted for torch.optim compatibility; it changes nothing. Default: ``None``.",
    "capturable": "the step can be captured in a CUDA graph; needs every parameter on the fused CUDA path. "
    "Default: ``False``.",
    "differentiable": "``True`` is refused (``ValueError``). Default: ``False``.",
    "bf16_stochastic_round": "write bf16 parameters with stochastic rounding, as :class:`Adam`. Default: ``False``.",
    "offload_state": "keep GPU parameters' state in host memory, streamed through the fused CUDA kernels, as "
    ":class:`Adam`. Default: ``False``.",
}
_STORAGE_ARG_TYPES = {"state_format": "str", "block_size": "int", "min_quant_size": "int"}


def storage_args(**overrides: str):
    """A class decorator that ends its docstring's Args with the storage and executor arguments, each described
    as for every optimizer or as ``overrides`` says (an optimizer that refuses one, or takes it otherwise)."""

    def document(cls):
        if cls.__doc__ is None:  # python -OO strips docstrings
            return cls
        lines = []
        for name, text in (_STORAGE_ARGS | overrides).items():
            kind = _STORAGE_ARG_TYPES.get(name, "bool")
            first = f"        {name} ({kind}, optional): "
            words, line = text.split(" "), first
            for word in words:  # wrapped at 120 columns, continuation lines indented 12
                if len(line) + 1 + len(word) > 120 and line.strip():
                    lines.append(line.rstrip())
                    line = " " * 12
                line += word + " "
            lines.append(line.rstrip())
        cls.__doc__ = cls.__doc__.rstrip() + "\n" + "\n".join(lines) + "\n    "
        return cls

    return document


class LowBitOptimizer(torch.optim.Optimizer):
    """Base of the library's optimizers. A subclass sets the class attributes below and implements
    ``_check_hyperparams(group)``, ``_state_keys(group, p)``, ``_hyperparam_values(group)``,
    ``_coefficients(steps, hp, group)`` and ``_step_one(p, state, group, coefs)``; ``_fused_rule(group)`` where a
    fused kernel implements its rule."""

    _quantized_state_native = True  # quantize_optimizer_state refuses it: choose the format with state_format=
    STATE_KEYS: tuple[str, ...] = ()  # every state key the optimizer may create (besides "step")
    UNSIGNED_STATE_KEYS: tuple[str, ...] = ()  # the ones that never hold a negative value
    REQUIRED_GROUP_KEYS: tuple[str, ...] = ("params", "lr")  # what a loadable state_dict's groups hold
    # kept from the optimizer when a state_dict is loaded (how states are stored and params rounded)
    STORAGE_KEYS: tuple[str, ...] = ("state_format", "block_size", "min_quant_size", "bf16_stochastic_round")
    STEP_OPTIONAL = False  # torch.optim's form of the state has no "step" (SGD, Muon): a loaded one counts 1
    update_fn = None  # the compiled path's rule

    def __init__(
        self,
        params,
        defaults: dict[str, Any],
        *,
        compile: bool,
        fused: bool | None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        bf16_stochastic_round: bool = False,
        offload_state: bool = False,
    ) -> None:
        name = type(self).__name__
        defaults = dict(defaults, bf16_stochastic_round=bf16_stochastic_round)
        check_storage(defaults["block_size"], defaults["min_quant_size"])
        if defaults["state_format"] != "none":
            get_state_format(defaults["state_format"])  # raises ValueError naming the registered formats
        check_torch_keywords(name, foreach, capturable, differentiable, fused)
        if fused and not (fused_available() or cpu_kernels_available()):
            raise RuntimeError(
                "fused=True needs Triton and a CUDA device, or a C compiler for the fused CPU step "
                "(see the warning above)"
            )
        check_offload(name, offload_state, fused, capturable)
        self._setup(compile, fused, foreach, capturable, offload_state)
        super().__init__(params, defaults)

    def _setup(
        self, compile: bool, fused: bool | None, foreach=None, capturable: bool = False, offload_state: bool = False
    ) -> None:
        """What the optimizer builds for itself rather than saves: the compiled update, the caches, the path."""
        self._compile, self._fused_option = bool(compile), fused
        self._foreach, self._capturable, self._offload_state = foreach, capturable, offload_state
        # None or True: fused wherever a fused kernel runs (CUDA: Triton's; CPU: kernels.cpu's C); True also
        # selects Triton's interpreter for CPU parameters when TRITON_INTERPRET=1 is set (testing the Triton kernels)
        self._fused, self._interpreter = fused is not False, fused is True
        self._update = CompiledOrEager(type(self).update_fn, enabled=self._compile)
        self._offload = Offloader()  # offload_state: the GPU window chunks of state run in
        self._hp = HyperparamTensors()
        self._rounding_rows = RoundingRows()
        self._plans: dict[int, dict] = {}  # id(group) -> its fused plans (optim/fused.py's plan_group)
        self._graphs: dict[int, StepGraph] = {}  # id(group) -> its step's CUDA graph (optim/replay.py)
        self._replayable: dict[int, tuple] = {}  # id(group) -> (its params with grads, the device a graph may use)
        self._with_grad: dict[int, tuple] = {}  # id(group) -> (which params have grads, params, states, snapshot)
        self._grad_addresses: dict[int, tuple] = {}  # id(group) -> (its params with grads, their grads' addresses)
        self._positions: dict[int, int] = {}  # id(param) -> its position in the optimizer (stochastic rounding)
        self._in_backward: dict[int, tuple] | None = None  # step_in_backward: id(param) -> (its list, plans)
        self._group_map: tuple | None = None  # (the groups, id(param) -> its group): see _group_of
        self._key = traced.register(self)  # how a compiled step's operator finds this optimizer (optim/traced.py)

    # ---- copies (copy.deepcopy, pickle, torch.save(optimizer)): the caches are rebuilt, how to build them saved --
    def __getstate__(self) -> dict[str, Any]:
        self._wait_offloaded()
        state = super().__getstate__()
        state["options"] = {
            "compile": self._compile,
            "fused": self._fused_option,
            "foreach": self._foreach,
            "capturable": self._capturable,
            "offload_state": self._offload_state,
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        options = state.pop("options", None)
        super().__setstate__(state)
        if options is not None or not hasattr(self, "_update"):
            self._setup(**(options or {"compile": True, "fused": None}))

    # ---- what a subclass says -----------------------------------------------------------------------------
    def _check_hyperparams(self, group: dict[str, Any]) -> None:
        """Raise ValueError naming a bad hyperparameter of ``group``; normalize numbers in place."""
        raise NotImplementedError

    def _state_keys(self, group, p: Tensor | None = None) -> tuple[str, ...]:
        """The state keys ``p`` has in ``group`` (besides "step")."""
        raise NotImplementedError

    def _hyperparam_values(self, group) -> tuple[Any, ...]:
        """The group's hyperparameters in the order ``_coefficients`` reads them (lr first)."""
        raise NotImplementedError

    def _coefficients(self, steps: Tensor, hp: Tensor, group) -> Tensor:
        """Per-parameter coefficient rows, float64 ``steps.shape + (k,)``, from advanced step counts."""
        raise NotImplementedError

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key: Tensor | None = None) -> None:
        """One parameter on the compiled path, with its row of :meth:`_coefficients` (and, for stochastic rounding
        of a bf16 parameter, its ``(key, element offset)`` row)."""
        raise NotImplementedError

    def _step_params(self, group, params: list[Tensor], states: list, coefs: list[Tensor], round_keys: list) -> None:
        """The compiled path's step of ``params`` (of ``group``, on one device), with their coefficient rows and
        rounding keys: each one's :meth:`_step_one`. Muon8bit's, whose update of a sharded matrix spans ranks,
        steps its sharded matrices together."""
        for p, state, row, key in zip(params, states, coefs, round_keys):
            if local(p).numel() == 0:
                continue  # an empty shard (more ranks than rows): nothing to update, no graph to compile
            self._step_one(p, state, group, row, key)

    def _fused_rule(self, group) -> FusedRule | None:
        """The fused kernel's rule for this group, or None where none implements it; or a callable giving each
        parameter's rule (``fused.rule_for``), where a group's parameters take different rules (Muon8bit's)."""
        return None

    def _initial_state_value(self, group, key: str) -> float:
        """The value every element of a new state ``key`` starts from (Adagrad's ``initial_accumulator_value``)."""
        return 0.0

    def _unfused_reason(self, group) -> str:
        """Why :meth:`_fused_rule` gives no rule for ``group`` (for error messages)."""
        return "its update rule"

    def _launch_flags(self, group) -> dict[str, Any]:
        """Keyword flags of the group's fused launches (``maximize``, say)."""
        return {}

    def _fused_hyperparams(self, group, device: torch.device) -> Tensor:
        """The hyperparameters the fused kernels of ``_fused_rule(group)`` read: :meth:`_hyperparams` unless the
        optimizer's own differ from the rule's."""
        return self._hyperparams(group, device)

    def _launch_settings(self, group, device: torch.device, rule: FusedRule) -> tuple[Tensor, dict[str, Any]]:
        """``(hyperparameters, launch flags)`` of a plan of ``rule`` on ``device``: :meth:`_fused_hyperparams` and
        :meth:`_launch_flags`, the group's, where ``_fused_rule(group)`` is one rule; an optimizer whose group runs
        several (Muon8bit) gives each rule its own."""
        return self._fused_hyperparams(group, device), self._launch_flags(group)

    def _finish_step(self, group, plans: list) -> None:
        """After the group's launches and its compiled path: the update of the parameters of ``plans``, those whose
        rule's output is a direction (``FusedRule.output``), from the directions the kernels wrote
        (``plan.directions``). Muon8bit orthogonalizes them, with the directions its compiled path left."""
        if plans:
            raise NotImplementedError(f"{type(self).__name__} runs no rule whose output is a direction")

    # ---- what every part asks of the optimizer --------------------------------------------------------------
    def _signed(self, key: str) -> bool:
        return key not in self.UNSIGNED_STATE_KEYS

    def _hyperparams(self, group, device: torch.device) -> Tensor:
        """:meth:`_hyperparam_values` as the group's float64 tensor on ``device`` (optim/hyperparams.py)."""
        return self._hp.get(group, self._hyperparam_values(group), device)

    def _rounding(self, params: list[Tensor]) -> list[tuple[int, int]]:
        """``(position in the optimizer, element offset of the local shard)`` of each of ``params``: what the
        stochastic rounding of a parameter hashes, with its step (:mod:`torchao_optim.quant.rounding`)."""
        if any(id(p) not in self._positions for p in params):
            self._positions = {id(p): i for i, p in enumerate(q for g in self.param_groups for q in g["params"])}
        return [(self._positions[id(p)], element_offset(p)) for p in params]

    def _where(self, p: Tensor) -> str:
        """``p`` as an error message names it: its position over all groups and its shape."""
        return f"parameter {self._rounding([p])[0][0]} of shape {tuple(p.shape)}"

    def _group_plans(self, group) -> dict:
        """Where ``group``'s fused plans are cached (optim/fused.py's plan_group)."""
        return self._plans.setdefault(id(group), {})

    def _group_of(self, p: Tensor) -> dict:
        """The param group holding ``p`` now (groups are replaced by load_state_dict and may be added), from a map
        rebuilt whenever the list of groups differs from the one it was made from."""
        groups = tuple(self.param_groups)
        if self._group_map is None or not same_objects(self._group_map[0], groups):
            self._group_map = (groups, {id(q): g for g in groups for q in g["params"]})
        return self._group_map[1][id(p)]

    # ---- parameter groups and checkpoints -----------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim``'s; a group that fails the checks raises and is not added."""
        with warnings.catch_warnings():
            # refused below with the parameter named; torch.optim's warning for it would only come first
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate")
            super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any], index: int | None = None) -> None:
        """Raise ValueError unless ``group`` holds valid hyperparameters and parameters; normalizes numbers."""
        check_group(self, group, len(self.param_groups) - 1 if index is None else index)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ours or the matching ``torch.optim`` optimizer's state_dict.

        The whole checkpoint is checked first, against what this optimizer would create for each parameter
        (keys, shapes, dtypes, devices, the block layout and scales of quantized states, finite values):
        a bad one raises ValueError naming the parameter, the key and what was expected, and leaves the
        optimizer as it was. States are then converted to this optimizer's format (fp32 states are
        quantized, quantized ones dequantized where this optimizer keeps plain state); hyperparameters come
        from the checkpoint, how states are stored (``STORAGE_KEYS``) from this optimizer.
        """
        self._wait_offloaded()
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        param_groups, state = checked_state(self, state_dict, self.STORAGE_KEYS)
        self.__setstate__({"state": state, "param_groups": param_groups})
        self._plans.clear()  # plans point at the replaced state tensors
        self._graphs.clear()  # and so do the graphs that replay them
        self._with_grad.clear()
        self._hp.clear()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim``'s (the state tensors themselves, not copies); with ``offload_state``, after the
        last step's copies back to host memory have finished."""
        self._wait_offloaded()
        return super().state_dict()

    def explain(self) -> str:
        """Which executor each parameter's next step takes (the fused kernels or the compiled path), with which
        state, and why a parameter is not fused: counted per param group (optim/explain.py)."""
        return explain(self)

    def _wait_offloaded(self) -> None:
        """Before the host state is read or replaced (optim/offload.py)."""
        if getattr(self, "_offload", None) is not None:
            self._offload.wait()

    # ---- the step -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): reevaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "_in_backward", None) is not None:
            # Stepping in backward, the hooks have stepped every parameter and freed its gradient: step() has
            # nothing left to do, but steps, as the hooks would, a parameter that holds a gradient the hooks did not
            # see (a gradient set by hand, as torch.distributed.checkpoint's get_state_dict does to create states)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._step_param(p)
                        p.grad = None
            return loss
        if torch.compiler.is_compiling():  # one registered operator per group (optim/traced.py)
            for index, group in enumerate(self.param_groups):
                params, grads, tensors = [], [], []
                self._init_group(group, params, grads, tensors)
                if params:
                    torch.ops.torchao_optim.step_(params, grads, tensors, self._key, index)
            return loss
        for group in self.param_groups:
            if replay.replay_steady(self, group):
                continue
            params, states = dispatch.params_with_grad(self, group)
            dispatch.step_group(self, group, params, states, lambda group=group: self._group_plans(group), replay=True)
        return loss

    def _init_group(self, group, params: list[Tensor], grads: list[Tensor], tensors: list[Tensor]) -> int:
        """torch.optim's hook, which dynamo runs on the real objects while tracing a compiled step: fills the lists
        with the group's parameters with gradients, their gradients and their states' tensors (optim/dispatch.py)."""
        return dispatch.init_group(self, group, params, grads, tensors)

    @torch.no_grad()
    def _step_param(self, p: Tensor) -> None:
        """The step of one parameter, from its gradient (``step_in_backward``'s hook). Its plan is its own, kept
        while it steps this way."""
        group = self._group_of(p)
        state = state_of(self, p)
        check_grad(type(self).__name__, p, p.grad)
        adopt_state(self, p, group, state)
        params, cache = self._in_backward.setdefault(id(p), ([p], {}))
        dispatch.step_group(self, group, params, [state], lambda: cache)
        self._opt_called = True  # what torch's lr schedulers read to know that the optimizer has stepped
