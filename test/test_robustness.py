"""Nothing lost, nothing half-done: bad checkpoints and groups, copies, shared memory, many configurations,
fp64 and extreme values.

Every optimizer here runs eagerly (``compile=False``) except in TestConfigurations, which checks dynamo's
caching with the "eager" backend (tracing and guards as with inductor, without C++ compilation): what is
checked is which graphs exist, not what they compile to.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import warnings
from unittest import mock

import expecttest
import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from torchao_optim import Adam, AdamW, AdamW8bit, DTQ8bitTensor, create_dynamic_map, dequantize_state_dict
from torchao_optim.optim import compiled as compiled_module
from torchao_optim.testing import assert_same_tensor, save_load

SHAPES = [(64, 128), (4097,), (64,)]  # quantized whole blocks, quantized with a short last block, fp32 state


def make(seed=0, steps=2, **kw):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = AdamW8bit(params, compile=False, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def snapshot(opt):
    """Everything load_state_dict may change: groups (hyperparameters, parameter identity) and state."""
    groups = [
        {k: (list(map(id, v)) if k == "params" else copy.deepcopy(v)) for k, v in g.items()} for g in opt.param_groups
    ]
    state = {
        id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for p, s in opt.state.items()
    }
    return groups, state


def assert_unchanged(test, opt, before, what):
    groups, state = snapshot(opt)
    test.assertEqual(groups, before[0], what)
    test.assertEqual(set(state), set(before[1]), what)
    for pid, s in state.items():
        test.assertEqual(set(s), set(before[1][pid]), what)
        for k, v in s.items():
            assert_same_tensor(test, v, before[1][pid][k], f"{what}: {k}")


def _dtq(q, **fields):
    """``q`` with some inner tensors replaced, as a corrupted checkpoint would hold it."""
    return DTQ8bitTensor(q.shape, q.dtype, **{**q.fields(), **fields}, **q.attrs())


def _absmax_with(q, value):
    absmax = q.absmax.clone()
    absmax[1] = value
    return _dtq(q, absmax=absmax)


def _state_with(sd, pid, key, value):
    sd["state"][pid][key] = value


def _delete(sd, pid, key):
    del sd["state"][pid][key]


def _loaded_on_meta(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, map_location="meta")


class _OtherLibrarysState(torch.Tensor):
    """A tensor subclass of another library (as torchao's 8-bit state is): it implements no op we would run."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_OtherLibrarysState does not implement {func}")


_OTHER = f"{_OtherLibrarysState.__module__}.{_OtherLibrarysState.__qualname__}"  # as the error names it


# (name, how to corrupt a state_dict of make()'s optimizer, what the error must say)
CORRUPTIONS = [
    (
        "missing exp_avg_sq",
        lambda sd: _delete(sd, 0, "exp_avg_sq"),
        r"parameter 0 of shape \(64, 128\): state has no \['exp_avg_sq'\]",
    ),
    ("missing step", lambda sd: _delete(sd, 2, "step"), r"parameter 2 of shape \(64,\): state has no \['step'\]"),
    (
        "another parameter's state",
        lambda sd: sd["state"].__setitem__(0, sd["state"][1]),
        r"parameter 0 .*state\['exp_avg'\] has shape \(4097,\); expected the parameter's \(64, 128\)",
    ),
    (
        "truncated codes",
        lambda sd: _state_with(
            sd, 0, "exp_avg", _dtq(sd["state"][0]["exp_avg"], codes=sd["state"][0]["exp_avg"].codes[:-100])
        ),
        r"parameter 0 .*state\['exp_avg'\]: DTQ8bitTensor.codes .* must be torch.uint8 of shape \(8192,\), got "
        r"torch.uint8 of shape \(8092,\)",
    ),
    (
        "absmax of the wrong shape",
        lambda sd: _state_with(
            sd, 1, "exp_avg_sq", _dtq(sd["state"][1]["exp_avg_sq"], absmax=sd["state"][1]["exp_avg_sq"].absmax[:-1])
        ),
        r"parameter 1 .*DTQ8bitTensor.absmax .* must be torch.float32 of shape \(17,\), "
        r"got torch.float32 of shape \(16,\)",
    ),
    (
        "NaN absmax",
        lambda sd: _state_with(sd, 0, "exp_avg", _absmax_with(sd["state"][0]["exp_avg"], float("nan"))),
        r"parameter 0 .*absmax must be finite and non-negative .* block 1 holds nan",
    ),
    (
        "negative absmax",
        lambda sd: _state_with(sd, 0, "exp_avg_sq", _absmax_with(sd["state"][0]["exp_avg_sq"], -1.0)),
        r"parameter 0 .*exp_avg_sq.*block 1 holds -1.0",
    ),
    (
        "codes as int32",
        lambda sd: _state_with(
            sd, 0, "exp_avg", _dtq(sd["state"][0]["exp_avg"], codes=sd["state"][0]["exp_avg"].codes.to(torch.int32))
        ),
        r"codes .* must be torch.uint8 of shape \(8192,\), got torch.int32",
    ),
    (
        "NaN in an fp32 state",
        lambda sd: sd["state"][2]["exp_avg"].__setitem__(5, float("nan")),
        r"parameter 2 .*state\['exp_avg'\] must be finite; element 5 \(flat\) holds nan",
    ),
    (
        "negative exp_avg_sq",
        lambda sd: sd["state"][2]["exp_avg_sq"].__setitem__(7, -2.0),
        r"state\['exp_avg_sq'\] must be finite and >= 0; element 7 \(flat\) holds -2.0",
    ),
    (
        "integer state",
        lambda sd: _state_with(sd, 2, "exp_avg", torch.zeros(64, dtype=torch.int64)),
        r"parameter 2 .*must be a floating-point tensor holding data, got torch.int64",
    ),
    (
        "complex state",
        lambda sd: _state_with(sd, 2, "exp_avg", torch.zeros(64, dtype=torch.complex64)),
        r"got torch.complex64",
    ),
    (
        "meta state",
        lambda sd: _state_with(sd, 2, "exp_avg", torch.zeros(64, device="meta")),
        r"parameter 2 of shape \(64,\): state\['exp_avg'\] is on the meta device, which holds no data",
    ),
    (
        "meta quantized state",
        lambda sd: _state_with(sd, 0, "exp_avg", _loaded_on_meta(sd)["state"][0]["exp_avg"]),
        r"parameter 0 of shape \(64, 128\): state\['exp_avg'\] is on the meta device, which holds no data",
    ),
    (
        "meta step",
        lambda sd: _state_with(sd, 1, "step", torch.tensor(1.0, device="meta")),
        r"parameter 1 .*state\['step'\] is on the meta device, which holds no data",
    ),
    (
        "loaded with map_location='meta'",
        lambda sd: sd.update(_loaded_on_meta(sd)),
        r"parameter 0 of shape \(64, 128\): state\['step'\] is on the meta device, .*load it with a map_location "
        r"that holds data, such as 'cpu'",
    ),
    (
        "another library's state",
        lambda sd: _state_with(sd, 0, "exp_avg", _OtherLibrarysState((64, 128))),
        r"parameter 0 of shape \(64, 128\): state\['exp_avg'\] is a " + re.escape(_OTHER) + r", a tensor subclass this "
        r"library does not know .*converting optimizer state from other libraries is not supported yet",
    ),
    (
        "another library's step",
        lambda sd: _state_with(sd, 1, "step", _OtherLibrarysState(())),
        r"parameter 1 .*state\['step'\] is a " + re.escape(_OTHER),
    ),
    ("state not a tensor", lambda sd: _state_with(sd, 2, "exp_avg", [0.0] * 64), r"must be a tensor, got list"),
    (
        "NaN step",
        lambda sd: _state_with(sd, 1, "step", torch.tensor(float("nan"))),
        r"parameter 1 .*state\['step'\] must be a finite count >= 0, got nan",
    ),
    ("negative step", lambda sd: _state_with(sd, 1, "step", -3.0), r"got -3.0"),
    ("step of two elements", lambda sd: _state_with(sd, 1, "step", torch.tensor([1.0, 2.0])), r"shape \(2,\)"),
    (
        "unknown state key",
        lambda sd: _state_with(sd, 2, "momentum_buffer", torch.zeros(64)),
        r"parameter 2 .*unknown keys \['momentum_buffer'\]",
    ),
    ("state entry not a dict", lambda sd: sd["state"].__setitem__(2, torch.zeros(64)), r"must be a dict, got Tensor"),
    (
        "state of an unlisted parameter",
        lambda sd: sd["state"].__setitem__(9, sd["state"][2]),
        r"state for parameter id 9, which no param group lists",
    ),
    (
        "amsgrad without max_exp_avg_sq",
        lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True),
        r"parameter 0 .*state has no \['max_exp_avg_sq'\].*amsgrad=True",
    ),
    (
        "an SGD state_dict",
        lambda sd: sd.update(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES], lr=0.1).state_dict()
        ),
        r"param group 0 of the state_dict has no \['betas', 'eps'\].*another optimizer's",
    ),
    ("bad lr", lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0), r"param group 0: Invalid learning rate: -1.0"),
    ("bad betas", lambda sd: sd["param_groups"][0].__setitem__("betas", (0.9, 1.5)), r"beta parameter at index 1: 1.5"),
    ("amsgrad not a bool", lambda sd: sd["param_groups"][0].__setitem__("amsgrad", "yes"), r"Invalid amsgrad: 'yes'"),
    (
        "another number of groups",
        lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])),
        r"2 parameter groups, the optimizer 1",
    ),
    (
        "another number of parameters",
        lambda sd: sd["param_groups"][0]["params"].pop(),
        r"has 2 parameters, the optimizer's 3",
    ),
    ("a parameter listed twice", lambda sd: sd["param_groups"][0]["params"].__setitem__(1, 0), r"lists parameter id 0"),
    ("not a state_dict", lambda sd: sd.pop("state"), r"a dict with 'state' and 'param_groups'"),
]


