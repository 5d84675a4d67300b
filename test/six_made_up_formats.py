"""Six more made-up formats and their shared test cases, run by test_registry.py in a pytest process of their own.

They show that formats added one after another never break the suite: ten formats (these and the built-in
ones) pass the shared cases in one process, with names up to 32 characters and blocks from 32 to 4096
elements. Registered only there: every registered format is also crossed with every optimizer of the conformance
table (test_conformance.py), which would add minutes to every other test run.
"""

import torch

from torchao_optim.state import CodebookState, StateLayout, register_state_format
from torchao_optim.testing import StateFormatTestCase


class PowerGridTensor(CodebookState):
    """Codes of an even grid on [-1, 1] (``signed=True``) or [0, 1] raised to ``power`` (denser near 0 where
    ``power`` > 1), ``bits`` per code; the unsigned grid's 0 is never taken by a positive value."""

    attr_fields = ("signed", "block_size")
    bits = 8
    power = 1.0

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        return super()._attrs(block_size=block_size, signed=bool(signed), **attrs)

    @classmethod
    def layout(cls, *, signed, block_size):
        levels = 2**cls.bits - 1 if signed else 2**cls.bits  # signed: an odd count, so that 0 is a level
        t = torch.linspace(-1.0 if signed else 0.0, 1.0, levels, dtype=torch.float64)
        codebook = tuple(sorted(set((t.sign() * t.abs() ** cls.power).float().tolist())))
        return StateLayout(
            codes="codes",
            scales="absmax",
            block_size=block_size,
            bits=cls.bits,
            codebook=codebook,
            never_zero=not signed,
        )


def max_error(layout: StateLayout) -> float:
    """The largest round-trip error of a codebook, as a fraction of the block's absmax: half its widest gap, or
    its smallest positive value where ``never_zero`` rounds a tiny positive value up to it."""
    book = layout.codebook
    error = max(b - a for a, b in zip(book, book[1:])) / 2
    return max(error, min(v for v in book if v > 0)) if layout.never_zero else error


FORMATS = {  # name (at most 32 characters): (bits, block size, power)
    "test_uniform8_b32": (8, 32, 1.0),
    "test_square4_b64": (4, 64, 2.0),
    "test_cubic8_b256": (8, 256, 3.0),
    "test_uniform4_b1024": (4, 1024, 1.0),
    "test_power_one_and_a_half8_b2048": (8, 2048, 1.5),
    "test_square8_block_4096_elements": (8, 4096, 2.0),
}

for _name, (_bits, _block, _power) in FORMATS.items():
    _title = "".join(part.title() for part in _name.split("_")[1:])
    # at module level under its own name, so that pickle and torch.load find the class
    _fmt = globals()[f"{_title}Tensor"] = register_state_format(_name)(
        type(
            f"{_title}Tensor",
            (PowerGridTensor,),
            {"bits": _bits, "power": _power, "default_block_size": _block, "__module__": __name__},
        )
    )
    globals()[f"Test{_title}"] = type(
        f"Test{_title}",
        (StateFormatTestCase,),
        {
            "format_name": _name,
            "block_size": _block,
            "__module__": __name__,
            "max_error": {s: max_error(_fmt.layout(signed=s, block_size=_block)) for s in (True, False)},
        },
    )
