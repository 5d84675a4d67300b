"""The shared test case every state format inherits.

A format's test module subclasses :class:`StateFormatTestCase`, sets ``format_name`` and the error bound
of its codebook, and so gets every check below: construction, the op table (each op against the
dequantized reference), checkpoints, devices, edge input and ``torch.compile``. A new format is covered
by that subclass alone, never by editing a list.
"""

from __future__ import annotations

import pickle
import unittest

import expecttest
import torch

from torchao_optim.optim.compiled import compiled
from torchao_optim.state import get_state_format
from torchao_optim.testing.compare import Failures, assert_same_tensor, save_load

__all__ = ["StateFormatTestCase", "requires_cuda"]

requires_cuda = unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")


def _state_copy(state, value):
    state.copy_(value)


def _state_lerp(state, g, w):
    state.copy_(state.dequantize().lerp(g, w))


class StateFormatTestCase(expecttest.TestCase):
    """Set ``format_name``; ``max_error`` is the largest |x - dequantize(quantize(x))| allowed, as a fraction
    of the block's absmax, for ``signed=True`` and ``signed=False``; ``block_size`` (default 256) is the block
    size every check quantizes with (set it to the format's ``default_block_size`` where that differs). A format
    whose scales are not per block overrides :meth:`quant_errors`. docs/adding-a-format.md lists the rest."""

    format_name: str = ""
    max_error = {True: 0.0, False: 0.0}
    block_size = 256
    __test__ = False  # collected only through subclasses that name a format

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__test__ = bool(cls.format_name)

    @classmethod
    def setUpClass(cls):
        cls.fmt = get_state_format(cls.format_name)
        # Compiled functions of the class's own, each with a dynamo cache of its own: a format needs a few graphs,
        # and in one cache shared by every format they would reach dynamo's recompile limit (8) with the fifth
        # format. Nothing is lost: one format's graphs never serve another.
        cls.compiled_copy = staticmethod(compiled(_state_copy, isolated=True))
        cls.compiled_lerp = staticmethod(compiled(_state_lerp, isolated=True))

    def setUp(self):
        torch.manual_seed(0)

    # ---- helpers ------------------------------------------------------------------------------------
    def quantize(self, x, signed=True):
        return self.fmt.from_float(x, signed=signed, block_size=self.block_size)

    def sample(self, *shape, signed=True):
        """Values spanning many decades, like optimizer state."""
        x = torch.randn(*shape) * torch.exp(torch.empty(*shape).uniform_(-8, 2))
        return x if signed else x.abs()

    def failures(self) -> Failures:
        """A :class:`~torchao_optim.testing.compare.Failures` naming this case's format and block size."""
        return Failures(self, f"format {self.format_name!r} (block_size={self.block_size})")

    def assertBitEqual(self, a, b, what: str = ""):
        assert_same_tensor(
            self, a, b, f"format {self.format_name!r}: {what}" if what else f"format {self.format_name!r}"
        )

    def quant_errors(self, q, x, signed=True):
        """Where ``q`` is further from ``x`` than ``max_error`` allows: a line (what was measured, the bound) if
        any block is; empty if none. A format whose scales are not per block overrides this."""
        deq = q.dequantize().float().reshape(-1)
        flat = x.float().reshape(-1)
        bs = self.block_size
        over, worst = [], (0.0, 0, 0.0)  # blocks over the bound; (error / absmax, block, error) of the worst
        for start in range(0, flat.numel(), bs):
            blk, got = flat[start : start + bs], deq[start : start + bs]
            finite = torch.isfinite(blk)
            absmax = blk[finite].abs().max().item() if finite.any() else 0.0
            err = (blk - got)[finite].abs().max().item() if finite.any() else 0.0
            bound = self.max_error[signed] * absmax * (1 + 1e-5) + 1e-30  # + fp32 rounding
            if not err <= bound:
                over.append(start // bs)
                worst = max(worst, (err / max(absmax, 1e-30), start // bs, err))
        if not over:
            return []
        return [
            f"signed={signed}, shape {tuple(x.shape)}: {len(over)} of {-(-flat.numel() // bs)} blocks over the "
            f"bound; the worst, block {worst[1]}, has a round-trip error of {worst[0]:.4g} of its absmax "
            f"({worst[2]:.4g}), bound max_error={self.max_error[signed]:.4g}"
        ]

    def assertWithinQuantError(self, q, x, signed=True):
        with self.failures() as check:
            check.lines += self.quant_errors(q, x, signed)

    # ---- construction -------------------------------------------------------------------------------
    def test_from_float_round_trip_error(self):
        with self.failures() as check:
            for signed in (True, False):
                for shape in [(4096,), (16, 256), (1000, 3), (300,)]:
                    x = self.sample(*shape, signed=signed)
                    q = self.quantize(x, signed)
                    check.values(
                        (type(q), q.shape, q.dtype),
                        (self.fmt, x.shape, torch.float32),
                        f"signed={signed}, shape {shape}: type, shape, dtype",
                    )
                    check.lines += self.quant_errors(q, x, signed)

    def test_zeros(self):
        with self.failures() as check:
            for signed in (True, False):
                z = self.fmt.zeros((7, 300), signed=signed, block_size=self.block_size)
                check.values(z.shape, (7, 300), f"signed={signed}: zeros((7, 300)).shape")
                check.equal(z.dequantize(), torch.zeros(7, 300), f"signed={signed}, shape (7, 300): zeros")
            check.values(
                self.fmt.zeros((10,), signed=True, dtype=torch.bfloat16).dequantize().dtype,
                torch.bfloat16,
                "zeros(dtype=torch.bfloat16).dequantize().dtype",
            )

    def test_edge_input(self):
        # empty, all-zero blocks, a short last block, non-contiguous input
        bs = self.block_size
        with self.failures() as check:
            check.values(tuple(self.quantize(torch.empty(0)).dequantize().shape), (0,), "shape (0,): dequantized shape")
            x = torch.zeros(3 * bs)
            x[bs + 5] = 3.0
            deq = self.quantize(x).dequantize()
            check.equal(deq[:bs], torch.zeros(bs), f"shape {tuple(x.shape)}: an all-zero block")
            check.values(deq[bs + 5].item(), 3.0, f"shape {tuple(x.shape)}: a block's only nonzero element")
            x = self.sample(bs * 2 + 17)
            check.lines += self.quant_errors(self.quantize(x), x)
            x = self.sample(64, 48).t()
            check.that(not x.is_contiguous(), "the transposed sample is contiguous")
            check.equal(
                self.quantize(x).dequantize(),
                self.quantize(x.contiguous()).dequantize(),
                "shape (48, 64), non-contiguous against contiguous",
            )

    def test_non_finite_stays_in_its_element(self):
        x = self.sample(2 * self.block_size)
        ref = self.quantize(x).dequantize()
        with self.failures() as check:
            for bad in (float("nan"), float("inf"), float("-inf")):
                y = x.clone()
                y[3] = bad
                deq = self.quantize(y).dequantize()
                others = torch.ones_like(x, dtype=torch.bool)
                others[3] = False
                check.equal(deq[others], ref[others], f"shape {tuple(x.shape)}, {bad} at element 3: the others")
                check.that(
                    torch.isfinite(deq[3]),
                    f"shape {tuple(x.shape)}: {bad} was stored as {deq[3].item()}, expected a finite value",
                )

    def test_bad_input(self):
        with self.assertRaisesRegex(TypeError, "int64", msg=f"format {self.format_name!r}"):
            self.fmt.from_float(torch.arange(4096), signed=True)
        with self.assertRaisesRegex(TypeError, "float64", msg=f"format {self.format_name!r}"):
            self.fmt.zeros((4096,), signed=True, dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "block_size", msg=f"format {self.format_name!r}"):
            self.fmt.zeros((4096,), signed=True, block_size=0)

    # ---- the op table -------------------------------------------------------------------------------
    def test_out_of_place_ops_match_dequantized_reference(self):
        x, y = self.sample(2, 700), self.sample(2, 700)
        q = self.quantize(x)
        d = q.dequantize()
        other = self.quantize(y.abs(), signed=False)
        cases = {
            "lerp": (lambda t: t.lerp(y, 0.1), lambda t: t.lerp(y, 0.1)),
            "lerp_tensor": (lambda t: torch.lerp(t, y, torch.tensor(0.3)), None),
            "mul": (lambda t: t * 0.5, None),
            "mul_tensor": (lambda t: t * y, None),
            "add": (lambda t: t.add(y, alpha=2.0), None),
            "add_scalar": (lambda t: t + 1.5, None),
            "sub": (lambda t: t - y, None),
            "addcmul": (lambda t: t.addcmul(y, y, value=0.1), None),
            "addcdiv": (lambda t: t.addcdiv(y, y.abs() + 1, value=0.1), None),
            "sqrt": (lambda t: t.abs().sqrt(), None),
            "div": (lambda t: t / 3.0, None),
            "div_tensor": (lambda t: t / (y.abs() + 1), None),
            "maximum": (lambda t: torch.maximum(t, y), None),
            "neg": (lambda t: -t, None),
            "where": (lambda t: torch.where(y > 0, t, y), None),
        }
        with self.failures() as check:
            for name, (op, _) in cases.items():
                out = op(q)
                if check.values(type(out), torch.Tensor, f"{name}, shape (2, 700): type of the result"):
                    check.equal(out, op(d), f"{name}, shape (2, 700): against the dequantized reference")
            # both operands quantized
            check.equal(q * other, d * other.dequantize(), "mul, shape (2, 700), both operands quantized")

    def test_in_place_ops_requantize_once(self):
        x, y = self.sample(3, 1000), self.sample(3, 1000)
        cases = {
            "lerp_": lambda t: t.lerp_(y, 0.1),
            "mul_": lambda t: t.mul_(0.9),
            "mul_tensor_": lambda t: t.mul_(y),
            "add_": lambda t: t.add_(y, alpha=0.5),
            "sub_": lambda t: t.sub_(y),
            "addcmul_": lambda t: t.addcmul_(y, y, value=0.01),
            "addcdiv_": lambda t: t.addcdiv_(y, y.abs() + 1, value=0.01),
            "div_": lambda t: t.div_(2.0),
            "neg_": lambda t: t.neg_(),
        }
        with self.failures() as check:
            for name, op in cases.items():
                q = self.quantize(x)
                expected = self.quantize(op(q.dequantize().clone()))
                out = op(q)
                check.that(out is q, f"{name}: returned a new tensor, not its input")
                check.same(q, expected, f"{name}, shape (3, 1000): against the requantized reference")

    def test_in_place_on_plain_tensor_with_quantized_argument(self):
        # torch.optim's param.addcdiv_(exp_avg, denom) with a quantized exp_avg
        p, x = torch.randn(4096), self.sample(4096)
        q = self.quantize(x)
        with self.failures() as check:
            check.equal(
                p.clone().add_(q, alpha=-0.1), p.clone().add_(q.dequantize(), alpha=-0.1), "add_, shape (4096,)"
            )
            check.equal(
                p.clone().addcdiv_(q, p.abs() + 1, value=-0.1),
                p.clone().addcdiv_(q.dequantize(), p.abs() + 1, value=-0.1),
                "addcdiv_, shape (4096,)",
            )

    def test_copy(self):
        x = self.sample(4, 1024)
        with self.failures() as check:
            # float -> quantized requantizes
            q = self.fmt.zeros(x.shape, signed=True, block_size=self.block_size)
            q.copy_(x)
            check.same(q, self.quantize(x), "shape (4, 1024), float into quantized")
            # quantized -> float dequantizes
            out = torch.empty_like(x)
            out.copy_(q)
            check.equal(out, q.dequantize(), "shape (4, 1024), quantized into float")
            # quantized -> quantized copies the fields
            r = self.fmt.zeros(x.shape, signed=True, block_size=self.block_size)
            r.copy_(q)
            check.same(r, q, "shape (4, 1024), quantized into quantized")
            # a different layout goes through float
            u = self.fmt.zeros(x.shape, signed=False, block_size=self.block_size)
            signed_q = self.quantize(x.abs())
            u.copy_(signed_q)
            check.same(u, self.quantize(signed_q.dequantize(), signed=False), "shape (4, 1024), signed into unsigned")
            # broadcasting from a scalar tensor
            q.copy_(torch.tensor(0.0))
            check.equal(q.dequantize(), torch.zeros_like(x), "shape (4, 1024), a 0-d tensor broadcast")

    def test_constructors_like(self):
        q = self.quantize(self.sample(5, 999))
        with self.failures() as check:
            for name, z in (
                ("zeros_like", torch.zeros_like(q)),
                ("empty_like", torch.empty_like(q)),
                ("new_zeros", q.new_zeros((5, 999))),
            ):
                if check.values(type(z), self.fmt, f"{name}, shape (5, 999): type"):
                    check.values(z.attrs(), q.attrs(), f"{name}, shape (5, 999): attributes")
                    check.equal(z.dequantize(), torch.zeros(5, 999), f"{name}, shape (5, 999)")
            check.values(q.new_zeros((3, 4)).shape, (3, 4), "new_zeros((3, 4)).shape")
            check.that(q.zero_() is q, "zero_ returned a new tensor, not its input")
            check.equal(q.dequantize(), torch.zeros(5, 999), "zero_, shape (5, 999)")

    def test_clone_detach(self):
        q = self.quantize(self.sample(4096))
        with self.failures() as check:
            c, d = q.clone(), q.detach()
            check.same(c, q, "shape (4096,), clone")
            check.same(d, q, "shape (4096,), detach")
            q.mul_(0.0)
            check.that(not torch.equal(c.dequantize(), q.dequantize()), "shape (4096,): a clone follows its source")
            check.same(d, q, "shape (4096,), detach after its source changed")  # detach shares storage

    def test_to_dtype_and_device(self):
        q = self.quantize(self.sample(4096))
        with self.failures() as check:
            b = q.to(torch.bfloat16)
            if check.values((type(b), b.dtype), (self.fmt, torch.bfloat16), "to(torch.bfloat16): type and dtype"):
                check.equal(b.dequantize(), q.dequantize().to(torch.bfloat16), "shape (4096,), to(torch.bfloat16)")
            check.same(q.to("cpu"), q, "shape (4096,), to('cpu')")
            check.same(q.cpu(), q, "shape (4096,), cpu()")
            check.that(not q.is_pinned(), "is_pinned() of a tensor in pageable memory")
            if torch.cuda.is_available():
                g = q.cuda()
                if check.values((type(g), g.device.type), (self.fmt, "cuda"), "cuda(): type and device"):
                    check.same(g.cpu(), q, "shape (4096,), cuda() then cpu()")
                    check.equal(g.dequantize().cpu(), q.dequantize(), "shape (4096,), dequantized on CUDA")

    def test_view_reshape_slice(self):
        row = self.block_size * -(-512 // self.block_size)  # whole blocks, at least 512 elements
        x = self.sample(8, row)
        q = self.quantize(x)
        with self.failures() as check:
            for v in (q.view(-1), q.reshape(8 * row), q.view(4, 2 * row), q.flatten()):
                what = f"shape (8, {row}) viewed as {tuple(v.shape)}"
                if check.values(type(v), self.fmt, f"{what}: type"):
                    check.equal(v.dequantize(), q.dequantize().reshape(v.shape), what)
            s = q[2:6]  # rows 2..5: whole blocks
            if check.values(tuple(s.shape), (4, row), f"shape (8, {row}), rows [2:6]: shape"):
                check.equal(s.dequantize(), q.dequantize()[2:6], f"shape (8, {row}), rows [2:6]")
                s.copy_(torch.zeros(4, row))  # a slice is a view: writes reach the parent
                check.equal(q.dequantize()[2:6], torch.zeros(4, row), f"shape (8, {row}), a write to rows [2:6]")
        with self.assertRaisesRegex(ValueError, "block boundary", msg=f"format {self.format_name!r}"):
            self.quantize(self.sample(10, self.block_size + 1))[1:3]  # row 1 starts one element into a block
        if not type(q).column_shardable:
            with self.assertRaisesRegex(NotImplementedError, "dim 0", msg=f"format {self.format_name!r}"):
                q[:, :256]
            return
        # columns (tensor parallelism's Shard(1)): whole blocks of each row, a view that writes reach
        bs, last = self.block_size, f"shape (8, {row}), columns [{row - self.block_size}:]"  # each row's last block
        with self.failures() as check:
            c = q[:, row - bs :]
            check.equal(c.dequantize(), q.dequantize()[:, row - bs :], last)
            c.copy_(torch.zeros(8, bs))
            check.equal(q.dequantize()[:, row - bs :], torch.zeros(8, bs), f"{last}: a write")
        with self.assertRaisesRegex(ValueError, "not whole blocks", msg=f"format {self.format_name!r}"):
            q[:, 1 : bs + 1]

    def test_slice_bounds_are_clamped_as_torch_clamps_them(self):
        # negative bounds count from the end and stop at the start, bounds past either end are clamped, an end
        # before the start is empty (wherever it lies), and a step that selects at most one row is that row
        u = max(self.block_size, 256)  # bounds on block boundaries: a quantized state is sliced in whole blocks
        q = self.quantize(self.sample(2 * u))
        rows = self.quantize(self.sample(4, u))
        bounds = (None, -4 * u, -3 * u, -2 * u, -u, 0, u, 2 * u, 3 * u, 4 * u)
        cases = [(q, slice(a, b)) for a in bounds for b in bounds]
        cases += [
            (q, slice(300, 300)),
            (q, slice(300, 100)),
            (q, slice(-100, 5)),
            (rows, slice(1, 3, 7)),
            (rows, slice(-7, 2)),
            (rows, slice(3, -9)),
        ]
        for t, index in cases:
            got, want = t[index], t.dequantize()[index]
            self.assertIs(type(got), self.fmt, index)
            self.assertEqual(got.shape, want.shape, index)
            self.assertTrue(torch.equal(got.dequantize(), want), index)
        with self.assertRaisesRegex(NotImplementedError, "step=2"):
            rows[::2]

    def test_equal(self):
        q = self.quantize(self.sample(4096))
        with self.failures() as check:
            check.that(torch.equal(q, q.clone()), "torch.equal(q, q.clone()) is False, expected True")
            check.that(torch.equal(q, q.dequantize()), "torch.equal(q, q.dequantize()) is False, expected True")
            check.that(not torch.equal(q, q.dequantize() + 1), "torch.equal(q, q.dequantize() + 1) is True")

    def test_unsupported_op_names_op_and_docs(self):
        q = self.quantize(self.sample(4096))
        with self.assertRaisesRegex(
            NotImplementedError, r"aten\.exp\.default.*Adding an op", msg=f"format {self.format_name!r}"
        ):
            torch.exp(q)

    # ---- checkpoints --------------------------------------------------------------------------------
    def test_save_load_weights_only_and_pickle(self):
        q = self.quantize(self.sample(3, 1000))
        with self.failures() as check:
            check.same(save_load({"state": q})["state"], q, "shape (3, 1000), torch.save and torch.load")
            check.same(pickle.loads(pickle.dumps(q)), q, "shape (3, 1000), pickle")

    # ---- torch.compile --------------------------------------------------------------------------------
    def test_compiled_equals_eager_bit_for_bit(self):
        with self.failures() as check:
            for n in (4096, 3 * self.block_size + 17):
                x = self.sample(n)
                eager = self.fmt.zeros((n,), signed=True, block_size=self.block_size)
                comp = self.fmt.zeros((n,), signed=True, block_size=self.block_size)
                _state_copy(eager, x)
                self.compiled_copy(comp, x)
                check.same(comp, eager, f"shape ({n},), copy_ compiled against eager")
                g = self.sample(n)
                _state_lerp(eager, g, 0.25)
                self.compiled_lerp(comp, g, 0.25)
                # lerp itself may round differently in a fused kernel (FMA); the state must agree to within
                # one code, which is exactly what dequantize shows
                a, b = comp.dequantize(), eager.dequantize()
                rel = ((a - b).abs() / b.abs().clamp_min(1e-30)).max()
                check.that(
                    torch.allclose(a, b, rtol=0.02, atol=1e-30),
                    f"shape ({n},), lerp compiled against eager: relative difference up to {rel.item():.4g}, "
                    f"bound 0.02",
                )
