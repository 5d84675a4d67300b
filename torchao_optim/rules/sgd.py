"""SGD with momentum (``torch.optim.SGD``): the rule's coefficients, its update in plain tensor code, and
:data:`SGD`, the rule as the fused kernels take it.

In the same form as Adam's (:mod:`torchao_optim.rules.adam`): the state may be plain or any format, non-finite
gradient elements are skipped (parameter and state keep their values), and so is an element whose new state
would overflow.
"""

from __future__ import annotations

import functools

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, store_param

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


@functools.cache  # imported once: a launch asks for it every step
def _triton_update():
    from torchao_optim.rules.triton_updates import sgd_tile_update

    return sgd_tile_update


SGD = FusedRule(
    "sgd",
    ("momentum_buffer",),
    (True,),
    SGD_COEFS,
    sgd_coefficients,
    option="nesterov",
    triton_update=_triton_update,
    c_name="sgd",
)
