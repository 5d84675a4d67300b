"""convert_state_dict: bitsandbytes and torchao Adam/AdamW checkpoints into ours and back.

Without either library (CI), source checkpoints are built from the layouts the libraries document and store
(torchao_optim/optim/convert_bnb.py and convert_torchao.py say what they are): known fp32 moments quantized to the
source's codebook and block scales by nearest rounding, as the source does. The converted moments must equal the
source's dequantization (codebook value times block scale) exactly, and what our optimizer holds after
``load_state_dict`` must be within one requantization of them (exact where the layout is ours). Where the libraries
import, their real optimizers train, and ours continues from the converted state (benchmarks/check_convert.py).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from benchmark_scripts import load_benchmark

import torchao_optim
from torchao_optim.optim.convert_torchao import TorchaoState, TorchaoState4bit, TorchaoState8bit, TorchaoStateFp8
from torchao_optim.quant import create_dynamic_map, dynamic_map_values, quantize_blockwise
from torchao_optim.state import DTQ8bitTensor, FourBitTensor

SHAPE = (64, 96)  # 6144 elements: 24 blocks of 256, the last of 2048 short
SMALL = (40,)  # under bitsandbytes' min_8bit_size and torchao's 4096: plain fp32 state


def moments(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g) * torch.logspace(-6, -1, shape[-1])  # magnitudes over five decades
    v = (torch.randn(shape, generator=g) * 1e-3) ** 2
    return m, v


def nearest_codes(x, table, block_size):
    """Codes (uint8, x's shape) and absmax per block: nearest ``table`` value to x / absmax of its block."""
    flat = x.reshape(-1)
    pad = -flat.numel() % block_size
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block_size)
    absmax = blocks.abs().amax(1)
    y = (blocks / absmax[:, None]).reshape(-1)[: flat.numel()]
    codes = (y[:, None] - table[None, :]).abs().argmin(1).to(torch.uint8)
    return codes.view(x.shape), absmax


def dequant(codes, table, absmax, block_size):
    values = table[codes.reshape(-1).long()]
    pad = -values.numel() % block_size
    blocks = torch.cat([values, values.new_zeros(pad)]).view(-1, block_size) * absmax[:, None]
    return blocks.reshape(-1)[: codes.numel()].view(codes.shape)


def bnb_entry(m, v, block_size=256, step=7):
    """One parameter's state as bitsandbytes' blockwise 8-bit Adam stores it (flat keys, before 0.50)."""
    entry = {"step": step}
    for n, (x, signed) in enumerate(((m, True), (v, False)), start=1):
        table = create_dynamic_map(signed)
        codes, absmax = nearest_codes(x, table, block_size)
        entry.update({f"state{n}": codes, f"qmap{n}": table, f"absmax{n}": absmax})
    return entry


def bnb_state_dict(wrapped=False, block_size=256):
    m, v = moments(SHAPE)
    big = bnb_entry(m, v, block_size)
    small_m, small_v = moments(SMALL, 1)
    small = {"step": 7, "state1": small_m, "state2": small_v}
    if wrapped:  # bitsandbytes 0.50's state_dict(): all but "step" under one key
        big = {"step": 7, "__bnb_optimizer_quant_state__": {k: t for k, t in big.items() if k != "step"}}
        small = {"step": 7, "__bnb_optimizer_quant_state__": {"state1": small_m, "state2": small_v}}
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, alpha=0.0, t_alpha=None, t_beta3=None)
    return {"state": {0: big, 1: small}, "param_groups": [{**group, "params": [0, 1]}]}


def params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(SHAPE)), torch.nn.Parameter(torch.randn(SMALL))]


def plain(x):
    return x.dequantize(torch.float32) if isinstance(x, torchao_optim.QuantizedState) else x


@pytest.mark.parametrize("wrapped", [False, True], ids=["flat", "wrapped"])
def test_bitsandbytes_blockwise_converts_with_its_codes(wrapped):
    sd = bnb_state_dict(wrapped)
    out = torchao_optim.convert_state_dict(sd, "bitsandbytes")
    src = bnb_state_dict()["state"]
    big = out["state"][0]
    assert isinstance(big["exp_avg"], DTQ8bitTensor) and isinstance(big["exp_avg_sq"], DTQ8bitTensor)
    for key, n in (("exp_avg", 1), ("exp_avg_sq", 2)):
        want = dequant(src[0][f"state{n}"], src[0][f"qmap{n}"], src[0][f"absmax{n}"], 256)
        assert torch.equal(big[key].dequantize(), want)
        assert torch.equal(out["state"][1][key], src[1][f"state{n}"])  # fp32 state of a small tensor
    assert float(big["step"]) == 7.0
    assert out["param_groups"] == [
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False, params=[0, 1])
    ]

    # loaded into our 8-bit AdamW the codes are kept as they are: an exact resume
    opt = torchao_optim.AdamW8bit(params())
    opt.load_state_dict(out)
    held = opt.state[opt.param_groups[0]["params"][0]]
    assert torch.equal(held["exp_avg"].codes, src[0]["state1"].reshape(-1))
    assert torch.equal(held["exp_avg_sq"].absmax, src[0]["absmax2"])


