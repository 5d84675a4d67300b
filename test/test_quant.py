import pytest
import torch

from torchao_optim.quant import (
    block_absmax,
    create_dynamic_map,
    dequantize_blockwise,
    dynamic_map_values,
    normalize,
    quantize_blockwise,
    quantize_nearest,
    quantize_nearest_search,
)


def spanning_values(n, signed, seed=0):
    """Magnitudes log-uniform over 1e-7..1e3 (ten decades, past both ends of the map once normalized)."""
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** torch.empty(n).uniform_(-7, 3, generator=g)
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1 if signed else 1
    return (mag * sign).float()


def nearest_distance(y, table):
    return (y[:, None] - table[None, :]).abs().min(dim=1).values


@pytest.mark.parametrize(
    "signed,max_exponent_bits,total_bits", [(True, 7, 8), (False, 7, 8), (True, 3, 4), (False, 3, 4)]
)
def test_codes_are_nearest(signed, max_exponent_bits, total_bits):
    table = create_dynamic_map(signed, max_exponent_bits, total_bits)
    values = dynamic_map_values(signed, max_exponent_bits, total_bits)
    x = spanning_values(100_000, signed)
    y = x / x.abs().max()
    mids = (table[1:] + table[:-1]) / 2
    y = torch.cat([y, table, mids, torch.tensor([0.0, -0.0, 1.0, -1.0 if signed else 0.5])])
    codes = quantize_nearest(y, values, never_zero=not signed)
    got = (y - table[codes.long()]).abs()
    ref = (y[:, None] - table[None, :]).abs().argmin(dim=1)
    # the unsigned map never rounds a positive value to 0: it takes the smallest positive value instead
    lifted = (not signed) & (y > 0) & (ref == 0)
    assert torch.all(codes[lifted] == 1)
    # everything else is nearest up to the fp32 rounding of the midpoints that decide it (half an ulp of 1.0)
    best = nearest_distance(y, table)
    assert torch.all(got[~lifted] - best[~lifted] <= 2**-24)
    # and equals the reference rule (binary search over the midpoints) exactly
    assert torch.equal(codes, quantize_nearest_search(y, values, never_zero=not signed))
    if not signed:
        assert lifted.any()  # the data reaches below the smallest code


def test_search_quantizer_is_nearest_on_random_data():
    for signed in (True, False):
        table = create_dynamic_map(signed)
        x = spanning_values(50_000, signed, seed=1)
        y = x / x.abs().max()
        codes = quantize_nearest_search(y, table.tolist())
        torch.testing.assert_close((y - table[codes.long()]).abs(), nearest_distance(y, table), rtol=0, atol=2**-24)


def test_block_absmax_is_exact_and_ignores_non_finite():
    x = spanning_values(1000, True)
    x[10] = float("nan")
    x[300] = float("inf")
    absmax = block_absmax(x, 256)
    assert absmax.shape == (4,)
    for b in range(4):
        blk = x[b * 256 : (b + 1) * 256]
        assert absmax[b] == blk[torch.isfinite(blk)].abs().max()
    assert torch.equal(block_absmax(torch.zeros(512), 256), torch.zeros(2))


def test_normalize():
    x = torch.tensor([2.0, -4.0, float("nan"), float("inf"), float("-inf"), 1.0])
    y = normalize(x, block_absmax(x, 3), 3)
    assert torch.equal(y, torch.tensor([0.5, -1.0, 0.0, 1.0, -1.0, 1.0]))


def test_blockwise_round_trip():
    table = create_dynamic_map(True)
    x = spanning_values(1000, True).view(10, 100)
    codes, absmax = quantize_blockwise(x, table.tolist(), 256)
    assert codes.dtype == torch.uint8 and codes.shape == (1000,) and absmax.shape == (4,)
    deq = dequantize_blockwise(codes, absmax, table.tolist(), 256, x.shape)
    assert deq.shape == x.shape
    scale = absmax.repeat_interleave(256)[:1000].view(10, 100)
    assert torch.all((deq - x).abs() <= 0.0071 * scale)  # half the widest gap of the signed map


def test_quantizer_compiles_fullgraph_and_matches_eager():
    values = dynamic_map_values(True)
    f = torch.compile(lambda y: quantize_nearest(y, values), fullgraph=True, dynamic=True)
    y = spanning_values(10_000, True)
    y = y / y.abs().max()
    assert torch.equal(f(y), quantize_nearest(y, values))
