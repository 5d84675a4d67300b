"""benchmarks/benchmark_e2e.py: the time each optimizer adds to forward and backward, on the CPU with tiny models
(a stand-in MLP, a two-layer LLaMA, and a one-block ViT where timm imports), timed with the wall clock."""

import json
import re
import sys

import pytest
import torch
from benchmark_scripts import load_benchmark
from torch import nn

bench = load_benchmark("benchmark_e2e")
Spread = bench.Spread

TINY_LLAMA = json.dumps(
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a loaded shared CPU their barriers cost tenths of a second."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stand_in() -> "bench.Workload":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))  # 8192-weight layers: quantized
    x, y = torch.randn(16, 64), torch.randint(10, (16,))
    return bench.Workload(
        "mlp", "a stand-in MLP", model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )


def test_every_block_starts_from_the_same_weights_in_rotated_order(monkeypatch):
    work = _stand_in()
    start = [p.detach().clone() for p in work.model.parameters()]
    seen = []
    run_block = bench.run_block

    def recording(work, name, *args):
        block = run_block(work, name, *args)
        seen.append(name)
        return block

    built = []
    build = bench.optimizers.build

    def checking_build(name, params, **kw):
        params = list(params)
        built.append(all(torch.equal(p, s) for p, s in zip(params, start)))
        return build(name, params, **kw)

    monkeypatch.setattr(bench, "run_block", recording)
    monkeypatch.setattr(bench.optimizers, "build", checking_build)
    logged = []
    rows = bench.measure(
        work, ["AdamWTorchFused", "AdamW8bit"], 2, 2, 1, "none", torch.device("cpu"), log=logged.append
    )

    # one untimed warm-up block, then the rounds, each starting one later in the list
    assert seen == ["fwd+bwd", "fwd+bwd", "AdamWTorchFused", "AdamW8bit", "AdamWTorchFused", "AdamW8bit", "fwd+bwd"]
    assert built == [True] * 4  # each optimizer is built on the starting weights, whatever trained before it
    assert len(logged) == 2 and logged[0].startswith("  round 1/2: fwd+bwd ")

    base, fused, ours = rows
    assert [r.name for r in rows] == ["fwd+bwd", "AdamWTorchFused", "AdamW8bit"]
    for row in (fused, ours):
        assert len(row.step_ms) == len(row.added_ms) == len(row.optimizer_ms) == 2
        # a round's added time is that round's step minus that round's fwd+bwd
        assert row.added_ms == pytest.approx([s - b for s, b in zip(row.step_ms, base.step_ms)])
        assert all(t > 0 for t in row.optimizer_ms) and row.first_step_s > 0
        assert row.peak_gb is None  # CPU: no allocator statistics
    assert base.optimizer_ms == [] and base.added_ms == []

    n_params = sum(p.numel() for p in work.model.parameters())
    d = bench.row_dict(ours, n_params)
    assert d["added_ms"] == Spread.of(ours.added_ms).as_dict() and d["added_ms_runs"] == ours.added_ms
    # fp32 moments take 8 bytes a parameter (and a step count per tensor); 8-bit codes quantize the weights
    assert bench.row_dict(fused, n_params)["state_bytes_per_param"] == pytest.approx(8.0, rel=0.01)
    assert d["state_bytes_per_param"] < 3.0


def _result(rows, n=3):
    base = dict(name="fwd+bwd", step_ms=dict(median=25.78, min=25.7, max=25.9, n=n), first_step_s=1.0, peak_gb=3.0)

    def row(name, lo, median, hi, step_ms):
        return dict(
            name=name,
            step_ms=dict(median=25.78 + median, min=25.7 + lo, max=25.9 + hi, n=n),
            added_ms=dict(median=median, min=lo, max=hi, n=n),
            optimizer_ms=dict(median=step_ms, min=step_ms, max=step_ms, n=n),
            state_bytes_per_param=8.0,
            peak_gb=4.0,
            first_step_s=2.0,
        )

    return dict(
        workload="vit_b",
        description="ViT-B",
        n_params=86e6,
        amp="bf16",
        steps=40,
        warmup=8,
        repeats=n,
        rows=[base] + [row(*r) for r in rows],
    )


def test_the_table_says_within_noise_where_the_spreads_overlap():
    table = bench.markdown(
        _result(
            [
                ("AdamWTorchForeach", 1.70, 1.79, 1.85, 1.6),
                ("AdamWTorchFused", 0.70, 0.73, 0.76, 0.6),
                ("AdamW8bit", 0.40, 0.45, 0.50, 0.35),
                ("AdamW4bit", 0.35, 0.38, 0.46, 0.3),
                ("AdamWFp8", 0.68, 0.74, 0.80, 0.5),
            ]
        )
    )
    lines = table.splitlines()
    assert lines[2].startswith("86.0M params, amp bf16, 40 timed steps after 8 untimed, 3 rounds; fwd+bwd alone: 25.78")
    assert lines[4].startswith("| optimizer | added ms/step | vs AdamWTorchFused | optimizer ms (events) |")
    cells = {line.split(" | ")[0][2:]: line.split(" | ") for line in lines if line.startswith("| Adam")}
    assert cells["AdamWTorchForeach"][1:3] == ["1.79 (1.70–1.85)", "+1.06 ms"]
    assert cells["AdamWTorchFused"][2] == "(reference)"
    assert cells["AdamW8bit"][2] == "-0.28 ms"
    assert cells["AdamWFp8"][2] == "within noise"  # 0.68-0.80 overlaps 0.70-0.76
    assert "Least added time first (≈: within noise): AdamW4bit ≈ AdamW8bit < AdamWTorchFused ≈ AdamWFp8 < " in table

    once = bench.markdown(_result([("AdamWTorchFused", 0.7, 0.7, 0.7, 0.6), ("AdamW8bit", 0.4, 0.4, 0.4, 0.3)], n=1))
    assert "| no spread (1 repeat) |" in once and "Least added time first" not in once
    assert "One round only" in once


def test_main_writes_json_and_markdown_for_a_tiny_llama(tmp_path, capsys):
    argv = ["--device", "cpu", "--workloads", "llama_1b", "--llama_config", TINY_LLAMA, "--llama_batch", "2"]
    argv += ["--llama_seq", "16", "--optims", "AdamWTorchFused,AdamW8bit", "--repeats", "2", "--steps", "2"]
    argv += ["--warmup", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "| AdamW8bit | " in out and "wrote " in out

    saved = json.loads((tmp_path / "e2e_cpu.json").read_text())
    assert saved["env"]["command"].startswith("python benchmarks/benchmark_e2e.py --device cpu")
    (result,) = saved["results"]
    assert result["workload"] == "llama_1b" and result["repeats"] == 2 and result["steps"] == 2
    assert '"num_hidden_layers": 2' in result["description"] and "batch 2 x 16 tokens" in result["description"]
    assert [r["name"] for r in result["rows"]] == ["fwd+bwd", "AdamWTorchFused", "AdamW8bit"]
    base = result["rows"][0]
    for row in result["rows"][1:]:
        assert row["added_ms"]["n"] == 2 and len(row["step_ms_runs"]) == 2
        assert row["added_ms_runs"] == pytest.approx([s - b for s, b in zip(row["step_ms_runs"], base["step_ms_runs"])])
        assert row["optimizer_ms"]["min"] <= row["optimizer_ms"]["median"] <= row["optimizer_ms"]["max"]
    assert result["rows"][1]["state_bytes_per_param"] == pytest.approx(8.0, rel=0.01)  # fp32 moments
    md = (tmp_path / "e2e_cpu.md").read_text()
    assert "### llama_1b: LlamaForCausalLM" in md and "| AdamWTorchFused | " in md


def test_a_tiny_vit(tmp_path, capsys):
    try:
        import timm  # noqa: F401
    except Exception as err:  # ImportError, or a torchvision built for another torch
        pytest.skip(f"the vit_b workload needs timm, which cannot be imported here ({type(err).__name__})")
    kwargs = json.dumps(dict(img_size=32, patch_size=8, depth=1, embed_dim=64, num_heads=2))
    argv = ["--device", "cpu", "--workloads", "vit_b", "--vit_kwargs", kwargs, "--vit_batch", "4"]
    argv += ["--optims", "AdamWTorchFused", "--repeats", "1", "--quick", "--out", str(tmp_path)]
    assert bench.main(argv) == 0, capsys.readouterr().err
    (result,) = json.loads((tmp_path / "e2e_cpu.json").read_text())["results"]
    assert result["workload"] == "vit_b" and result["steps"] == bench.QUICK_STEPS["vit_b"]
    assert result["warmup"] == bench.QUICK_WARMUP
    assert [r["name"] for r in result["rows"]] == ["fwd+bwd", "AdamWTorchFused"]


def test_peers_that_do_not_import_are_left_out_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    notes = []
    names = bench.choose_optimizers(None, log=notes.append)
    assert names == list(bench.DEFAULT_OPTIMS)
    assert notes == [
        "[skip] AdamWBnb8bit: cannot import bitsandbytes (pip install bitsandbytes)",
        "[skip] AdamWTorchao8bit: cannot import torchao (pip install torchao)",
        "[skip] AdamWTorchao4bit: cannot import torchao (pip install torchao)",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optims", "AdamW8bit,nope"], r"unknown optimizer\(s\) 'nope'; known: Adam, AdamW, "),
        (["--workloads", "resnet"], r"unknown workload\(s\) \['resnet'\] \(choose from: vit_b, llama_1b\)"),
        (["--repeats", "0"], r"--repeats: expected a positive integer, got '0'"),
        (["--llama_config", "[1]"], r"--llama_config: expected a JSON object"),
        (["--reference", "nope"], r"unknown --reference 'nope'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert bench.main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("benchmark_e2e.py: error: "), err
    assert re.search(message, err), err
