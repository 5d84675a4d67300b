"""A format whose scales are not per block of the optimizer's block size (here: one absmax per row, whatever block
size is asked for) resumes exactly from a checkpoint with no edit under torchao_optim/optim/: the optimizer
asks the format (``QuantizedState.matches_layout``) whether a loaded state is laid out as it would store a new
one, and keeps its codes."""

import pytest
import torch

from torchao_optim import AdamW
from torchao_optim.quant import dynamic_map_values
from torchao_optim.state import CodebookState, StateLayout, register_state_format, registry
from torchao_optim.testing import save_load
from torchao_optim.testing.compare import same_tensor_problems


class RowScale8Tensor(CodebookState):
    """8-bit codes of the dynamic map (whose signed map has no -1.0), one fp32 absmax per row: each row (the last
    dimension; a vector is one row) is one block, whatever ``block_size`` an optimizer asks for."""

    attr_fields = ("signed", "block_size")

    @classmethod
    def _attrs(cls, signed=None, block_size=None, **attrs):
        return super()._attrs(block_size=block_size, signed=bool(signed), **attrs)

    @staticmethod
    def row_attrs(shape, attrs):
        shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
        return dict(attrs, block_size=max(shape[-1], 1) if len(shape) else 1)

    @classmethod
    def zeros(cls, shape, **attrs):
        return super().zeros(shape, **cls.row_attrs(shape, attrs))

    @classmethod
    def from_float(cls, x, **attrs):
        return super().from_float(x, **cls.row_attrs(x.shape, attrs))

    @classmethod
    def layout(cls, *, signed, block_size):
        return StateLayout(
            codes="codes",
            scales="absmax",
            block_size=block_size,
            codebook=dynamic_map_values(signed),
            never_zero=not signed,
        )

    @classmethod
    def matches_layout(cls, value, *, signed, block_size):
        # the block size follows from the shape, not from what the optimizer asks for
        return type(value) is cls and value.attrs() == cls._attrs(**cls.row_attrs(value.shape, {"signed": signed}))


@pytest.fixture
def row_format():
    """The format registered as "test_row8" for one test: registered for good, it would enroll in the generated
    conformance classes of the test files collected after this one."""
    register_state_format("test_row8")(RowScale8Tensor)
    yield "test_row8"
    del registry._FORMATS["test_row8"]


def test_row_scales_resume_exactly(row_format):
    shapes = [(6, 100), (3, 320), (50,)]
    gen = torch.Generator().manual_seed(0)
    first = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]

    def make(params):  # eager: the layout decision is the executor's input, whichever runs
        return AdamW(params, lr=1e-2, state_format=row_format, min_quant_size=0, compile=False, fused=False)

    def train(opt, params, steps):
        for g in steps:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()

    opt = make(first)
    train(opt, first, grads[:2])
    for p, shape in zip(first, shapes):
        assert opt.state[p]["exp_avg"].absmax.shape == ((shape[0],) if len(shape) == 2 else (1,))  # a scale per row
    ckpt = save_load({"params": [p.detach() for p in first], "opt": opt.state_dict()})
    resumed = [torch.nn.Parameter(t.clone()) for t in ckpt["params"]]
    opt2 = make(resumed)
    opt2.load_state_dict(ckpt["opt"])
    for p, q in zip(resumed, first):  # loaded as saved: the codes kept, not requantized
        for key in ("exp_avg", "exp_avg_sq"):
            problems = same_tensor_problems(opt2.state[p][key], opt.state[q][key], f"loaded {key} of {tuple(p.shape)}")
            assert not problems, "\n".join(problems)
    train(opt, first, grads[2:])
    train(opt2, resumed, grads[2:])
    for p, q in zip(resumed, first):
        assert torch.equal(p, q), tuple(p.shape)
        for key in ("exp_avg", "exp_avg_sq"):
            problems = same_tensor_problems(opt2.state[p][key], opt.state[q][key], f"{key} of {tuple(p.shape)}")
            assert not problems, "\n".join(problems)
