"""The 4-bit variants of the language-model benchmark (benchmarks/fourbit_variants.py): registered for the benchmark
only, each one change from "4bit", each on the fused path, and runnable through benchmark_convergence.py."""

import json

import pytest
import torch
from benchmark_scripts import BENCHMARKS, load_benchmark, run_benchmark_modules

import torchao_optim
from torchao_optim.optim.explain import route
from torchao_optim.quant import dynamic_map_values
from torchao_optim.state.fourbit import balanced_map, square_map

bench = load_benchmark("benchmark_convergence")
VARIANTS_FILE = str(BENCHMARKS / "fourbit_variants.py")
TINY = bench.PRESETS["tiny"].model


@pytest.fixture
def variants(monkeypatch):
    """Load the variants as benchmark_convergence.py's --formats_from does; the formats and optimizers they register
    are forgotten after the test, so that the other tests' sweeps over every registered format do not see them."""
    return run_benchmark_modules(monkeypatch, "fourbit_variants")["VARIANTS"]


def test_variant_formats_are_one_change_each_and_leave_4bit_alone(variants):
    four = torchao_optim.get_state_format("4bit")
    assert four.first_moment == "quadratic" and four.default_block_size == 128  # the library's default
    layouts = {}
    for name in ("4bit", "4bit_dyn", "4bit_vdyn", "4bit_b64"):
        fmt = torchao_optim.get_state_format(name)
        # each state's layout is what the fused kernels read: every variant takes them
        layouts[name] = [fmt.zeros((256, 256), signed=s, device="meta").fast_path_layout() for s in (True, False)]
        assert None not in layouts[name] and bench.has_fused_layout(name)
    (m4, v4), (md, vd), (mb, vb) = layouts["4bit"], layouts["4bit_dyn"], layouts["4bit_b64"]
    assert md.codebook == dynamic_map_values(True, 3, 4) != m4.codebook and (md.block_size, vd) == (128, v4)
    mv, vv = layouts["4bit_vdyn"]
    assert mv == m4 and vv.codebook == dynamic_map_values(False, 3, 4) != v4.codebook and vv.block_size == 128
    assert vv.never_zero and not v4.never_zero  # the dynamic map has a zero level, which exp_avg_sq must not take
    assert (mb.block_size, vb.block_size) == (64, 64) and (mb.codebook, vb.codebook) == (m4.codebook, v4.codebook)
    # loading the file again registers nothing new and keeps every name
    assert bench.runpy.run_path(VARIANTS_FILE)["VARIANTS"] == variants
    # the codebooks of the other variants: each changes the map it names and keeps the other state's
    for name, first, second in [
        ("4bit_bal", balanced_map("quadratic"), None),
        ("4bit_lin", balanced_map("linear"), None),
        ("4bit_nrm", balanced_map("normal"), None),
        ("4bit_vsq", None, square_map(4)),
        ("4bit_bal_vsq", balanced_map("quadratic"), square_map(4)),
        ("4bit_dyn_vsq", dynamic_map_values(True, 3, 4), square_map(4)),
        ("4bit_lin_vsq", balanced_map("linear"), square_map(4)),
    ]:
        fmt = torchao_optim.get_state_format(name)
        m, v = [fmt.zeros((256, 256), signed=s, device="meta").fast_path_layout() for s in (True, False)]
        assert (m.codebook, v.codebook) == (first or m4.codebook, second or v4.codebook), name
        assert (m.block_size, v.block_size, v.never_zero) == (128, 128, False), name
    rank1 = torchao_optim.get_state_format("4bit_rank1_nrm")
    assert issubclass(rank1, torchao_optim.get_state_format("4bit_rank1")) and rank1.first_moment == "balanced_normal"
    assert variants == [
        "AdamW-4bit_dyn",
        "AdamW-4bit_vdyn",
        "AdamW-4bit_b64",
        "AdamW-4bit_bal",
        "AdamW-4bit_lin",
        "AdamW-4bit_nrm",
        "AdamW-4bit_vsq",
        "AdamW-4bit_bal_vsq",
        "AdamW-4bit_dyn_vsq",
        "AdamW-4bit_lin_vsq",
        "AdamW-4bit_rank1_nrm",
        "AdamW-4bit_sr",
        "AdamW-4bit_srm",
        "AdamW-m4v8",
        "AdamW-4bit_floor",
        "AdamW-4bit_dyn_floor",
        "AdamW4bit-emb8",
        "AdamW4bit-small8",
    ]
    with pytest.raises(ValueError, match="optimizer name 'AdamW4bit' is built in"):
        bench.optimizers.register_optimizer(bench.optimizers.OptimizerEntry("AdamW4bit", "", None))


