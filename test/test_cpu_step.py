"""The fused CPU step (kernels/cpu_step.c): the same update as the compiled path, for every rule it runs.

The conformance cases run it against torch.optim for every format (the "cpu" executor); here it is held to the
compiled path's own function, run eagerly on the same inputs: the codes and scales it stores are the same bit
for bit (the encoder is the same rule over the same tables, the arithmetic the same operations in the same
order), and parameters agree within fp32 rounding (eager torch may round one operation differently: measured one
ulp, on one element in a few thousand; for bf16 and fp16 parameters such an ulp may flip the final rounding, one
ulp of the parameter's dtype on a few elements). Then what a user of the CPU relies on: it is the path taken by default,
threads change nothing, it needs no Triton, and a machine without a C compiler still trains, on the compiled path,
with a warning.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import made_up_formats  # noqa: F401  (the test-only formats: codebooks written after the kernel)
import pytest
import torch

import torchao_optim
from torchao_optim import Adagrad8bit, Adam, AdamW, AdEMAMix8bit, Lion8bit, RMSprop8bit, SGD8bit, list_state_formats
from torchao_optim.kernels import cpu
from torchao_optim.optim import launch
from torchao_optim.state import QuantizedState, get_state_format

pytestmark = pytest.mark.skipif(
    not cpu.cpu_kernels_available(), reason="the fused CPU step could not be built (no C compiler)"
)

# a 2-D tensor with a partial last block, an odd size (4-bit: a lone last nibble), whole blocks, and one below
# min_quant_size (fp32 state)
SHAPES = ((300, 257), (1001,), (4096,), (50,))
ULP = 2.0**-23
STEPS = 4  # steps of _train


def _fused_formats():
    """fp32 state and every format the C step reads ("4bit_rank1"'s rank-1 scales among them)."""
    out = ["none"]
    for fmt in list_state_formats():
        cls = get_state_format(fmt)
        if all(cls.zeros((4, 128), signed=s).fused_layout() is not None for s in (True, False)):
            out.append(fmt)
    return out


def _pair(make, dtype, **kw):
    """Two copies of the same parameters: one stepped by the fused CPU step, one by the compiled path's function
    run eagerly."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    fused = [torch.nn.Parameter(t.clone()) for t in init]
    eager = [torch.nn.Parameter(t.clone()) for t in init]
    return fused, eager, make(fused, **kw), make(eager, fused=False, compile=False, **kw)


def _train(params_a, params_b, opt_a, opt_b, steps=STEPS, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for a, b in zip(params_a, params_b):
            g = torch.randn(a.shape, generator=gen) * 10 ** torch.empty(a.shape).uniform_(-4, 0, generator=gen)
            if step == 2:  # non-finite gradient elements are skipped alike
                g.view(-1)[3], g.view(-1)[7], g.view(-1)[-1] = float("nan"), float("inf"), -float("inf")
            a.grad, b.grad = g.to(dtype), g.to(dtype)
        opt_a.step()
        opt_b.step()


def _assert_same_step(opt_a, opt_b, params_a, params_b):
    plans = opt_a._plans[id(opt_a.param_groups[0])]
    assert plans["rest"] == [] and {plan.executor for plan in plans["plans"]} == {"cpu"}
    for a, b in zip(params_a, params_b):
        scale = b.detach().float().abs().clamp_min(1.0)
        diff = (a.float() - b.float()).abs()
        beyond = diff > 2 * ULP * scale
        if a.dtype != torch.float32:
            # bf16/fp16 parameters: a one-ulp difference of the fp32 update flips the rounding to the parameter's
            # dtype where it falls next to a rounding boundary (seen on one element in 77100 on a CPU without
            # AVX2, where eager torch takes its scalar kernels), and the later steps start from the flipped value:
            # an ulp of that dtype per step at most, on a few elements
            ulp = torch.finfo(a.dtype).eps * b.detach().float().abs().clamp_min(torch.finfo(a.dtype).tiny)
            assert (diff[beyond] <= STEPS * ulp[beyond]).all(), "parameters beyond an ulp of their dtype per step"
            assert beyond.sum() <= max(1, a.numel() // 1000), f"{int(beyond.sum())} parameters beyond fp32 rounding"
        else:
            assert not beyond.any(), "parameters beyond fp32 rounding"
        assert opt_a.state[a].keys() == opt_b.state[b].keys()
        for key, sa in opt_a.state[a].items():
            sb = opt_b.state[b][key]
            if isinstance(sa, QuantizedState):
                names, _ = sa.__tensor_flatten__()
                for name in names:  # codes and scales, bit for bit
                    assert torch.equal(getattr(sa, name), getattr(sb, name)), (key, name, tuple(a.shape))
            elif key == "step":
                assert float(sa) == float(sb)
            else:  # plain fp32 state: its arithmetic is the update's, within rounding
                torch.testing.assert_close(sa, sb, rtol=4 * ULP, atol=0)


@pytest.mark.parametrize("fmt", _fused_formats())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_adamw_equals_compiled_path(fmt, dtype):
    if dtype not in cpu.cpu_dtypes():
        pytest.skip("this C compiler has no _Float16: fp16 parameters take the compiled path")
    a, b, oa, ob = _pair(AdamW, dtype, lr=1e-2, weight_decay=0.1, state_format=fmt, min_quant_size=256)
    _train(a, b, oa, ob, dtype=dtype)
    _assert_same_step(oa, ob, a, b)


MATRIX_SCALE_RULES = {
    "adamw": lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "adamw-amsgrad-maximize": lambda ps, **kw: AdamW(ps, lr=1e-2, amsgrad=True, maximize=True, **kw),
    "adagrad": lambda ps, **kw: Adagrad8bit(ps, lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1, **kw),
}


@pytest.mark.parametrize("rule", list(MATRIX_SCALE_RULES))
@pytest.mark.parametrize("fmt", ["4bit_rank1", "factored", "factored4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matrix_scales_at_their_edges_equal_compiled_path(threads, fmt, rule, monkeypatch):
    """Scales over a whole matrix on the C step: "4bit_rank1"'s rank-1 scales (the step finds the new row and column
    maxima) and the factored formats' row and column means (fp64 sums, folded range by range). The compiled path's
    codes, maxima and means bit for bit, for one, two and three states (Adagrad's sum, Adam's, amsgrad's maximum),
    where a block holds pieces of several rows (fewer columns than a block, or a row ending inside a block), where a
    row is all zero, where a row's values are subnormal (rank-1: the 2**64 lift), where a gradient element is NaN or
    infinite (skipped), and on one thread or two (each thread's maxima or sums merged in order)."""
    shapes = ((37, 5), (3, 1000), (64, 128), (2, 3, 40))
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    a, b = ([torch.nn.Parameter(t.clone()) for t in init] for _ in range(2))
    make = MATRIX_SCALE_RULES[rule]
    kw = dict(state_format=fmt, min_quant_size=0)
    oa, ob = make(a, **kw), make(b, fused=False, compile=False, **kw)
    monkeypatch.setattr(launch, "MIN_BLOCKS_PER_THREAD", 1)  # two threads for this small plan too
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for step in range(STEPS):
            for pa, pb in zip(a, b):
                g = torch.randn(pa.shape, generator=gen)
                rows = g.view(g.shape[0], -1)
                rows[0] = 0.0  # an all-zero row: its maximum (or mean) and scales 0
                rows[1] *= 3e-20  # a second moment of order 1e-42: subnormal
                if step == 2:
                    rows[-1, -1], rows[-1, 0] = float("nan"), float("inf")
                pa.grad, pb.grad = g.clone(), g.clone()
            oa.step()
            ob.step()
    finally:
        torch.set_num_threads(before)
    plans = oa._plans[id(oa.param_groups[0])]["plans"]
    assert all(any(r is not None for r in plan.rows) for plan in plans)
    _assert_same_step(oa, ob, a, b)


@pytest.mark.parametrize("fmt", ["dtq8", "4bit"])
def test_adam_l2_maximize_equals_compiled_path(fmt):
    a, b, oa, ob = _pair(
        Adam, torch.float32, lr=1e-2, weight_decay=0.1, maximize=True, state_format=fmt, min_quant_size=256
    )
    _train(a, b, oa, ob)
    _assert_same_step(oa, ob, a, b)


@pytest.mark.parametrize("fmt", ["dtq8", "fp8", "none"])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps, **kw: SGD8bit(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3, **kw),
        lambda ps, **kw: SGD8bit(ps, lr=1e-2, momentum=0.9, nesterov=True, maximize=True, **kw),
        lambda ps, **kw: Lion8bit(ps, lr=1e-3, weight_decay=0.1, **kw),
    ],
    ids=["sgd", "sgd-nesterov-maximize", "lion"],
)
def test_one_state_rules_equal_compiled_path(fmt, make):
    a, b, oa, ob = _pair(lambda ps, **kw: make(ps, state_format=fmt, min_quant_size=256, **kw), torch.float32)
    _train(a, b, oa, ob)
    _assert_same_step(oa, ob, a, b)


