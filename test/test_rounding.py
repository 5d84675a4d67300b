"""Stochastic rounding to bf16: unbiased, reproducible, and the same bits from torch and from the kernels."""

import pytest
import torch

from torchao_optim.optim.fused import fused_available
from torchao_optim.quant.rounding import rounding_key, stochastic_round_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n).pow(torch.rand(n, generator=g))
    # exact bf16 values, values one fp32 ulp either side of them, zeros, extremes
    exact = x.to(torch.bfloat16).to(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.3895e38, -3.3895e38, 1e-40, -1e-40])
    return torch.cat([x, exact, torch.nextafter(exact, exact + 1), torch.nextafter(exact, exact - 1), special])


def test_result_is_a_neighbour_and_exact_values_stay():
    x = _values(20000)
    y = stochastic_round_bf16(x, rounding_key(torch.tensor(5), torch.tensor(11.0))).to(torch.float32)
    down = x.to(torch.bfloat16).to(torch.float32)  # nearest; the neighbours bracket x
    lower = torch.where(
        down <= x,
        down,
        torch.nextafter(down.to(torch.bfloat16), torch.tensor(-float("inf"), dtype=torch.bfloat16)).to(torch.float32),
    )
    upper = torch.where(
        down >= x,
        down,
        torch.nextafter(down.to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).to(torch.float32),
    )
    finite = torch.isfinite(y)
    assert bool(((y == lower) | (y == upper))[finite].all())
    exact = x == down
    assert torch.equal(y[exact], x[exact])


@pytest.mark.parametrize("value", [1.0 + 1e-3, -1.0 - 3e-3, 1000.2, 3.0e-20])
def test_unbiased(value):
    # 2**18 draws of one value: the mean is the value within 4 standard errors of a two-point distribution
    n = 1 << 18
    x = torch.full((n,), value)
    y = stochastic_round_bf16(x, rounding_key(torch.tensor(0), torch.tensor(1.0))).to(torch.float64)
    lo, hi = y.min().item(), y.max().item()
    assert lo != hi  # both neighbours occur
    p = (value - lo) / (hi - lo)
    stderr = (hi - lo) * (p * (1 - p) / n) ** 0.5
    assert abs(y.mean().item() - torch.tensor(value).item()) < 4 * stderr + 1e-12 * abs(value)


def test_keys_differ_by_parameter_and_step_and_are_reproducible():
    x = torch.full((4096,), 1.0 + 1e-3)
    runs = {
        (i, s): stochastic_round_bf16(x, rounding_key(torch.tensor(i), torch.tensor(float(s))))
        for i in range(3)
        for s in range(1, 4)
    }
    for a in runs:
        for b in runs:
            assert torch.equal(runs[a], runs[b]) == (a == b)
    assert torch.equal(runs[(1, 2)], stochastic_round_bf16(x, rounding_key(torch.tensor(1), torch.tensor(2.0))))


@pytest.mark.skipif(not fused_available(DEVICE), reason="needs Triton (CUDA or its interpreter)")
@pytest.mark.parametrize("param_index,step", [(0, 1.0), (7, 12345.0), (2**31 + 5, 2.0**24)])
def test_kernels_draw_the_same_bits(param_index, step):
    from torchao_optim.kernels.triton_rounding import stochastic_round_bf16_triton

    x = _values(30000, seed=param_index % 97)
    expected = stochastic_round_bf16(x, rounding_key(torch.tensor(param_index), torch.tensor(step)))
    got = stochastic_round_bf16_triton(x.to(DEVICE), param_index, torch.tensor([step], device=DEVICE))
    assert torch.equal(got.cpu().view(torch.int16), expected.view(torch.int16))