def test_every_blockwise_variant_steps_a_gpt_on_the_fused_path(variants):
    """One step of a one-block GPT of width 512: every parameter with quantized state is updated by the fused step,
    in the format its variant says (-emb8: the embeddings in 8-bit; -small8: every matrix of at most 2**19 elements,
    here all but the 512 x 1536 and 512 x 2048 ones of the block)."""
    torch.manual_seed(0)
    model = bench.GPT(bench.GPTConfig(d_model=512, n_layer=1, n_head=2, context=64))
    names = {p: n for n, p in model.named_parameters()}
    x = torch.randint(0, 256, (2, 16))
    model(x, x).backward()
    main = {name: name.removeprefix("AdamW-") for name in variants if name.startswith("AdamW-")}
    for name in variants:
        if name in ("AdamW-4bit_rank1_nrm", "AdamW-4bit_sr", "AdamW-4bit_srm", "AdamW-m4v8") or "floor" in name:
            # the per-parameter compiled path: rank-1 scales here (their own tests), stochastic codes and floors below
            continue
        optimizer = bench.optimizers.build(name, model.param_groups(0.1), lr=1e-3)
        optimizer.step()
        formats = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                executor, words, why = route(optimizer, p, group)
                assert executor.startswith("fused"), (name, names[p], words, why)
                formats[names[p]] = getattr(optimizer.state[p]["exp_avg"], "format_name", "plain")
        four = main.get(name, "4bit")
        assert formats["blocks.0.mlp.fc.weight"] == formats["blocks.0.attn.qkv.weight"] == four
        assert formats["blocks.0.ln_attn.weight"] == "plain"  # under min_quant_size, whatever the variant
        embeddings = "dtq8" if name in ("AdamW4bit-emb8", "AdamW4bit-small8") else four
        assert formats["tok_emb.weight"] == formats["pos_emb.weight"] == embeddings
        small = "dtq8" if name == "AdamW4bit-small8" else four  # the head (256 x 512), the attention's projection
        assert formats["head.weight"] == formats["blocks.0.attn.proj.weight"] == small


def test_emb8_needs_groups_with_and_without_weight_decay(variants):
    model = bench.GPT(TINY)
    with pytest.raises(ValueError, match=r"needs groups with and without weight decay; got weight decays \[None\]"):
        bench.optimizers.build("AdamW4bit-emb8", model.parameters())


def test_a_variant_runs_through_the_benchmark(variants, tmp_path):
    """benchmark_convergence.py --formats_from: a variant's name is an optimizer like the others, and its run is
    recorded with its state's bytes (the embeddings' 8-bit state costs more than 4-bit's)."""
    argv = ["--model_size", "tiny", "--steps", "4", "--batch_size", "4", "--seq_len", "32", "--seeds", "0"]
    argv += ["--eval_every", "4", "--eval_batches", "1", "--device", "cpu", "--out", str(tmp_path)]
    result = bench.main([*argv, "--formats_from", VARIANTS_FILE, "--optims", "AdamW4bit,AdamW4bit-emb8"])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["optimizer"] for r in runs] == ["AdamW4bit", "AdamW4bit-emb8"] and not result["skipped_runs"]
    assert runs[0]["init_param_checksum"] == runs[1]["init_param_checksum"]
    assert all(r["final_val_loss"] < r["val_curve"][0][1] for r in runs)  # trained
    # the embeddings (256 x 64 and 64 x 64) in dtq8: 1 + 4/256 bytes per element and state, not 0.5 + 4/128
    extra = (256 * 64 + 64 * 64) * 2 * ((1 + 4 / 256) - (0.5 + 4 / 128))
    assert runs[1]["state_bytes"] - runs[0]["state_bytes"] == pytest.approx(extra)
    assert result["config"]["formats_from"] == VARIANTS_FILE


def test_formats_from_a_missing_file_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--formats_from", "no_such_file.py"])
    assert "--formats_from no_such_file.py: no such file" in capsys.readouterr().err