def requantization_bound(codebook, x, block_size):
    """Per element, the largest move of one requantization of ``x`` to ``codebook`` (sorted, within [-1, 1]) with
    the absmax of its block: half the widest gap between neighbouring values, or the whole gap from 0 to the
    smallest positive value where a format never stores a positive value as 0."""
    values = torch.tensor(sorted(set(codebook) | {0.0}))
    widest = float(values.diff().max())
    absmax = x.reshape(-1).abs()
    pad = -absmax.numel() % block_size
    absmax = torch.cat([absmax, absmax.new_zeros(pad)]).view(-1, block_size).amax(1)
    per_block = absmax * widest * (1 + 1e-6)
    return per_block.repeat_interleave(block_size)[: x.numel()].view(x.shape)


@pytest.mark.parametrize("block_size", [256, 2048], ids=["blocks256", "blocks2048_before_0.44"])
def test_bitsandbytes_into_another_format_is_one_requantization(block_size):
    sd = bnb_state_dict(block_size=block_size)
    out = torchao_optim.convert_state_dict(sd, "bitsandbytes")
    src = sd["state"][0]
    opt = torchao_optim.AdamW4bit(params())
    opt.load_state_dict(out)
    held = opt.state[opt.param_groups[0]["params"][0]]
    for key, n in (("exp_avg", 1), ("exp_avg_sq", 2)):
        want = dequant(src[f"state{n}"], src[f"qmap{n}"], src[f"absmax{n}"], block_size)
        assert torch.equal(plain(out["state"][0][key]), want)
        assert isinstance(held[key], FourBitTensor)
        layout = held[key].layout(**held[key].attrs())
        err = (held[key].dequantize() - want).abs()
        assert (err <= requantization_bound(layout.codebook, want, 128)).all()
        assert err.max() > 0  # another codebook: this is a requantization, not a copy


def test_bitsandbytes_one_scale_per_tensor():
    m, v = moments(SHAPE)
    entry = {"step": 3}
    for n, (x, signed) in enumerate(((m, True), (v, False)), start=1):
        table = create_dynamic_map(signed)
        codes, absmax = nearest_codes(x, table, m.numel())
        entry.update({f"state{n}": codes, f"qmap{n}": table, f"max{n}": absmax, f"new_max{n}": torch.zeros(1)})
    sd = {
        "state": {0: entry},
        "param_groups": [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, params=[0])],
    }
    out = torchao_optim.convert_state_dict(sd, "bitsandbytes")
    for key, n in (("exp_avg", 1), ("exp_avg_sq", 2)):
        want = entry[f"qmap{n}"][entry[f"state{n}"].long()] * entry[f"max{n}"]
        assert torch.equal(out["state"][0][key], want)


def bad(sd, path, value):
    """A copy of ``sd`` with the value at ``path`` (keys) replaced, or removed where ``value`` is ``...``."""
    import copy

    sd = copy.deepcopy(sd)
    node = sd
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return sd


@pytest.mark.parametrize(
    "path, value, message",
    [
        (
            ("state", 0, "absmax1"),
            torch.ones(5),
            r"5 block scales for 6144 elements; expected 24 for blocks of 256, 3 ",
        ),
        (("state", 0, "state2"), ..., r"no 'state2'.*one-state optimizer"),
        (("state", 0, "gnorm_vec"), torch.zeros(100), r"state\['gnorm_vec'\].*percentile_clipping"),
        (
            ("state", 0, "qmap1"),
            torch.zeros(16),
            r"qmap1.*float32 codebook of shape \(256,\), got torch.float32 \(16,\)",
        ),
        (("state", 0, "extra"), 1, r"unknown keys \['extra'\]"),
        (("param_groups", 0, "alpha"), 5.0, r"AdEMAMix"),
        (("state", 0, "absmax1"), ..., r"neither absmax1 nor max1"),
    ],
    ids=["absmax_length", "one_state", "percentile_clipping", "qmap_size", "unknown_key", "ademamix", "no_scale"],
)
def test_bitsandbytes_layouts_we_do_not_know_are_refused_by_name(path, value, message):
    with pytest.raises(ValueError, match=r"bitsandbytes state_dict.*" + message):
        torchao_optim.convert_state_dict(bad(bnb_state_dict(), path, value), "bitsandbytes")