ADAGRAD_RMSPROP = {
    "adagrad": lambda ps, **kw: Adagrad8bit(
        ps, lr=1e-2, lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1, maximize=True, **kw
    ),
    "rmsprop": lambda ps, **kw: RMSprop8bit(ps, lr=1e-3, weight_decay=1e-3, **kw),
    "rmsprop-momentum": lambda ps, **kw: RMSprop8bit(ps, lr=1e-3, alpha=0.9, momentum=0.9, maximize=True, **kw),
}


@pytest.mark.parametrize(
    "name,fmt",
    # each kernel family once in CI (the conformance cases hold the C step to torch.optim for all three rules)
    [("adagrad", "dtq8"), ("rmsprop-momentum", "dtq8")]
    + [
        pytest.param(name, fmt, marks=pytest.mark.slow)
        for name in ADAGRAD_RMSPROP
        for fmt in ("dtq8", "4bit", "none")
        if (name, fmt) not in (("adagrad", "dtq8"), ("rmsprop-momentum", "dtq8"))
    ],
)
def test_adagrad_and_rmsprop_equal_compiled_path(name, fmt):
    """Adagrad's sum and RMSprop's square_avg (unsigned, the one-state rules; with momentum the first of two states)
    stored bit for bit as the compiled path stores them; RMSprop's momentum buffer too, which depends on a square
    root (correctly rounded on both paths)."""
    make = ADAGRAD_RMSPROP[name]
    a, b, oa, ob = _pair(lambda ps, **kw: make(ps, state_format=fmt, min_quant_size=256, **kw), torch.float32)
    _train(a, b, oa, ob)
    _assert_same_step(oa, ob, a, b)


