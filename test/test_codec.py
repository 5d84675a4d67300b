"""The one encoding rule, four encoders: the O(1) encoder (eager and compiled), the kernels' Triton encoder,
the fused CPU step's C encoder (both its paths) and the binary-search reference agree bit for bit on a sweep of over
10^7 values that includes every
decision boundary, the floats either side of each, zeros, the smallest normals and subnormals."""

import made_up_formats
import pytest
import torch

from torchao_optim.kernels.cpu import cpu_kernels_available
from torchao_optim.optim.fused import fused_available
from torchao_optim.quant import create_dynamic_map, decision_boundaries, quantize_nearest, quantize_nearest_search
from torchao_optim.state import get_state_format


def _layout_codebook(fmt, signed):
    layout = get_state_format(fmt).zeros((256,), signed=signed).fast_path_layout()
    return tuple(layout.codebook), layout.never_zero


CODEBOOKS = {
    "dtq8 signed": (tuple(create_dynamic_map(True).tolist()), False),
    "dtq8 unsigned": (tuple(create_dynamic_map(False).tolist()), True),
    "made-up cubic": (made_up_formats._cubic(True), False),
    "made-up quadratic": (made_up_formats._cubic(False), True),
    "4-bit dynamic map": (tuple(create_dynamic_map(True, 3, 4).tolist()), False),
    "4-bit grid": (tuple(torch.linspace(0, 1, 16).tolist()), True),
    "8-bit grid without zero": (tuple((i + 1) / 256 for i in range(256)), False),
    "4bit signed": _layout_codebook("4bit", True),
    "4bit unsigned": _layout_codebook("4bit", False),
    "fp8 signed": _layout_codebook("fp8", True),
    "fp8 unsigned": _layout_codebook("fp8", False),
}
LARGE = {"dtq8 signed", "dtq8 unsigned"}  # 5M random values each; 1M for the others: 10^7 and more in all


def sweep(codebook, never_zero, n_random, seed=0):
    """Every boundary, the two floats either side of it (and their negatives), special values, and values
    log-uniform over [1e-40, 1] of both signs (so subnormals too)."""
    bounds = decision_boundaries(codebook, never_zero)
    up, down = torch.tensor(2.0), torch.tensor(-2.0)
    near = [
        bounds,
        bounds.nextafter(up),
        bounds.nextafter(down),
        bounds.nextafter(up).nextafter(up),
        bounds.nextafter(down).nextafter(down),
    ]
    near += [-x for x in near]
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, tiny, -tiny, tiny / 2, -tiny / 2, 1e-45, -1e-45, 1e-40, 0.5])
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** torch.empty(n_random, dtype=torch.float64).uniform_(-40, 0, generator=g)
    sign = torch.randint(0, 2, (n_random,), generator=g) * 2 - 1
    y = torch.cat(near + [special, (mag * sign).float()])
    return y.clamp(-1.0, 1.0)


@pytest.fixture(scope="module", params=sorted(CODEBOOKS))
def case(request):
    codebook, never_zero = CODEBOOKS[request.param]
    y = sweep(codebook, never_zero, 5_000_000 if request.param in LARGE else 1_000_000)
    return request.param, codebook, never_zero, y, quantize_nearest_search(y, codebook, never_zero)


def test_o1_encoder_equals_search(case):
    name, codebook, never_zero, y, ref = case
    assert torch.equal(quantize_nearest(y, codebook, never_zero), ref), name


def test_compiled_encoder_equals_search(case):
    name, codebook, never_zero, y, ref = case
    if name not in LARGE:
        pytest.skip("one compile per codebook: the dynamic maps stand for the rest")
    quantize_nearest(y[:1], codebook, never_zero)  # builds the tables eagerly: compiled code reads them as constants
    f = torch.compile(lambda y: quantize_nearest(y, codebook, never_zero), fullgraph=True, dynamic=True)
    assert torch.equal(f(y), ref), name


@pytest.mark.skipif(
    not fused_available("cuda") and not fused_available("cpu"), reason="needs Triton (a GPU, or its interpreter)"
)
@pytest.mark.parametrize(
    "flat_max_bits, grid", [(0, False), (12, False), (None, True)], ids=["two-loads", "one-load", "planned"]
)
def test_kernel_encoder_equals_search(case, flat_max_bits, grid):
    """Also for negative inputs to a codebook without negative values, which the kernels' encoder reads with
    its key's sign part left out. Every form of the encoder: two loads, one (``codec.flat_keyed``, which the
    fused kernels use where a codebook needs at most ``kernels.tables.FLAT_MAX_BITS`` mantissa bits per exponent),
    and the form the planner picks, which for an even grid (``codec.grid_bits``) reads no table."""
    from torchao_optim.kernels.triton_codec import quantize_nearest_triton

    name, codebook, never_zero, y, ref = case
    device = "cuda" if fused_available("cuda") else "cpu"
    codes = quantize_nearest_triton(y.to(device), codebook, never_zero, flat_max_bits, grid).cpu()
    assert torch.equal(codes, ref), name