def test_an_unknown_source_or_target_is_refused_by_name():
    sd = bnb_state_dict()
    with pytest.raises(ValueError, match=r"source='lpmm'"):
        torchao_optim.convert_state_dict(sd, "lpmm")
    with pytest.raises(ValueError, match=r"source='bitsandbytes', target='torchao'"):
        torchao_optim.convert_state_dict(sd, "bitsandbytes", "torchao")
    with pytest.raises(ValueError, match=r"torchao_format and block_size describe a torchao target"):
        torchao_optim.convert_state_dict(sd, "bitsandbytes", torchao_format="8bit")


# ---- torchao, as torch.load gives its states without torchao ------------------------------------------------


def torchao_8bit(x, signed, block_size=256):
    """A torchao OptimState8bit's fields, on the stand-in class load_torchao_checkpoint reads them into."""
    table = create_dynamic_map(signed)
    codes, scale = nearest_codes(x, table, block_size)
    out = torch.Tensor._make_wrapper_subclass(TorchaoState8bit, x.shape, dtype=torch.float32)
    out.__dict__.update(codes=codes, scale=scale, qmap=table, signed=signed, block_size=block_size)
    return out


def torchao_state_dict():
    m, v = moments(SHAPE)
    small_m, small_v = moments(SMALL, 1)
    state = {
        0: {"step": torch.tensor(5.0), "exp_avg": torchao_8bit(m, True), "exp_avg_sq": torchao_8bit(v, False)},
        1: {"step": torch.tensor(5.0), "exp_avg": small_m, "exp_avg_sq": small_v},
    }
    group = dict(lr=torch.tensor(2e-3), betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, amsgrad=False, params=[0, 1])
    return {"state": state, "param_groups": [group]}


def test_torchao_8bit_converts_with_its_codes():
    sd = torchao_state_dict()
    out = torchao_optim.convert_state_dict(sd, "torchao")
    assert out["param_groups"][0]["lr"] == pytest.approx(2e-3) and isinstance(out["param_groups"][0]["lr"], float)
    for key in ("exp_avg", "exp_avg_sq"):
        src = sd["state"][0][key]
        assert torch.equal(out["state"][0][key].dequantize(), dequant(src.codes, src.qmap, src.scale, 256))
        assert torch.equal(out["state"][1][key], sd["state"][1][key])
    opt = torchao_optim.Adam8bit(params())  # torchao's Adam8bit: L2 decay, as ours with decoupled_weight_decay=False
    opt.load_state_dict(out)
    assert torch.equal(
        opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].codes, sd["state"][0]["exp_avg"].codes.reshape(-1)
    )


def test_torchao_states_of_an_unknown_layout_are_refused_by_name():
    sd = torchao_state_dict()
    del sd["state"][0]["exp_avg"].__dict__["qmap"]
    with pytest.raises(
        ValueError, match=r"torchao state_dict, parameter id 0, state\['exp_avg'\].*without the field 'qmap'"
    ):
        torchao_optim.convert_state_dict(sd, "torchao")
    sd = torchao_state_dict()
    sd["state"][0]["exp_avg_sq"].__dict__["signed"] = True
    with pytest.raises(ValueError, match=r"exp_avg_sq'\]: a torchao state with signed=True; this key's is False"):
        torchao_optim.convert_state_dict(sd, "torchao")
    sd = torchao_state_dict()
    sd["state"][0]["exp_avg"] = torchao_optim.DTQ8bitTensor.zeros(SHAPE, signed=True)
    with pytest.raises(ValueError, match=r"is a torchao_optim.state.dtq8.DTQ8bitTensor, which is none of torchao's"):
        torchao_optim.convert_state_dict(sd, "torchao")


def stand_in(cls, shape, **fields):
    out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)
    out.__dict__.update(fields)
    return out


