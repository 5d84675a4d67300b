"""Every one-state optimizer (SGD8bit, Lion8bit, Muon8bit) in every registered state format (and fp32 state,
"none") on each executor it has passes the rule conformance case: one generated class per (optimizer, format,
executor), nothing listed by hand. Fused classes skip where the fused executor cannot run; without CUDA they run
in Triton's interpreter (conftest.py)."""
import made_up_formats  # noqa: F401  (registers the test-only formats, so that they are covered too)

from torchao_optim import list_state_formats
from torchao_optim.testing import RULES, RuleConformanceCase


def _class_name(rule: str, fmt: str, executor: str) -> str:
    return "Test" + "".join(part.title() for part in (rule + "_" + fmt).split("_")) + executor.title()


for _rule, _spec in RULES.items():
    for _fmt in ["none"] + list_state_formats():
        for _executor in _spec.executors:
            _name = _class_name(_rule, _fmt, _executor)
            globals()[_name] = type(_name, (RuleConformanceCase,), {
                "rule": _rule, "format_name": _fmt, "executor": _executor, "__module__": __name__})
