"""The fused path's coefficient kernel computes rules.adam.adam_coefficients (then rounded to fp32).

Runs on CUDA, or in Triton's interpreter on a machine without one (test/conftest.py sets it up)."""

import pytest
import torch

from torchao_optim.optim.fused import fused_available
from torchao_optim.rules import ADAM, adam_coefficients

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not fused_available(DEVICE), reason="needs Triton (CUDA or its interpreter)")


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize(
    "hp", [(1e-3, 0.9, 0.999, 1e-8, 1e-2), (0.3, 0.5, 0.95, 1e-3, 0.0), (2e-5, 0.0, 0.9999, 0.0, 0.1)]
)
def test_coefficients_kernel_matches_adam_coefficients(decoupled, hp):
    adam_coefs_kernel = ADAM.triton_coefficients()
    # step counts before the launch (the kernel advances them): small, large, and up to fp32's exact integers
    steps = torch.tensor([0, 1, 2, 9, 99, 999, 12345, 99999, 1_000_000, 2**24 - 1], dtype=torch.float32, device=DEVICE)
    hyperparams = torch.tensor(hp, dtype=torch.float64, device=DEVICE)
    coefs = torch.empty(len(steps), 7, dtype=torch.float32, device=DEVICE)
    expected = adam_coefficients(steps + 1, hyperparams, decoupled).to(torch.float32)
    out_steps = steps.clone()
    adam_coefs_kernel[(1,)](out_steps, hyperparams, coefs, len(steps), DECOUPLED=decoupled, N_POW2=16)
    torch.testing.assert_close(out_steps, steps + 1, rtol=0, atol=0)
    # The constants are the same fp64 expressions rounded once: equal. The two per-step columns come from
    # beta**t by squaring (a few fp64 ulps from torch's pow): equal after rounding to fp32 but for a rare
    # tie, so allow one fp32 ulp.
    torch.testing.assert_close(coefs[:, 2:], expected[:, 2:], rtol=0, atol=0)
    torch.testing.assert_close(coefs[:, :2], expected[:, :2], rtol=1.2e-7, atol=0)