@pytest.mark.parametrize("kind", ["4bit", "fp8"])
def test_torchao_4bit_and_fp8_convert_to_their_values(kind):
    m, v = moments(SHAPE)
    state, want = {"step": torch.tensor(5.0)}, {}
    for key, x, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):
        if kind == "4bit":  # 16 values, blocks of 128, two codes a byte with the first element in the high nibble
            table = create_dynamic_map(True, 3, 4) if signed else torch.linspace(0, 1, 17)[1:]
            codes, scale = nearest_codes(x, table, 128)
            flat = codes.reshape(-1)
            packed = (flat[0::2] << 4) | flat[1::2]
            state[key] = stand_in(
                TorchaoState4bit, SHAPE, codes=packed, scale=scale, qmap=table, signed=signed, _shape=torch.Size(SHAPE)
            )
            want[key] = dequant(codes, table, scale, 128)
        else:  # float8_e4m3fn codes, one scale (absmax / 448) per block of 256
            scale = x.reshape(-1, 256).abs().amax(1) / 448
            codes = (x.reshape(-1, 256) / scale[:, None]).to(torch.float8_e4m3fn).view(SHAPE)
            state[key] = stand_in(TorchaoStateFp8, SHAPE, codes=codes, scale=scale)
            want[key] = (codes.float().view(-1, 256) * scale[:, None]).view(SHAPE)
    group = dict(lr=torch.tensor(1e-3), betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, params=[0])
    out = torchao_optim.convert_state_dict({"state": {0: state}, "param_groups": [group]}, "torchao")
    for key in want:
        assert torch.equal(out["state"][0][key], want[key])


@pytest.fixture
def fake_torchao(monkeypatch):
    """Modules named as torchao's, holding a class named as its OptimState8bit: ``torch.save`` then writes what
    torchao writes (the class by its module and name, its fields as the object's state)."""
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.optim", types.ModuleType("torchao.optim"))
    module = types.ModuleType("torchao.optim.subclass_8bit")
    # a wrapper subclass without storage, as torchao's: pickled by class name, dtype, shape and fields
    cls = type("OptimState8bit", (TorchaoState,), {"__module__": module.__name__, "kind": "8bit"})
    module.OptimState8bit = cls
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return cls


def test_a_torchao_checkpoint_loads_and_converts_without_torchao(fake_torchao, tmp_path, monkeypatch):
    sd = torchao_state_dict()
    for entry in sd["state"][0].values():
        if isinstance(entry, TorchaoState8bit):
            entry.__class__ = fake_torchao  # as torchao's own object would be pickled
    torch.save(sd, tmp_path / "optimizer.pt")
    for name in ("torchao", "torchao.optim", "torchao.optim.subclass_8bit"):
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(Exception, match="OptimState8bit"):  # torch.load alone cannot read it
        torch.load(tmp_path / "optimizer.pt", weights_only=True)
    loaded = torchao_optim.load_torchao_checkpoint(tmp_path / "optimizer.pt")
    assert "TorchaoState8bit(shape=(64, 96)" in repr(loaded["state"][0]["exp_avg"])
    out = torchao_optim.convert_state_dict(loaded, "torchao")
    want = torchao_optim.convert_state_dict(torchao_state_dict(), "torchao")
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(out["state"][0][key].dequantize(), want["state"][0][key].dequantize())
    with pytest.raises(NotImplementedError, match="convert the state_dict with convert_state_dict"):
        loaded["state"][0]["exp_avg"] + 1


# ---- ours to the libraries ---------------------------------------------------------------------------------


def trained(cls=torchao_optim.AdamW8bit, **kwargs):
    ps = params()
    opt = cls(ps, lr=1e-3, **kwargs)
    for i in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        opt.step()
    return opt


def test_ours_to_bitsandbytes_is_its_layout_and_comes_back_exactly():
    opt = trained()
    sd = opt.state_dict()
    out = torchao_optim.convert_state_dict(sd, "torchao_optim", "bitsandbytes")
    big, small = out["state"][0], out["state"][1]
    assert big["step"] == 3 and isinstance(big["step"], int)
    assert big["state1"].dtype == torch.uint8 and big["state1"].shape == SHAPE
    assert big["absmax1"].shape == (math.ceil(math.prod(SHAPE) / 256),)
    assert torch.equal(big["qmap1"], create_dynamic_map(True)) and torch.equal(big["qmap2"], create_dynamic_map(False))
    assert torch.equal(big["state1"].reshape(-1), sd["state"][0]["exp_avg"].codes)  # our dtq8 codes are its codes
    assert small["state1"].dtype == torch.float32 and torch.equal(small["state2"], sd["state"][1]["exp_avg_sq"])
    assert out["param_groups"][0]["alpha"] == 0.0 and "state_format" not in out["param_groups"][0]
    back = torchao_optim.convert_state_dict(out, "bitsandbytes")
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(back["state"][0][key].dequantize(), sd["state"][0][key].dequantize())


