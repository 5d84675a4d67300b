import torch
from torch._inductor.utils import run_and_get_code

from torchao_optim import DTQ8bitTensor, create_dynamic_map
from torchao_optim.testing import StateFormatTestCase


class TestDTQ8(StateFormatTestCase):
    format_name = "dtq8"
    # half the widest gap of each map: 0.9/64/2 (signed, top decade) and 0.9/128/2 (unsigned)
    max_error = {True: 0.9 / 128, False: 0.9 / 256}

    def test_repr_is_metadata_only(self):
        q = DTQ8bitTensor.zeros((4, 1024), signed=True)
        self.assertExpectedInline(
            repr(q), """DTQ8bitTensor(shape=(4, 1024), dtype=torch.float32, device=cpu, signed=True, block_size=256)"""
        )

    def test_fields(self):
        x = torch.randn(3, 1000)
        q = DTQ8bitTensor.from_float(x, signed=True)
        self.assertEqual(q.codes.dtype, torch.uint8)
        self.assertEqual(q.codes.shape, (3000,))
        self.assertEqual(q.absmax.dtype, torch.float32)
        self.assertEqual(q.absmax.shape, (12,))  # ceil(3000 / 256): the last block is short
        self.assertTrue(q.signed)
        self.assertEqual(q.block_size, 256)
        # codes index the sorted map, as bitsandbytes' do
        table = create_dynamic_map(True)
        self.assertTrue(torch.equal(q.dequantize().view(-1)[:256], table[q.codes[:256].long()] * q.absmax[0]))
        with self.assertRaisesRegex(TypeError, "signed"):
            DTQ8bitTensor.zeros((10,))

    def test_compiled_state_update_is_one_kernel(self):
        def step(state, g, w):
            state.copy_(state.dequantize().lerp(g, w))

        q = DTQ8bitTensor.from_float(torch.randn(8192), signed=True)
        _, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=True), q, torch.randn(8192), 0.1)
        kernels = sum(src.count("async_compile.cpp_pybinding(") + src.count("async_compile.triton(") for src in code)
        self.assertExpectedInline(str(kernels), """1""")
