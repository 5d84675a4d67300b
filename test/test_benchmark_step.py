"""benchmarks/benchmark_step.py: what its columns mean (the step a training loop sustains, the device's and the
host's times, the step from an idle GPU), on the CPU, and on a GPU where there is one."""

import json
import os
import time

import pytest
import torch
from benchmark_scripts import load_benchmark

bench = load_benchmark("benchmark_step")
optimizers = bench.optimizers


def test_step_is_the_larger_of_device_and_host_time_on_the_cpu():
    calls = []
    times = bench.step_times(lambda: calls.append(time.sleep(0.002)), "cpu", 3)
    assert len(calls) == 3  # on a CPU one pass: the device time is the wall time
    assert times["device"] == times["alone"] and times["step"] == max(times["device"], times["host"])
    assert times["step"] >= 2.0  # ms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device time with the host ahead needs a GPU")
def test_device_time_leaves_out_the_host_time_before_the_launch():
    x = torch.zeros(1 << 20, device="cuda")

    def step():  # 5 ms on the host, then a kernel of a few microseconds
        time.sleep(0.005)
        x.add_(1.0)

    device_s, host_s = optimizers.timed(step, "cuda", spin_s=0.02)
    alone_s, _ = optimizers.timed(step, "cuda")
    assert host_s >= 0.005 and alone_s >= 0.005  # from an idle GPU the host's 5 ms count
    assert device_s < 0.002, device_s  # queued behind the spin, only the kernel does
    times = bench.step_times(step, "cuda", 3)
    assert times["step"] == max(times["device"], times["host"]) >= 5.0  # host-bound: the host's time is the step's


def test_the_step_table_on_the_cpu(tmp_path):
    rows = bench.main(
        [
            "--device",
            "cpu",
            "--optims",
            "AdamWTorchFused,AdamW-dtq8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--dtypes",
            "fp32",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["name"] for r in rows] == ["AdamWTorchFused", "AdamW-dtq8"]
    for r in rows:
        assert r["step_ms"] == max(r["device_ms"], r["host_ms"]) > 0
        assert r["x_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
    saved = json.loads((tmp_path / "step_cpu.json").read_text())
    assert saved["results"][1]["state_bytes_per_param"] == pytest.approx(rows[1]["state_bytes_per_param"])
    assert rows[1]["state_bytes_per_param"] < 2.2 < rows[0]["state_bytes_per_param"]


def test_inductor_options_from_the_command_line():
    import torch._inductor.config as config

    before = config.triton.autotune_pointwise
    try:
        bench.set_inductor_options([f"triton.autotune_pointwise={not before}"])
        assert config.triton.autotune_pointwise is (not before)
    finally:
        config.triton.autotune_pointwise = before
    for bad in ("triton.no_such_option=1", "triton.autotune_pointwise", "no_such_group.option=1"):
        with pytest.raises(SystemExit, match="expected name=value"):
            bench.set_inductor_options([bad])


def test_cold_caches_are_fresh_then_removed_and_the_environment_restored():
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    before = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    with bench.cold_caches() as root:
        assert cache_dir().startswith(root) and os.environ["TRITON_CACHE_DIR"].startswith(root)
        assert os.listdir(root) == ["inductor"]  # inductor's, just made: nothing compiled there yet
    assert not os.path.exists(root)
    assert {k: os.environ.get(k) for k in before} == before
