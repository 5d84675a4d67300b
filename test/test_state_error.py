"""benchmarks/state_error.py: each candidate's update against fp32 AdamW's along one fp32 AdamW run."""

import json

import pytest
from benchmark_scripts import BENCHMARKS, load_benchmark

bench = load_benchmark("state_error")


def test_measures_each_candidate_against_the_reference(tmp_path):
    argv = ["--model_size", "tiny", "--device", "cpu", "--batch_size", "4", "--seq_len", "32", "--stop_at", "6"]
    argv += ["--every", "3", "--out", str(tmp_path), "--optims", "AdamW,AdamW8bit,AdamW4bit"]
    result = bench.main(argv)
    assert json.loads((tmp_path / "state_error.json").read_text())["candidates"] == ["AdamW", "AdamW8bit", "AdamW4bit"]
    records = result["records"]
    assert [r["step"] for r in records["AdamW"]] == [3, 6]
    assert "params" not in records["AdamW"][0] and "params" in records["AdamW"][-1]  # per parameter: the last only
    # the reference's own optimizer, on a shadow of its parameters, takes the same steps
    for r in records["AdamW"]:
        t = r["total"]
        assert t["gain"] == pytest.approx(1.0, abs=1e-6) and t["cos"] == pytest.approx(1.0, abs=1e-6)
        assert t["err"] == pytest.approx(0.0, abs=1e-3) and t["m_err"] == 0.0 and t["v_bias"] == 0.0
    # 8-bit state is close to it, 4-bit further, as the format's resolution says; both move along its steps
    last = {name: records[name][-1]["total"] for name in ("AdamW8bit", "AdamW4bit")}
    assert 0 < last["AdamW8bit"]["err"] < 0.15 < last["AdamW4bit"]["err"] < 1.0
    assert last["AdamW8bit"]["cos"] > 0.98 and last["AdamW4bit"]["cos"] > 0.5
    # 4-bit exp_avg_sq's smallest level, 1/16 of its block's absmax, overestimates the denominator on average
    assert last["AdamW4bit"]["v_bias"] > 0 and last["AdamW4bit"]["v_hi"] > 0
    table = bench.table(result)
    assert table.splitlines()[0].startswith("| optimizer | gain (last) | gain | cos | err |")
    assert "AdamW4bit, lowest gain at step 6: " in table


def test_documented_in_the_benchmarks_readme():
    assert "state_error.py" in (BENCHMARKS / "README.md").read_text()
