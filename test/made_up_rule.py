"""An update rule that exists only for the tests, written after the fused kernels and unknown to them.

It is what a contributor writes for a new rule, in one file (docs/adding-a-rule.md walks through it): the rule's
coefficients, its update in plain tensor code (the compiled path's), the same update in Triton's language and in C,
the :class:`~torchao_optim.rules.FusedRule` that carries them, and an optimizer that uses it. The fused C step and the
Triton kernels must run it with no kernel edit, and store what its compiled path stores, bit for bit.

The rule, momentum with a decaying step size (made up; one state, ``momentum_buffer``, and one option, ``signed``)::

    g = grad + weight_decay * p
    b = momentum * b + (1 - momentum) * g
    p = p - lr / (1 + (t - 1) * lr_decay) * (sign(b) if signed else b)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.optim.base import LowBitOptimizer
from torchao_optim.optim.checks import as_float, check_bool, check_number
from torchao_optim.optim.compiled_path import flat_aliases
from torchao_optim.rules import FusedRule, finite_grad, store_param, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

# The one-state Triton kernel reads four columns.
COEFS = ("step_size", "weight_decay", "momentum", "one_minus_momentum")


def decaying_momentum_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """Rows, float64 ``step.shape + (4,)`` (:data:`COEFS`), from the group's ``(lr, momentum, lr_decay,
    weight_decay)`` and advanced step counts: ``lr / (1 + (t - 1) * lr_decay), weight_decay, momentum,
    1 - momentum``. ``signed`` (the rule's option) changes no row."""
    lr, momentum, lr_decay, weight_decay = hyperparams.unbind()
    step_size = lr / (1 + (step.to(torch.float64) - 1) * lr_decay)
    consts = torch.stack([weight_decay, momentum, 1 - momentum]).expand(step.shape + (3,))
    return torch.cat([step_size.unsqueeze(-1), consts], dim=-1)


def decaying_momentum_update(param, grad, momentum_buffer, coefs, *, signed, maximize, round_key=None) -> None:
    """One step on one parameter, in place; a non-finite gradient element, or one whose buffer would overflow, is
    skipped (parameter and buffer keep their values)."""
    step_size, wd, momentum, one_minus_momentum = coefs.unbind()
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    g, finite = finite_grad(grad, momentum_buffer.dtype, maximize)
    g = g + (wd * p).to(g.dtype)
    b_new = momentum_buffer * momentum + one_minus_momentum * g
    ok = finite & torch.isfinite(b_new)
    b = torch.where(ok, b_new, momentum_buffer)
    momentum_buffer.copy_(b)
    d = torch.sign(b) if signed else b
    store_param(param, torch.where(ok, p - step_size * d, p), round_key)


def decaying_momentum_tile_update(p, g, s, coefs, SIGNED: tl.constexpr, PTX: tl.constexpr):
    """:func:`decaying_momentum_update` on a tile of fp32 values (``s``: the buffer): returns ``(p, s)``."""
    step_size, wd, momentum, one_minus_momentum = coefs
    finite = tl.abs(g) < float("inf")  # NaN is not < inf
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    s_new = s * momentum + one_minus_momentum * g
    ok = finite & (tl.abs(s_new) < float("inf"))
    s = tl.where(ok, s_new, s)
    if SIGNED:
        d = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
    else:
        d = s
    p = tl.where(ok, p - step_size * d, p)
    return p, s


C_UPDATE = r"""
NOINLINE static void decaying_momentum(float *restrict p, const float *restrict g_in, float *restrict s, int n,
                                       const float *c, int use_sign) {
    const float step_size = c[0], wd = c[1], momentum = c[2], one_minus_momentum = c[3];
    for (int i = 0; i < n; i++) {
        float g = g_in[i], pi = p[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        g = g + wd * pi;
        float s_new = s[i] * momentum + one_minus_momentum * g;
        int ok = is_finite(s_new) ? fin : 0;
        float si = keep_if(ok, s_new, s[i]);
        s[i] = si;
        float sign = si > 0.0f ? 1.0f : (si < 0.0f ? -1.0f : 0.0f);
        float d = use_sign ? sign : si;
        p[i] = ok ? pi - step_size * d : pi;
    }
}
"""

DECAYING_MOMENTUM = FusedRule(
    "decaying_momentum",
    ("momentum_buffer",),
    (True,),
    COEFS,
    decaying_momentum_coefficients,
    option="signed",
    triton_update=triton_jit(decaying_momentum_tile_update),
    c_source=C_UPDATE,
    c_name="decaying_momentum",
)


class DecayingMomentum8bit(LowBitOptimizer):
    """The made-up rule's optimizer, its buffer in a low-bit state format.

    Args:
        params (iterable): parameters or dicts defining parameter groups.
        lr (float, optional): learning rate at the first step. Default: ``1e-3``.
        momentum (float, optional): the buffer's decay. Default: ``0.9``.
        lr_decay (float, optional): the step size at step ``t`` is ``lr / (1 + (t - 1) * lr_decay)``. Default: ``0``.
        weight_decay (float, optional): L2 penalty. Default: ``0``.
        signed (bool, optional): move by the buffer's sign rather than the buffer. Default: ``False``.
        maximize (bool, optional): maximize the objective. Default: ``False``.
    """

    STATE_KEYS = ("momentum_buffer",)
    REQUIRED_GROUP_KEYS = ("params", "lr", "momentum", "lr_decay", "weight_decay", "signed")
    update_fn = staticmethod(decaying_momentum_update)

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.9,
        lr_decay=0.0,
        weight_decay=0.0,
        signed=False,
        *,
        maximize=False,
        state_format="dtq8",
        block_size=None,
        min_quant_size=4096,
        compile=True,
        fused=None,
        offload_state=False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            signed=signed,
            maximize=maximize,
            state_format=state_format,
            block_size=block_size,
            min_quant_size=min_quant_size,
        )
        super().__init__(params, defaults, compile=compile, fused=fused, offload_state=offload_state)

    def _check_hyperparams(self, group) -> None:
        check_number("learning rate", group["lr"])
        check_number("momentum value", group["momentum"], 0.0, 1.0)
        for key in ("momentum", "lr_decay", "weight_decay"):
            as_float(group, key)
        for key in ("signed", "maximize"):
            check_bool(group, key)

    def _state_keys(self, group, p=None):
        return ("momentum_buffer",)

    def _hyperparam_values(self, group):
        return (group["lr"], group["momentum"], group["lr_decay"], group["weight_decay"])

    def _coefficients(self, steps, hp, group):
        return decaying_momentum_coefficients(steps, hp)

    def _fused_rule(self, group):
        return DECAYING_MOMENTUM

    def _launch_flags(self, group):
        return dict(maximize=group["maximize"], signed=group["signed"])

    def _step_one(self, p, state, group, coefs, round_key=None) -> None:
        with flat_aliases(p, p.grad, [state["momentum_buffer"]]) as (p, grad, (buf,)):
            self._update(p, grad, buf, coefs, signed=group["signed"], maximize=group["maximize"], round_key=round_key)