class TestCorruptCheckpoints(expecttest.TestCase):
    def test_each_corruption_raises_and_changes_nothing(self):
        params, opt = make()
        good = opt.state_dict()
        for name, corrupt, message in CORRUPTIONS:
            with self.subTest(name):
                sd = copy.deepcopy(good)
                corrupt(sd)
                before = snapshot(opt)
                with self.assertRaisesRegex(ValueError, message):
                    opt.load_state_dict(sd)
                assert_unchanged(self, opt, before, name)
        # and after all that the optimizer trains on exactly as an untouched twin does
        twin_params, twin = make()
        for p, q in zip(params, twin_params):
            p.grad = q.grad = torch.randn(p.shape)
        opt.step()
        twin.step()
        for p, q in zip(params, twin_params):
            self.assertTrue(torch.equal(p, q))

    def test_error_names_the_parameter(self):
        model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 8))
        named = list(model.named_parameters())
        opt = AdamW8bit([{"params": [p for _, p in named], "param_names": [n for n, _ in named]}], compile=False)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        sd = opt.state_dict()
        del sd["state"][2]["exp_avg"]
        with self.assertRaisesRegex(ValueError, r"parameter 2 \('1.weight'\) of shape \(8, 64\): state has no"):
            opt.load_state_dict(sd)

    def test_conversions_still_load(self):
        """Another block size, another format (fp32 from torch.optim) and fp16 values convert as before; the
        states end in this optimizer's layout."""
        params, opt = make(block_size=64)
        other = [torch.nn.Parameter(p.detach().clone()) for p in params]
        o2 = AdamW8bit(other, compile=False)
        o2.load_state_dict(opt.state_dict())
        self.assertEqual(o2.state[other[0]]["exp_avg"].block_size, 256)
        ref = torch.optim.AdamW(other, foreach=False)
        ref.load_state_dict(dequantize_state_dict(opt.state_dict()))
        sd = ref.state_dict()
        sd["state"][2]["exp_avg"] = sd["state"][2]["exp_avg"].half()
        o2.load_state_dict(sd)
        self.assertIs(type(o2.state[other[0]]["exp_avg"]), DTQ8bitTensor)
        self.assertEqual(o2.state[other[2]]["exp_avg"].dtype, torch.float32)

    def test_add_param_group_with_bad_betas_is_not_added(self):
        params, opt = make()
        extra = torch.nn.Parameter(torch.randn(64))
        before = snapshot(opt)
        for bad, message in (
            ({"betas": (0.9, 1.0)}, "1.0"),
            ({"lr": float("nan")}, "nan"),
            ({"state_format": "int3"}, "int3"),
            ({"amsgrad": 1}, "amsgrad"),
        ):
            with self.assertRaisesRegex(ValueError, re.escape(message)):
                opt.add_param_group({"params": [extra], **bad})
            assert_unchanged(self, opt, before, str(bad))
        for p in params:
            p.grad = torch.randn_like(p)
        extra.grad = torch.randn_like(extra)
        opt.step()
        self.assertTrue(all(torch.isfinite(p).all() for p in params))

    def test_a_parameter_listed_twice_in_a_group_is_refused(self):
        """torch.optim warns and steps such a parameter twice; the fused step would update it from two threads
        at once (results that differed from run to run): refused, naming where it is listed, and, for
        add_param_group, not added."""
        params, opt = make()
        before = snapshot(opt)
        extra = torch.nn.Parameter(torch.randn(4, 5))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the error alone, without torch.optim's warning before it
            with self.assertRaisesRegex(
                ValueError,
                re.escape("param group 1: the parameter of shape (4, 5) is listed 2 times, at positions [0, 2]"),
            ):
                opt.add_param_group({"params": [extra, torch.nn.Parameter(torch.randn(3)), extra]})
            assert_unchanged(self, opt, before, "add_param_group")
            with self.assertRaisesRegex(
                ValueError,
                re.escape(
                    "param group 0: the parameter ('w') of shape (4, 5) is listed 3 times, at positions [1, 2, 3]"
                ),
            ):
                AdamW8bit([("v", params[0]), ("w", extra), ("x", extra), ("y", extra)], compile=False)
            with self.assertRaisesRegex(ValueError, re.escape("(64, 128) is listed 2 times, at positions [0, 1]")):
                AdamW8bit([params[0], params[0]])

    def test_numpy_scalars_and_tensors_are_accepted(self):
        """Where torch.optim takes a numpy scalar or a one-element tensor, so do we (constructor, group,
        checkpoint), and the step uses its value."""
        init = torch.randn(64)
        ours, ref = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
        kw = dict(
            lr=np.float32(1e-2),
            betas=(torch.tensor(0.8), torch.tensor(0.99)),
            eps=np.float32(1e-6),
            weight_decay=torch.tensor(0.1),
        )
        o = AdamW([ours], compile=False, **kw)
        r = torch.optim.AdamW([ref], foreach=False, **kw)
        o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": np.float64(1e-3)})
        for _ in range(3):
            ours.grad = ref.grad = torch.randn(64)
            o.step()
            r.step()
        self.assertLessEqual((ours - ref).abs().max().item(), 1e-6)
        o.load_state_dict(o.state_dict())


