"""Regression: inductor's FX graph cache keys a graph over our state by everything that decides it.

The key once left the shape out, so a graph compiled for one shape was handed to another
(``AssertionError: expected size 64==16384``) when a stock optimizer's step was compiled over our state
for two models in one process.
"""
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import fresh_cache

from torchao_optim import DTQ8bitTensor


def test_cache_key_names_shape_and_layout():
    a = DTQ8bitTensor.zeros((64,), signed=True)
    keys = {a._stable_hash_for_caching()}
    for other in (DTQ8bitTensor.zeros((16384,), signed=True), DTQ8bitTensor.zeros((64,), signed=False),
                  DTQ8bitTensor.zeros((2, 32), signed=True), DTQ8bitTensor.zeros((64,), signed=True, block_size=64)):
        keys.add(other._stable_hash_for_caching())
    assert len(keys) == 5
    assert DTQ8bitTensor.zeros((64,), signed=True)._stable_hash_for_caching() in keys  # data never enters


def _stock_step(p, g, exp_avg, exp_avg_sq):
    # what torch.optim.AdamW(foreach=False) does to its state and parameter, in place
    exp_avg.lerp_(g, 0.1)
    exp_avg_sq.mul_(0.999).addcmul_(g, g, value=0.001)
    p.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(1e-8), value=-1e-3)


def test_stock_step_compiled_for_two_shapes_with_the_fx_graph_cache():
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True):
        for n in (64, 16384, 64):
            torch._dynamo.reset()  # a new process would start here: only the FX graph cache remembers
            g = torch.randn(n)
            states = [DTQ8bitTensor.from_float(torch.randn(n) * 0.1, signed=True),
                      DTQ8bitTensor.from_float(torch.rand(n) * 0.1, signed=False)]
            eager_states = [s.clone() for s in states]
            p, p_eager = torch.randn(n), None
            p_eager = p.clone()
            torch.compile(_stock_step, fullgraph=True, dynamic=False)(p, g, *states)
            _stock_step(p_eager, g, *eager_states)
            # compiled lerp_ rounds once (an fma) where eager rounds twice: equal up to that rounding, so a
            # value within an ulp of a decision boundary may take the neighbouring code
            for s, e in zip(states, eager_states):
                torch.testing.assert_close(s.absmax, e.absmax, rtol=1e-6, atol=0)
                differ = s.codes != e.codes
                assert differ.float().mean() < 1e-3
                assert ((s.codes.int() - e.codes.int()).abs()[differ] <= 1).all()
            torch.testing.assert_close(p, p_eager)
