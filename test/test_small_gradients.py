"""benchmarks/small_gradients.py: how far each low-bit state's steps follow fp32 AdamW's where gradients are small."""

from benchmark_scripts import load_benchmark, run_benchmark_modules

small = load_benchmark("small_gradients")


def test_blockwise_states_follow_fp32_at_every_scale_and_a_floor_does_not(monkeypatch):
    run_benchmark_modules(monkeypatch, "fourbit_variants")  # AdamW-4bit_floor: torchao's floor on our 4-bit state
    got = small.measure(
        ["AdamW8bit", "AdamW4bit", "AdamW-4bit_floor"], [1e-3, 1e-8], steps=5, device="cpu", compile=False
    )
    for name in ("AdamW8bit", "AdamW4bit"):
        # without a floor the codes do not depend on the scale (test_scale_invariance.py); only fp32 AdamW's own eps,
        # the size of the small gradients, moves the reference: the gain stays within rounding of its value at 1e-3
        assert abs(got[name][1e-8][0] - got[name][1e-3][0]) < 0.05, (name, got[name])
        assert got[name][1e-3][0] > 0.9, (name, got[name])
    floor = got["AdamW-4bit_floor"]
    assert abs(floor[1e-3][0] - got["AdamW4bit"][1e-3][0]) < 1e-6  # above the floor: "4bit" itself
    assert floor[1e-8][0] < 0.5, floor  # under it: the steps after the first nearly vanish
