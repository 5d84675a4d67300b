import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchao_optim import (
    DTQ8bitTensor,
    Factored4Tensor,
    FactoredTensor,
    FourBitRank1Tensor,
    FourBitTensor,
    Fp8Tensor,
    get_state_format,
    list_state_formats,
    register_state_format,
)
from torchao_optim.state import QuantizedState


def test_builtin_formats():
    builtin = {"dtq8": DTQ8bitTensor, "4bit": FourBitTensor, "4bit_rank1": FourBitRank1Tensor, "fp8": Fp8Tensor}
    builtin.update(factored=FactoredTensor, factored4=Factored4Tensor)
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


# The six formats' shared cases take about 30 s each on a 2-core CPU (each compiles its step): CI runs those of
# the smallest and the largest block, with all six registered; --runslow runs every format's.
SIX_IN_CI = "Uniform8B32 or Square8Block4096Elements"


@pytest.mark.parametrize("which", [SIX_IN_CI, pytest.param("", marks=pytest.mark.slow, id="all")])
def test_six_more_formats_pass_the_shared_cases_in_one_process(which):
    """Formats added one after another never break the suite: six more made-up formats (names up to 32
    characters, blocks of 32 to 4096 elements; test/six_made_up_formats.py) pass every shared case in one pytest
    process, with all six registered. In a process of its own: the registry keeps what is registered, and each
    registered format would be crossed with every optimizer of the conformance table (test_conformance.py)."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]))
    select = ["-k", which] if which else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select, str(here / "six_made_up_formats.py")],
        env=env,
        cwd=here.parent,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