# Rules of three states (AdEMAMix, centered RMSprop with momentum, amsgrad), and centered RMSprop's two
# (test_triton_three_states.py holds the Triton kernel's three-state form to this step)
THREE_STATES = {
    "ademamix": lambda ps, **kw: AdEMAMix8bit(ps, lr=1e-2, weight_decay=0.1, **kw),
    "ademamix-schedulers-maximize": lambda ps, **kw: AdEMAMix8bit(
        ps, lr=1e-2, betas=(0.9, 0.99, 0.98), alpha=3.0, t_alpha=4, t_beta3=5, maximize=True, **kw
    ),
    "rmsprop-centered": lambda ps, **kw: RMSprop8bit(ps, lr=1e-3, weight_decay=1e-3, centered=True, **kw),
    "rmsprop-centered-momentum": lambda ps, **kw: RMSprop8bit(
        ps, lr=1e-3, alpha=0.9, momentum=0.9, centered=True, maximize=True, **kw
    ),
    "adamw-amsgrad": lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
    "adam-amsgrad-l2-maximize": lambda ps, **kw: Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, **kw),
}


@pytest.mark.parametrize("fmt", ["dtq8", "4bit", "none"])
@pytest.mark.parametrize("name", THREE_STATES)
def test_three_state_rules_equal_compiled_path(name, fmt):
    """Each state (the third included, and every state that depends on a square root: centered RMSprop's momentum
    buffer) stored bit for bit as the compiled path stores it, a non-finite gradient element skipped alike
    (_train's third step)."""
    make = THREE_STATES[name]
    a, b, oa, ob = _pair(lambda ps, **kw: make(ps, state_format=fmt, min_quant_size=256, **kw), torch.float32)
    _train(a, b, oa, ob)
    _assert_same_step(oa, ob, a, b)


