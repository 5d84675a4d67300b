"""The convergence benchmark (benchmarks/benchmark_convergence.py), run for a few steps with a tiny model."""

import json
import math
import subprocess
import sys

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("benchmark_convergence")

OPTIMS = ["AdamW", "AdamW8bit"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    argv = [
        "--model_size",
        "tiny",
        "--steps",
        "12",
        "--batch_size",
        "8",
        "--seq_len",
        "64",
        "--seeds",
        "0",
        "--eval_every",
        "6",
        "--eval_batches",
        "2",
        "--device",
        "cpu",
        "--optims",
        ",".join(OPTIMS),
        "--out",
        str(out),
    ]
    returned = bench.main(argv)
    return out, returned


def test_json(results):
    out, returned = results
    data = json.loads((out / "results.json").read_text())
    assert data == json.loads(json.dumps(returned))
    assert list(data["summary"]) == OPTIMS
    assert [(r["optimizer"], r["seed"]) for r in data["runs"]] == [(o, 0) for o in OPTIMS]
    assert data["config"]["steps"] == 12 and data["config"]["model"]["d_model"] == 64
    assert data["environment"]["torch"] and data["environment"]["device"] == "cpu"
    assert data["corpus"]["train_files"] > 0 and data["corpus"]["val_files"] > 0
    for run in data["runs"]:
        assert len(run["train_loss"]) == 12
        assert [s for s, _ in run["val_curve"]] == [0, 6, 12]
        losses = run["train_loss"] + [v for _, v in run["val_curve"]]
        assert all(v is not None and math.isfinite(v) and 1.0 < v < 6.5 for v in losses)
        # untrained: close to a uniform guess over 256 bytes; after 12 steps: lower
        assert abs(run["val_curve"][0][1] - math.log(256)) < 0.2
        assert run["final_val_loss"] < run["val_curve"][0][1] - 0.3
        assert run["state_bytes"] > 0 and run["train_time_s"] > 0
    adamw, ours = data["runs"]
    # same seed: same initial weights and the same first evaluation for every optimizer
    assert adamw["init_param_checksum"] == ours["init_param_checksum"]
    assert adamw["val_curve"][0] == ours["val_curve"][0]
    # 8-bit state: fp32 AdamW keeps 8 bytes per parameter, AdamW8bit about 2 (small tensors stay fp32)
    assert adamw["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    assert ours["state_bytes_per_param"] < 3.0
    assert abs(ours["final_val_loss"] - adamw["final_val_loss"]) < 0.1
    assert data["acceptance"]["AdamW8bit"]["passed"] is None  # one seed: undecided
    assert bench.exit_status(returned) == 0  # an undecided check is not a failure


def test_markdown(results):
    out, _ = results
    table = (out / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| optimizer")]
    assert [row.split("|")[1].strip() for row in rows] == OPTIMS
    for row in rows:
        mean = float(row.split("|")[2].split("±")[0])
        assert 1.0 < mean < 6.0


def test_plot(results):
    pytest.importorskip("matplotlib")
    out, _ = results
    png = (out / "val_loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_default_optims_skip_formats_covered_by_an_alias():
    optims = bench.default_optims()
    assert optims[:2] == ["AdamW", "AdamW8bit"]
    assert "AdamW-dtq8" not in optims and len(optims) == len(set(optims))


def test_default_optims_leave_formats_without_a_fused_layout_to_all_formats(capsys):
    """The default run stays short: a format without a fused layout (its first step compiles for about a minute
    on a CPU) runs only when asked for."""
    assert bench.has_fused_layout("4bit") and not bench.has_fused_layout("4bit_rank1")
    default, every = bench.default_optims(), bench.default_optims(all_formats=True)
    assert "AdamW-4bit" in default and "AdamW-fp8" in default and "AdamW-4bit_rank1" not in default
    assert "AdamW-4bit_rank1" in every and set(default) < set(every)
    assert [o for o in every if o not in default] == [o for o in every if bench.takes_compiled_path(o)]
    assert bench.parse_args([]).optims == default
    assert bench.parse_args(["--all_formats"]).optims == every
    assert bench.takes_compiled_path("AdamW-4bit_rank1") and bench.takes_compiled_path("AdamWCompiled-dtq8")
    assert not any(bench.takes_compiled_path(o) for o in default)
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--all_formats", "--optims", "AdamW"])
    assert exc.value.code == 2
    assert "--all_formats extends the default --optims" in capsys.readouterr().err


TINY_TWO_SEEDS = [
    "--model_size",
    "tiny",
    "--steps",
    "8",
    "--batch_size",
    "4",
    "--seeds",
    "0,1",
    "--eval_every",
    "8",
    "--eval_batches",
    "1",
    "--device",
    "cpu",
]


def test_failed_acceptance_sets_a_nonzero_exit_status(tmp_path):
    """SGD (50x AdamW's lr) ends 0.4 below fp32 AdamW, whose two seeds end 0.03 apart after 8 steps: the check
    fails, and the script, run as a user runs it, says so last and exits with status 1 after writing its results."""
    out = tmp_path / "out"
    argv = [sys.executable, bench.__file__, *TINY_TWO_SEEDS, "--optims", "AdamW,SGD", "--out", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("expected duration: about ")  # before any training: after corpus and model lines
    assert any(line.startswith("- Acceptance, SGD: ") and line.endswith(": FAIL") for line in lines)
    assert lines[-1] == "acceptance check failed: SGD (exit status 1)"
    data = json.loads((out / "results.json").read_text())
    assert data["acceptance"]["SGD"]["passed"] is False
    assert bench.failed_acceptance(data) == ["SGD"] and bench.exit_status(data) == 1


def test_passed_acceptance_exits_zero(tmp_path):
    """fp32 state through our update matches torch.optim.AdamW to rounding: within AdamW's seed range."""
    result = bench.main([*TINY_TWO_SEEDS, "--optims", "AdamW,AdamW-none", "--out", str(tmp_path)])
    assert result["acceptance"]["AdamW-none"]["passed"] is True
    assert bench.failed_acceptance(result) == [] and bench.exit_status(result) == 0


def test_missing_peer_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--optims", "AdamW,bnb"])
    assert exc.value.code == 2
    message = capsys.readouterr().err
    assert "needs bitsandbytes" in message and "pip install bitsandbytes" in message
    assert message.count("\n") == 1  # one line, no traceback
    with pytest.raises(SystemExit):
        bench.parse_args(["--optims", "Adafactor"])
    assert "unknown optimizer 'Adafactor'" in capsys.readouterr().err


def test_lr_schedule():
    lrs = [bench.lr_at(s, 1.0, warmup=10, total=100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_no_warmup(capsys):
    """--warmup 0 means no warm-up: the first step runs at the peak lr; a negative count is refused."""
    assert bench.parse_args(["--warmup", "0"]).warmup == 0
    lrs = [bench.lr_at(s, 1.0, warmup=0, total=100) for s in range(100)]
    assert lrs[0] == 1.0 and all(a >= b for a, b in zip(lrs, lrs[1:]))
    with pytest.raises(SystemExit):
        bench.parse_args(["--warmup", "-1"])
    assert "--warmup must be 0 (no warm-up) or positive, got -1" in capsys.readouterr().err
