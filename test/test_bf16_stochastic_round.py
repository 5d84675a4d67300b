"""``bf16_stochastic_round=True`` on every optimizer of ours: bf16 parameters updated by less than half an ulp
drift as the fp32 update says (within 10% of the ideal), the same bits on the fused and the compiled path,
reproducible, exact on resume, and no effect on other dtypes. The fused path runs in Triton's interpreter on
a CPU (conftest.py)."""

import io

import pytest
import torch

from torchao_optim import AdamW, Lion8bit, SGD8bit
from torchao_optim.optim.fused import fused_available

# (class, options, the per-step update a constant gradient of 1 gives): AdamW's update is lr once m and v
# have settled (they are exact in every format: a block of equal values), Lion's is lr, SGD's lr * grad
LR = 1e-4  # at 1.0 a bf16 ulp is 2**-7: the update is 1/78 of it
CASES = {
    "AdamW": (AdamW, dict(weight_decay=0.0, eps=1e-12)),
    "SGD8bit": (SGD8bit, dict(momentum=0.9, dampening=0.9)),  # buffer 1 - 0.9**t ... -> updates of lr * grad
    "Lion8bit": (Lion8bit, dict()),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = pytest.mark.skipif(
    not fused_available("cpu") and not torch.cuda.is_available(),
    reason="the fused executor needs Triton (its interpreter on a CPU)",
)


def _params(dtype=torch.bfloat16, device=DEVICE):
    # a quantized matrix (8192 elements; min_quant_size 4096) and a vector in plain state (4000 elements)
    return [
        torch.nn.Parameter(torch.ones(64, 128, dtype=dtype, device=device)),
        torch.nn.Parameter(torch.full((4000,), -2.0, dtype=dtype, device=device)),
    ]


def _train(name, params, steps, fused=False, sr=True, opt=None, state=None):
    cls, kw = CASES[name]
    if opt is None:
        opt = cls(params, lr=LR, fused=fused, bf16_stochastic_round=sr, **kw)
    if state is not None:
        opt.load_state_dict(state)
    for _ in range(steps):
        for p in params:
            p.grad = torch.full_like(p, -1.0)  # every update moves the parameter up by the same amount
        opt.step()
    return opt


@pytest.mark.parametrize("name", list(CASES))
def test_small_updates_drift_as_in_fp32(name):
    # on the default executor (the fused step: C on a CPU, Triton on CUDA); the compiled path draws the same bits
    # (test_cpu_step.py, test_fused_and_compiled_round_the_same below)
    steps = 100
    drift = {}
    for sr in (False, True):
        params = _params()
        _train(name, params, steps, fused=None, sr=sr)
        drift[sr] = (params[0].float().mean().item() - 1.0, params[1].float().mean().item() + 2.0)
    # the ideal: what fp32 parameters move under the same optimizer
    ref = _params(torch.float32)
    _train(name, ref, steps, fused=None, sr=False)
    ideal = (ref[0].mean().item() - 1.0, ref[1].mean().item() + 2.0)
    assert ideal[0] > 0.5 * LR * steps  # the case really moves the parameters
    assert drift[False] == (0.0, 0.0)  # round-to-nearest loses every update
    # round-ups are rare events (about 1.3 per element over the run at 1.0, 0.64 at 2.0): the means of 8192
    # and 4000 elements carry 1-2% of noise, well inside 10%
    assert drift[True][0] == pytest.approx(ideal[0], rel=0.10)
    assert drift[True][1] == pytest.approx(ideal[1], rel=0.10)


@FUSED
@pytest.mark.parametrize(
    # the rounding is one function of the template for every rule; CI compiles AdamW's step only (about 15 s a rule
    # on a 2-core CPU), the momentum kernel's rules under --runslow
    "name",
    [n if n == "AdamW" else pytest.param(n, marks=pytest.mark.slow) for n in CASES],
)
def test_fused_and_compiled_round_the_same(name):
    out = []
    for fused in (False, True):
        params = _params()
        _train(name, params, 4, fused=fused)
        out.append([p.detach().clone() for p in params])
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(CASES))
def test_reproducible_and_exact_on_resume(name):
    whole = _params()
    _train(name, whole, 6)
    again = _params()
    _train(name, again, 6)
    assert all(torch.equal(a, b) for a, b in zip(whole, again))  # no generator: the same bits every run

    first = _params()
    opt = _train(name, first, 3)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = [torch.nn.Parameter(p.clone().to(DEVICE)) for p in ckpt["params"]]
    cls, kw = CASES[name]
    opt2 = cls(resumed, lr=LR, bf16_stochastic_round=True, **kw)
    _train(name, resumed, 3, opt=opt2, state=ckpt["opt"])
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))


def test_parameters_round_differently_and_fp32_is_untouched():
    params = _params()
    _train("AdamW", params, 10)
    # two parameters (or elements) never share their random bits: the rows of the matrix differ
    assert not all(torch.equal(params[0][0], params[0][i]) for i in range(1, 64))
    with_sr, without = _params(torch.float32), _params(torch.float32)
    _train("AdamW", with_sr, 5, sr=True)
    _train("AdamW", without, 5, sr=False)
    assert all(torch.equal(a, b) for a, b in zip(with_sr, without))


def test_a_bad_value_is_refused_by_name():
    with pytest.raises(ValueError, match="bf16_stochastic_round"):
        AdamW(_params(), bf16_stochastic_round="yes")
    opt = AdamW(_params())
    with pytest.raises(ValueError, match="bf16_stochastic_round"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "bf16_stochastic_round": 1})
