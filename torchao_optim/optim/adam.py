"""Adam and AdamW with low-bit state: drop-in replacements for ``torch.optim.Adam`` / ``torch.optim.AdamW``."""
from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from torchao_optim.optim.checkpoint import checked_state
from torchao_optim.optim.compiled import CompiledOrEager
from torchao_optim.optim.fused import fused_available, plan_group
from torchao_optim.optim.sharded import is_dtensor, like_param, local, quantizable_sharding, row_aligned_block_size
from torchao_optim.optim.update import adam_coefficients, adam_update
from torchao_optim.state import QuantizedState, get_state_format

__all__ = ["Adam", "AdamW", "Adam8bit", "AdamW8bit", "AdamDTQ8bit", "dequantize_state_dict"]

_STORAGE_KEYS = ("state_format", "block_size", "min_quant_size", "decoupled_weight_decay")


def _number(name, value, tensor_ok=False):
    """``value`` as a Python float: ints, floats, numpy scalars and (where torch.optim takes one) a one-element
    tensor; anything else is a ValueError naming it."""
    if isinstance(value, Tensor):
        if not tensor_ok or value.numel() != 1 or value.is_complex():
            raise ValueError(f"Invalid {name}: a tensor {name} must be real with exactly one element, got "
                             f"shape {tuple(value.shape)} and dtype {value.dtype}")
        return float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid {name}: {value!r} (a real number)")
    return float(value)


def _check_hyperparams(lr, betas, eps, weight_decay, block_size=None, min_quant_size=0):
    if not _number("lr", lr, tensor_ok=True) >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr!r}")
    if not _number("epsilon value", eps, tensor_ok=True) >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= _number(f"beta parameter at index {i}", beta, tensor_ok=True) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta!r}")
    if not _number("weight_decay value", weight_decay, tensor_ok=True) >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r}")
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                   or block_size <= 0):
        raise ValueError(f"Invalid block_size: {block_size!r} (a positive int, or None for the format's default)")
    if not isinstance(min_quant_size, int) or isinstance(min_quant_size, bool) or min_quant_size < 0:
        raise ValueError(f"Invalid min_quant_size: {min_quant_size!r}")


def _normalize_group(group) -> None:
    """Numpy scalars become Python floats, and one-element tensor betas, eps and weight_decay become floats
    (read once, as torch.optim's non-capturable paths do); a tensor lr stays a tensor, read every step."""
    for key in ("eps", "weight_decay"):
        if not isinstance(group[key], (int, float)):
            group[key] = _number(key, group[key], tensor_ok=True)
    group["betas"] = tuple(b if isinstance(b, (int, float)) else _number("beta", b, tensor_ok=True)
                           for b in group["betas"])
    if not isinstance(group["lr"], (int, float, Tensor)):
        group["lr"] = _number("lr", group["lr"])
    for key in ("amsgrad", "maximize", "decoupled_weight_decay"):
        if not isinstance(group[key], bool):
            raise ValueError(f"Invalid {key}: {group[key]!r} (True or False)")


def _alias(t: Tensor, shape) -> Tensor:
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