# ---- copies ------------------------------------------------------------------------------------------------
class TestCopies(expecttest.TestCase):
    def test_copies_step_like_the_original(self):
        whole_object = lambda o: save_load(o, weights_only=False)  # noqa: E731
        for how in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o)), whole_object):
            model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 8))
            opt = AdamW8bit(model.parameters(), lr=1e-2, compile=False)
            for _ in range(2):
                model(torch.randn(4, 128)).square().sum().backward()
                opt.step()
            both = how({"model": model, "opt": opt})
            model2, opt2 = both["model"], both["opt"]
            self.assertIs(opt2.param_groups[0]["params"][0], model2[0].weight)  # the copy optimizes the copy
            x = torch.randn(4, 128)
            for m, o in ((model, opt), (model2, opt2)):
                o.zero_grad()
                m(x).square().sum().backward()
                o.step()
            for p, q in zip(model.parameters(), model2.parameters()):
                self.assertTrue(torch.equal(p, q))
                for key, value in opt.state[p].items():
                    assert_same_tensor(self, opt2.state[q][key], value, key)
        # the optimizer alone, and its compile option
        opt = AdamW8bit([torch.nn.Parameter(torch.randn(8))], compile=True)
        self.assertTrue(copy.deepcopy(opt)._update.enabled)
        self.assertFalse(copy.deepcopy(AdamW8bit([torch.nn.Parameter(torch.randn(8))], compile=False))._update.enabled)