def test_ours_in_another_format_to_bitsandbytes_is_one_requantization():
    sd = trained(torchao_optim.AdamWFp8).state_dict()
    out = torchao_optim.convert_state_dict(sd, "torchao_optim", "bitsandbytes", min_8bit_size=100)
    for key, n in (("exp_avg", 1), ("exp_avg_sq", 2)):
        ours = sd["state"][0][key].dequantize()
        got = dequant(out["state"][0][f"state{n}"], out["state"][0][f"qmap{n}"], out["state"][0][f"absmax{n}"], 256)
        assert ((got - ours).abs() <= requantization_bound(dynamic_map_values(n == 1), ours, 256)).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(amsgrad=True), r"amsgrad=True, which bitsandbytes' Adam does not do"),
        (dict(maximize=True), r"maximize=True"),
    ],
)
def test_what_bitsandbytes_cannot_continue_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        torchao_optim.convert_state_dict(trained(**kwargs).state_dict(), "torchao_optim", "bitsandbytes")


def test_adam_with_l2_decay_is_refused_for_bitsandbytes():
    sd = trained(torchao_optim.Adam8bit, weight_decay=0.1).state_dict()
    with pytest.raises(ValueError, match=r"L2 weight decay.*decay decoupled"):
        torchao_optim.convert_state_dict(sd, "torchao_optim", "bitsandbytes")


def test_another_optimizers_state_is_refused():
    sd = trained(torchao_optim.Lion8bit).state_dict()
    with pytest.raises(ValueError, match=r"param group 0 has no \['eps'\].*not an Adam/AdamW state_dict"):
        torchao_optim.convert_state_dict(sd, "torchao_optim", "bitsandbytes")
    sd = trained().state_dict()
    sd["state"][0] = {"step": sd["state"][0]["step"], "momentum_buffer": sd["state"][0]["exp_avg"]}
    with pytest.raises(ValueError, match=r"parameter id 0: .*\['momentum_buffer', 'step'\]: only Adam/AdamW states"):
        torchao_optim.convert_state_dict(sd, "torchao_optim", "torchao", torchao_format="8bit")


def test_torch_optim_adamw_state_converts_too():
    ps = params()
    opt = torch.optim.AdamW(ps)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    out = torchao_optim.convert_state_dict(opt.state_dict(), "torchao_optim", "bitsandbytes")
    want, _ = quantize_blockwise(opt.state[ps[0]]["exp_avg"], dynamic_map_values(True), 256)
    assert torch.equal(out["state"][0]["state1"].reshape(-1), want)


# ---- the real libraries, where they import -----------------------------------------------------------------

bench = load_benchmark("check_convert")


@pytest.mark.parametrize("name", list(bench.SOURCES))
def test_training_continues_from_a_converted_checkpoint(name):
    """Ours continues from the converted checkpoint within the distance the two libraries drift apart anyway, and
    closer to the source than a resume that lost its state (benchmarks/check_convert.py says why that is the
    yardstick); the source library continues from a checkpoint of ours likewise."""
    if bench.source_class(name) is None:
        pytest.skip(f"{bench.SOURCES[name][0]} does not import")
    r = bench.check(name, device="cpu", width=64, resume_at=10, steps=10, lr=1e-3)
    assert r["gap"] <= r["bound"] and r["back_gap"] <= r["bound"], r
    assert r["fresh"] > max(r["gap"], r["back_gap"]), r


def test_ours_to_torchao_is_its_own_classes():
    pytest.importorskip("torchao.optim")
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    sd = trained().state_dict()
    out = torchao_optim.convert_state_dict(sd, "torchao_optim", "torchao", torchao_format="8bit")
    state = out["state"][0]["exp_avg"]
    assert type(state) is OptimState8bit and torch.equal(state.codes.reshape(-1), sd["state"][0]["exp_avg"].codes)
    assert torch.is_tensor(out["param_groups"][0]["lr"])  # torchao's step refuses a float lr
    out = torchao_optim.convert_state_dict(sd, "torchao_optim", "torchao", torchao_format="4bit")
    assert type(out["state"][0]["exp_avg_sq"]) is OptimState4bit
    assert type(out["state"][1]["exp_avg"]) is torch.Tensor  # under 4096 elements torchao keeps plain state