def _step_shape(p: Tensor, states) -> tuple:
    """The shape the compiled update sees: (n_blocks, block_size) when the states are quantized and the
    size is whole blocks, so the update, the per-block absmax and the requantization share one iteration
    space and fuse into one pass; flat otherwise. Either way one graph serves every parameter size."""
    q = next((s for s in states if isinstance(s, QuantizedState)), None)
    bs = getattr(q, "block_size", None)
    if bs and p.numel() % bs == 0 and p.numel() > 0:
        return (p.numel() // bs, bs)
    return (p.numel(),)


class Adam(torch.optim.Optimizer):
    r"""Adam with its two moment buffers stored in a low-bit state format.

    The algorithm is ``torch.optim.Adam``'s (``torch.optim.AdamW``'s with ``decoupled_weight_decay=True``):

    .. code-block:: text

        g = grad (negated if maximize);  g += weight_decay * p  (Adam)  |  p *= 1 - lr * weight_decay  (AdamW)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g          (v_max = max(v_max, v) with amsgrad)
        p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    ``m`` and ``v`` are dequantized, updated in fp32 and requantized once per step; for each parameter
    ``torch.compile`` fuses that into one kernel. Parameters with fewer than ``min_quant_size`` elements,
    and with ``state_format="none"``, keep plain state: fp32, or fp64 for fp64 parameters, whose update is
    fp64 in any case. A non-finite gradient element, or one whose new ``m`` or ``v`` would overflow, is
    skipped: its parameter and state keep their values, and no other element is affected.

    Parameters sharded with FSDP2 (DTensors) get DTensor states laid out like them, quantized per local shard
    with blocks that never cross a row, so that layouts do not depend on the mesh (docs/distributed.md).

    ``load_state_dict`` and ``add_param_group`` check everything before they change anything (see
    :mod:`torchao_optim.optim.checkpoint`); copies (``copy.deepcopy``, pickle, ``torch.save``) step like
    the original.

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float or Tensor, optional): learning rate; may change every step (schedulers, or assigning
            ``group["lr"]``) without recompiling. Default: ``1e-3``.
        betas (Tuple[float, float], optional): coefficients of the running averages. Default: ``(0.9, 0.999)``.
        eps (float, optional): added to the denominator. Default: ``1e-8``.
        weight_decay (float, optional): L2 penalty (Adam) or decoupled decay (AdamW). Default: ``0``.
        amsgrad (bool, optional): keep the maximum of ``v`` (``max_exp_avg_sq``, same format). Default: ``False``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
        state_format (str, optional): a registered format name (see ``list_state_formats()``) or ``"none"``
            for fp32 state. Default: ``"dtq8"``.
        block_size (int, optional): elements per quantization block; ``None`` takes the format's default.
        min_quant_size (int, optional): smaller parameters keep fp32 state. Default: ``4096``.
        compile (bool, optional): fuse each update with ``torch.compile``; falls back to eager mode, with one
            warning, where compiling is impossible. Default: ``True``.
        fused (bool, optional): on CUDA, update each parameter group with one multi-tensor Triton launch
            per device, dtype and pair of state layouts: every format with a ``fast_path_layout()``, and fp32
            state (not amsgrad); other parameters take the per-parameter compiled path. ``None`` uses it
            wherever Triton and CUDA are available; ``True`` also runs it on the CPU in Triton's interpreter
            when ``TRITON_INTERPRET=1`` is set (slow: for testing). Default: ``None``.
        decoupled_weight_decay (bool, optional): AdamW's weight decay. Default: ``False``.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        maximize=False,
        state_format="dtq8",
        block_size=None,
        min_quant_size=4096,
        compile=True,
        fused=None,
        decoupled_weight_decay=False,
    ):
        _check_hyperparams(lr, betas, eps, weight_decay, block_size, min_quant_size)
        if state_format != "none":
            get_state_format(state_format)  # raises ValueError naming the registered formats
        if fused and not fused_available():
            raise RuntimeError("fused=True needs Triton and a CUDA device (or, for testing, TRITON_INTERPRET=1)")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay, state_format=state_format, block_size=block_size,
            min_quant_size=min_quant_size,
        )
        self._setup(compile, fused)
        super().__init__(params, defaults)

    def _setup(self, compile: bool, fused: Optional[bool]) -> None:
        """What the optimizer builds for itself rather than saves: the compiled update, caches, the path."""
        self._compile, self._fused_option = bool(compile), fused
        self._update = CompiledOrEager(adam_update, enabled=self._compile)
        self._hp_tensors: Dict[tuple, tuple] = {}
        self._plans: Dict[int, dict] = {}
        self._with_grad: Dict[int, tuple] = {}  # id(group) -> (which params have grads, params, states)
        # None: fused wherever a GPU is; True: also in Triton's interpreter on the CPU (for testing)
        self._fused = fused_available("cuda") if fused is None else bool(fused) and fused_available()
        self._interpreter = fused is True

    # ---- copies: copy.deepcopy, pickle, torch.save(optimizer) -------------------------------------------
    def __getstate__(self) -> Dict[str, Any]:
        # The compiled update and the caches are rebuilt by the copy; only how to build them is saved.
        state = super().__getstate__()
        state["options"] = {"compile": self._compile, "fused": self._fused_option}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        options = state.pop("options", None)
        super().__setstate__(state)
        if options is not None or not hasattr(self, "_update"):
            self._setup(**(options or {"compile": True, "fused": None}))

    # ---- parameter groups ---------------------------------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As ``torch.optim``'s; a group that fails the checks raises and is not added."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group: Dict[str, Any], index: Optional[int] = None) -> None:
        """Raise ValueError unless ``group`` holds valid hyperparameters and parameters; normalizes numbers."""
        where = f"param group {len(self.param_groups) - 1 if index is None else index}"
        try:
            _check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                               group["block_size"], group["min_quant_size"])
            _normalize_group(group)
            if group["state_format"] != "none":
                get_state_format(group["state_format"])  # raises ValueError naming the registered formats
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(f"{type(self).__name__} does not support complex parameters (got {p.dtype})")
            if not p.is_floating_point():
                raise ValueError(f"{type(self).__name__} optimizes floating-point parameters, got {p.dtype}")

    # ---- state --------------------------------------------------------------------------------------
    def _format_for(self, p: Tensor, group) -> Optional[type]:
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

    def _block_size_for(self, p: Tensor, group, fmt: type) -> Optional[int]:
        """The block size of ``p``'s quantized state: the group's (or the format's default); for a DTensor
        parameter the row-aligned one (:func:`~torchao_optim.optim.sharded.row_aligned_block_size`), or None
        when there is none or when its placements do not keep rows whole."""
        block_size = group["block_size"] or fmt.default_block_size
        if not is_dtensor(p):
            return block_size
        if not quantizable_sharding(p.placements):
            return None
        return row_aligned_block_size(p.shape, block_size)

    @staticmethod
    def _plain_state_dtype(p: Tensor) -> torch.dtype:
        """Unquantized state is fp32, or fp64 for fp64 parameters (torch.optim's numbers)."""
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _new_state_tensor(self, p: Tensor, group, signed: bool) -> Tensor:
        """A state of zeros for ``p``; for a DTensor parameter, the state of its local shard as a DTensor laid
        out like ``p``."""
        fmt = self._format_for(p, group)
        lp = local(p)
        if fmt is None:
            state = torch.zeros_like(lp, dtype=self._plain_state_dtype(p), memory_format=torch.contiguous_format)
        else:
            state = fmt.zeros(lp.shape, signed=signed, block_size=self._block_size_for(p, group, fmt),
                              device=lp.device)
        return like_param(p, state) if is_dtensor(p) else state

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _init_state(self, p: Tensor, group, state) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key in self._state_keys(group):
            state[key] = self._new_state_tensor(p, group, signed=(key == "exp_avg"))

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load ours or a ``torch.optim.Adam``/``AdamW`` state_dict.

        The whole checkpoint is checked first, against what this optimizer would create for each parameter
        (keys, shapes, dtypes, devices, the block layout and scales of quantized states, finite values):
        a bad one raises ValueError naming the parameter, the key and what was expected, and leaves the
        optimizer as it was. States are then converted to this optimizer's format (fp32 states are
        quantized, quantized ones dequantized where this optimizer keeps plain state); hyperparameters come
        from the checkpoint, how states are stored (``state_format``, ``block_size``, ``min_quant_size``,
        ``decoupled_weight_decay``) from this optimizer.
        """
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        param_groups, state = checked_state(self, state_dict, _STORAGE_KEYS)
        self.__setstate__({"state": state, "param_groups": param_groups})
        self._plans.clear()  # plans point at the replaced state tensors
        self._with_grad.clear()
        self._hp_tensors.clear()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---- hyperparameters as a device tensor: changing them never recompiles, never syncs ---------------
    def _hyperparams(self, group, device: torch.device) -> Tensor:
        """The group's ``(lr, beta1, beta2, eps, weight_decay)`` as a float64 tensor on ``device`` (the input of
        :func:`adam_coefficients`), refilled only where a value changed; a tensor lr on the device is copied
        there without a host sync."""
        values = (group["lr"], group["betas"][0], group["betas"][1], group["eps"], group["weight_decay"])
        cached, hp = self._hp_tensors.setdefault(
            (id(group), device), ([None] * 5, torch.zeros(5, dtype=torch.float64, device=device)))
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

    # ---- the step -----------------------------------------------------------------------------------
    def _params_with_grad(self, group):
        """The group's parameters that have a gradient, and their states (created on first use). The lists
        are reused while the same parameters have gradients: a step costs one pass over the grads."""
        grads = [p.grad for p in group["params"]]
        key = (tuple(map(id, group["params"])), tuple(g is None for g in grads))
        cached = self._with_grad.get(id(group))
        if cached is not None and cached[0] == key:
            # The gradients may be new tensors every step; torch checks that a gradient's dtype is its
            # parameter's, but a sparse one may replace a dense one.
            if all(g is None or g.layout is torch.strided for g in grads):
                return cached[1], cached[2]
        params, states = [], []
        for p, grad in zip(group["params"], grads):
            if grad is None:
                continue
            if is_dtensor(p) != is_dtensor(grad) or (is_dtensor(p) and grad.placements != p.placements):
                raise RuntimeError(f"{type(self).__name__}: a parameter of type {type(p).__name__} with placements "
                                   f"{getattr(p, 'placements', None)} has a gradient of type {type(grad).__name__} "
                                   f"with placements {getattr(grad, 'placements', None)}; they must match")
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if grad.is_complex() or p.is_complex():
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters or gradients")
            state = self.state[p]
            if not state:
                self._init_state(p, group, state)
            params.append(p)
            states.append(state)
        self._with_grad[id(group)] = (key, params, states)
        return params, states

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
        for group in self.param_groups:
            params, states = self._params_with_grad(group)
            rest = range(len(params))
            if params and self._fused:
                plans, rest = plan_group(self._plans.setdefault(id(group), {}), params, states, group["amsgrad"],
                                         self._interpreter)
                for plan in plans:
                    plan.launch(self._hyperparams(group, plan.params[0].device),
                                decoupled=group["decoupled_weight_decay"], maximize=group["maximize"])
            if rest:
                self._step_compiled([params[i] for i in rest], [states[i] for i in rest], group)
        return loss

    def _step_compiled(self, params, states, group) -> None:
        """The per-parameter compiled path: every format, every device. The step counts and Adam's
        coefficients are advanced and computed for all of them at once, per device (a handful of small
        kernels, not a handful per parameter)."""
        by_device: Dict[torch.device, List[int]] = {}
        for i, p in enumerate(params):
            by_device.setdefault(p.device, []).append(i)
        for device, idx in by_device.items():
            steps = [states[i]["step"] for i in idx]
            torch._foreach_add_(steps, 1)
            coefs = adam_coefficients(torch.stack(steps), self._hyperparams(group, device),
                                      group["decoupled_weight_decay"])  # (n, 7) float64
            # The update's compute dtype: fp64 for fp64 parameters, fp32 otherwise (as the fused kernels). Each
            # parameter gets a row, a view at storage offset 8 * (row + 1): dynamo specializes offsets 0 and 1,
            # so a first row at offset 0 would compile a graph of its own.
            coefs = torch.nn.functional.pad(coefs, (0, 0, 1, 0))
            rows64, rows32 = coefs.unbind(0), coefs.to(torch.float32).unbind(0)
            for row, i in enumerate(idx, start=1):
                self._step_one(params[i], states[i], group,
                               rows64[row] if params[i].dtype == torch.float64 else rows32[row])

    def _step_one(self, p: Tensor, state, group, coefs: Tensor) -> None:
        """One parameter on the compiled path, with its row of :func:`adam_coefficients`. A DTensor parameter
        is updated through its local shard and local states (elementwise, with whole blocks on every rank)."""
        p, grad = local(p), local(p.grad)
        if p.numel() == 0:
            return  # an empty shard (more ranks than rows): nothing to update, and no graph to compile for it
        states = [local(state.get(k)) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")]
        # Every parameter, whatever its shape, reuses one compiled graph. (A non-contiguous parameter
        # keeps its shape, and gets a graph of its own.)
        if p.is_contiguous():
            shape = _step_shape(p, states)
            grad = grad if grad.is_contiguous() else grad.contiguous()
            p, grad, states = _alias(p, shape), _alias(grad, shape), [None if s is None else _alias(s, shape)
                                                                      for s in states]
        self._update(p, grad, *states, coefs, decoupled_weight_decay=group["decoupled_weight_decay"],
                     amsgrad=group["amsgrad"], maximize=group["maximize"])


class AdamW(Adam):
    """:class:`Adam` with decoupled weight decay (``torch.optim.AdamW``); ``weight_decay`` defaults to ``1e-2``.

    Args: as :class:`Adam`, without ``decoupled_weight_decay``.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, state_format="dtq8", block_size=None, min_quant_size=4096, compile=True, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         state_format=state_format, block_size=block_size, min_quant_size=min_quant_size,
                         compile=compile, fused=fused, decoupled_weight_decay=True)


