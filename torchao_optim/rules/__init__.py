"""Update rules: each written once in plain tensor code that does not know the state's format, and described as
data (:class:`FusedRule`) for the fused kernels. Imports no optimizer and no kernel; Triton only in
``triton_updates.py``, which a rule's ``triton_update`` imports when a Triton kernel first needs it."""

from torchao_optim.rules.adagrad import ADAGRAD, ADAGRAD_COEFS, adagrad_coefficients, adagrad_update
from torchao_optim.rules.adam import ADAM, COEFS, adam_coefficients, adam_update
from torchao_optim.rules.ademamix import ADEMAMIX_COEFS, ademamix_coefficients, ademamix_update
from torchao_optim.rules.base import FusedRule, finite_grad, store_param
from torchao_optim.rules.lion import LION, LION_COEFS, lion_coefficients, lion_update
from torchao_optim.rules.muon import MUON_COEFS, muon_coefficients, muon_momentum
from torchao_optim.rules.rmsprop import (
    RMSPROP,
    RMSPROP_COEFS,
    RMSPROP_MOMENTUM,
    RMSPROP_MOMENTUM_COEFS,
    rmsprop_coefficients,
    rmsprop_update,
)
from torchao_optim.rules.sgd import SGD, SGD_COEFS, sgd_coefficients, sgd_update

__all__ = [
    "FusedRule",
    "ADAM",
    "SGD",
    "LION",
    "ADAGRAD",
    "RMSPROP",
    "RMSPROP_MOMENTUM",
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
    "finite_grad",
    "store_param",
]
