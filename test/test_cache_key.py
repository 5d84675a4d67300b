"""The compile caches key a graph over our state by everything that decides it: a graph compiled for one
shape is never handed to another, in one process (a stock optimizer's step compiled over our state for two
models) or from the cache on disk to the next process (a rank-1 state's row count is the size of an inner
tensor only, which the cache's guards never see: a graph specialized on it failed with
``expected size 768==1152`` in the next training run).
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import fresh_cache

import torchao_optim
from torchao_optim import DTQ8bitTensor

ROOT = Path(__file__).resolve().parent.parent


def test_cache_key_names_shape_and_layout():
    a = DTQ8bitTensor.zeros((64,), signed=True)
    keys = {a._stable_hash_for_caching()}
    for other in (
        DTQ8bitTensor.zeros((16384,), signed=True),
        DTQ8bitTensor.zeros((64,), signed=False),
        DTQ8bitTensor.zeros((2, 32), signed=True),
        DTQ8bitTensor.zeros((64,), signed=True, block_size=64),
    ):
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
            states = [
                DTQ8bitTensor.from_float(torch.randn(n) * 0.1, signed=True),
                DTQ8bitTensor.from_float(torch.rand(n) * 0.1, signed=False),
            ]
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


# ---- the optimizer's compiled step, over processes that share one cache directory ------------------------------

LR = 1e-3
# One matrix size, four ways: rows equal to the block count (a 128-column matrix at block size 128), fewer rows
# than blocks, and two row counts with the same rows + columns (the size of 4bit_rank1's maxima).
MATRICES = [[128, 1152], [1152, 128], [256, 576], [576, 256]]


def step_compiled_and_eager(fmt, block_size, shapes, steps=2):
    """AdamW on parameters of ``shapes`` (in one group, so one compiled graph unless they need more), ``steps``
    steps compiled (the per-parameter compiled path) and uncompiled from the same start and gradients. Returns
    what differs beyond the compiled graph's rounding (a fused multiply-add), as lines; empty if nothing."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(steps)]
    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile that fell back to eager mode compares nothing
        for compile in (True, False):
            params = [torch.nn.Parameter(t.clone()) for t in init]
            opt = torchao_optim.AdamW(
                params, lr=LR, state_format=fmt, block_size=block_size, min_quant_size=0, fused=False, compile=compile
            )
            for step_grads in grads:
                for p, g in zip(params, step_grads):
                    p.grad = g.clone()
                opt.step()
            runs.append((params, opt))
    (ours, opt), (ref, ref_opt) = runs
    problems = []
    for p, q in zip(ours, ref):
        what = f"{fmt} block_size={block_size} shape {tuple(p.shape)}"
        err = (p - q).abs().max().item()
        if err > 1e-3 * LR:  # measured up to 1.2e-7 (rounding); a wrong state moves elements by about LR
            problems.append(f"{what}: parameter differs by {err:.3g} (bound {1e-3 * LR:.3g})")
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][key].dequantize(), ref_opt.state[q][key].dequantize()
            differ = (a != b).float().mean().item()
            if differ > 1e-3:  # measured 0: an element may take a neighbouring code after an fma rounds once
                problems.append(f"{what}: {key} differs in {differ:.3%} of its elements (bound 0.1%)")
    return problems


def run_in_processes(cache_dir, processes, timeout=900):
    """Each entry of ``processes`` is a list of ``(format, block_size, shapes)`` configurations, run one after
    another in a new Python process with ``cache_dir`` as inductor's cache: the processes share the compile
    caches only through the disk, as separate training runs do. Returns every problem any of them found."""
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "test"), os.environ.get("PYTHONPATH", "")]),
    )
    problems = []
    for configs in processes:
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", __file__, json.dumps(configs)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            problems.append(f"process for {configs} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        else:
            problems += json.loads(proc.stdout.strip().splitlines()[-1])
    return problems


def test_compiled_steps_from_a_shared_cache_match_eager(tmp_path):
    """A 4bit_rank1 graph compiled where the row count equals the block count (in a process that compiled a
    vector's graph first, so the recompile gave the two sizes their own symbols), then other matrices of the same
    size in the next process: each must get a graph of its own shape, not that one from the cache."""
    problems = run_in_processes(
        tmp_path,
        [
            [["4bit_rank1", None, [[512]]], ["4bit_rank1", None, [[1152, 128]]]],
            [["4bit_rank1", None, [[256, 576], [576, 256], [128, 1152]]]],
        ],
    )
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_compiled_steps_from_a_shared_cache_match_eager_every_format(tmp_path):
    """The same over every registered format (and the test-only ones), two block sizes, the four ways of one
    matrix size, a vector and a flat state whose last block is short, in three processes that each meet the
    shapes in another order, one after another on one cache directory."""
    import made_up_formats  # noqa: F401  (registered in the worker processes too)

    configs = [(fmt, bs) for fmt in torchao_optim.list_state_formats() for bs in (None, 64)]
    orders = [
        [[[512]], [MATRICES[1]], [[300]], MATRICES],
        [MATRICES[2:] + MATRICES[:2], [MATRICES[1], [300]], [[512], MATRICES[0]]],
        [[MATRICES[0]], [MATRICES[3]], [MATRICES[1], MATRICES[2]], [[300], [512]]],
    ]
    processes = [[[fmt, bs, shapes] for fmt, bs in configs for shapes in order] for order in orders]
    problems = run_in_processes(tmp_path, processes, timeout=3600)
    assert not problems, "\n".join(problems)


def main(configs):
    import made_up_formats  # noqa: F401  (the slow sweep covers the test-only formats)

    problems = []
    for fmt, block_size, shapes in configs:
        try:
            problems += step_compiled_and_eager(fmt, block_size, [tuple(s) for s in shapes])
        except Exception as err:  # noqa: BLE001  (reported with its configuration; the others still run)
            problems.append(
                f"{fmt} block_size={block_size} shapes {shapes}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}"
            )
    print(json.dumps(problems))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