class Adam8bit(Adam):
    """:class:`Adam` with the 8-bit dynamic tree state (``state_format="dtq8"``, blocks of 256)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, block_size=None, min_quant_size=4096, compile=True, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, state_format="dtq8",
                         block_size=block_size, min_quant_size=min_quant_size, compile=compile, fused=fused)


class AdamW8bit(AdamW):
    """:class:`AdamW` with the 8-bit dynamic tree state (``state_format="dtq8"``, blocks of 256)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, block_size=None, min_quant_size=4096, compile=True, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, state_format="dtq8",
                         block_size=block_size, min_quant_size=min_quant_size, compile=compile, fused=fused)


AdamDTQ8bit = Adam8bit


def dequantize_state_dict(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of an optimizer ``state_dict`` with every quantized state dequantized to fp32, loadable by
    ``torch.optim.Adam``/``AdamW`` (our private group keys are dropped); a DTensor state (FSDP2) stays a DTensor
    laid out the same way, over its dequantized local shard."""
    ours = {"state_format", "block_size", "min_quant_size"}

    def plain(v):
        if is_dtensor(v) and isinstance(v.to_local(), QuantizedState):  # FSDP2: each rank's rows
            return like_param(v, v.to_local().dequantize(torch.float32))
        return v.dequantize(torch.float32) if isinstance(v, QuantizedState) else v

    state = {idx: {k: plain(v) for k, v in s.items()} for idx, s in state_dict["state"].items()}
    groups = [{k: v for k, v in g.items() if k not in ours} for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}
