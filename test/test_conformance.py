"""Every registered state format (and plain fp32 state, "none") on every executor passes the optimizer
conformance case: one generated test class per (format, executor), nothing listed by hand. Fused classes skip
where the fused executor cannot run; without CUDA it runs in Triton's interpreter (conftest.py)."""
import made_up_formats  # noqa: F401  (registers the test-only formats, so that they are covered too)

from torchao_optim import list_state_formats
from torchao_optim.testing import OptimizerConformanceCase

# Formats coarser than the case's 8-bit bound: (mean, max) of |p - p_ref| / sum(lr). Measured over the case's
# parity and lr-schedule runs, either executor: test_cubic8 mean 0.0126, max 0.35 (its cubic codebook is coarser
# than dtq8's near the top); test_linear4 mean 0.27, max 0.79 (an even 4-bit grid rounds small exp_avg_sq values
# up to 1/15 of the block's absmax, so small-gradient elements barely move). Bounds at 2-2.4x. The 4-bit bound
# cannot see a 10% lr error (its fp32-state parameter can); its exact checks carry the weight.
PARITY_TOLERANCE = {"test_cubic8": (0.03, 0.8), "test_linear4": (0.6, 1.6)}


def _class_name(fmt: str, executor: str) -> str:
    return "Test" + "".join(part.title() for part in fmt.split("_")) + executor.title()


for _fmt in ["none"] + list_state_formats():
    for _executor in ("compiled", "fused"):
        _attrs = {"format_name": _fmt, "executor": _executor, "__module__": __name__}
        if _fmt in PARITY_TOLERANCE:
            _attrs["parity_tolerance"] = PARITY_TOLERANCE[_fmt]
        _name = _class_name(_fmt, _executor)
        globals()[_name] = type(_name, (OptimizerConformanceCase,), _attrs)
