"""AdEMAMix8bit beyond the conformance case: its argument checks, the paper's alpha and beta3 schedulers in the
coefficient rows, and its states (its fused C step: test_cpu_step.py; its path: test_explain.py)."""

import math

import pytest
import torch

from torchao_optim import AdEMAMix8bit
from torchao_optim.rules import ADEMAMIX_COEFS, ademamix_coefficients


def params(*shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes or ((64, 96), (50,))]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1e-3), r"Invalid learning rate: -0\.001"),
        (dict(betas=(0.9, 0.999)), r"betas must be a triple \(beta1, beta2, beta3\), got \(0\.9, 0\.999\)"),
        (dict(betas=(0.9, 0.999, 1.0)), r"Invalid beta parameter at index 2: 1\.0"),
        (dict(betas=(-0.1, 0.999, 0.9999)), r"Invalid beta parameter at index 0: -0\.1"),
        (dict(alpha=-5.0), r"Invalid alpha value: -5\.0"),
        (dict(t_alpha=0), r"Invalid t_alpha: 0 \(a positive number of steps, or None for no scheduler\)"),
        (dict(t_beta3=-10), r"Invalid t_beta3: -10"),
        (dict(t_alpha="100"), r"Invalid t_alpha: '100'"),
        (dict(betas=(0.0, 0.999, 0.9999), t_beta3=100), r"Invalid betas: .* t_beta3=100 .*beta1 > 0 and beta3 > 0"),
        (dict(eps=-1e-8), r"Invalid epsilon value: -1e-08"),
        (dict(weight_decay=-0.01), r"Invalid weight_decay value: -0\.01"),
        (dict(maximize="no"), r"Invalid maximize: 'no'"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdEMAMix8bit(params(), **kwargs)


def test_a_bad_param_group_is_refused_and_not_added():
    opt = AdEMAMix8bit(params())
    with pytest.raises(ValueError, match=r"param group 1: Invalid beta parameter at index 2: 1\.5"):
        opt.add_param_group({"params": params((3,)), "betas": (0.9, 0.999, 1.5)})
    assert len(opt.param_groups) == 1


def _row(t, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=0, t_beta3=0, eps=1e-8, weight_decay=1e-2):
    hp = torch.tensor([lr, *betas, alpha, t_alpha, t_beta3, eps, weight_decay], dtype=torch.float64)
    return dict(zip(ADEMAMIX_COEFS, ademamix_coefficients(torch.tensor([float(t)]), hp)[0].tolist()))


def test_coefficients_without_schedulers():
    row = _row(3)
    assert row["inv_bias_correction1"] == pytest.approx(1 / (1 - 0.9**3), rel=1e-15)
    assert row["inv_bias_correction2_sqrt"] == pytest.approx(1 / math.sqrt(1 - 0.999**3), rel=1e-15)
    assert row["alpha"] == 5.0
    assert row["one_minus_beta3"] == pytest.approx(1e-4, rel=1e-12)
    assert row["decay"] == pytest.approx(1 - 1e-5, rel=1e-15)
    assert (row["lr"], row["eps"], row["beta2"]) == (1e-3, 1e-8, 0.999)


def test_alpha_warms_up_linearly_over_t_alpha_steps():
    alphas = [_row(t, t_alpha=4)["alpha"] for t in (1, 2, 3, 4, 5, 100)]
    assert alphas == pytest.approx([1.25, 2.5, 3.75, 5.0, 5.0, 5.0], rel=1e-15)


def test_beta3_follows_the_papers_scheduler():
    """From beta1 towards beta3 along the paper's curve, which makes the slow EMA's half-life ln(0.5) / ln(beta3(t))
    grow linearly in t, then beta3 from t_beta3 on."""
    beta1, beta3, t_beta3 = 0.9, 0.9999, 1000
    b3 = {
        t: 1 - _row(t, betas=(beta1, 0.999, beta3), t_beta3=t_beta3)["one_minus_beta3"]
        for t in (1, 250, 500, 1000, 2000)
    }
    half = {t: math.log(0.5) / math.log(b) for t, b in b3.items()}
    h1, h3 = math.log(0.5) / math.log(beta1), math.log(0.5) / math.log(beta3)
    for t in (1, 250, 500):
        assert half[t] == pytest.approx(h1 + (h3 - h1) * t / t_beta3, rel=1e-6)
    assert b3[1000] == pytest.approx(beta3, abs=1e-15)
    assert b3[2000] == beta3
    assert b3[1] > beta1


def test_three_states_the_second_moment_unsigned():
    ps = params()
    opt = AdEMAMix8bit(ps, min_quant_size=256, compile=False)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    assert set(opt.state[ps[0]]) == {"step", "exp_avg", "exp_avg_slow", "exp_avg_sq"}
    layout = {k: opt.state[ps[0]][k].fast_path_layout() for k in ("exp_avg", "exp_avg_slow", "exp_avg_sq")}
    assert [min(layout[k].codebook) < 0 for k in layout] == [True, True, False]  # nu on the unsigned map