# ---- shared memory ------------------------------------------------------------------------------------------
def _hogwild_worker(model, opt, which, grads):
    """Train only parameter ``which`` of the shared model with the shared optimizer."""
    params = list(model.parameters())
    for g in grads:
        for i, p in enumerate(params):
            p.grad = g if i == which else None
        opt.step()


class TestReplacedParameterData(expecttest.TestCase):
    """``p.data = new`` between steps (weight swaps, ``module.to`` on a parameter's data): the next step updates
    the new storage, and never writes where the parameter used to live (the fused plans hold addresses)."""

    def test_the_step_follows_the_new_storage(self):
        def run(fused, move):
            params, opt = make(steps=1, fused=fused)  # planned at the first addresses
            gen = torch.Generator().manual_seed(1)
            old, before = [], []
            for _ in range(2):
                if move:
                    old = [p.data for p in params]  # kept alive: the fused step must not write there
                    before = [x.clone() for x in old]
                    for p in params:
                        p.data = p.data.clone()
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            return params, old, before

        for fused in (None, False):
            moved, old, before = run(fused, move=True)
            kept, _, _ = run(fused, move=False)
            for a, b in zip(moved, kept):
                assert_same_tensor(self, a, b, f"fused={fused}")
            for x, y in zip(old, before):
                assert_same_tensor(self, x, y, "an old storage")

    def test_data_of_another_shape_is_refused(self):
        # by both executors, with one message naming the parameter, before anything changes (step counts included)
        for fused in (None, False):
            params, opt = make(steps=1, fused=fused)
            params[1].data = torch.zeros(32, 128)
            for p in params:
                p.grad = torch.zeros(p.shape)
            before = snapshot(opt)
            data = [p.detach().clone() for p in params]
            with self.assertRaisesRegex(
                RuntimeError,
                re.escape(
                    "parameter 1 has shape (32, 128) and a state 'exp_avg' of shape (4097,): its data was replaced"
                ),
            ):
                opt.step()
            assert_unchanged(self, opt, before, f"fused={fused}")
            for p, x in zip(params, data):
                assert_same_tensor(self, p.detach(), x, f"fused={fused}")


