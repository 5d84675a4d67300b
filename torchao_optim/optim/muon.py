"""Muon with its momentum buffer in low bits, and AdamW (low-bit too) for the parameters Muon is not for.

Muon (Keller Jordan et al., 2024) orthogonalizes the momentum of each 2-D parameter with a few Newton-Schulz
iterations. The elementwise half (the momentum buffer and the Nesterov direction) is a fused rule
(:data:`~torchao_optim.rules.MUON`): one launch over every matrix of a group updates the quantized buffers and writes
the directions, in fp32, into a buffer of the plan's; each is then orthogonalized and its parameter updated. On the
per-parameter path (``fused=False``, a format the kernels do not read) it is the compiled
:func:`~torchao_optim.rules.muon.muon_momentum`, the same arithmetic. The orthogonalization is ``torch.optim.Muon``'s
own function where this torch has one, otherwise :func:`newton_schulz` below, which computes the same thing (bit for
bit on the CPU: tested against torch's where both exist).

A matrix sharded by rows (FSDP2's ``Shard(0)``, HSDP's ``(Replicate(), Shard(0))``) keeps its momentum sharded:
each rank updates its rows' quantized buffer. The orthogonalization needs the whole matrix: each rank's rows of
the direction (fp32) are gathered onto the rank that owns the matrix's orthogonalization (round-robin over the
ranks that split the rows, in parameter order), Newton-Schulz runs there, and each rank receives its rows of the
result (bf16, as Newton-Schulz returns it): :func:`~torchao_optim.optim.sharded.map_whole`, once per step for every
such matrix of a group, whichever path computed its rows' direction. docs/distributed.md gives the bytes moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from torchao_optim.optim.base import LowBitOptimizer
from torchao_optim.optim.checks import as_float, check_bool, check_number, check_storage, number
from torchao_optim.optim.compiled import CompiledOrEager
from torchao_optim.optim.compiled_path import flat_aliases, round_keys
from torchao_optim.optim.sharded import is_dtensor, local, map_whole, row_shard_dim
from torchao_optim.rules import (
    ADAM,
    MUON,
    adam_coefficients,
    adam_update,
    muon_coefficients,
    muon_momentum,
    split_direction,
    store_param,
)

__all__ = ["Muon8bit", "MuonRules", "newton_schulz", "orthogonalize"]

# The quintic's coefficients and step count from the Muon authors (Keller Jordan's post and reference code).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(
    g: Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS
) -> Tensor:
    """An approximately orthogonal matrix with ``g``'s singular vectors (2-D ``g``), in bf16: ``X = g / ||g||_F``
    (the wide orientation, so that ``X @ X.T`` is the smaller Gram matrix), then ``steps`` times
    ``A = X X^T;  X = a X + (b A + c A A) X``. The coefficients are chosen for a steep slope at 0, not for
    convergence: singular values end up in about [0.7, 1.2], which trains as well as exact orthogonalization."""
    if g.dim() != 2:
        raise ValueError(f"Newton-Schulz orthogonalizes 2-D matrices, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalize(g: Tensor, coefficients, steps: int, eps: float) -> Tensor:
    """``torch.optim.Muon``'s orthogonalization where this torch has it, else :func:`newton_schulz`."""
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz
    except ImportError:
        return newton_schulz(g, tuple(coefficients), steps, eps)
    return _zeropower_via_newtonschulz(g, tuple(coefficients), steps, eps)


@dataclass(frozen=True)
class MuonRules:
    """A Muon8bit group's fused rules, by parameter (``optim.fused.rule_for``): :data:`MUON` for a matrix Muon
    orthogonalizes, :data:`ADAM` for the AdamW fallback's. ``use_muon``: the group's setting."""

    use_muon: bool | None

    def __call__(self, p: Tensor):
        return MUON if (self.use_muon if self.use_muon is not None else p.dim() == 2) else ADAM


def _rows_split(p: Tensor) -> bool:
    """Whether ``p`` is a DTensor whose rows are split across ranks (its orthogonalization gathers it)."""
    return is_dtensor(p) and row_shard_dim(p.placements) is not None


