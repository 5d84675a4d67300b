"""Update rules, one file each: its plain tensor update, which does not know the state's format, its per-step
coefficients, and the rule as the fused kernels take it (:class:`FusedRule`), with its element update in Triton's
language (made a ``@triton.jit`` function when a Triton kernel first asks for it: importing a rule imports no
Triton) and in C (source text the C step is built with). Imports no optimizer and no kernel."""

from torchao_optim.rules.adagrad import ADAGRAD, ADAGRAD_COEFS, adagrad_coefficients, adagrad_update
from torchao_optim.rules.adam import ADAM, ADAM_AMSGRAD, COEFS, adam_coefficients, adam_update
from torchao_optim.rules.ademamix import ADEMAMIX, ADEMAMIX_COEFS, ademamix_coefficients, ademamix_update
from torchao_optim.rules.base import OUTPUTS, FusedRule, finite_grad, split_direction, sqrt_rn, store_param, triton_jit
from torchao_optim.rules.lion import LION, LION_COEFS, lion_coefficients, lion_update
from torchao_optim.rules.muon import MUON, MUON_COEFS, muon_coefficients, muon_momentum
from torchao_optim.rules.rmsprop import (
    RMSPROP,
    RMSPROP_CENTERED,
    RMSPROP_CENTERED_MOMENTUM,
    RMSPROP_COEFS,
    RMSPROP_MOMENTUM,
    RMSPROP_MOMENTUM_COEFS,
    rmsprop_coefficients,
    rmsprop_update,
)
from torchao_optim.rules.sgd import SGD, SGD_COEFS, sgd_coefficients, sgd_update

# The package's fused rules: the C step is built with theirs once (kernels/cpu.py); another rule gets a build of its
# own on first use.
BUILT_IN_RULES = (
    ADAM,
    SGD,
    LION,
    ADAGRAD,
    RMSPROP,
    RMSPROP_MOMENTUM,
    ADAM_AMSGRAD,
    RMSPROP_CENTERED,
    RMSPROP_CENTERED_MOMENTUM,
    ADEMAMIX,
    MUON,
)

__all__ = [
    "FusedRule",
    "BUILT_IN_RULES",
    "ADAM",
    "SGD",
    "LION",
    "ADAGRAD",
    "RMSPROP",
    "RMSPROP_MOMENTUM",
    "ADAM_AMSGRAD",
    "RMSPROP_CENTERED",
    "RMSPROP_CENTERED_MOMENTUM",
    "ADEMAMIX",
    "MUON",
    "COEFS",
    "SGD_COEFS",
    "LION_COEFS",
    "MUON_COEFS",
    "ADAGRAD_COEFS",
    "RMSPROP_COEFS",
    "RMSPROP_MOMENTUM_COEFS",
    "ADEMAMIX_COEFS",
    "adam_coefficients",
    "adam_update",
    "sgd_coefficients",
    "sgd_update",
    "lion_coefficients",
    "lion_update",
    "adagrad_coefficients",
    "adagrad_update",
    "rmsprop_coefficients",
    "rmsprop_update",
    "ademamix_coefficients",
    "ademamix_update",
    "muon_coefficients",
    "muon_momentum",
    "OUTPUTS",
    "finite_grad",
    "split_direction",
    "store_param",
    "sqrt_rn",
    "triton_jit",
]