class TestSharedMemory(expecttest.TestCase):
    def test_share_memory_of_a_quantized_tensor(self):
        q = DTQ8bitTensor.from_float(torch.randn(1000), signed=True)
        self.assertFalse(q.is_shared())
        self.assertIs(q.share_memory_(), q)
        self.assertTrue(q.is_shared() and q.codes.is_shared() and q.absmax.is_shared())

    def test_hogwild_two_processes(self):
        """The shared-Adam pattern: model and optimizer state in shared memory, two processes stepping the
        same optimizer at once, each on its own parameter. The result is bit-identical to one process
        making the same steps."""
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(64, 80, bias=False))
        reference = copy.deepcopy(model)
        grads = [[torch.randn(p.shape) for _ in range(3)] for p in model.parameters()]
        opt = AdamW8bit(model.parameters(), compile=False)
        ref_opt = AdamW8bit(reference.parameters(), compile=False)
        for m, o in ((model, opt), (reference, ref_opt)):  # create the state before it is shared
            for p in m.parameters():
                p.grad = torch.zeros_like(p)
            o.step()
        model.share_memory()
        for state in opt.state.values():
            for value in state.values():
                value.share_memory_()
        ctx = torch.multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_hogwild_worker, args=(model, opt, i, grads[i])) for i in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
        self.assertEqual([proc.exitcode for proc in procs], [0, 0])
        for i in range(2):
            _hogwild_worker(reference, ref_opt, i, grads[i])
        for p, q in zip(model.parameters(), reference.parameters()):
            self.assertTrue(torch.equal(p, q))
            self.assertEqual(float(opt.state[p]["step"]), 4.0)
            for key in ("exp_avg", "exp_avg_sq"):
                assert_same_tensor(self, opt.state[p][key], ref_opt.state[q][key], key)


# ---- many configurations in one process ------------------------------------------------------------------
def _eager_backend_failing(gm, example_inputs):
    raise RuntimeError("no C++ compiler in this test")