def test_grid_codebooks():
    """The even grids ``(i + 1) / 2**k`` are recognized (4-bit ``exp_avg_sq``'s among them), and nothing else: not
    a grid with a zero level, a shifted or uneven one, or one whose boundary above zero ``never_zero`` moved."""
    from torchao_optim.quant.codec import grid_bits
    from torchao_optim.state.fourbit import linear_map_without_zero

    assert grid_bits(linear_map_without_zero(4)) == 4
    assert grid_bits(tuple((i + 1) / 256 for i in range(256))) == 8
    assert grid_bits((0.5, 1.0)) == 1
    assert grid_bits(tuple(i / 16 for i in range(16))) == 0  # a zero level
    assert grid_bits(tuple(i / 15 for i in range(16))) == 0
    assert grid_bits(tuple((i + 1) / 16 for i in range(15))) == 0  # not a power of two of values
    assert grid_bits(tuple(i / 8 for i in range(9)), never_zero=True) == 0
    uneven = list(linear_map_without_zero(4))
    uneven[3] += 2**-20
    assert grid_bits(tuple(uneven)) == 0


def test_one_load_tables_of_the_built_in_codebooks():
    """The one-load form's table for the built-in codebooks is 512 << m entries, m the most mantissa bits an exponent
    needs: 3 for the 4-bit ones (8 K entries at most), 6 and 7 for the dynamic 8-bit maps (64 K), within the fused
    kernels' limit; a codebook needing more than ``max_bits`` has none."""
    from torchao_optim.kernels.tables import FLAT_MAX_BITS
    from torchao_optim.quant.codec import flat_keyed

    for name, most in [
        ("4bit signed", 3),
        ("4bit unsigned", 3),
        ("4-bit dynamic map", 3),
        ("dtq8 signed", 7),
        ("dtq8 unsigned", 7),
    ]:
        table, shift = flat_keyed(*CODEBOOKS[name], max_bits=FLAT_MAX_BITS)
        assert 23 - shift <= most and table.numel() == 512 << (23 - shift), name
    assert flat_keyed(*CODEBOOKS["dtq8 unsigned"], max_bits=6) is None


@pytest.mark.skipif(not cpu_kernels_available(), reason="the fused CPU step could not be built (no C compiler)")
@pytest.mark.parametrize(
    "form, compact",
    [("two_loads", True), ("two_loads", False), ("one_load", True)],
    ids=["first-table-in-registers", "two-loads", "one-load"],
)
def test_cpu_encoder_equals_search(case, form, compact):
    from torchao_optim.kernels.cpu import quantize_nearest_cpu
    from torchao_optim.kernels.tables import CPU_FLAT_MAX_BITS
    from torchao_optim.quant.codec import flat_keyed

    name, codebook, never_zero, y, ref = case
    if form == "one_load" and flat_keyed(tuple(codebook), never_zero, CPU_FLAT_MAX_BITS) is None:
        with pytest.raises(ValueError, match="bits per exponent"):
            quantize_nearest_cpu(y, codebook, never_zero, form=form)
        return
    assert torch.equal(quantize_nearest_cpu(y, codebook, never_zero, compact=compact, form=form), ref), name


def test_rule_is_nearest_with_ties_toward_zero():
    codebook = (-1.0, -0.5, 0.0, 0.5, 1.0)
    y = torch.tensor([-0.75, -0.25, 0.25, 0.75, -0.7, 0.3, 0.0, -0.0])
    # on a midpoint the code nearer zero wins; elsewhere the nearest
    expected = torch.tensor([1, 2, 2, 3, 1, 3, 2, 2], dtype=torch.uint8)
    assert torch.equal(quantize_nearest(y, codebook), expected)
    assert torch.equal(quantize_nearest_search(y, codebook), expected)
    # never_zero: a positive value never takes 0.0's code, zero itself does
    y = torch.tensor([0.0, 1e-30, 0.2, -1e-30])
    assert torch.equal(quantize_nearest(y, codebook, never_zero=True), torch.tensor([2, 3, 3, 2], dtype=torch.uint8))


def test_a_codebook_too_dense_for_the_encoder_is_refused():
    from torchao_optim.quant import bucket_tables

    with pytest.raises(ValueError, match="too close together"):
        bucket_tables((0.0, 0.5, 0.5 + 2**-20, 0.5 + 2**-19, 1.0))
    with pytest.raises(ValueError, match="sorted"):
        bucket_tables((0.0, 1.0, 0.5))
