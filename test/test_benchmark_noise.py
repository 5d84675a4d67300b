"""benchmarks/noise.py: the spread of repeated measurements, and the rule that a table does not rank two figures
whose spreads overlap."""

import pytest
from benchmark_scripts import load_benchmark

noise = load_benchmark("noise")
Spread = noise.Spread


def test_spread_of_samples():
    s = Spread.of([3.0, 1.0, 2.0])
    assert (s.median, s.lo, s.hi, s.n) == (2.0, 1.0, 3.0, 3)
    assert Spread.of([1.0, 4.0]).median == 2.5
    assert Spread.from_dict(s.as_dict()) == s
    assert s.text() == "2.00 (1.00–3.00)" and s.text(1) == "2.0 (1.0–3.0)"
    assert Spread.of([0.45]).text() == "0.45"  # one repeat: no range to show
    with pytest.raises(ValueError, match="at least one sample"):
        Spread.of([])


@pytest.mark.parametrize(
    "a, b, verdict",
    [
        ((1.0, 2.0), (3.0, 4.0), "lower"),  # apart
        ((3.0, 4.0), (1.0, 2.0), "higher"),
        ((1.0, 2.5), (2.0, 4.0), "within noise"),  # overlapping
        ((1.0, 4.0), (2.0, 3.0), "within noise"),  # one inside the other
        ((1.0, 2.0), (2.0, 3.0), "within noise"),  # touching: a shared point is not a separation
        ((1.0, 1.0), (1.0, 1.0), "within noise"),  # identical repeats
    ],
)
def test_compare_intervals(a, b, verdict):
    sa = Spread((a[0] + a[1]) / 2, a[0], a[1], 3)
    sb = Spread((b[0] + b[1]) / 2, b[0], b[1], 3)
    assert noise.compare(sa, sb) == verdict
    assert noise.overlaps(sa, sb) == noise.overlaps(sb, sa) == (verdict == "within noise")


def test_one_repeat_has_no_spread_to_judge_by():
    once, thrice = Spread(1.0, 1.0, 1.0, 1), Spread(5.0, 4.0, 6.0, 3)
    assert noise.compare(once, thrice) == noise.compare(thrice, once) == "no spread (1 repeat)"
    assert noise.difference(once, thrice, " ms") == "no spread (1 repeat)"
    assert noise.ordering([("a", once), ("b", thrice)]) == ""


def test_difference_cells():
    ref = Spread(0.73, 0.70, 0.76, 3)
    assert noise.difference(Spread(0.45, 0.43, 0.47, 3), ref, " ms") == "-0.28 ms"
    assert noise.difference(Spread(1.79, 1.70, 1.85, 3), ref, " ms") == "+1.06 ms"
    assert noise.difference(Spread(0.74, 0.69, 0.80, 3), ref, " ms") == "within noise"
    assert noise.difference(Spread(110.0, 108.0, 112.0, 3), Spread(100.0, 99.0, 101.0, 3), relative=True) == "+10.0%"


def test_ordering_names_only_the_steps_the_repeats_vouch_for():
    rows = [
        ("foreach", Spread(1.79, 1.70, 1.85, 3)),
        ("fused", Spread(0.73, 0.70, 0.76, 3)),
        ("8bit", Spread(0.45, 0.40, 0.50, 3)),
        ("4bit", Spread(0.38, 0.35, 0.46, 3)),
    ]
    assert noise.ordering(rows) == "4bit ≈ 8bit < fused < foreach"
    throughput = [("a", Spread(100.0, 99.0, 101.0, 2)), ("b", Spread(120.0, 118.0, 121.0, 2))]
    assert noise.ordering(throughput, lower_is_better=False) == "b > a"