@pytest.mark.slow  # about 34 s of compiles: a benchmark-only candidate, not a library format
def test_stochastic_codes_are_unbiased_deterministic_and_take_the_compiled_path(variants):
    """ "4bit_sr" rounds each code up or down between its two neighbours so that the decoded value is right on average,
    from bits that depend only on the element's position and value (a resumed run stores the same codes); the fused
    kernels round to the nearest, so its parameters take the compiled path."""
    ns = bench.runpy.run_path(VARIANTS_FILE)
    stochastic_codes = ns["stochastic_codes"]
    codebook = torchao_optim.get_state_format("4bit").layout(signed=True, block_size=128).codebook
    levels = torch.tensor(codebook)
    y = torch.full((100_000,), 0.2)  # between the levels 0.140625 and 0.25
    decoded = levels[stochastic_codes(y, codebook).long()]
    assert set(decoded.unique().tolist()) == {0.140625, 0.25}
    # the mean of 100,000 draws: its standard error is 0.055 / sqrt(1e5) = 1.7e-4; 1e-3 is six of them
    assert abs(decoded.mean().item() - 0.2) < 1e-3
    assert torch.equal(stochastic_codes(y, codebook), stochastic_codes(y.clone(), codebook))  # the same bits again
    assert torch.equal(levels[stochastic_codes(levels, codebook).long()], levels)  # a level is stored exactly
    below = torch.tensor([-1.0, -0.9])  # under the smallest level, -0.766: the smallest, as rounding to nearest
    assert torch.equal(stochastic_codes(below, codebook), torch.zeros(2, dtype=torch.uint8))
    model = bench.GPT(TINY)
    for name, signed_only in (("AdamW-4bit_sr", False), ("AdamW-4bit_srm", True)):
        optimizer = bench.optimizers.build(name, model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (2, 16))
        model(x, x).backward()
        optimizer.step()
        p = max(model.parameters(), key=lambda t: t.numel())
        assert route(optimizer, p, optimizer.param_groups[0])[0] == "compiled path"
        # exp_avg_sq after one step is (1 - beta2) g**2: srm stores it rounded to the nearest, as "4bit" does
        beta2 = optimizer.param_groups[0]["betas"][1]
        one_minus_beta2 = torch.tensor(1 - beta2, dtype=torch.float64).float()  # as Adam's coefficients hold it
        true_v = one_minus_beta2 * p.grad.float() * p.grad.float()  # the update's own order
        nearest = torchao_optim.get_state_format("4bit").from_float(true_v, signed=False)
        v = optimizer.state[p]["exp_avg_sq"]
        assert torch.equal(v.absmax, nearest.absmax) and torch.equal(v.codes, nearest.codes) == signed_only, name
        model.zero_grad()


def test_torchao_floor_changes_only_blocks_under_it_and_shrinks_their_steps(variants):
    """ "4bit_floor" and "4bit_dyn_floor" clip each block's absmax at 1e-12, as torchao's states do: where every
    block's largest value is above it they store what "4bit" and "4bit_dyn" store, bit for bit; a block of gradients of
    1e-8 (second moments of 1e-17) decodes its second moment at 1/16 of 1e-12 at least, so its steps shrink, where
    "4bit"'s follow fp32 AdamW's (test_scale_invariance.py)."""
    torch.manual_seed(0)
    for floored, plain in (("4bit_floor", "4bit"), ("4bit_dyn_floor", "4bit_dyn")):
        fmt, base = torchao_optim.get_state_format(floored), torchao_optim.get_state_format(plain)
        for signed in (True, False):
            x = torch.randn(4096) if signed else torch.rand(4096) + 1e-3
            a, b = fmt.from_float(x, signed=signed), base.from_float(x, signed=signed)
            assert torch.equal(a.codes, b.codes) and torch.equal(a.absmax, b.absmax), (floored, signed)
        assert fmt.zeros((4096,), signed=False).fused_layout() is None  # the compiled path
    start = torch.randn(32, 128) * 0.02  # min_quant_size's 4096 elements: quantized state
    steps = {}
    for name in ("AdamW", "AdamW4bit", "AdamW-4bit_floor"):
        p = torch.nn.Parameter(start.clone())
        optimizer = bench.optimizers.build(name, [p], lr=1e-3, weight_decay=0.0, compile=False)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            p.grad = torch.randn(32, 128, generator=gen) * 1e-8
            optimizer.step()
        steps[name] = (p.detach() - start).norm().item()
    # "4bit" within its rounding of fp32 AdamW's steps (test_scale_invariance holds it to its own steps at every
    # scale). The floor's first step is fp32's (its state starts at zero and the step reads the unrounded new moments);
    # from the second on, its stored second moment is 6.25e-14 at least against about 1e-19, and those four steps
    # nearly vanish: measured 0.35 of fp32's total, against 0.2 for the first step alone
    assert abs(steps["AdamW4bit"] / steps["AdamW"] - 1) < 0.2, steps
    assert steps["AdamW-4bit_floor"] < steps["AdamW"] / 2, steps
