"""Every registered state format (and plain fp32 state, "none") on every executor passes the optimizer
conformance case: one generated test class per (format, executor), nothing listed by hand. Fused classes skip
where the fused executor cannot run; without CUDA it runs in Triton's interpreter (conftest.py)."""

import made_up_formats  # noqa: F401  (registers the test-only formats, so that they are covered too)

from torchao_optim import get_state_format, list_state_formats
from torchao_optim.testing import OptimizerConformanceCase
from torchao_optim.testing.optimizer_case import EXECUTORS, compiled_or_eager

# Formats coarser than the case's 8-bit bound: (mean, max) of |p - p_ref| / sum(lr). Measured over the case's
# parity and lr-schedule runs, either executor: test_cubic8 mean 0.0126, max 0.35 (its cubic codebook is coarser
# than dtq8's near the top); test_linear4 mean 0.27, max 0.79 (an even 4-bit grid rounds small exp_avg_sq values
# up to 1/15 of the block's absmax, so small-gradient elements barely move). Bounds at 2-2.4x. The 4-bit bound
# cannot see a 10% lr error (its fp32-state parameter can); its exact checks carry the weight.
# 4bit: mean 0.237, max 0.762 (its 4-bit exp_avg is the coarse part: 16 levels); 4bit_rank1: mean 0.138, max 0.697
# (these gradients' magnitudes vary by e^4 within a block, which rank-1 scales follow better). Bounds at 2-2.2x.
# test_grid8: mean 0.115, max 0.70 (its exp_avg_sq grid, (i + 1) / 256, rounds small values up to 1/256 of the
# block's absmax, as test_linear4's). Bounds at 2.1-2.2x.
PARITY_TOLERANCE = {
    "test_cubic8": (0.03, 0.8),
    "test_linear4": (0.6, 1.6),
    "test_grid8": (0.25, 1.5),
    "4bit": (0.5, 1.6),
    "4bit_rank1": (0.3, 1.5),
}


def _fusable(fmt: str) -> bool:
    """Whether the format describes both of Adam's states of a matrix as a StateLayout (the fused executor's
    input). A format that does not (rank-1 scales) has no fused executor to conform to: its fused class would
    only test the compiled path again."""
    if fmt == "none":
        return True
    cls = get_state_format(fmt)
    return all(cls.zeros((4, 128), signed=signed).fast_path_layout() is not None for signed in (True, False))


def _class_name(fmt: str, executor: str) -> str:
    return "Test" + "".join(part.title() for part in fmt.split("_")) + executor.title()


# Without CUDA (CI), the compiled executor runs for fp32 state, dtq8 and a made-up codebook format (a format
# written after the library compiles), and for the formats no fused executor covers; the others run the same
# update eagerly (testing.optimizer_case.compiled_or_eager says why). With CUDA, every format runs compiled.
COMPILED_ON_CPU = {"none", "dtq8", "test_cubic8"}


def _executors(fmt: str):
    if not _fusable(fmt):
        return ("compiled",)
    return (compiled_or_eager(fmt, COMPILED_ON_CPU),) + tuple(e for e in EXECUTORS if e not in ("compiled", "eager"))


for _fmt in ["none"] + list_state_formats():
    for _executor in _executors(_fmt):
        _attrs = {"format_name": _fmt, "executor": _executor, "__module__": __name__}
        if _fmt in PARITY_TOLERANCE:
            _attrs["parity_tolerance"] = PARITY_TOLERANCE[_fmt]
        _name = _class_name(_fmt, _executor)
        globals()[_name] = type(_name, (OptimizerConformanceCase,), _attrs)
