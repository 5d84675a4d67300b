"""A shared test case that fails says, in one message, everything that failed: the optimizer, format and executor,
every shape that failed, what was measured and the bound. Checked here by running the cases with bounds that
cannot hold, on purpose."""

import itertools
import re
import unittest

import pytest
import test_conformance as conformance

from torchao_optim import AdamW
from torchao_optim.testing import ConformanceCase, StateFormatTestCase, optim_db

ADAMW = next(info for info in optim_db if info.name == "adamw")


def failure(case: unittest.TestCase) -> str:
    """The failure message of running ``case`` (a test case instance), which must fail."""
    result = unittest.TestResult()
    case.run(result)
    assert len(result.failures) == 1 and not result.errors, result.errors
    return result.failures[0][1]


def test_parity_failure_names_every_shape_with_its_measure_and_bound():
    case = ConformanceCase(ADAMW, ADAMW.samples[0], "dtq8", "eager", parity_tolerance=(1e-4, 1e-3))
    with pytest.raises(AssertionError) as failed:
        conformance.test_matches_reference(case)
    message = str(failed.value)
    assert "adamw, format 'dtq8', executor 'eager': 4 failed" in message
    for shape in ("(4, 128)", "(3, 100)"):
        assert re.search(
            rf"parity, shape {re.escape(shape)}: mean \|p - p_ref\| / sum\(lr\) [0-9.e-]+, bound 0.0001", message
        ), message
        assert re.search(
            rf"parity, shape {re.escape(shape)}: max \|p - p_ref\| / sum\(lr\) [0-9.e-]+, bound 0.001", message
        ), message


def test_exact_resume_failure_names_every_shape_and_difference():
    class ResumedWithOtherBlocks(ConformanceCase):
        calls = itertools.count()

        def optimizer(self, params, lr=None):
            if next(self.calls) % 2 == 0:
                return super().optimizer(params, lr)
            # the resumed optimizer keeps its own block size (a storage setting): its states are laid out anew
            return AdamW(
                params,
                lr=self.lr,
                weight_decay=0.1,
                block_size=64,
                compile=False,
                fused=False,
                min_quant_size=self.min_quant_size,
            )

    with pytest.raises(AssertionError) as failed:
        conformance.test_exact_resume(ResumedWithOtherBlocks(ADAMW, ADAMW.samples[0], "dtq8", "eager"))
    message = str(failed.value)
    assert "adamw, format 'dtq8', executor 'eager': 6 failed" in message
    for shape in ("(4, 128)", "(3, 100)"):
        assert re.search(
            rf"shape {re.escape(shape)}: the resumed parameter against the one that went on: \d+ of "
            rf"\d+ elements differ, by up to [0-9.e-]+; bound: bit-identical",
            message,
        ), message
        assert f"shape {shape}: exp_avg_sq: attributes {{'signed': False, 'block_size': 64}} against" in message


def test_round_trip_failure_names_format_every_shape_and_bound():
    class TightFormat(StateFormatTestCase):
        format_name = "fp8"
        max_error = {True: 1e-3, False: 1e-3}

    TightFormat.setUpClass()
    message = failure(TightFormat("test_from_float_round_trip_error"))
    assert "format 'fp8' (block_size=256): 8 failed" in message
    for signed, shape in itertools.product((True, False), ("(4096,)", "(16, 256)", "(1000, 3)", "(300,)")):
        assert re.search(
            rf"signed={signed}, shape {re.escape(shape)}: \d+ of \d+ blocks over the bound; the worst, "
            rf"block \d+, has a round-trip error of [0-9.e-]+ of its absmax \([0-9.e-]+\), bound "
            rf"max_error=0.001",
            message,
        ), message