def test_amsgrad_takes_a_negative_zero_maximum_as_zero():
    """The C update takes amsgrad's maximum as an integer maximum of the two values' patterns (both >= 0, which order
    as their patterns do); a -0.0 in max_exp_avg_sq (a loaded checkpoint may hold one) counts as 0 there, as
    torch.maximum takes it, not as the largest pattern."""
    a, b, oa, ob = _pair(lambda ps, **kw: AdamW(ps, lr=1e-2, amsgrad=True, state_format="none", **kw), torch.float32)
    _train(a, b, oa, ob, steps=1)
    for opt, params in ((oa, a), (ob, b)):
        for p in params:
            opt.state[p]["max_exp_avg_sq"].view(-1)[:64] = -0.0
    _train(a, b, oa, ob, steps=1)
    _assert_same_step(oa, ob, a, b)
    for p in a:
        top = oa.state[p]["max_exp_avg_sq"].view(-1)[:64]
        assert (top > 0).all()  # the new v of those elements, not the -0.0


@pytest.mark.parametrize("name", ["ademamix", "rmsprop-centered-momentum", "adamw-amsgrad"])
def test_three_state_rules_round_bf16_as_the_compiled_path(name):
    """bf16 parameters and gradients, with stochastic rounding: the states bit for bit, the parameters as
    _assert_same_step allows."""
    make = THREE_STATES[name]
    a, b, oa, ob = _pair(
        lambda ps, **kw: make(ps, min_quant_size=256, bf16_stochastic_round=True, **kw), torch.bfloat16
    )
    _train(a, b, oa, ob, dtype=torch.bfloat16)
    _assert_same_step(oa, ob, a, b)


def test_bf16_stochastic_rounding_draws_the_compiled_paths_bits():
    """Same hash, same key, same element offsets: the rounded bf16 parameters are those of the compiled path,
    except where the fp32 value before rounding differs by its last ulp (then at most one bf16 ulp apart)."""
    a, b, oa, ob = _pair(AdamW, torch.bfloat16, lr=1e-3, bf16_stochastic_round=True, min_quant_size=256)
    _train(a, b, oa, ob, steps=3, dtype=torch.bfloat16)
    for x, y in zip(a, b):
        differ = (x != y).float().mean().item()
        assert differ < 1e-3, f"{differ:.2%} of elements rounded differently"
        ulp = y.float().abs() * 2.0**-7
        assert ((x.float() - y.float()).abs() <= ulp).all()
    # and rounding is stochastic, not to nearest: a plain bf16 run differs
    c, _, oc, _ = _pair(AdamW, torch.bfloat16, lr=1e-3, min_quant_size=256)
    d, _, od, _ = _pair(AdamW, torch.bfloat16, lr=1e-3, min_quant_size=256)
    _train(c, d, oc, od, steps=3, dtype=torch.bfloat16)
    assert any(not torch.equal(x, z) for x, z in zip(a, c))


def test_threads_change_nothing():
    """Blocks are independent: one thread and two store the same bytes."""
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            gen = torch.Generator().manual_seed(0)
            p = torch.nn.Parameter(torch.randn(1 << 18, generator=gen))  # 1024 blocks: enough for two threads
            opt = AdamW([p], lr=1e-2)
            for _ in range(2):
                p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            results.append(
                (p.detach().clone(), opt.state[p]["exp_avg"].codes.clone(), opt.state[p]["exp_avg_sq"].absmax.clone())
            )
    finally:
        torch.set_num_threads(before)
    for x, y in zip(*results):
        assert torch.equal(x, y)


