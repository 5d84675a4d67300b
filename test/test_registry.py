import pytest

from torchao_optim import (DTQ8bitTensor, FourBitRank1Tensor, FourBitTensor, Fp8Tensor, get_state_format,
                           list_state_formats, register_state_format)
from torchao_optim.state import QuantizedState


def test_builtin_formats():
    builtin = {"dtq8": DTQ8bitTensor, "4bit": FourBitTensor, "4bit_rank1": FourBitRank1Tensor, "fp8": Fp8Tensor}
    assert set(builtin) <= set(list_state_formats())
    for name, cls in builtin.items():
        assert get_state_format(name) is cls and cls.format_name == name


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError, match=r"unknown state format 'nope'.*dtq8"):
        get_state_format("nope")


def test_register_rejects_bad_input():
    with pytest.raises(ValueError, match="already registered"):
        register_state_format("dtq8")(type("Other", (QuantizedState,), {}))
    with pytest.raises(TypeError, match="QuantizedState subclass"):
        register_state_format("plain")(int)
    with pytest.raises(ValueError, match="'none'"):
        register_state_format("none")
