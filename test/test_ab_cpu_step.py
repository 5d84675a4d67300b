"""benchmarks/ab_cpu_step.py: two builds of the C step timed in turn in one process, on the CPU."""

import subprocess

import pytest
import torch
from benchmark_scripts import BENCHMARKS, load_benchmark

from torchao_optim import SGD8bit
from torchao_optim.kernels import cpu
from torchao_optim.optim import launch

ab = load_benchmark("ab_cpu_step")
needs_c_step = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="no C compiler for the fused C step")


class Counting:
    """A C step library whose step calls are counted."""

    def __init__(self, library):
        self.library, self.calls = library, 0

    def __getattr__(self, name):
        attribute = getattr(self.library, name)
        if name != "torchao_optim_cpu_step":
            return attribute

        def step(*args):
            self.calls += 1
            return attribute(*args)

        return step


@needs_c_step
def test_steps_alternate_between_the_builds_and_train_alike():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 256)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twin):
        q.grad = p.grad.clone()
    a, b = Counting(cpu.cpu_kernels()), Counting(cpu.cpu_kernels())
    times = ab.timed_pairs(SGD8bit(params, lr=0.1, momentum=0.9), {"a": a, "b": b}, steps=3, warmup=1)
    assert (a.calls, b.calls) == (4, 4)  # one launch a step, every round on each
    assert [len(t) for t in times.values()] == [3, 3] and all(t > 0 for ts in times.values() for t in ts)
    reference = SGD8bit(twin, lr=0.1, momentum=0.9)
    for _ in range(8):
        reference.step()
    for p, q in zip(params, twin):  # the same library twice: the same 8 steps as one optimizer's
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert launch.cpu_rule is cpu.cpu_rule  # the launch's own lookup back


@needs_c_step
def test_the_table_against_this_revision(capsys):
    inside = subprocess.run(["git", "-C", str(BENCHMARKS), "rev-parse", "HEAD"], capture_output=True)
    if inside.returncode != 0:
        pytest.skip("not a git checkout")
    rows = ab.main(["--before", "HEAD", "--optims", "SGD8bit", "--steps", "2", "--threads", "1"])
    assert [r["optimizer"] for r in rows] == ["SGD8bit"] and len(rows[0]["before"]) == len(rows[0]["after"]) == 2
    assert "| SGD8bit |" in capsys.readouterr().out