def test_is_the_default_on_cpu_and_needs_no_compile():
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(10))]  # 8-bit and fp32 state
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = AdamW(params, lr=1e-3)

    def compiled_path(*args, **kwargs):
        raise AssertionError("the compiled path ran")

    opt._update = compiled_path
    opt.step()
    assert {plan.executor for plan in opt._plans[id(opt.param_groups[0])]["plans"]} == {"cpu"}


# Run in a fresh process where Triton cannot be imported (as for a user who has not installed it): every import of it
# by this package's code is recorded (torch's own probe, when an optimizer first imports torch._dynamo, is answered
# as a missing package and not counted), then the fused C step trains and explain() says so.
WITHOUT_TRITON = """
import importlib.abc, importlib.util, os, sys, traceback

ours = []
# this package's own files (a path that merely contains its name, such as a virtual environment's, is not ours)
PACKAGE = os.path.realpath(importlib.util.find_spec("torchao_optim").submodule_search_locations[0]) + os.sep


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            # the importing line: the innermost frame outside importlib and this finder
            importer = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")][-1]
            if os.path.realpath(importer.filename).startswith(PACKAGE):
                ours.append(f"{name} by {importer.filename}:{importer.lineno}")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
import torch
import torchao_optim

routes = []
for fused in (None, True):
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))]
    opt = torchao_optim.AdamW(params[:1], fused=fused)
    opt.add_param_group({"params": params[1:], "state_format": "4bit"})
    sgd = torchao_optim.SGD8bit([torch.nn.Parameter(torch.randn(64, 64))], lr=0.1, momentum=0.9, fused=fused)
    for o in (opt, sgd):
        for group in o.param_groups:
            for p in group["params"]:
                p.grad = torch.randn_like(p)
        o.step()
        routes += [line.split(":")[0].strip() for line in o.explain().splitlines() if line.startswith("  ")]
print(sorted(set(routes)))
print(ours)
print(sorted(m for m in sys.modules if m.startswith("torchao_optim.kernels.triton")))
"""