def lr_ratio(shape, adjust_lr_fn: str | None) -> float:
    """torch.optim.Muon's lr adjustment for a (rows, cols) parameter: ``sqrt(max(1, rows / cols))`` ("original",
    the default) or ``0.2 * sqrt(max(rows, cols))`` ("match_rms_adamw": AdamW's update RMS, Moonshot's)."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


class Muon8bit(LowBitOptimizer):
    r"""Muon with its momentum buffer stored in a low-bit state format; AdamW for every other parameter.

    For each 2-D parameter (``torch.optim.Muon``'s algorithm):

    .. code-block:: text

        B = momentum * B + (1 - momentum) * g
        O = NS(g + momentum * (B - g))   (NS(B) without nesterov): Newton-Schulz orthogonalization
        p = p * (1 - lr * weight_decay) - lr * ratio(shape) * O

    Parameters that are not 2-D (biases, norms; and any group with ``use_muon=False``, such as embeddings and
    the output layer, which the Muon authors leave to AdamW) are updated by AdamW with ``adamw_betas`` and
    ``adamw_eps``, the group's ``lr`` and ``weight_decay``, and low-bit ``exp_avg``/``exp_avg_sq``: give them
    a group of their own with AdamW's lr. A non-finite gradient element keeps its buffer and parameter, and
    counts as 0 in the direction (the orthogonalization mixes every element of the matrix).

    Under FSDP2 and HSDP (matrices sharded by rows, ``Shard(0)``), each rank keeps and updates the momentum of its
    own rows; each matrix's direction is gathered onto one rank (round-robin in parameter order), orthogonalized
    there and scattered back by rows, so that training is that of one process (docs/distributed.md). Every rank
    must step the same matrices in the same order, as FSDP2's do. Other shardings of a matrix Muon orthogonalizes
    (``Shard(1)``, rows split along two mesh dimensions) are refused (``ValueError``) when the group is added.

    Args:
        params (iterable): parameters or dicts defining parameter groups (a group may set ``use_muon``).
        lr (float or Tensor, optional): learning rate. Default: ``1e-3``.
        weight_decay (float, optional): decoupled weight decay. Default: ``0.1``.
        momentum (float, optional): momentum factor. Default: ``0.95``.
        nesterov (bool, optional): Nesterov momentum. Default: ``True``.
        ns_coefficients (Tuple[float, float, float], optional): the quintic's ``(a, b, c)``.
            Default: ``(3.4445, -4.775, 2.0315)``.
        eps (float, optional): the norm's floor in the orthogonalization. Default: ``1e-7``.
        ns_steps (int, optional): Newton-Schulz iterations. Default: ``5``.
        adjust_lr_fn (str, optional): ``None``/``"original"`` or ``"match_rms_adamw"``. Default: ``None``.
        adamw_betas (Tuple[float, float], optional): the AdamW fallback's betas. Default: ``(0.9, 0.95)``.
        adamw_eps (float, optional): the AdamW fallback's eps. Default: ``1e-8``.
        use_muon (bool, optional): ``None``: Muon for 2-D parameters, AdamW for the rest; ``False``: AdamW for
            all the group's parameters; ``True``: Muon, and every parameter must be 2-D. Default: ``None``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
        state_format (str, optional): a registered format or ``"none"``. Default: ``"dtq8"``.
        block_size (int, optional): elements per quantization block; ``None`` takes the format's default.
        min_quant_size (int, optional): smaller parameters keep fp32 state. Default: ``4096``.
        compile (bool, optional): compile each per-parameter update with ``torch.compile``; falls back to eager
            mode, with one warning, where compiling fails. Default: ``True``.
        fused (bool, optional): the matrices' momentum and the AdamW fallback take the fused kernels (``None`` or
            ``True``: the Triton kernels on CUDA, the fused C step on the CPU; ``False``: the compiled path), one
            launch per plan; the orthogonalization's matrix products follow, per matrix. Default: ``None``.
        foreach (bool, optional): accepted for torch.optim compatibility; it changes nothing. Default: ``None``.
        capturable (bool, optional): ``True`` is refused (``ValueError``): Muon's step is not one fused launch (its
            orthogonalization runs after the kernels).
            Default: ``False``.
        differentiable (bool, optional): ``True`` is refused (``ValueError``). Default: ``False``.
        bf16_stochastic_round (bool, optional): write bf16 parameters with stochastic rounding, as
            :class:`Adam`. Default: ``False``.
        offload_state (bool, optional): ``True`` is refused (``ValueError``): the offloaded step streams chunks of
            state through kernels that write parameters, and Muon's writes directions.
            Default: ``False``.
    """

    STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    UNSIGNED_STATE_KEYS = ("exp_avg_sq",)
    REQUIRED_GROUP_KEYS = ("params", "lr", "momentum", "weight_decay", "nesterov")
    STEP_OPTIONAL = True
    update_fn = staticmethod(muon_momentum)

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        use_muon: bool | None = None,
        maximize: bool = False,
        state_format: str = "dtq8",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        compile: bool = True,
        fused: bool | None = None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        bf16_stochastic_round: bool = False,
        offload_state: bool = False,
    ) -> None:
        if capturable:
            raise ValueError(
                "Muon8bit(capturable=True) is not supported: the step is not one fused launch (the "
                "orthogonalization runs after the kernels)"
            )
        if offload_state:
            raise ValueError(
                "Muon8bit(offload_state=True) is not supported: offloaded state is streamed through "
                "kernels that write parameters, and Muon's kernel writes the directions it orthogonalizes"
            )
        check_storage(block_size, min_quant_size)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            use_muon=use_muon,
            maximize=maximize,
            state_format=state_format,
            block_size=block_size,
            min_quant_size=min_quant_size,
        )
        self._check_hyperparams(dict(defaults, params=[]))
        super().__init__(
            params,
            defaults,
            compile=compile,
            fused=fused,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            bf16_stochastic_round=bf16_stochastic_round,
            offload_state=offload_state,
        )

    def _setup(self, compile, fused, foreach=None, capturable=False, offload_state=False) -> None:
        super()._setup(compile, fused, foreach, capturable, offload_state)
        self._adam_update = CompiledOrEager(adam_update, enabled=self._compile)
        self._owner_orders = None  # (the param groups, id(matrix) -> its order): see _owner_order
        self._split_pending: list = []  # the compiled path's directions of matrices split by rows (_step_params)

    def _check_hyperparams(self, group) -> None:
        check_number("learning rate", group["lr"])
        for key in ("weight_decay", "eps", "adamw_eps"):
            check_number(f"{key} value", group[key])
            as_float(group, key)
        check_number("momentum value", group["momentum"], 0.0, 1.0)
        as_float(group, "momentum")
        betas = group["adamw_betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"adamw_betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            check_number(f"adamw_betas[{i}]", beta, 0.0, 1.0)
        group["adamw_betas"] = tuple(number("adamw_betas", b, tensor_ok=True) for b in betas)
        coefficients = group["ns_coefficients"]
        if not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3):
            raise ValueError(f"ns_coefficients must be three numbers (a, b, c), got {coefficients!r}")
        steps = group["ns_steps"]
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 < steps < 100:
            raise ValueError(f"Invalid ns_steps: {steps!r} (an int in [1, 99])")
        if group["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (None, 'original' or 'match_rms_adamw')")
        for key in ("nesterov", "maximize"):
            check_bool(group, key)
        if group["use_muon"] not in (None, True, False):
            raise ValueError(f"Invalid use_muon: {group['use_muon']!r} (None, True or False)")
        if group["use_muon"]:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"use_muon=True: Muon updates 2-D parameters only, got shape {tuple(p.shape)}")
        for p in group["params"]:
            # Checked here, not in step(): a step that fails on a matrix would have updated the others
            if self._uses_muon(group, p) and is_dtensor(p):
                try:
                    row_shard_dim(p.placements)
                except ValueError:
                    raise ValueError(
                        f"Muon8bit cannot orthogonalize the parameter of shape {tuple(p.shape)} sharded as "
                        f"{tuple(p.placements)}: it gathers matrices split by rows along one mesh dimension "
                        f"(Shard(0), every other mesh dimension Replicate()). Give it to the AdamW fallback "
                        f"(use_muon=False in its param group)"
                    ) from None

    def _uses_muon(self, group, p: Tensor) -> bool:
        return group["use_muon"] if group["use_muon"] is not None else p.dim() == 2

    def _state_keys(self, group, p=None):
        if p is None:
            return ()
        return ("momentum_buffer",) if self._uses_muon(group, p) else ("exp_avg", "exp_avg_sq")

    def _hyperparam_values(self, group):
        b1, b2 = group["adamw_betas"]
        return (group["lr"], group["momentum"], group["weight_decay"], b1, b2, group["adamw_eps"])

    def _fused_rule(self, group):
        """Each parameter's rule (:class:`MuonRules`): Muon's momentum for the matrices it orthogonalizes, Adam's for
        the AdamW fallback's parameters."""
        return MuonRules(group["use_muon"])

    def _launch_settings(self, group, device, rule):
        """Muon's ``(lr, momentum, weight_decay)`` and its option for :data:`MUON`; AdamW's ``(lr, beta1, beta2, eps,
        weight_decay)``, in the order Adam's kernels read, for the fallback."""
        lr, momentum, weight_decay, b1, b2, eps = self._hyperparams(group, device).unbind()
        if rule is MUON:
            flags = dict(nesterov=group["nesterov"], maximize=group["maximize"])
            return torch.stack([lr, momentum, weight_decay]), flags
        return torch.stack([lr, b1, b2, eps, weight_decay]), dict(decoupled=True, maximize=group["maximize"])

    def _finish_step(self, group, plans) -> None:
        """The matrices of ``plans`` (Muon's), whose momentum the kernels have updated and whose directions they
        wrote, and those whose rows are split across ranks that the compiled path left (``_split_pending``): each
        direction orthogonalized and its parameter updated as on the compiled path. The split ones are gathered
        together (:meth:`_orthogonalize_split`), whichever path computed their rows' direction."""
        split, self._split_pending = self._split_pending, []
        for plan in plans:
            steps = [s["step"] for s in plan.states]
            keys = round_keys(self, plan.params, steps, group, plan.coefs.device)
            for i, (p, written) in enumerate(zip(plan.params, plan.directions)):
                direction, ok = split_direction(written)
                key = keys[i + 1] if keys is not None and p.dtype == torch.bfloat16 else None
                if _rows_split(p):
                    split.append((p, direction, ok, plan.coefs[i], key))
                    continue
                ortho = orthogonalize(direction, group["ns_coefficients"], group["ns_steps"], group["eps"])
                self._apply(p, ortho, ok, plan.coefs[i], group, key)
        if split:
            self._orthogonalize_split(group, split)

    def _coefficients(self, steps, hp, group):
        """Muon's 4 columns, then AdamW's 7 (:func:`adam_coefficients`): each parameter reads its rule's."""
        lr, momentum, weight_decay, b1, b2, eps = hp.unbind()
        muon = muon_coefficients(steps, torch.stack([lr, momentum, weight_decay]))
        adam = adam_coefficients(steps, torch.stack([lr, b1, b2, eps, weight_decay]), True)
        return torch.cat([muon, adam], dim=-1)

    def _step_params(self, group, params, states, coefs, round_keys) -> None:
        """Each parameter's :meth:`_step_one`, but for the matrices whose rows are split across ranks: their momentum
        and direction on the local rows, left in ``_split_pending`` for :meth:`_finish_step` to orthogonalize."""
        split = [self._uses_muon(group, p) and _rows_split(p) for p in params]
        rest = [i for i, s in enumerate(split) if not s]
        super()._step_params(*([group] + [[items[i] for i in rest] for items in (params, states, coefs, round_keys)]))
        for i in (i for i, s in enumerate(split) if s):
            p, row = params[i], coefs[i]
            shard = local(p)
            dtype = torch.promote_types(p.dtype, torch.float32)  # the direction's, on every rank alike (fused: fp32)
            direction, ok = shard.new_zeros(shard.shape, dtype=dtype), shard.new_zeros(shard.shape, dtype=torch.bool)
            if shard.numel():  # (an empty shard has no rows, but a part in the gather and the scatter)
                with flat_aliases(None, p.grad, [states[i]["momentum_buffer"]]) as (_, grad, (buf,)):
                    direction, ok = self._update(
                        grad, buf, row[:4], nesterov=group["nesterov"], maximize=group["maximize"]
                    )
                direction, ok = direction.reshape(shard.shape).to(dtype), ok.reshape(shard.shape)
            self._split_pending.append((p, direction, ok, row, round_keys[i]))

    def _owner_order(self, p: Tensor) -> int:
        """``p``'s position among the optimizer's sharded matrices that Muon orthogonalizes, in parameter order:
        its orthogonalization's owner is this, modulo the ranks that split its rows (every rank computes the
        same, also when parameters step one at a time in backward)."""
        groups = tuple(self.param_groups)
        cached = self._owner_orders
        if cached is None or len(cached[0]) != len(groups) or any(a is not b for a, b in zip(cached[0], groups)):
            sharded = (q for g in groups for q in g["params"] if self._uses_muon(g, q) and is_dtensor(q))
            cached = self._owner_orders = (groups, {id(q): i for i, q in enumerate(sharded)})
        return cached[1][id(p)]

    def _orthogonalize_split(self, group, split: list) -> None:
        """Muon on matrices split by rows, from each rank's ``(matrix, direction of its rows, ok, coefficient row,
        rounding key)``: the directions gathered onto each matrix's owner, orthogonalized there, and each rank's rows
        of the result scattered back (:func:`map_whole`); then each rank's rows of the parameter updated. The same
        numbers as one process: the momentum is elementwise, the orthogonalization the same function of the same
        matrix, the update elementwise. Every rank holds the same matrices (FSDP2 steps the same parameters on every
        rank); they are taken in their owners' order, whichever path computed each rank's direction."""
        split = sorted(split, key=lambda item: self._owner_order(item[0]))
        params = [item[0] for item in split]

        def ns(whole, i):
            return orthogonalize(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])

        owners = [self._owner_order(p) for p in params]
        # Newton-Schulz returns bf16 (it computes in bf16): the rows scattered back are bf16, exactly
        orthos = map_whole(params, [item[1] for item in split], ns, owners, torch.bfloat16)
        for (p, _, ok, row, key), ortho in zip(split, orthos):
            if ortho.numel():
                self._apply(p, ortho, ok, row, group, key)

    def _apply(self, p: Tensor, ortho: Tensor, ok: Tensor, coefs: Tensor, group, round_key) -> None:
        """``p``'s local tensor from its rows of the orthogonalized direction: decayed, then moved by lr times the
        ratio of ``p``'s (global) shape; elements that are not ``ok`` kept."""
        shard = local(p)
        x = shard.to(torch.promote_types(p.dtype, torch.float32))
        new = x * coefs[1] - (coefs[0] * lr_ratio(p.shape, group["adjust_lr_fn"])) * ortho.to(x.dtype)
        store_param(shard, torch.where(ok, new, x), round_key)

    def _step_one(self, p: Tensor, state, group, coefs: Tensor, round_key=None) -> None:
        if not self._uses_muon(group, p):
            with flat_aliases(p, p.grad, [state["exp_avg"], state["exp_avg_sq"]]) as (param, grad, states):
                self._adam_update(
                    param,
                    grad,
                    *states,
                    None,
                    coefs[4:],
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    maximize=group["maximize"],
                    round_key=round_key,
                )
            return
        # a whole matrix: a plain tensor, or a DTensor every rank holds whole (replicated)
        shape = local(p).shape
        with flat_aliases(None, p.grad, [state["momentum_buffer"]]) as (_, grad, (buf,)):
            direction, ok = self._update(grad, buf, coefs[:4], nesterov=group["nesterov"], maximize=group["maximize"])
        ortho = orthogonalize(direction.reshape(shape), group["ns_coefficients"], group["ns_steps"], group["eps"])
        self._apply(p, ortho, ok.reshape(shape), coefs, group, round_key)