class TestConfigurations(expecttest.TestCase):
    def test_many_configurations_stay_compiled(self):
        """16 (param dtype, amsgrad, format, maximize) configurations in one process: each compiles once,
        no fallback warning, dynamo's recompile limit (8 per cache) notwithstanding."""
        configs = [
            (dtype, amsgrad, fmt, maximize)
            for dtype in (torch.float32, torch.bfloat16, torch.float16)
            for amsgrad in (False, True)
            for fmt in ("dtq8", "none")
            for maximize in (False,)
        ]
        configs += [
            (torch.float64, False, "none", False),
            (torch.float64, True, "dtq8", False),
            (torch.float32, False, "dtq8", True),
            (torch.float32, True, "none", True),
        ]
        self.assertGreaterEqual(len(set(configs)), 12)
        with mock.patch.object(compiled_module, "BACKEND", "eager"), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for dtype, amsgrad, fmt, maximize in configs:
                p = torch.nn.Parameter(torch.randn(64, 128, dtype=dtype))
                opt = Adam([p], amsgrad=amsgrad, state_format=fmt, maximize=maximize, fused=False)
                graphs = counters["stats"]["unique_graphs"]
                for _ in range(2):
                    p.grad = torch.randn_like(p)
                    opt.step()
                what = f"{dtype} amsgrad={amsgrad} {fmt} maximize={maximize}"
                self.assertEqual(counters["stats"]["unique_graphs"], graphs + 1, what)
                self.assertTrue(opt._update.enabled, what)
                self.assertTrue(torch.isfinite(p).all(), what)

    def test_fallback_warns_once_and_says_why(self):
        p = torch.nn.Parameter(torch.randn(64, 128))
        eager = torch.nn.Parameter(p.detach().clone())
        o, e = AdamW8bit([p], fused=False), AdamW8bit([eager], compile=False, fused=False)
        with (
            mock.patch.object(compiled_module, "BACKEND", _eager_backend_failing),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            for _ in range(3):
                p.grad = eager.grad = torch.randn(64, 128)
                o.step()
                e.step()
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("no C++ compiler in this test", messages[0])
        self.assertIn("falling back to eager mode", messages[0])
        self.assertIn("slower", messages[0])
        self.assertTrue(torch.equal(p, eager))

    def test_recompile_limit_hit_warns(self):
        """If a configuration's own cache fills up after all, the fallback is not silent."""
        # a size-1 dimension is specialized: the second parameter needs a second entry in the same cache
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((64, 128), (1, 256))]
        opt = AdamW8bit(params, min_quant_size=0, fused=False)
        with (
            mock.patch.object(compiled_module, "BACKEND", "eager"),
            torch._dynamo.config.patch(recompile_limit=1),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("recompile", messages[0].lower())

    def test_bad_input_does_not_switch_compiling_off(self):
        """A state that fails eagerly too is the input's fault: the error is raised, compiling stays on."""
        p = torch.nn.Parameter(torch.randn(64, 128))
        opt = AdamW8bit([p], fused=False)
        p.grad = torch.randn_like(p)
        with mock.patch.object(compiled_module, "BACKEND", "eager"):
            opt.step()
            q = opt.state[p]["exp_avg"]
            opt.state[p]["exp_avg"] = _dtq(q, codes=q.codes[:100])
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                with self.assertRaisesRegex(ValueError, r"state\['exp_avg'\]: DTQ8bitTensor.codes .* must be"):
                    opt.step()
        self.assertTrue(opt._update.enabled)


# ---- fp64 ------------------------------------------------------------------------------------------------------
class TestFP64(expecttest.TestCase):
    def test_fp32_state_format_none_is_torch_optim_in_fp64(self):
        for cls, ref_cls, kw in (
            (AdamW, torch.optim.AdamW, dict(amsgrad=True)),
            (Adam, torch.optim.Adam, dict(weight_decay=0.1, maximize=True)),
        ):
            gen = torch.Generator().manual_seed(0)
            init = torch.randn(300, dtype=torch.float64, generator=gen)
            ours, ref = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
            o = cls([ours], lr=1e-2, state_format="none", compile=False, **kw)
            r = ref_cls([ref], lr=1e-2, foreach=False, **kw)
            for _ in range(20):
                ours.grad = ref.grad = torch.randn(300, dtype=torch.float64, generator=gen)
                o.step()
                r.step()
            self.assertEqual(o.state[ours]["exp_avg"].dtype, torch.float64)
            self.assertLessEqual(((ours - ref).abs().max() / ref.abs().max()).item(), 1e-12)
            for key in ("exp_avg", "exp_avg_sq"):
                err = (o.state[ours][key] - r.state[ref][key]).abs().max() / r.state[ref][key].abs().max()
                self.assertLessEqual(err.item(), 1e-12, key)

    def test_small_updates_are_not_lost(self):
        """100 steps of lr 1e-9 on fp64 parameters of size ~1: torch.optim moves them about 1e-7, below an
        fp32 ulp; so do we, with plain state (to 1e-12 of the movement) and with 8-bit state (within the 8-bit
        error of the movement)."""
        gen = torch.Generator().manual_seed(1)
        init = torch.randn(64, 128, dtype=torch.float64, generator=gen) + 3.0
        grads = [torch.randn(64, 128, dtype=torch.float64, generator=gen) + 2.0 for _ in range(100)]  # one direction
        runs = {}
        for name, make_opt in (
            ("torch", lambda p: torch.optim.AdamW([p], lr=1e-9, foreach=False)),
            ("none", lambda p: AdamW([p], lr=1e-9, state_format="none", compile=False)),
            ("dtq8", lambda p: AdamW([p], lr=1e-9, compile=False)),
        ):
            p = torch.nn.Parameter(init.clone())
            opt = make_opt(p)
            for g in grads:
                p.grad = g
                opt.step()
            runs[name] = p.detach() - init
        moved = runs["torch"].abs()
        self.assertGreater(moved.mean().item(), 5e-8)
        self.assertLessEqual((runs["none"] - runs["torch"]).abs().max().item(), 1e-12 * moved.max().item())
        self.assertLessEqual(((runs["dtq8"] - runs["torch"]).abs().mean() / moved.mean()).item(), 0.06)


# ---- extreme values -------------------------------------------------------------------------------------------
class TestExtremeValues(expecttest.TestCase):
    def test_a_huge_gradient_moves_nothing_far(self):
        """One finite gradient of 1e30 among normal ones: torch.optim stores v = Inf there and moves that
        element by the weight decay only; we skip the element that step. No element ever moves by more
        than a few lr, in that step or later."""
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 128))
        opt = AdamW8bit([p], lr=1e-3, compile=False)
        for k in range(6):
            p.grad = torch.randn_like(p)
            if k == 2:
                p.grad[3, 5] = 1e30
            before = p.detach().clone()
            opt.step()
            moved = (p.detach() - before).abs()
            self.assertLessEqual(moved.max().item(), 10 * 1e-3, f"step {k}")
            if k == 2:
                self.assertEqual(moved[3, 5].item(), 0.0)


