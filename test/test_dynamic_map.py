import pytest
import torch

from torchao_optim import create_dynamic_map


def reference_map(signed, max_exponent_bits, total_bits):
    """The map from its definition, in float64: decade i holds the midpoints of an even grid on [0.1, 1]
    with 2**(i + total_bits - 1 - max_exponent_bits [+1 if unsigned]) intervals, scaled by 10**(i - E + 1)."""
    values = [0.0, 1.0]
    for i in range(max_exponent_bits):
        n = 2 ** (i + total_bits - 1 - max_exponent_bits + (0 if signed else 1))
        if n < 1:
            continue
        for k in range(int(n)):
            v = 10.0 ** (i - max_exponent_bits + 1) * (0.1 + (k + 0.5) * 0.9 / n)
            values += [v, -v] if signed else [v]
    return torch.tensor(sorted(values), dtype=torch.float64)


@pytest.mark.parametrize(
    "signed,max_exponent_bits,total_bits",
    [
        (True, 7, 8),
        (False, 7, 8),
        (True, 7, 4),
        (True, 3, 4),
        (False, 3, 4),
    ],
)
def test_matches_definition(signed, max_exponent_bits, total_bits):
    got = create_dynamic_map(signed, max_exponent_bits, total_bits)
    ref = reference_map(signed, max_exponent_bits, total_bits)
    assert got.dtype == torch.float32 and got.shape == (2**total_bits,)
    assert torch.all(got[1:] > got[:-1]), "sorted, no duplicates"
    torch.testing.assert_close(got.double(), ref, rtol=2e-7, atol=0)


def test_facts_of_the_8bit_maps():
    s, u = create_dynamic_map(True), create_dynamic_map(False)
    assert (s > 0).sum() == 128 and (s < 0).sum() == 127 and (s == 0).sum() == 1
    assert s.max() == 1.0 and -1.0 not in s and abs(s.min().item() + 0.99297) < 1e-5
    assert abs(s[s > 0].min().item() - 5.5e-7) < 1e-12
    assert (u > 0).sum() == 255 and u.min() == 0 and u.max() == 1.0
    assert abs(u[u > 0].min().item() - 3.25e-7) < 1e-12


def test_invalid_combinations_are_refused():
    with pytest.raises(ValueError, match="17 values"):
        create_dynamic_map(False, 7, 4)
    with pytest.raises(ValueError, match="total_bits"):
        create_dynamic_map(True, 7, 9)
    with pytest.raises(ValueError, match="max_exponent_bits"):
        create_dynamic_map(True, 0, 8)
