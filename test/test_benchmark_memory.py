"""The memory benchmark (benchmarks/benchmark_memory.py) on the CPU with its tiny Llama: the fit search runs,
the JSON holds what the README's table is made of, and the fitted bytes per layer order the configurations the
way their byte counts say (torch's fp32 AdamW above its bf16 form and above our 4-bit state). Memory, not time:
nothing here depends on how fast the machine is."""

import json

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("benchmark_memory")
FAST = [
    "--device",
    "cpu",
    "--geometry",
    "tiny",
    "--fit-iters",
    "1",
    "--fit-warmup",
    "0",
    "--iters",
    "1",
    "--warmup",
    "0",
    "--no-compile",
]


def test_grads_are_dense_and_full_size():
    import torch

    model = bench.ParamModel(bench.TINY.shapes(1), torch.bfloat16, "cpu")
    model().backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.is_contiguous()
        assert p.grad.untyped_storage().nbytes() == p.numel() * p.element_size()


def test_geometries():
    assert bench.numel(bench.LLAMA_70B.shapes(80)) == pytest.approx(68.98e9, rel=1e-3)  # Llama-2-70B
    per_layer = bench.numel(bench.LLAMA_70B.shapes(1)) - bench.numel(bench.LLAMA_70B.shapes(0))
    assert per_layer == 855_654_400


def test_predict():
    # 1 GB fixed + 2 GB a layer under 10 GB on the device; the host grows by 3 GB a layer under 12 GB
    fits = {"device": (1e9, 2e9), "host": (0.0, 3e9)}
    assert bench.predict(fits, {"device": 10e9, "host": 12e9}, 80) == (4, "device")
    assert bench.predict(fits, {"device": 10e9, "host": 11e9}, 80) == (3, "host")
    assert bench.predict({"device": (1e9, 0.0)}, {"device": 10e9}, 80) == (80, "max-layers")


def test_fit_search_on_cpu(tmp_path):
    configs = "AdamWTorchFused,AdamWTorchFused-bf16,AdamW4bit,AdamW8bitSR-offload,TorchaoOffload"
    bench.main(FAST + ["--configs", configs, "--fit-layers", "1,5", "--no-confirm", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "memory_tiny_cpu.json").read_text())
    assert data["geometry"] == "tiny" and data["env"]["command"].startswith("python benchmarks/benchmark_memory.py")
    rows = {r["name"]: r for r in data["results"]}
    for name in ("AdamW8bitSR-offload", "TorchaoOffload"):  # CUDA only: skipped, with the reason
        assert rows[name]["status"] == "skipped" and "CUDA" in rows[name]["reason"]
    per_param = {}
    for name in ("AdamWTorchFused", "AdamWTorchFused-bf16", "AdamW4bit"):
        row = rows[name]
        assert row["status"] == "ok", row
        search = row["search"]
        assert [r["layers"] for r in search["runs"]] == [1, 5] and not any(r["oom"] for r in search["runs"])
        for r in search["runs"]:
            assert r["iteration_ms"] > 0 and r["device_bytes"] > 0 and r["state_bytes"] > 0
            assert r["n_params"] == bench.numel(bench.TINY.shapes(r["layers"]))
        per_param[name] = search["fit"]["device"]["b"] / data["layer_params"]
        assert search["predicted_layers"] >= 1 and search["bound"] in ("device", "max-layers")
    # params + grads + two fp32 states: 16 bytes a parameter, measured as the process's peak RSS
    assert 12 < per_param["AdamWTorchFused"] < 24, per_param
    assert per_param["AdamWTorchFused-bf16"] < 0.8 * per_param["AdamWTorchFused"], per_param
    assert per_param["AdamW4bit"] < 0.8 * per_param["AdamWTorchFused"], per_param
    state = {
        n: rows[n]["search"]["runs"][-1]["state_bytes"] / rows[n]["search"]["runs"][-1]["n_params"] for n in per_param
    }
    assert state["AdamWTorchFused"] == pytest.approx(8, rel=0.01) and state["AdamW4bit"] < 1.5, state


def test_confirm_stays_under_the_limit(tmp_path):
    limit_gb = 0.04
    bench.main(
        FAST
        + ["--configs", "AdamWTorchFused", "--fit-layers", "1,3", "--device-gb", str(limit_gb), "--out", str(tmp_path)]
    )
    data = json.loads((tmp_path / "memory_tiny_cpu.json").read_text())
    search = data["results"][0]["search"]
    largest = search["largest"]
    assert largest is not None and largest["layers"] >= 1
    assert largest["device_bytes"] <= limit_gb * 1e9
    assert largest["iteration_ms"] > 0 and len(largest["iteration_ms_all"]) == 1


def test_isolated_configs_give_the_same_rows(tmp_path):
    """``--isolate`` (the default on CUDA) measures each config in a process of its own and collects its row."""
    configs = "AdamWTorchFused,AdamWTorchFused-bf16"
    bench.main(
        FAST + ["--configs", configs, "--fit-layers", "1,5", "--no-confirm", "--isolate", "--out", str(tmp_path)]
    )
    rows = {r["name"]: r for r in json.loads((tmp_path / "memory_tiny_cpu.json").read_text())["results"]}
    assert list(rows) == configs.split(",")
    assert all(r["status"] == "ok" for r in rows.values())
    b = {name: r["search"]["fit"]["device"]["b"] for name, r in rows.items()}
    assert b["AdamWTorchFused"] > b["AdamWTorchFused-bf16"] > 0  # fp32 params, grads and state: twice bf16's