def _values(kind, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    base = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == "spread":
        x = base * torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-20, 5, generator=gen))
    elif kind == "subnormal":
        x = base * finfo.smallest_normal * 0.5
    elif kind == "huge":
        x = base.sign() * finfo.max * torch.empty(n, dtype=torch.float64).uniform_(0.01, 1, generator=gen)
    elif kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "equal":
        x = torch.full((n,), float(base[0]), dtype=torch.float64)
    else:  # mixed: a few huge and subnormal elements among normal ones
        x = base.clone()
        x[::7] *= finfo.max / 8
        x[3::11] *= finfo.smallest_normal
    return x.to(dtype)


VALUE_KINDS = ["spread", "subnormal", "huge", "zeros", "equal", "mixed"]
HALF_GAP = {s: (torch.diff(create_dynamic_map(s).double()).max() / 2).item() for s in (True, False)}


class TestFromFloat(expecttest.TestCase):
    def test_unsigned_refuses_negative_values(self):
        with self.assertRaisesRegex(
            ValueError,
            r"signed=False.* stores values >= 0 only .*got 1 negative values, "
            r"the smallest -2.5",
        ):
            DTQ8bitTensor.from_float(torch.tensor([1.0, -2.5, 3.0]), signed=False)
        q = DTQ8bitTensor.from_float(torch.tensor([1.0, -0.0, 0.0]), signed=False)  # -0.0 is not negative
        self.assertTrue(torch.equal(q.dequantize(), torch.tensor([1.0, 0.0, 0.0])))


