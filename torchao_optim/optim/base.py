"""What every optimizer of the library shares: the group loop, state creation, checked checkpoints, copies.

:class:`LowBitOptimizer` is a ``torch.optim.Optimizer`` whose states are created in a registered format
(``state_format``), and whose step sends each parameter group to the fused multi-tensor kernels where a
plan covers it (``optim/fused.py``) and every other parameter down the per-parameter compiled path
(``optim/compiled.py``). A subclass (Adam, SGD, Lion, Muon) declares its state keys and their signs, checks
its hyperparameters, turns them into per-step coefficients (one row per parameter, float64, the one form both
executors read) and updates one parameter on the compiled path; everything else is here.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim import offload, replay, traced
from torchao_optim.optim.checkpoint import check_usable, checked_moment, checked_state, checked_step
from torchao_optim.optim.compiled import CompiledOrEager
from torchao_optim.optim.fused import _GRAD, FusedRule, check_state_shapes, fused_available, plan_group
from torchao_optim.optim.offload import Slots, plan_offloaded, state_nbytes
from torchao_optim.optim.replay import Steady, StepGraph
from torchao_optim.optim.sharded import (
    element_offset,
    is_dtensor,
    like_param,
    local,
    quantizable_sharding,
    row_aligned_block_size,
)
from torchao_optim.optim.snapshot import StateSnapshot, same_objects
from torchao_optim.quant.rounding import rounding_key
from torchao_optim.state import QuantizedState, get_state_format

__all__ = ["LowBitOptimizer", "check_number", "check_storage"]

_LAYOUT = operator.attrgetter("layout")
_IS_NONE = functools.partial(operator.is_, None)
_STRIDED = functools.partial(operator.is_, torch.strided)


def number(name, value, tensor_ok=False):
    """``value`` as a Python float: ints, floats, numpy scalars and (where torch.optim takes one) a one-element
    tensor; anything else is a ValueError naming it."""
    if isinstance(value, Tensor):
        if not tensor_ok or value.numel() != 1 or value.is_complex():
            raise ValueError(
                f"Invalid {name}: a tensor {name} must be real with exactly one element, got "
                f"shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        return float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid {name}: {value!r} (a real number)")
    return float(value)


def check_number(name: str, value, low: float = 0.0, high: float | None = None, tensor_ok=True) -> None:
    """ValueError naming ``name`` unless ``low <= value`` (and ``value < high``)."""
    x = number(name, value, tensor_ok=tensor_ok)
    if not (x >= low and (high is None or x < high)):
        raise ValueError(f"Invalid {name}: {value!r}")


def check_storage(block_size, min_quant_size) -> None:
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0):
        raise ValueError(f"Invalid block_size: {block_size!r} (a positive int, or None for the format's default)")
    if not isinstance(min_quant_size, int) or isinstance(min_quant_size, bool) or min_quant_size < 0:
        raise ValueError(f"Invalid min_quant_size: {min_quant_size!r}")


def as_float(group, key: str) -> None:
    """Numpy scalars and one-element tensors in ``group[key]`` become Python floats (read once, as torch.optim's
    non-capturable paths do)."""
    if not isinstance(group[key], (int, float)) or isinstance(group[key], bool):
        group[key] = number(key, group[key], tensor_ok=True)


def check_bool(group, key: str) -> None:
    if not isinstance(group[key], bool):
        raise ValueError(f"Invalid {key}: {group[key]!r} (True or False)")


def check_unique(group) -> None:
    """ValueError naming a parameter that ``group`` lists more than once (its positions, name and shape): it would
    be stepped twice per step, and on the fused path by two threads at once, racing on its state."""
    first: dict[int, int] = {}
    for i, p in enumerate(group["params"]):
        if first.setdefault(id(p), i) != i:
            positions = [j for j, q in enumerate(group["params"]) if q is p]
            names = group.get("param_names")
            name = f" ({names[positions[0]]!r})" if names and len(names) > positions[0] else ""
            raise ValueError(
                f"the parameter{name} of shape {tuple(p.shape)} is listed {len(positions)} times, at "
                f"positions {positions}, so each step would update it {len(positions)} times: list "
                f"each parameter once"
            )


def check_torch_keywords(name: str, foreach, capturable, differentiable, fused) -> None:
    """torch.optim's implementation keywords: what we can honour is accepted, the rest refused by name.

    ``foreach`` picks torch.optim's implementation and never its numbers: ours are chosen by ``fused`` and
    ``compile``, so any value is accepted. ``capturable=True`` is honoured where the step can be captured in a
    CUDA graph: the fused CUDA path. ``differentiable=True`` is refused: quantization is not differentiable.
    """
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"Invalid foreach: {foreach!r} (None, True or False)")
    if not isinstance(capturable, bool) or not isinstance(differentiable, bool):
        raise ValueError(f"Invalid capturable or differentiable: {capturable!r}, {differentiable!r} (True or False)")
    if differentiable:
        raise ValueError(
            f"{name}(differentiable=True) is not supported: the step requantizes its state, which "
            f"autograd cannot differentiate; use the torch.optim optimizer with differentiable=True"
        )
    if capturable:
        if fused is False:
            raise ValueError(f"{name}(capturable=True) needs the fused CUDA path, which fused=False turns off")
        if not fused_available("cuda"):
            raise ValueError(
                f"{name}(capturable=True) needs the fused CUDA path (Triton and a CUDA device): only "
                f"its step can be captured in a CUDA graph"
            )


def check_offload(name: str, offload_state, fused, capturable) -> None:
    """``offload_state=True`` streams state through the fused CUDA kernels: refused by name where they cannot run."""
    if not isinstance(offload_state, bool):
        raise ValueError(f"Invalid offload_state: {offload_state!r} (True or False)")
    if not offload_state:
        return
    if fused is False:
        raise ValueError(
            f"{name}(offload_state=True) streams the state through the fused CUDA path, which fused=False turns off"
        )
    if capturable:
        raise ValueError(
            f"{name}(offload_state=True, capturable=True) is not supported: the offloaded step "
            f"orders its copies with events on side streams, which a CUDA graph of the step would "
            f"freeze; choose one"
        )
    if not fused_available("cuda") and not (fused and fused_available("cpu")):
        raise ValueError(
            f"{name}(offload_state=True) needs the fused CUDA path (Triton and a CUDA device): the "
            f"state is streamed through the GPU's fused kernels"
        )


def alias(t: Tensor, shape) -> Tensor:
    """``t`` (contiguous) with ``shape``, sharing its storage but not a ``view`` of it: torch.compile with
    dynamic shapes mishandles mutated inputs that are views of a differently shaped base."""
    shape = tuple(shape)
    if isinstance(t, QuantizedState):  # inner tensors are flat already: a new wrapper over them
        return t._new(t.fields(), shape=shape)
    if tuple(t.shape) == shape and type(t) is Tensor and not t._is_view():
        return t
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape, strides)


def step_shape(p: Tensor, states) -> tuple:
    """The shape the compiled update sees: (n_blocks, block_size) when the states are quantized and the
    size is whole blocks, so the update, the per-block absmax and the requantization share one iteration
    space and fuse into one pass; flat otherwise. Either way one graph serves every parameter size."""
    q = next((s for s in states if isinstance(s, QuantizedState)), None)
    bs = getattr(q, "block_size", None)
    if bs and p.numel() % bs == 0 and p.numel() > 0:
        return (p.numel() // bs, bs)
    return (p.numel(),)


@contextlib.contextmanager
def flat_aliases(p: Tensor | None, grad: Tensor, states: Sequence[Tensor | None]):
    """Within: ``(p, grad, states)`` as the compiled update takes them, contiguous and aliased to
    :func:`step_shape`, so that every parameter, whatever its shape, reuses one compiled graph. DTensors (FSDP2)
    are replaced by their local shards: the update is elementwise, and every rank holds whole blocks.

    A quantized state holds its elements in the parameter's logical (row-major) order, whatever the strides.
    A tensor that is not contiguous (a transposed weight, a channels_last conv weight, its gradient) is handed
    over as a contiguous copy in that order, and, where the update writes it, copied back on leaving. Tensors
    of several layouts in one update are what inductor miscompiles: it iterates the parameter's layout and the
    states' flat blocks in loops of their own, and drops a short last block's codes. ``p`` None: a rule that
    does not write the parameter (Muon's momentum)."""
    written = [None if p is None else local(p)] + [local(s) for s in states]
    work = [t if t is None or t.is_contiguous() else t.contiguous() for t in written]
    grad = local(grad)
    grad = grad if grad.is_contiguous() else grad.contiguous()
    shape = step_shape(grad, work[1:])
    olds = work[:1] + [grad] + work[1:]
    out = [None if t is None else alias(t, shape) for t in olds]
    if len(shape) == 2:
        # (n_blocks, block_size): the block size is the format's, a constant of the graph, not a size for
        # dynamo to reason about (with it symbolic, tracing spends a third of its time on symbolic arithmetic
        # and guards). Only on the aliases made here: a caller's own tensor is never marked.
        for new, old in zip(out, olds):
            if new is not None and new is not old:
                torch._dynamo.mark_static(new, 1)
    yield out[0], out[1], out[2:]
    for original, contiguous in zip(written, work):
        if contiguous is not original:
            original.copy_(contiguous)


class LowBitOptimizer(torch.optim.Optimizer):
    """Base of the library's optimizers. A subclass sets the class attributes below and implements
    ``_check_hyperparams(group)``, ``_hyperparam_values(group)``, ``_coefficients(steps, hp, group)`` and
    ``_step_one(p, state, group, coefs)``; ``_fused_rule(group)`` where a fused kernel implements its rule."""

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
        foreach=None,
        capturable: bool = False,
        differentiable: bool = False,
        bf16_stochastic_round: bool = False,
        offload_state: bool = False,
    ):
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
        """What the optimizer builds for itself rather than saves: the compiled update, caches, the path."""
        self._compile, self._fused_option = bool(compile), fused
        self._foreach, self._capturable, self._offload_state = foreach, capturable, offload_state
        self._slots: Slots | None = None  # offload_state: the GPU window chunks of state run in
        # stepping in backward with offload_state: which parameter's hook ran after which, last time
        self._next_in_backward: dict[int, int] = {}
        self._last_stepped: int | None = None
        self._update = CompiledOrEager(type(self).update_fn, enabled=self._compile)
        self._hp_tensors: dict[tuple, tuple] = {}
        self._plans: dict[int, dict] = {}
        self._graphs: dict[int, StepGraph] = {}  # id(group) -> its step's CUDA graph (optim/replay.py)
        self._grad_addresses: dict[int, tuple] = {}  # id(group) -> (its params with grads, their grads' addresses)
        self._replayable: dict[int, tuple] = {}  # id(group) -> (its params with grads, the device a graph may use)
        self._round_info: dict[tuple, tuple] = {}  # (param ids, device) -> (params, their rounding rows there)
        self._with_grad: dict[int, tuple] = {}  # id(group) -> (which params have grads, params, states)
        self._positions: dict[int, int] = {}  # id(param) -> its position in the optimizer (stochastic rounding)
        self._in_backward: dict[int, tuple] | None = None  # step_in_backward: id(param) -> (its list, plans)
        self._group_map: tuple | None = None  # (the groups, id(param) -> its group): see _group_of
        # None or True: fused wherever a fused kernel runs (CUDA: Triton's; CPU: kernels.cpu's C); True also
        # selects Triton's interpreter for CPU parameters when TRITON_INTERPRET=1 is set (testing the Triton kernels)
        self._fused = fused is not False
        self._interpreter = fused is True
        self._key = traced.register(self)  # how a compiled step's operator finds this optimizer (optim/traced.py)

    # ---- copies: copy.deepcopy, pickle, torch.save(optimizer) -------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # The compiled update and the caches are rebuilt by the copy; only how to build them is saved.
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

    # ---- parameter groups ---------------------------------------------------------------------------
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

    def _check_hyperparams(self, group: dict[str, Any]) -> None:
        """Raise ValueError naming a bad hyperparameter of ``group``; normalize numbers in place."""
        raise NotImplementedError

    def _check_group(self, group: dict[str, Any], index: int | None = None) -> None:
        """Raise ValueError unless ``group`` holds valid hyperparameters and parameters; normalizes numbers."""
        where = f"param group {len(self.param_groups) - 1 if index is None else index}"
        try:
            self._check_hyperparams(group)
            check_unique(group)
            check_bool(group, "bf16_stochastic_round")
            check_storage(group["block_size"], group["min_quant_size"])
            if group["state_format"] != "none":
                get_state_format(group["state_format"])  # raises ValueError naming the registered formats
            if self._offload_state and any(is_dtensor(p) for p in group["params"]):
                raise ValueError(
                    "offload_state=True does not support DTensor (FSDP2) parameters: use FSDP2's "
                    "own CPUOffloadPolicy, or offload without sharding"
                )
            if self._offload_state and self._state_keys(group) and self._fused_rule(group) is None:
                raise ValueError(
                    f"offload_state=True needs the fused CUDA path, which no kernel gives this "
                    f"group's settings ({self._unfused_reason(group)})"
                )
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if group["state_format"] != "none":
            self._build_format_tables(group)
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(f"{type(self).__name__} does not support complex parameters (got {p.dtype})")
            if not p.is_floating_point():
                raise ValueError(f"{type(self).__name__} optimizes floating-point parameters, got {p.dtype}")

    @staticmethod
    def _build_format_tables(group) -> None:
        """Create a small tensor of the group's format, signed and unsigned, so that its codebook tables exist
        before any step: a step traced by torch.compile creates its states while compiling, where tables can no
        longer be built (quant/codec.py)."""
        fmt = get_state_format(group["state_format"])
        block_size = group["block_size"] or fmt.default_block_size
        for signed in (True, False):
            try:
                fmt.zeros((block_size,), signed=signed, block_size=block_size)
            except ValueError:
                pass  # the format refuses this shape; its tables are built with its first state

    # ---- state --------------------------------------------------------------------------------------
    def _state_keys(self, group, p: Tensor | None = None) -> tuple[str, ...]:
        """The state keys ``p`` has in ``group`` (besides "step")."""
        raise NotImplementedError

    def _unfused_reason(self, group) -> str:
        """Why :meth:`_fused_rule` gives no rule for ``group`` (for error messages)."""
        return "its update rule"

    def _offloads(self, p: Tensor) -> bool:
        """Whether ``p``'s state lives in host memory (``offload_state``): parameters on the fused device."""
        return self._offload_state and (p.device.type == "cuda" or (self._interpreter and p.device.type == "cpu"))

    def _state_device(self, p: Tensor) -> torch.device:
        """Where ``p``'s states live between steps: host memory when offloaded, else ``p``'s device."""
        return torch.device("cpu") if self._offloads(p) else local(p).device

    def _signed(self, key: str) -> bool:
        return key not in self.UNSIGNED_STATE_KEYS

    def _format_for(self, p: Tensor, group) -> type | None:
        """The format class for ``p``'s state, or None for plain (unquantized) state. Decided from the global
        shape only (a DTensor's ``shape``), so a sharded parameter is quantized on every mesh or on none."""
        if group["state_format"] == "none" or p.numel() < group["min_quant_size"]:
            return None
        fmt = get_state_format(group["state_format"])
        block_size = self._block_size_for(p, group, fmt)
        if block_size is None:
            return None  # sharded, and no block fits within a row (see optim/sharded.py)
        try:
            fmt.check_attrs(p.shape, **fmt._attrs(signed=True, block_size=block_size))
        except ValueError:
            return None  # the format cannot store this shape: keep plain state
        return fmt

    def _block_size_for(self, p: Tensor, group, fmt: type) -> int | None:
        """The block size of ``p``'s quantized state: the group's (or the format's default); for a DTensor
        parameter the row-aligned one (:func:`~torchao_optim.optim.sharded.row_aligned_block_size`), or None
        when there is none or when its placements do not keep rows whole."""
        block_size = group["block_size"] or fmt.default_block_size
        if not is_dtensor(p):
            return block_size
        if not quantizable_sharding(p.placements) or not fmt.row_shardable:
            return None
        return row_aligned_block_size(p.shape, block_size)

    @staticmethod
    def _plain_state_dtype(p: Tensor) -> torch.dtype:
        """Unquantized state is fp32, or fp64 for fp64 parameters (torch.optim's numbers)."""
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _new_state_tensor(self, p: Tensor, group, signed: bool) -> Tensor:
        """A state of zeros for ``p``; for a DTensor parameter, the state of its local shard as a DTensor laid
        out like ``p``. An offloaded state is created on the meta device: the step's planner makes it, as zeros,
        in host memory (:func:`~torchao_optim.optim.offload.plan_offloaded`)."""
        fmt = self._format_for(p, group)
        lp = local(p)
        device = torch.device("meta") if self._offloads(p) else lp.device
        if fmt is None:
            state = torch.zeros(lp.shape, dtype=self._plain_state_dtype(p), device=device)
        else:
            state = fmt.zeros(lp.shape, signed=signed, block_size=self._block_size_for(p, group, fmt), device=device)
        return like_param(p, state) if is_dtensor(p) else state

    def _where(self, p: Tensor) -> str:
        """``p`` as an error message names it: its position over all groups and its shape."""
        return f"parameter {self._rounding([p])[0][0]} of shape {tuple(p.shape)}"

    def _state_of(self, p: Tensor) -> dict:
        """``p``'s state dict, made empty where ``state`` has none (a ``defaultdict`` as torch.optim's, or a plain
        dict a user put in its place)."""
        if p not in self.state:
            self.state[p] = {}
        state = self.state[p]
        if not isinstance(state, dict):
            raise ValueError(
                f"{type(self).__name__}: the state of {self._where(p)} must be a dict, got {type(state).__name__}"
            )
        return state

    def _is_own_moment(self, p: Tensor, group, key: str, value) -> bool:
        """Whether ``value`` is in the form this optimizer keeps ``p``'s ``key`` in (what
        :meth:`_new_state_tensor` makes): the step can use it as it is."""
        if not isinstance(value, Tensor) or is_dtensor(value) != is_dtensor(p):
            return False
        if is_dtensor(p) and (value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements)):
            return False
        lv, lp = local(value), local(p)
        if lv.shape != lp.shape:
            return False
        if lv.device != self._state_device(p) and not (lv.is_meta and self._offloads(p)):
            return False
        fmt = self._format_for(p, group)
        if fmt is None:
            return type(lv) is Tensor and lv.dtype == self._plain_state_dtype(p) and lv.is_contiguous()
        return type(lv) is fmt and lv.attrs() == fmt._attrs(
            signed=self._signed(key), block_size=self._block_size_for(p, group, fmt)
        )

    def _adopt_state(self, p: Tensor, group, state: dict) -> None:
        """Make ``state`` one the step can use, as torch.optim would use it. What it lacks is created: a reset state
        gets zeros and step 0, and a group may gain a key (SGD's momentum buffer when momentum is turned on). A value
        put in that is not in the form this optimizer keeps (a plain tensor where it keeps quantized codes; another
        dtype, device, format or block size) is converted as :meth:`load_state_dict` converts a checkpoint: the
        state then holds the converted tensor. A value that cannot be used raises ValueError naming the parameter
        and the key."""
        step = state.get("step")
        if step is None:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif not (type(step) is Tensor and step.dtype == torch.float32 and step.dim() == 0 and step.device == p.device):
            check_usable(step, f"{self._where(p)}: state['step']")
            state["step"] = checked_step(p, step, self._where(p))
        for key in self._state_keys(group, p):
            value = state.get(key)
            if value is None:
                state[key] = self._new_state_tensor(p, group, signed=self._signed(key))
            elif not self._is_own_moment(p, group, key, value):
                where = f"{self._where(p)}: state[{key!r}]"
                check_usable(value, where)
                state[key] = checked_moment(self, p, group, key, value, where)
            elif isinstance(local(value), QuantizedState) and not local(value).is_meta:
                # the kernels trust a state's fields to fit its shape: a truncated one would be read past its end
                try:
                    local(value).check_fields()
                except ValueError as err:
                    raise ValueError(f"{self._where(p)}: state[{key!r}]: {err}") from None

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
        self._hp_tensors.clear()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim``'s (the state tensors themselves, not copies); with ``offload_state``, after the
        last step's copies back to host memory have finished."""
        self._wait_offloaded()
        return super().state_dict()

    # ---- offloaded state ----------------------------------------------------------------------------
    def _wait_offloaded(self) -> None:
        """Before the host state is read or replaced: wait for the copies back, and forget which chunks the
        slots hold (the host copy may change under them)."""
        if getattr(self, "_slots", None) is not None:
            self._slots.forget()

    def _offload_slots(self, device: torch.device) -> Slots:
        """The GPU window of ``offload_state``: two slots of the largest chunk, sized once for every parameter
        of the optimizer (so that stepping parameter by parameter, in backward, never outgrows them)."""
        if self._slots is not None and self._slots.device != device:
            raise ValueError(
                f"{type(self).__name__}(offload_state=True) streams state through one GPU; "
                f"parameters on {self._slots.device} and {device}: use one optimizer per device"
            )
        if self._slots is None:
            largest = 0
            for group in self.param_groups:
                for p in group["params"]:
                    if self._offloads(p):
                        n = sum(
                            state_nbytes(self._new_state_tensor(p, group, self._signed(k)))
                            for k in self._state_keys(group, p)
                        )
                        largest = max(largest, n)
            self._slots = Slots(max(offload.CHUNK_BYTES, largest), device)
        return self._slots

    def _step_offloaded(
        self, group, params: list[Tensor], states: list[dict], rule: FusedRule, plan_cache, flags: dict[str, Any]
    ) -> None:
        """The step of ``params`` (all offloaded) with their states streamed through the GPU in chunks."""
        device = params[0].device
        slots = self._offload_slots(device)
        first = self._rounding(params[:1])[0][0]  # stepping one parameter at a time, they alternate slots
        chunks, rest = plan_offloaded(
            plan_cache(), params, states, rule, slots, self._interpreter, self._rounding, first_slot=first
        )
        if rest:
            self._refuse_unplanned(params, states, rest)
        hp = self._hyperparams(group, device)
        slots.run(chunks, lambda plan: plan.launch(hp, **flags))
        if self._in_backward is not None:  # one parameter at a time: copy in the one backward reached next last time
            previous, self._last_stepped = self._last_stepped, id(params[0])
            if previous is not None:
                self._next_in_backward[previous] = id(params[0])
            upcoming = self._in_backward.get(self._next_in_backward.get(id(params[0])))
            if upcoming is not None and "chunks" in upcoming[1]:
                for chunk in upcoming[1]["chunks"]:
                    slots.prefetch(chunk)

    def _refuse_unplanned(self, params: list[Tensor], states: list[dict], rest) -> None:
        """``offload_state``: a parameter the fused path does not cover is refused by name (its states, not yet
        made, are dropped: the optimizer stays usable)."""
        for i in rest:
            for key in [k for k, v in states[i].items() if isinstance(v, Tensor) and v.is_meta]:
                del states[i][key]
        p = params[rest[0]]
        raise ValueError(
            f"{type(self).__name__}(offload_state=True): a parameter of shape {tuple(p.shape)} "
            f"({p.dtype}, {p.device}{', a DTensor' if is_dtensor(p) else ''}) is not covered by the "
            f"fused CUDA path, through which offloaded state is streamed (see docs/bigger-models.md, "
            f"'Offloaded state')"
        )

    # ---- hyperparameters as a device tensor: changing them never recompiles, never syncs ---------------
    def _hyperparam_values(self, group) -> tuple[Any, ...]:
        """The group's hyperparameters in the order ``_coefficients`` reads them (lr first)."""
        raise NotImplementedError

    def _hyperparams(self, group, device: torch.device) -> Tensor:
        """:meth:`_hyperparam_values` as a float64 tensor on ``device``, refilled only where a value changed; a
        tensor lr on the device is copied there without a host sync."""
        values = self._hyperparam_values(group)
        entry = self._hp_tensors.get((id(group), device))
        if entry is None:
            entry = self._hp_tensors[(id(group), device)] = (
                [None] * len(values),
                torch.zeros(len(values), dtype=torch.float64, device=device),
            )
        cached, hp = entry
        for i, value in enumerate(values):
            if isinstance(value, Tensor):
                if value.device == device:
                    hp[i].copy_(value.reshape(()))
                    cached[i] = None
                    continue
                value = value.item()  # a CPU tensor: reading it costs no device sync
            if cached[i] != value:
                hp[i].fill_(value)
                cached[i] = value
        return hp

    def _fused_hyperparams(self, group, device: torch.device) -> Tensor:
        """The hyperparameters the fused kernels of ``_fused_rule(group)`` read: :meth:`_hyperparams` unless the
        optimizer's own differ from the rule's (Muon8bit's AdamW fallback)."""
        return self._hyperparams(group, device)

    def _coefficients(self, steps: Tensor, hp: Tensor, group) -> Tensor:
        """Per-parameter coefficient rows, float64 ``steps.shape + (k,)``, from advanced step counts."""
        raise NotImplementedError

    # ---- the step -----------------------------------------------------------------------------------
    def _check_grad(self, p: Tensor, grad: Tensor) -> None:
        if is_dtensor(p) != is_dtensor(grad) or (is_dtensor(p) and grad.placements != p.placements):
            raise RuntimeError(
                f"{type(self).__name__}: a parameter of type {type(p).__name__} with placements "
                f"{getattr(p, 'placements', None)} has a gradient of type {type(grad).__name__} "
                f"with placements {getattr(grad, 'placements', None)}; they must match"
            )
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if grad.is_complex() or p.is_complex():
            raise RuntimeError(f"{type(self).__name__} does not support complex parameters or gradients")

    def _params_with_grad(self, group) -> tuple[list[Tensor], list[dict]]:
        """The group's parameters that have a gradient, and their states (created on first use, adopted where a
        user changed them: :meth:`_adopt_state`). The lists are reused while the same parameters have gradients,
        the group's state keys are the same and the state holds the same objects (``optim/snapshot.py``): a step
        then costs a few passes over the parameters in C."""
        # (map over C functions: this runs on every step, before any launch, for every parameter)
        grads = list(map(_GRAD, group["params"]))
        present = [g for g in grads if g is not None]
        key = (
            tuple(map(id, group["params"])),
            len(present) == len(grads) or tuple(map(_IS_NONE, grads)),
            self._state_keys(group),
        )
        cached = self._with_grad.get(id(group))
        if cached is not None and cached[0] == key:
            params, states, snapshot = cached[1:]
            if not snapshot.holds(self.state):
                if not same_objects(tuple(map(self.state.get, params)), states):
                    cached = None  # a state dict replaced or removed: collect them again
                else:  # the same dicts (another's changed, or some value): adopt them, keep the lists
                    for p, state in zip(params, states):
                        self._adopt_state(p, group, state)
                    self._with_grad[id(group)] = (key, params, states, StateSnapshot(states, self.state))
        else:
            cached = None
        if cached is not None:
            # The gradients may be new tensors every step; torch checks that a gradient's dtype is its
            # parameter's, but a sparse one may replace a dense one. A sparse gradient has no address (nor
            # has a DTensor's, checked by layout): taking the addresses, which the fused plans need, checks it.
            try:
                self._grad_addresses[id(group)] = (params, tuple(map(Tensor.data_ptr, present)))
                return params, states
            except RuntimeError:
                self._grad_addresses.pop(id(group), None)
                if all(map(_STRIDED, map(_LAYOUT, present))):
                    return params, states
        params, states = [], []
        for p, grad in zip(group["params"], grads):
            if grad is None:
                continue
            self._check_grad(p, grad)
            state = self._state_of(p)
            self._adopt_state(p, group, state)
            params.append(p)
            states.append(state)
        self._with_grad[id(group)] = (key, params, states, StateSnapshot(states, self.state))
        return params, states

    def _fused_rule(self, group) -> FusedRule | None:
        """The fused kernel's rule for this group, or None where none implements it."""
        return None

    def _launch_flags(self, group) -> dict[str, Any]:
        return {}

    def _rounding(self, params: list[Tensor]) -> list[tuple[int, int]]:
        """``(position in the optimizer, element offset of the local shard)`` of each of ``params``: what the
        stochastic rounding of a parameter hashes, with its step (:mod:`torchao_optim.quant.rounding`)."""
        if any(id(p) not in self._positions for p in params):
            self._positions = {id(p): i for i, p in enumerate(q for g in self.param_groups for q in g["params"])}
        return [(self._positions[id(p)], element_offset(p)) for p in params]

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
            raise RuntimeError(
                f"{type(self).__name__}.step(): this optimizer steps in backward "
                f"(torchao_optim.step_in_backward); call the handle's remove() to step it again"
            )
        if torch.compiler.is_compiling():  # one registered operator per group (optim/traced.py)
            for index, group in enumerate(self.param_groups):
                params, grads, tensors = [], [], []
                self._init_group(group, params, grads, tensors)
                if params:
                    torch.ops.torchao_optim.step_(params, grads, tensors, self._key, index)
            return loss
        for group in self.param_groups:
            if self._replay_steady(group):
                continue
            params, states = self._params_with_grad(group)
            self._step_group(group, params, states, lambda group=group: self._group_plans(group), replay=True)
        return loss

    def _replay_steady(self, group) -> bool:
        """Step ``group`` by replaying its graph if its last step was replayed and nothing that step depended
        on has changed (:class:`~torchao_optim.optim.replay.Steady`); False where the whole way must decide."""
        graph = self._graphs.get(id(group))
        steady = graph.steady if graph is not None else None
        if steady is None or not replay.ENABLED:
            return False
        found = steady.grads_if_unchanged(group)
        if found is None or steady.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        cache = self._plans.get(id(group), {})
        if cache.get("plans") is not steady.plans:
            return False  # planned again since (a step traced by torch.compile plans through the same cache)
        with_grad = self._with_grad.get(id(group))
        if with_grad is None or with_grad[3] is not steady.snapshot or not steady.snapshot.holds(self.state):
            return False  # a state replaced, removed or reset: the whole way adopts it and plans again
        # the plans' tables follow moved gradients (outside the graph); a gradient that is not contiguous, moved
        # or a view at the same address, sends the step the full way, which plans its parameter again
        grads, addresses = found
        if not all([plan.refresh_grads(addresses, grads) for plan in steady.plans]):
            return False
        if addresses != steady.grad_addresses:
            if tuple(plan.grads_aligned for plan in steady.plans) != steady.aligned:
                return False  # the graph was captured for the other alignment: the signature differs
            steady.grad_addresses = addresses
        self._hyperparams(group, steady.device)
        graph.again()
        return True

    def _group_plans(self, group) -> dict:
        """Where ``group``'s fused plans are cached (optim/fused.py's plan_group)."""
        return self._plans.setdefault(id(group), {})

    def _group_tensors(self, group, params: list[Tensor], states: list[dict]) -> list[Tensor]:
        """The plain tensors that hold the states of ``params``: per parameter, each state's fields (a quantized
        state's codes and scales, or the plain state). Not the step counts: a compiled graph never reads them,
        and on the fused CUDA path they are views of one tensor (optim/fused.py), which a graph's inputs must not
        be. Not offloaded states either."""
        tensors = []
        for p, state in zip(params, states):
            if self._offloads(p):
                continue  # held in host memory and streamed by the step itself: no graph can read it
            for key in self._state_keys(group, p):
                value = local(state[key])
                tensors.extend(value.fields().values() if isinstance(value, QuantizedState) else [value])
        return tensors

    def _init_group(self, group, params: list[Tensor], grads: list[Tensor], tensors: list[Tensor]) -> int:
        """Fill the lists with ``group``'s parameters that have a gradient, their gradients and the tensors that
        hold their states (created here on the first step). Under torch.compile, dynamo runs this method on the
        real objects instead of tracing it, as it does torch.optim's."""
        ps, states = self._params_with_grad(group)
        rule = self._fused_rule(group) if ps and self._fused and not self._offload_state else None
        rest = range(len(ps))
        if rule is not None:  # plan now: a new plan re-points state["step"], which would recompile the next step
            _, rest = plan_group(self._group_plans(group), ps, states, rule, self._interpreter, self._rounding)
        # and make now the device tensors the step keeps (a CUDA graph's pool must not own them)
        for device in {p.device for p in ps}:
            self._hyperparams(group, device)
            if group["bf16_stochastic_round"]:
                self._rounding_rows([ps[i] for i in rest if ps[i].device == device], device)
        params.extend(ps)
        grads.extend(p.grad for p in ps)
        tensors.extend(self._group_tensors(group, ps, states))
        return len(ps)

    def _step_group_with(self, group, params: list[Tensor], grads: list[Tensor], tensors: list[Tensor]) -> None:
        """The step of ``group`` run by the ``torchao_optim::step_`` operator of a compiled step: with ``grads`` as
        the gradients (a compiled graph may hand over copies), and writing into ``params`` and ``tensors`` where
        they are copies of the optimizer's own (see optim/traced.py)."""
        own = [p for p in group["params"] if p.grad is not None]
        if len(own) != len(params) or len(grads) != len(params):
            raise RuntimeError(
                f"{type(self).__name__}: a compiled step was traced for {len(params)} parameters with "
                f"gradients in param group {self.param_groups.index(group)}, which now has "
                f"{len(own)}"
            )
        saved = [p.grad for p in own]
        try:
            for p, g in zip(own, grads):
                if p.grad is not g:
                    p.grad = g
            own, states = self._params_with_grad(group)
            own_tensors = self._group_tensors(group, own, states)
            self._step_group(group, own, states, lambda: self._group_plans(group))
        finally:
            for p, g in zip(own, saved):
                p.grad = g
        for mine, theirs in zip([local(p) for p in own] + own_tensors, [local(p) for p in params] + list(tensors)):
            if mine.data_ptr() != theirs.data_ptr():
                theirs.copy_(mine)

    def _step_group(self, group, params: list[Tensor], states: list[dict], plan_cache, replay: bool = False) -> None:
        """The step of ``params`` (of ``group``, all with gradients): fused plans (cached in the dict
        ``plan_cache()`` gives, while the same list comes back), then the compiled path for the rest. With
        ``replay``, the launches may be replayed from a CUDA graph (:mod:`torchao_optim.optim.replay`)."""
        rest = range(len(params))
        rule = self._fused_rule(group) if params and self._fused else None
        flags = dict(self._launch_flags(group), stochastic_round=group["bf16_stochastic_round"])
        if rule is not None and self._offload_state:
            offloaded = [i for i in rest if self._offloads(params[i])]
            if offloaded:
                self._step_offloaded(
                    group, [params[i] for i in offloaded], [states[i] for i in offloaded], rule, plan_cache, flags
                )
            rest, rule = [i for i in rest if not self._offloads(params[i])], None  # the others: compiled path
        plans = []
        # the fused path's table of gradient addresses: refreshed here, outside any graph that replays it
        addresses = self._grad_addresses.get(id(group)) if replay else None
        addresses = addresses[1] if addresses is not None and addresses[0] is params else None
        if rule is not None:
            plans, rest = plan_group(plan_cache(), params, states, rule, self._interpreter, self._rounding)
            if not all([plan.refresh_grads(addresses) for plan in plans]):  # a gradient moved, not contiguous
                plan_cache().clear()
                plans, rest = plan_group(plan_cache(), params, states, rule, self._interpreter, self._rounding)
                for plan in plans:
                    plan.refresh_grads(addresses)
        if rest and self._capturable:
            p = params[rest[0]]
            raise ValueError(
                f"{type(self).__name__}(capturable=True): a parameter of shape {tuple(p.shape)} "
                f"({p.dtype}, {p.device}) is not covered by the fused CUDA path, so the step "
                f"cannot be captured in a CUDA graph (see docs/optimizers.md, 'capturable')"
            )
        compiled = ([params[i] for i in rest], [states[i] for i in rest])

        def work():
            for plan in plans:
                plan.launch(self._fused_hyperparams(group, plan.params[0].device), refresh=False, **flags)
            if compiled[0]:
                self._step_compiled(*compiled, group)

        device = self._replay_device(group, params) if replay and (not compiled[0] or self._update.enabled) else None
        if device is None:
            return work()
        # Outside the graph too: the hyperparameters, refilled in place where a number changed; then what says
        # whether the graph still holds.
        self._hyperparams(group, device)
        # The numbers the hyperparameter tensor carries are data (refilled above); a tensor is read by address;
        # anything else the step may read as a constant (a flag, Muon's eps): it is part of the signature.
        data = {id(x) for x in self._hyperparam_values(group) if not isinstance(x, Tensor)}
        data_keys = {
            k for k, v in group.items() if id(v) in data or isinstance(v, tuple) and v and all(id(x) in data for x in v)
        }
        settings, tensors = [], []
        for k, v in group.items():
            if isinstance(v, Tensor):
                settings.append((k, id(v)))
                tensors.append(v)
            elif k != "params" and k not in data_keys:
                settings.append((k, v))
        if compiled[0]:  # what the compiled path's kernels read by address: parameters, gradients, states
            if addresses is None:
                addresses = tuple(map(Tensor.data_ptr, map(_GRAD, params)))
            read = (
                tuple(map(Tensor.data_ptr, compiled[0])),
                tuple(addresses[i] for i in rest),
                tuple(map(Tensor.data_ptr, self._group_tensors(group, *compiled))),
            )
        else:
            read = ()
        signature = (
            id(params),
            tuple(settings),
            tuple(id(plan) for plan in plans),
            tuple(plan.grads_aligned for plan in plans),
            read,
        )
        graph = self._graphs.setdefault(id(group), StepGraph())
        replayed = graph.run(signature, (params, plans, tensors), work, device)
        # replayed, fused only, every parameter with a gradient: the next step may take the short way
        # and the state it was made from is the state now (checked once here; the short way checks only that
        # nothing changed since)
        with_grad = self._with_grad.get(id(group))
        if (
            replayed
            and not compiled[0]
            and addresses is not None
            and len(params) == len(group["params"])
            and with_grad is not None
            and with_grad[1] is params
            and with_grad[3].holds(self.state)
        ):
            graph.steady = Steady(group, plan_cache()["addresses"], addresses, plans, device, data_keys, with_grad[3])

    def _replay_device(self, group, params: list[Tensor]) -> torch.device | None:
        """The CUDA device whose graph may replay the step of ``params`` (``group``'s with gradients), or None
        where none may: see :mod:`torchao_optim.optim.replay` for when."""
        if not params or not replay.ENABLED or self._offload_state or self._in_backward is not None:
            return None
        cached = self._replayable.get(id(group))
        if cached is None or cached[0] is not params:  # decided once per list of parameters
            device = params[0].device
            if device.type != "cuda" or any(p.device != device or is_dtensor(p) for p in params):
                device = None
            cached = self._replayable[id(group)] = (params, device)
        if cached[1] is None or torch.cuda.is_current_stream_capturing():
            return None
        return cached[1]

    @torch.no_grad()
    def _step_param(self, p: Tensor) -> None:
        """The step of one parameter, from its gradient (``step_in_backward``'s hook). Its plan is its own, kept
        while it steps this way."""
        group = self._group_of(p)
        state = self._state_of(p)
        self._check_grad(p, p.grad)
        self._adopt_state(p, group, state)
        params, cache = self._in_backward.setdefault(id(p), ([p], {}))
        self._step_group(group, params, [state], lambda: cache)

    def _group_of(self, p: Tensor) -> dict:
        """The param group holding ``p`` now (groups are replaced by load_state_dict and may be added), from a map
        rebuilt whenever the list of groups differs from the one it was made from."""
        groups = tuple(self.param_groups)
        if self._group_map is None or not same_objects(self._group_map[0], groups):
            self._group_map = (groups, {id(q): g for g in groups for q in g["params"]})
        return self._group_map[1][id(p)]

    def _step_compiled(self, params, states, group) -> None:
        """The per-parameter compiled path: every format, every device. The step counts are advanced and the
        coefficients computed for all of them at once, per device (a handful of small kernels, not a handful
        per parameter)."""
        check_state_shapes(params, states, self.STATE_KEYS, self._rounding)
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(params):
            by_device.setdefault(p.device, []).append(i)
        for device, idx in by_device.items():
            steps = [states[i]["step"] for i in idx]
            torch._foreach_add_(steps, 1)
            coefs = self._coefficients(torch.stack(steps), self._hyperparams(group, device), group)  # (n, k)
            # The update's compute dtype: fp64 for fp64 parameters, fp32 otherwise (as the fused kernels). Each
            # parameter gets a row, a view at storage offset k * (row + 1): dynamo specializes offsets 0 and 1,
            # so a first row at offset 0 would compile a graph of its own.
            coefs = torch.nn.functional.pad(coefs, (0, 0, 1, 0))
            rows64, rows32 = coefs.unbind(0), coefs.to(torch.float32).unbind(0)
            keys = self._round_keys([params[i] for i in idx], steps, group, device)
            for row, i in enumerate(idx, start=1):
                if local(params[i]).numel() == 0:
                    continue  # an empty shard (more ranks than rows): nothing to update, no graph to compile
                key = keys[row] if keys is not None and params[i].dtype == torch.bfloat16 else None
                self._step_one(
                    params[i], states[i], group, rows64[row] if params[i].dtype == torch.float64 else rows32[row], key
                )

    def _round_keys(self, params, steps, group, device) -> tuple[Tensor, ...] | None:
        """With ``bf16_stochastic_round`` and a bf16 parameter among ``params``: each parameter's int64
        ``(key, element offset)`` row for :func:`~torchao_optim.rules.store_param`, from its advanced
        step count, computed for all at once; padded by one row like the coefficients. Else None."""
        if not group["bf16_stochastic_round"] or not any(p.dtype == torch.bfloat16 for p in params):
            return None
        info = self._rounding_rows(params, device)  # (n, 2)
        keys = rounding_key(info[:, 0], torch.stack(steps).reshape(-1))
        return torch.nn.functional.pad(torch.stack([keys, info[:, 1]], 1), (0, 0, 1, 0)).unbind(0)

    def _rounding_rows(self, params, device) -> Tensor:
        """:meth:`_rounding` of ``params`` as an int64 ``(n, 2)`` tensor on ``device``: static while the same
        parameters step, so copied there once (never inside a CUDA graph, which cannot copy pageable memory)."""
        ids = (tuple(map(id, params)), device)
        if ids not in self._round_info:  # the parameters are kept with it, so that their ids are not reused
            self._round_info[ids] = (list(params), torch.tensor(self._rounding(params), dtype=torch.int64).to(device))
        return self._round_info[ids][1]

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key: Tensor | None = None) -> None:
        """One parameter on the compiled path, with its row of :meth:`_coefficients` (and, for stochastic
        rounding of a bf16 parameter, its ``(key, element offset)`` row)."""
        raise NotImplementedError
