"""SGD with momentum (``torch.optim.SGD``): the rule's coefficients, its update in plain tensor code, and
:data:`SGD`, the rule as the fused kernels take it: with the same update in Triton's language
(``sgd_tile_update``) and in C.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the state may be plain or any format, non-finite
gradient elements are skipped (parameter and state keep their values), and so is an element whose new state
would overflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, store_param, triton_jit

if TYPE_CHECKING:  # bound by triton_jit when a kernel first asks (Triton is not imported before)
    import triton.language as tl

__all__ = ["SGD", "SGD_COEFS", "sgd_coefficients", "sgd_update"]

SGD_COEFS = ("lr", "weight_decay", "momentum", "grad_coef")


def sgd_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, nesterov: bool = False) -> torch.Tensor:
    """SGD's rows, float64 ``step.shape + (4,)`` in the order of :data:`SGD_COEFS`, from the group's
    ``(lr, momentum, dampening, weight_decay)``. ``grad_coef`` is ``1 - dampening``, except at a parameter's
    first step, where torch.optim.SGD sets the buffer to the gradient itself (the buffer is zero then, so
    ``momentum * 0 + 1 * g`` is that, exactly). ``nesterov`` (the rule's option) changes no row."""
    lr, momentum, dampening, weight_decay = hyperparams.unbind()
    first = step.to(torch.float64) <= 1
    grad_coef = torch.where(first, torch.ones_like(dampening), 1 - dampening)
    consts = torch.stack([lr, weight_decay, momentum]).expand(step.shape + (3,))
    return torch.cat([consts, grad_coef.unsqueeze(-1)], dim=-1)


def sgd_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    coefs: torch.Tensor,
    *,
    nesterov: bool,
    maximize: bool,
    round_key: torch.Tensor | None = None,
) -> None:
    """One ``torch.optim.SGD`` step on one parameter, in place (``momentum_buffer`` None: momentum 0)."""
    lr, wd, momentum, grad_coef = coefs.unbind()
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    g, finite = finite_grad(grad, momentum_buffer.dtype if momentum_buffer is not None else p.dtype, maximize)
    g = g + (wd * p).to(g.dtype)
    ok = finite
    if momentum_buffer is not None:
        buf_new = momentum_buffer * momentum + grad_coef * g
        ok = finite & torch.isfinite(buf_new)
        buf = torch.where(ok, buf_new, momentum_buffer)
        momentum_buffer.copy_(buf)
        g = g + momentum * buf if nesterov else buf
    store_param(param, torch.where(ok, p - lr * g, p), round_key)


def sgd_tile_update(p, g, s, coefs, NESTEROV: tl.constexpr, PTX: tl.constexpr):
    """:func:`~torchao_optim.rules.sgd.sgd_update` on a tile (``s``: the momentum buffer): returns ``(p, s)``."""
    lr, wd, momentum, grad_coef = coefs
    finite = tl.abs(g) < float("inf")  # a non-finite gradient element is skipped (NaN is not < inf)
    g = tl.where(finite, g, 0.0)
    g = g + wd * p
    s_new = s * momentum + grad_coef * g
    ok = finite & (tl.abs(s_new) < float("inf"))
    s = tl.where(ok, s_new, s)
    if NESTEROV:
        d = g + momentum * s
    else:
        d = s
    p = tl.where(ok, p - lr * d, p)
    return p, s


# Its element update in C (FusedRule.c_source), built into the C step by kernels/cpu.py.
_C_UPDATE = r"""
static inline __attribute__((always_inline)) void sgd_loop(float *restrict p, const float *restrict g_in,
                                                          float *restrict s, int n, const float *c, int nesterov) {
    const float lr = c[0], wd = c[1], momentum = c[2], grad_coef = c[3];
    for (int i = 0; i < n; i++) {
        float g = g_in[i], pi = p[i];
        int fin = is_finite(g);
        g = fin ? g : 0.0f;
        g = g + wd * pi;
        float s_new = s[i] * momentum + grad_coef * g;
        int ok = fin & is_finite(s_new);
        float si = keep_if(ok, s_new, s[i]);
        s[i] = si;
        float d = nesterov ? g + momentum * si : si;
        p[i] = ok ? pi - lr * d : pi;
    }
}

ONE_STATE_BY_OPTION(sgd, sgd_loop)
"""


SGD = FusedRule(
    "sgd",
    ("momentum_buffer",),
    (True,),
    SGD_COEFS,
    sgd_coefficients,
    option="nesterov",
    triton_update=triton_jit(sgd_tile_update),
    c_source=_C_UPDATE,
    c_name="sgd",
)
