import torch

from torchao_optim import AdamFp8, AdamWFp8, Fp8Tensor
from torchao_optim.quant import bucket_tables
from torchao_optim.state.fp8 import float8_codebook
from torchao_optim.testing import StateFormatTestCase


def _fp32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


class TestFp8(StateFormatTestCase):
    format_name = "fp8"
    # half the widest gap: e4m3's top binade [256, 448] has steps of 32, so 16/448 of the absmax; the unsigned
    # e4m4's top binade steps by 1/16 of 2**e against a largest value of 31/16 * 2**e, so 1/62
    max_error = {True: 16 / 448, False: 1 / 62}

    def test_repr_is_metadata_only(self):
        self.assertExpectedInline(
            repr(Fp8Tensor.zeros((4, 1024), signed=False)),
            """Fp8Tensor(shape=(4, 1024), dtype=torch.float32, device=cpu, signed=False, block_size=256)""",
        )

    def test_fields(self):
        q = Fp8Tensor.from_float(torch.randn(3, 1000), signed=True)
        self.assertEqual((q.codes.dtype, tuple(q.codes.shape)), (torch.uint8, (3000,)))
        self.assertEqual((q.absmax.dtype, tuple(q.absmax.shape)), (torch.float32, (12,)))
        self.assertEqual(q.fast_path_layout().bits, 8)

    def test_codebooks_are_the_float8_values(self):
        e4m3 = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
        finite = torch.unique(e4m3[torch.isfinite(e4m3)])
        self.assertEqual(len(float8_codebook("e4m3", True)), 253)  # 256 - 2 NaN - (-0.0)
        self.assertTrue(torch.equal(torch.tensor(float8_codebook("e4m3", True)), finite / 448))
        self.assertEqual(len(float8_codebook("e5m2", False)), 124)  # 0x00..0x7B: 0, subnormals, normals
        self.assertEqual(float8_codebook("e5m2", False)[1], _fp32(2.0**-16 / 57344))
        # e4m4: 256 unsigned values, ascending in bit-pattern order; min subnormal 2**-4 * 2**(1-bias), max
        # 31/16 * 2**(15-bias)
        e4m4 = float8_codebook("e4m4", False)
        self.assertEqual(len(e4m4), 256)
        self.assertEqual(e4m4[1], _fp32((2.0**-4 * 2.0) / (31 / 16 * 2.0**15)))
        self.assertEqual(e4m4[-1], 1.0)
        for kind, signed in (("e4m3", True), ("e4m3", False), ("e5m2", False), ("e4m4", False)):
            bucket_tables(float8_codebook(kind, signed), never_zero=not signed)  # the O(1) encoder separates them
        with self.assertRaisesRegex(ValueError, "no sign bit"):
            float8_codebook("e4m4", True)
        with self.assertRaisesRegex(ValueError, "'e3m4'"):
            float8_codebook("e3m4", True)

    def test_float8_bits(self):
        # e4m3 codes map to the real float8_e4m3fn bit patterns, which decode to the same values
        x = self.sample(3, 1000)
        x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 448.0, -448.0])
        q = Fp8Tensor.from_float(x, signed=True)
        values = q.float8_bits().view(torch.float8_e4m3fn).float() / 448
        self.assertTrue(torch.equal(values, torch.tensor(float8_codebook("e4m3", True))[q.codes.long()]))
        self.assertEqual(q.float8_bits()[6].item(), 0x7E)  # 448 is the block's absmax: the largest finite e4m3
        self.assertEqual(q.float8_bits()[7].item(), 0xFE)
        with self.assertRaisesRegex(ValueError, "e4m4, not e4m3"):
            Fp8Tensor.from_float(x.abs(), signed=False).float8_bits()

    def test_second_moment_never_rounds_to_zero(self):
        v = torch.full((256,), 1e-20)
        v[0] = 1.0
        self.assertTrue((Fp8Tensor.from_float(v, signed=False).dequantize()[1:] > 0).all())

    def test_aliases(self):
        p = torch.nn.Parameter(torch.randn(64, 128))
        for cls in (AdamFp8, AdamWFp8):
            opt = cls([p], lr=1e-3, compile=False)
            self.assertEqual(opt.param_groups[0]["state_format"], "fp8")
            p.grad = torch.randn_like(p)
            opt.step()
            self.assertIs(type(opt.state[p]["exp_avg"]), Fp8Tensor)
        self.assertEqual(AdamWFp8([p]).param_groups[0]["weight_decay"], 1e-2)
        with self.assertRaisesRegex(TypeError, "always uses state_format='fp8'"):
            AdamFp8([p], state_format="dtq8")
