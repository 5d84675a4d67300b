"""Adam and AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019): the rule's coefficients, its update in plain tensor
code that does not know the state's format, and :data:`ADAM`, the rule as the fused kernels take it.

The states may be plain fp32 tensors or any :class:`~torchao_optim.state.QuantizedState`: reading one
(``lerp``, ``mul``, ``where``) dequantizes it, ``copy_`` into it requantizes. Under ``torch.compile`` the
dequantize -> update -> requantize chain of one parameter fuses into one kernel. An element whose new ``m`` or
``v`` would overflow the state's dtype (a finite gradient beyond about 5.8e20 in fp32) is skipped as a
non-finite gradient element is (:mod:`torchao_optim.rules.base`).
"""

from __future__ import annotations

import functools

import torch

from torchao_optim.rules.base import FusedRule, finite_grad, store_param

__all__ = ["ADAM", "COEFS", "adam_coefficients", "adam_update"]


# Columns of the coefficient table both executors read, one row per parameter.
COEFS = ("step_size", "inv_bias_correction2_sqrt", "weight_decay", "one_minus_beta1", "beta2", "one_minus_beta2", "eps")


def adam_coefficients(step: torch.Tensor, hyperparams: torch.Tensor, decoupled_weight_decay: bool) -> torch.Tensor:
    """Adam's per-step coefficients for parameters at step counts ``step`` (any shape, already advanced).

    ``hyperparams`` is the group's ``(lr, beta1, beta2, eps, weight_decay)`` as a float64 tensor on the
    step's device. Returns float64 ``step.shape + (7,)`` (executors take them in their compute dtype) in the
    order of :data:`COEFS`: ``lr / (1 - beta1**t)``,
    ``1 / sqrt(1 - beta2**t)``, the weight-decay coefficient (``1 - lr * weight_decay`` for AdamW, the L2
    factor for Adam), then ``1 - beta1, beta2, 1 - beta2, eps``.

    Computed once per group and step, in float64 like torch.optim's Python-float arithmetic (``1 - beta2``
    from an fp32 beta2 would be off by 1e-5 relative), and handed to either executor: the compiled
    per-element update and the fused kernel never evaluate a power per element, and a tensor lr on the
    device never needs a host sync.
    """
    t = step.to(torch.float64)
    lr, beta1, beta2, eps, weight_decay = hyperparams.unbind()
    wd = 1 - lr * weight_decay if decoupled_weight_decay else weight_decay
    consts = torch.stack([wd, 1 - beta1, beta2, 1 - beta2, eps])  # (5,)
    per_step = torch.stack([lr / (1 - beta1**t), (1 - beta2**t).rsqrt()], dim=-1)  # step.shape + (2,)
    return torch.cat([per_step, consts.expand(per_step.shape[:-1] + (5,))], dim=-1)


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    coefs: torch.Tensor,
    *,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
    round_key: torch.Tensor | None = None,
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step on one parameter, in place (``round_key``: see
    :func:`store_param`).

    ``coefs`` is this parameter's row of :func:`adam_coefficients` (7,), in the compute dtype: changing a
    hyperparameter changes data, never the compiled graph.
    """
    step_size, inv_bc2, wd, one_minus_beta1, beta2, one_minus_beta2, eps = coefs.unbind()
    # State arithmetic in the state's dtype (fp32, or fp64 for the plain state of fp64 parameters); the
    # parameter's arithmetic in fp32, or fp64 for fp64 parameters, so that no update smaller than an fp32
    # ulp of the parameter is lost.
    g, finite = finite_grad(grad, exp_avg.dtype, maximize)
    p = param.to(torch.promote_types(param.dtype, torch.float32))
    if decoupled_weight_decay:
        p_decayed = p * wd
    else:
        g = g + (wd * p).to(g.dtype)
        p_decayed = p

    m_new = exp_avg + one_minus_beta1 * (g - exp_avg)
    # ((1 - beta2) * g) * g: finite for |g| up to sqrt(max / (1 - beta2)) (5.8e20 in fp32 with beta2 = 0.999)
    v_new = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    # An element whose new moment overflows is skipped as a non-finite gradient is. torch.optim would store
    # Inf there (and never move the element again); a quantized state cannot hold Inf, and the largest code
    # it would saturate to is the block's largest finite value: a small v under a huge m.
    ok = finite & torch.isfinite(m_new) & torch.isfinite(v_new)
    m = torch.where(ok, m_new, exp_avg)
    v = torch.where(ok, v_new, exp_avg_sq)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if amsgrad:
        v = torch.maximum(max_exp_avg_sq, v)
        max_exp_avg_sq.copy_(v)

    denom = v.sqrt() * inv_bc2 + eps
    p_new = p_decayed - step_size * (m / denom)
    store_param(param, torch.where(ok, p_new, p), round_key)


@functools.cache  # imported once: a launch asks for it every step
def _triton_update():
    from torchao_optim.rules.triton_updates import adam_tile_update

    return adam_tile_update


@functools.cache
def _triton_coefficients():
    from torchao_optim.rules.triton_updates import adam_coefs_kernel

    return adam_coefs_kernel


ADAM = FusedRule(
    "adam",
    ("exp_avg", "exp_avg_sq"),
    (True, False),
    COEFS,
    adam_coefficients,
    option="decoupled",
    triton_update=_triton_update,
    triton_coefficients=_triton_coefficients,
    c_name="adam",
)