class TestProperties(expecttest.TestCase):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    # a last block of two subnormals, whose absmax has no finite fp32 reciprocal
    @example(n=322, block_size=64, signed=False, dtype=torch.float32, kind="subnormal", seed=10)
    @given(
        n=st.integers(1, 1100),
        block_size=st.sampled_from([64, 256]),
        signed=st.booleans(),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        kind=st.sampled_from(VALUE_KINDS),
        seed=st.integers(0, 2**16),
    )
    def test_round_trip(self, n, block_size, signed, dtype, kind, seed):
        x = _values(kind, n, dtype, seed)
        if not signed:
            x = x.abs()
        q = DTQ8bitTensor.from_float(x, signed=signed, block_size=block_size)
        q.check_fields()
        deq = q.dequantize(torch.float32).double().reshape(-1)
        self.assertTrue(torch.isfinite(deq).all())
        xf = x.double()
        block = torch.arange(n) // block_size
        # one rounding of the fp32 codebook value times the absmax, and of the dtype's conversion
        # (and, for subnormal products, half of fp32's smallest subnormal)
        bound = HALF_GAP[signed] * q.absmax.double()[block] * (1 + 1e-5) + q.absmax.double()[block] * 2**-23 + 2**-150
        self.assertTrue(((deq - xf).abs() <= bound).all())
        if not signed:
            self.assertTrue((deq >= 0).all())
        self.assertTrue(
            torch.equal(q.absmax.double(), torch.stack([xf[block == b].abs().max() for b in range(q.absmax.numel())]))
        )

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        shape=st.sampled_from([(300,), (17, 31), (4, 3, 100)]),
        kinds=st.lists(st.sampled_from(VALUE_KINDS), min_size=3, max_size=3),
        amsgrad=st.booleans(),
        maximize=st.booleans(),
        seed=st.integers(0, 2**16),
        fused=st.sampled_from([None, False]),
    )
    def test_step_is_torch_optims_on_the_same_input(self, shape, kinds, amsgrad, maximize, seed, fused):
        """From the same parameter and (dequantized) state, and the same gradient, of any magnitude: our
        update is torch.optim.AdamW's, to fp32 rounding, wherever torch's new state is finite; where it is
        not (a non-finite gradient, or a moment that overflows), our element does not move and stays finite."""
        kw = dict(lr=1e-2, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize)
        p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
        # fused None: the fused CPU step (amsgrad's three states too); False: the compiled path's function, eagerly
        opt = AdamW([p], compile=False, fused=fused, min_quant_size=0, block_size=64, **kw)
        for k, kind in enumerate(kinds):
            g = _values(kind, p.numel(), torch.float32, seed + k).view(shape)
            if k == 1:
                g.view(-1)[0] = float("nan")
            q = torch.nn.Parameter(p.detach().clone())
            ref = torch.optim.AdamW([q], foreach=False, **kw)
            if opt.state:  # a copy: torch.optim would share our step tensor and count every step twice
                ref.load_state_dict(copy.deepcopy(dequantize_state_dict(opt.state_dict())))
            before = p.detach().clone()
            p.grad, q.grad = g.clone(), g.clone()
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
                ref.step()
            ours, theirs = (p.detach() - before).reshape(-1), (q.detach() - before).reshape(-1)
            ok = (torch.isfinite(ref.state[q]["exp_avg"]) & torch.isfinite(ref.state[q]["exp_avg_sq"])).reshape(-1)
            self.assertTrue(torch.isfinite(p).all())
            self.assertTrue(torch.equal(ours[~ok], torch.zeros_like(ours[~ok])), f"step {k} {kind}")
            ulp = before.abs().reshape(-1).clamp_min(1.0) * 2**-22
            tol = 1e-5 * theirs.abs() + ulp
            self.assertTrue(((ours - theirs).abs()[ok] <= tol[ok]).all(), f"step {k} {kind}")
            for key in ("exp_avg", "exp_avg_sq"):
                state = opt.state[p][key]
                self.assertTrue(torch.isfinite(state.absmax).all())


def _steps_with_grads(make_grad, n=6):
    """Parameters after ``n`` AdamW8bit steps whose gradients ``make_grad(i, values)`` returns (the values of
    step i's gradient, in whatever layout it makes); the parameter has whole blocks, so the fused path takes it."""
    p = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(5)))
    opt = AdamW8bit([p], min_quant_size=0)
    for i in range(n):
        p.grad = make_grad(i, torch.randn(64, 64, generator=torch.Generator().manual_seed(i)))
        opt.step()
    return p.detach()


def test_a_gradient_replaced_by_a_view_at_the_same_address_is_read_by_its_strides():
    # p.grad = p.grad.t(), values written through the view: the address the plan holds is unchanged, the layout
    # is not. The step must notice (every step checks contiguity, not only when an address changes).
    def run(transposed_view):
        p = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(5)))
        opt = AdamW8bit([p], min_quant_size=0)
        buffer = None
        for i in range(6):
            g = torch.randn(64, 64, generator=torch.Generator().manual_seed(i))
            if transposed_view and i >= 2:
                buffer = p.grad if i == 2 else buffer  # the gradient of step 1: contiguous, where the plan reads
                p.grad = buffer.t().copy_(g)  # the values g at that address, column-major
                assert not p.grad.is_contiguous() and p.grad.data_ptr() == buffer.data_ptr()
            else:
                p.grad = g
            opt.step()
        return p.detach()

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=1e-6)


def test_a_gradient_that_moves_to_a_non_contiguous_tensor_is_read_by_its_strides():
    # the fused plans cache where each gradient is and read it as contiguous: one that moves to a transposed
    # layout (the same values) is planned again, onto the path that reads strides; before, the plan read its
    # memory in the wrong order
    expected = _steps_with_grads(lambda i, g: g.clone())
    got = _steps_with_grads(lambda i, g: g.t().contiguous().t() if i >= 2 else g.clone())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