def test_steps_without_triton():
    # what a user without Triton relies on: the fused C step, with no import of Triton from this package
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (a user's default: no interpreter)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(torchao_optim.__file__).parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    routes, ours, modules = out.stdout.strip().splitlines()[-3:]
    assert (routes, ours, modules) == ("['fused C step']", "[]", "[]"), out.stdout + out.stderr


def test_without_a_compiler_the_compiled_path_trains(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHAO_OPTIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    cpu.cpu_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler found"):
            assert not cpu.cpu_kernels_available()
        p = torch.nn.Parameter(torch.randn(64, 64))
        p.grad = torch.randn(64, 64)
        opt = AdamW([p], lr=1e-3, compile=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, above; not again per step
            opt.step()
        assert opt._plans[id(opt.param_groups[0])]["plans"] == []
        assert float(opt.state[p]["step"]) == 1.0
    finally:
        cpu.cpu_kernels.cache_clear()


def test_built_once_into_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHAO_OPTIM_CACHE_DIR", str(tmp_path))
    cpu.cpu_kernels.cache_clear()
    try:
        assert cpu.cpu_kernels_available()
        built = list(tmp_path.glob("cpu_step_*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu.cpu_kernels.cache_clear()
        assert cpu.cpu_kernels_available()
        assert [p.stat().st_mtime_ns for p in tmp_path.glob("cpu_step_*.so")] == [stamp]  # reused, not rebuilt
    finally:
        cpu.cpu_kernels.cache_clear()


def test_extra_compiler_flags_reach_the_build(monkeypatch, tmp_path):
    """$TORCHAO_OPTIM_CFLAGS (a sanitizer, say) goes to the compiler: a flag it refuses leaves the C step unbuilt, with
    the compiler's message; the flags are part of the cache key, so the healthy build is not reused for them."""
    monkeypatch.setenv("TORCHAO_OPTIM_CACHE_DIR", str(tmp_path))
    cpu.cpu_kernels.cache_clear()
    try:
        assert cpu.cpu_kernels_available()
        monkeypatch.setenv("TORCHAO_OPTIM_CFLAGS", "-fsanitize=not-a-sanitizer")
        cpu.cpu_kernels.cache_clear()
        with pytest.warns(RuntimeWarning, match="not-a-sanitizer"):
            assert not cpu.cpu_kernels_available()
    finally:
        cpu.cpu_kernels.cache_clear()


def test_a_portable_build_steps_alike(monkeypatch, tmp_path):
    """Built without ``-march=native`` (no AVX-512 or AVX2 code: the plain loops of the decode and the encoders), the
    step stores the same bytes as the build for this machine: the vector paths change speed, never a result."""
    results = []
    try:
        for portable in (False, True):
            monkeypatch.setenv("TORCHAO_OPTIM_CACHE_DIR", str(tmp_path / ("portable" if portable else "native")))
            if portable:
                monkeypatch.setattr(cpu, "NATIVE", [])
                monkeypatch.setattr(cpu, "GATHER", [])
            cpu.cpu_kernels.cache_clear()
            assert cpu.cpu_kernels_available()
            gen = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((3 * 4096 + 17,), (1001,))]
            opt = AdamW(
                [{"params": params[:1]}, {"params": params[1:], "state_format": "4bit"}], lr=1e-2, min_quant_size=256
            )
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            results.append(
                [
                    t.clone()
                    for p in params
                    for t in (p.detach(), opt.state[p]["exp_avg"].codes, opt.state[p]["exp_avg_sq"].absmax)
                ]
            )
    finally:
        cpu.cpu_kernels.cache_clear()
    for x, y in zip(*results):
        assert torch.equal(x, y)


def test_flags_the_compiler_refuses_are_dropped(monkeypatch, tmp_path):
    """A flag set the compiler rejects (here a made-up option) falls through to the next one; a later process
    loads the library built then, after one more try of the rejected set (a refusal is not cached on disk)."""
    monkeypatch.setenv("TORCHAO_OPTIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "GATHER", ["-fno-such-option-torchao-optim"])
    calls = []
    real_run = cpu.subprocess.run

    def counting_run(args, **kwargs):
        calls.append(args)
        return real_run(args, **kwargs)

    monkeypatch.setattr(cpu.subprocess, "run", counting_run)
    cpu.cpu_kernels.cache_clear()
    try:
        assert cpu.cpu_kernels_available()
        builds = [a for a in calls if "-o" in a]
        assert len(builds) == 2 and "-fno-such-option-torchao-optim" in builds[0]
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
        calls.clear()
        cpu.cpu_kernels.cache_clear()
        assert cpu.cpu_kernels_available()
        builds = [a for a in calls if "-o" in a]
        assert len(builds) == 1 and "-fno-such-option-torchao-optim" in builds[0]  # tried again, not rebuilt
    finally:
        cpu.cpu_kernels.cache_clear()


def test_a_failed_build_is_tried_again_by_a_later_process(monkeypatch, tmp_path):
    """Builds that fail (here killed midway, after writing part of their output) leave nothing in the cache: no
    partial library under a name that is loaded, and no mark that would keep a later process from building.
    The process warns once and takes the compiled path; a later one (the caches cleared) builds and loads."""
    monkeypatch.setenv("TORCHAO_OPTIM_CACHE_DIR", str(tmp_path))
    real_run = cpu.subprocess.run

    def killed_midway(args, **kwargs):
        if "-o" not in args:
            return real_run(args, **kwargs)
        with open(args[args.index("-o") + 1], "wb") as f:
            f.write(b"\x7fELF, then nothing")
        return cpu.subprocess.CompletedProcess(args, -9, "", "")

    monkeypatch.setattr(cpu.subprocess, "run", killed_midway)
    cpu.cpu_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built .*exit status -9"):
            assert not cpu.cpu_kernels_available()
        assert list(tmp_path.iterdir()) == []
        monkeypatch.setattr(cpu.subprocess, "run", real_run)
        assert not cpu.cpu_kernels_available()  # this process does not try again
        cpu.cpu_kernels.cache_clear()
        assert cpu.cpu_kernels_available()
        assert len(list(tmp_path.glob("cpu_step_*.so"))) == 1
    finally:
        cpu.cpu_kernels.cache_clear()
