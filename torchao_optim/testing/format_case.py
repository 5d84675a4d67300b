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
from torchao_optim.testing.compare import assert_same_tensor, save_load

__all__ = ["StateFormatTestCase", "requires_cuda"]

requires_cuda = unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")


def _state_copy(state, value):
    state.copy_(value)


def _state_lerp(state, g, w):
    state.copy_(state.dequantize().lerp(g, w))



class StateFormatTestCase(expecttest.TestCase):
    """Set ``format_name``; ``max_error`` is the largest |x - dequantize(quantize(x))| allowed, as a fraction
    of the block's absmax, for ``signed=True`` and ``signed=False``."""

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

    def assertBitEqual(self, a, b):
        assert_same_tensor(self, a, b)

    def assertWithinQuantError(self, q, x, signed=True):
        deq = q.dequantize().float().reshape(-1)
        flat = x.float().reshape(-1)
        bs = self.block_size
        for start in range(0, flat.numel(), bs):
            blk, got = flat[start : start + bs], deq[start : start + bs]
            finite = torch.isfinite(blk)
            absmax = blk[finite].abs().max() if finite.any() else torch.tensor(0.0)
            err = (blk - got)[finite].abs().max() if finite.any() else torch.tensor(0.0)
            bound = self.max_error[signed] * absmax.item() * (1 + 1e-5) + 1e-30  # + fp32 rounding
            self.assertLessEqual(err.item(), bound)

    # ---- construction -------------------------------------------------------------------------------
    def test_from_float_round_trip_error(self):
        for signed in (True, False):
            for shape in [(4096,), (16, 256), (1000, 3), (300,)]:
                x = self.sample(*shape, signed=signed)
                q = self.quantize(x, signed)
                self.assertIsInstance(q, self.fmt)
                self.assertEqual(q.shape, x.shape)
                self.assertEqual(q.dtype, torch.float32)
                self.assertWithinQuantError(q, x, signed)

    def test_zeros(self):
        for signed in (True, False):
            z = self.fmt.zeros((7, 300), signed=signed, block_size=self.block_size)
            self.assertEqual(z.shape, (7, 300))
            self.assertTrue(torch.equal(z.dequantize(), torch.zeros(7, 300)))
        self.assertEqual(self.fmt.zeros((10,), signed=True, dtype=torch.bfloat16).dequantize().dtype, torch.bfloat16)

    def test_edge_input(self):
        # empty, all-zero blocks, a short last block, non-contiguous input
        self.assertEqual(self.quantize(torch.empty(0)).dequantize().shape, (0,))
        x = torch.zeros(3 * self.block_size)
        x[self.block_size + 5] = 3.0
        deq = self.quantize(x).dequantize()
        self.assertTrue(torch.equal(deq[: self.block_size], torch.zeros(self.block_size)))
        self.assertEqual(deq[self.block_size + 5].item(), 3.0)
        x = self.sample(self.block_size * 2 + 17)
        self.assertWithinQuantError(self.quantize(x), x)
        x = self.sample(64, 48).t()
        self.assertFalse(x.is_contiguous())
        self.assertTrue(torch.equal(self.quantize(x).dequantize(), self.quantize(x.contiguous()).dequantize()))

    def test_non_finite_stays_in_its_element(self):
        x = self.sample(2 * self.block_size)
        ref = self.quantize(x).dequantize()
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[3] = bad
            deq = self.quantize(y).dequantize()
            others = torch.ones_like(x, dtype=torch.bool)
            others[3] = False
            self.assertTrue(torch.equal(deq[others], ref[others]), f"{bad} changed other elements")
            self.assertTrue(torch.isfinite(deq[3]), f"{bad} was stored as {deq[3]}")

    def test_bad_input(self):
        with self.assertRaisesRegex(TypeError, "int64"):
            self.fmt.from_float(torch.arange(4096), signed=True)
        with self.assertRaisesRegex(TypeError, "float64"):
            self.fmt.zeros((4096,), signed=True, dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "block_size"):
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
        for name, (op, _) in cases.items():
            out = op(q)
            self.assertIs(type(out), torch.Tensor, name)
            self.assertTrue(torch.equal(out, op(d)), name)
        # both operands quantized
        self.assertTrue(torch.equal(q * other, d * other.dequantize()))

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
        for name, op in cases.items():
            q = self.quantize(x)
            expected = self.quantize(op(q.dequantize().clone()))
            out = op(q)
            self.assertIs(out, q, name)
            self.assertBitEqual(q, expected)

    def test_in_place_on_plain_tensor_with_quantized_argument(self):
        # torch.optim's param.addcdiv_(exp_avg, denom) with a quantized exp_avg
        p, x = torch.randn(4096), self.sample(4096)
        q = self.quantize(x)
        self.assertTrue(torch.equal(p.clone().add_(q, alpha=-0.1), p.clone().add_(q.dequantize(), alpha=-0.1)))
        self.assertTrue(torch.equal(p.clone().addcdiv_(q, p.abs() + 1, value=-0.1),
                                    p.clone().addcdiv_(q.dequantize(), p.abs() + 1, value=-0.1)))

    def test_copy(self):
        x = self.sample(4, 1024)
        # float -> quantized requantizes
        q = self.fmt.zeros(x.shape, signed=True, block_size=self.block_size)
        q.copy_(x)
        self.assertBitEqual(q, self.quantize(x))
        # quantized -> float dequantizes
        out = torch.empty_like(x)
        out.copy_(q)
        self.assertTrue(torch.equal(out, q.dequantize()))
        # quantized -> quantized copies the fields
        r = self.fmt.zeros(x.shape, signed=True, block_size=self.block_size)
        r.copy_(q)
        self.assertBitEqual(r, q)
        # a different layout goes through float
        u = self.fmt.zeros(x.shape, signed=False, block_size=self.block_size)
        signed_q = self.quantize(x.abs())
        u.copy_(signed_q)
        self.assertBitEqual(u, self.quantize(signed_q.dequantize(), signed=False))
        # broadcasting from a scalar tensor
        q.copy_(torch.tensor(0.0))
        self.assertTrue(torch.equal(q.dequantize(), torch.zeros_like(x)))

    def test_constructors_like(self):
        q = self.quantize(self.sample(5, 999))
        for z in (torch.zeros_like(q), torch.empty_like(q), q.new_zeros((5, 999))):
            self.assertIs(type(z), self.fmt)
            self.assertEqual(z.attrs(), q.attrs())
            self.assertTrue(torch.equal(z.dequantize(), torch.zeros(5, 999)))
        self.assertEqual(q.new_zeros((3, 4)).shape, (3, 4))
        self.assertIs(q.zero_(), q)
        self.assertTrue(torch.equal(q.dequantize(), torch.zeros(5, 999)))

    def test_clone_detach(self):
        q = self.quantize(self.sample(4096))
        c, d = q.clone(), q.detach()
        self.assertBitEqual(c, q)
        self.assertBitEqual(d, q)
        q.mul_(0.0)
        self.assertFalse(torch.equal(c.dequantize(), q.dequantize()))  # clone is independent
        self.assertBitEqual(d, q)  # detach shares storage

    def test_to_dtype_and_device(self):
        q = self.quantize(self.sample(4096))
        b = q.to(torch.bfloat16)
        self.assertIs(type(b), self.fmt)
        self.assertEqual(b.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(b.dequantize(), q.dequantize().to(torch.bfloat16)))
        self.assertBitEqual(q.to("cpu"), q)
        self.assertBitEqual(q.cpu(), q)
        self.assertFalse(q.is_pinned())
        if torch.cuda.is_available():
            g = q.cuda()
            self.assertIs(type(g), self.fmt)
            self.assertEqual(g.device.type, "cuda")
            self.assertBitEqual(g.cpu(), q)
            self.assertTrue(torch.equal(g.dequantize().cpu(), q.dequantize()))

    def test_view_reshape_slice(self):
        row = self.block_size * -(-512 // self.block_size)  # whole blocks, at least 512 elements
        x = self.sample(8, row)
        q = self.quantize(x)
        for v in (q.view(-1), q.reshape(8 * row), q.view(4, 2 * row), q.flatten()):
            self.assertIs(type(v), self.fmt)
            self.assertTrue(torch.equal(v.dequantize(), q.dequantize().reshape(v.shape)))
        s = q[2:6]  # rows 2..5: whole blocks
        self.assertEqual(s.shape, (4, row))
        self.assertTrue(torch.equal(s.dequantize(), q.dequantize()[2:6]))
        s.copy_(torch.zeros(4, row))  # a slice is a view: writes reach the parent
        self.assertTrue(torch.equal(q.dequantize()[2:6], torch.zeros(4, row)))
        with self.assertRaisesRegex(ValueError, "block boundary"):
            self.quantize(self.sample(10, self.block_size + 1))[1:3]  # row 1 starts one element into a block
        with self.assertRaisesRegex(NotImplementedError, "dim 0"):
            q[:, :256]

    def test_equal(self):
        q = self.quantize(self.sample(4096))
        self.assertTrue(torch.equal(q, q.clone()))
        self.assertTrue(torch.equal(q, q.dequantize()))
        self.assertFalse(torch.equal(q, q.dequantize() + 1))

    def test_unsupported_op_names_op_and_docs(self):
        q = self.quantize(self.sample(4096))
        with self.assertRaisesRegex(NotImplementedError, r"aten\.exp\.default.*Adding an op"):
            torch.exp(q)

    # ---- checkpoints --------------------------------------------------------------------------------
    def test_save_load_weights_only_and_pickle(self):
        q = self.quantize(self.sample(3, 1000))
        loaded = save_load({"state": q})["state"]
        self.assertBitEqual(loaded, q)
        self.assertBitEqual(pickle.loads(pickle.dumps(q)), q)

    # ---- torch.compile --------------------------------------------------------------------------------
    def test_compiled_equals_eager_bit_for_bit(self):
        for n in (4096, 3 * self.block_size + 17):
            x = self.sample(n)
            eager = self.fmt.zeros((n,), signed=True, block_size=self.block_size)
            comp = self.fmt.zeros((n,), signed=True, block_size=self.block_size)
            _state_copy(eager, x)
            self.compiled_copy(comp, x)
            self.assertBitEqual(comp, eager)
            g = self.sample(n)
            _state_lerp(eager, g, 0.25)
            self.compiled_lerp(comp, g, 0.25)
            # lerp itself may round differently in a fused kernel (FMA); the state must agree to within
            # one code, which is exactly what dequantize shows
            self.assertTrue(torch.allclose(comp.dequantize(), eager.dequantize(), rtol=0.02, atol=1e-30))
