import io

import torch

import torchao_optim
from torchao_optim import Adam4bit, AdamW4bit, FourBitRank1Tensor, FourBitTensor
from torchao_optim.state.fourbit import balanced_map, linear_map_without_zero, quadratic_map, square_map
from torchao_optim.testing import StateFormatTestCase, assert_same_tensor


class TestFourBit(StateFormatTestCase):
    format_name = "4bit"
    block_size = 128
    # signed: half the widest gap of the quadratic map (49/64 to 1), and -1 (no -1.0 in the map, as in the
    # dynamic map) stored as -49/64; unsigned: the linear map without zero stores values below 1/32 of the
    # absmax as 1/16, an error of up to 1/16, and elsewhere rounds by half a step, 1/32
    max_error = {True: 15 / 64, False: 1 / 16}

    def test_repr_is_metadata_only(self):
        self.assertExpectedInline(
            repr(FourBitTensor.zeros((4, 1024), signed=True)),
            """FourBitTensor(shape=(4, 1024), dtype=torch.float32, device=cpu, signed=True, block_size=128)""",
        )

    def test_fields(self):
        x = torch.randn(3, 1001)
        q = FourBitTensor.from_float(x, signed=True)
        self.assertEqual((q.codes.dtype, tuple(q.codes.shape)), (torch.uint8, (1502,)))  # two codes per byte
        self.assertEqual((q.absmax.dtype, tuple(q.absmax.shape)), (torch.float32, (24,)))  # ceil(3003 / 128)
        layout = q.fast_path_layout()
        self.assertEqual((layout.bits, layout.block_size, layout.codebook), (4, 128, quadratic_map()))
        u = FourBitTensor.from_float(x.abs(), signed=False)
        self.assertEqual(u.fast_path_layout().codebook, tuple((i + 1) / 16 for i in range(16)))
        # element 2i in the low nibble of byte i
        table = torch.tensor(quadratic_map())
        first = table[(q.codes[0] & 15).long()] * q.absmax[0], table[(q.codes[0] >> 4).long()] * q.absmax[0]
        self.assertEqual((q.dequantize()[0, 0].item(), q.dequantize()[0, 1].item()), tuple(v.item() for v in first))

    def test_second_moment_has_no_zero_level(self):
        # the zero-point problem: a tiny v beside a large one is stored as absmax / 16, never 0
        v = torch.full((128,), 1e-12)
        v[0] = 1.0
        self.assertTrue(
            torch.equal(FourBitTensor.from_float(v, signed=False).dequantize()[1:], torch.full((127,), 1 / 16))
        )
        self.assertEqual(linear_map_without_zero(4)[0], 1 / 16)
        self.assertTrue(torch.equal(FourBitTensor.zeros((300,), signed=False).dequantize(), torch.zeros(300)))

    def test_other_codebooks(self):
        """The maps a subclass may choose (``first_moment``, ``second_moment``): 16 sorted values each."""
        for kind in ("quadratic", "linear", "normal"):
            values = balanced_map(kind)
            self.assertEqual(len(values), 16)
            self.assertEqual(list(values), sorted(values))
            self.assertEqual((values[0], values[7], values[-1]), (-1.0, 0.0, 1.0))
        self.assertEqual(balanced_map("linear")[-2:], (0.875, 1.0))
        with self.assertRaisesRegex(ValueError, "kind must be 'quadratic', 'linear' or 'normal', got 'cubic'"):
            balanced_map("cubic")
        roots = torch.tensor(square_map(4)).sqrt()
        torch.testing.assert_close(roots, torch.arange(1, 17) / 16)  # an even grid of the square root
        # a block whose largest element is negative: the quadratic map stores it at its lowest level, 49/64 of it;
        # a balanced map stores it exactly
        x = torch.linspace(-1.0, 0.5, 128)
        stored = {}
        for first in ("quadratic", "balanced"):
            cls = type("Variant", (FourBitTensor,), {"first_moment": first})
            stored[first] = cls.from_float(x, signed=True).dequantize()[0].item()
        self.assertEqual(stored, {"quadratic": -49 / 64, "balanced": -1.0})

    def test_aliases(self):
        p = torch.nn.Parameter(torch.randn(64, 128))
        for cls in (Adam4bit, AdamW4bit):
            opt = cls([p], lr=1e-3, compile=False)
            p.grad = torch.randn_like(p)
            opt.step()
            self.assertIs(type(opt.state[p]["exp_avg_sq"]), FourBitTensor)
            self.assertEqual(opt.state[p]["exp_avg"].codes.numel(), 64 * 128 // 2)


class TestFourBitRank1(StateFormatTestCase):
    format_name = "4bit_rank1"
    block_size = 128
    # as "4bit", relative to each element's scale: the block's absmax (signed, 1-D), or min(row max, column max)
    max_error = {True: 15 / 64, False: 1 / 16}

    def quant_errors(self, q, x, signed=True):
        if not q.rows:
            return super().quant_errors(q, x, signed)
        matrix = x.float().reshape(q.rows, -1)
        finite = torch.where(torch.isfinite(matrix), matrix.abs(), 0.0)
        scale = torch.minimum(finite.amax(1)[:, None], finite.amax(0)[None, :])
        err = torch.where(torch.isfinite(matrix), q.dequantize().float().reshape(q.rows, -1) - matrix, 0.0).abs()
        ratio = err / (scale * (1 + 1e-5) + 1e-30)
        if (err <= self.max_error[signed] * scale * (1 + 1e-5) + 1e-30).all():
            return []
        return [
            f"signed={signed}, shape {tuple(x.shape)}: round-trip error up to {ratio.max().item():.4g} of the "
            f"element's rank-1 scale, bound {self.max_error[signed]:.4g}"
        ]

    def test_rank1_scales(self):
        x = torch.rand(6, 300)
        x[2, 7] = 50.0  # an outlier: only row 2 and column 7 see it
        q = FourBitRank1Tensor.from_float(x, signed=False)
        self.assertEqual(q.rows, 6)
        self.assertIsNone(q.fast_path_layout())  # not blockwise: the compiled path
        self.assertTrue(torch.equal(q.absmax, torch.cat([x.amax(1), x.amax(0)])))
        scale = torch.minimum(x.amax(1)[:, None], x.amax(0)[None, :])
        err = (q.dequantize() - x).abs() / scale
        self.assertLessEqual(err.max().item(), 1 / 16 * (1 + 1e-6))
        # blockwise would store row 2's other elements to 1/32 of 50; rank-1 to 1/32 of their own column max
        block = FourBitTensor.from_float(x, signed=False)
        self.assertLess((q.dequantize() - x)[2].abs().mean(), (block.dequantize() - x)[2].abs().mean() / 10)
        # the shape survives the optimizer's flat views; exp_avg and 1-D tensors stay blockwise
        flat = q.view(-1)
        self.assertEqual(flat.rows, 6)
        self.assertTrue(torch.equal(flat.dequantize(), q.dequantize().view(-1)))
        self.assertEqual(FourBitRank1Tensor.from_float(x, signed=True).rows, 0)
        self.assertEqual(FourBitRank1Tensor.zeros((1800,), signed=False).rows, 0)
        self.assertEqual(FourBitRank1Tensor.zeros((6, 3, 100), signed=False).absmax.shape, (6 + 300,))
        # leading dimensions of one are no rows: (1, 6, 300) is 6 rows of 300, (1, 1800) a vector (blockwise: as
        # one row it would keep a scale per element)
        self.assertEqual(FourBitRank1Tensor.zeros((1, 6, 300), signed=False).absmax.shape, (6 + 300,))
        vector = FourBitRank1Tensor.from_float(x.reshape(1, 1800), signed=False)
        self.assertEqual((vector.rows, vector.absmax.shape), (0, (1800 // 128 + 1,)))
        self.assertEqual(FourBitRank1Tensor.zeros((1, 1), signed=False).rows, 0)

    def test_rank1_write_back_traces_through_aot_autograd(self):
        # A compiled update ends with the write-back of each mutated state: a copy_ between two compact rank-1
        # states, field by field as every format's. Copied through views of absmax (as rows are, into a row slice),
        # AOT autograd refused the graph and the optimizer fell back to eager mode.
        def requantize(state, x):
            state.copy_(x * 2)

        x = torch.rand(8, 64)
        compiled, eager = (FourBitRank1Tensor.zeros((8, 64), signed=False) for _ in range(2))
        torch.compile(requantize, backend="aot_eager", fullgraph=True)(compiled, x)
        requantize(eager, x)
        assert_same_tensor(self, compiled, eager)

    def test_rank1_loads_the_layout_saved_before_row_marks(self):
        # checkpoints from before rows was also a size hold codes and absmax, with rows as an attribute
        q = FourBitRank1Tensor.from_float(torch.rand(6, 300), signed=False)
        fields = {k: v for k, v in q.fields().items() if k != "row_marks"}
        old = type(q)(q.shape, q.dtype, **fields, **q.attrs())
        self.assertEqual(old.rows, 6)
        self.assertEqual(old.row_marks.shape, (6,))
        self.assertTrue(torch.equal(old.dequantize(), q.dequantize()))
        old.check_fields()

    def test_rank1_loaded_state_keeps_its_layout(self):
        # a checkpoint's state laid out as a new one would be keeps its codes (rows follows from the shape)
        q = FourBitRank1Tensor.zeros((6, 300), signed=False)
        self.assertTrue(FourBitRank1Tensor.matches_layout(q, signed=False, block_size=128))
        self.assertFalse(FourBitRank1Tensor.matches_layout(q, signed=False, block_size=64))
        blockwise = FourBitRank1Tensor.zeros((6, 300), signed=False, rows=0)
        self.assertFalse(FourBitRank1Tensor.matches_layout(blockwise, signed=False, block_size=128))
        self.assertTrue(
            FourBitRank1Tensor.matches_layout(
                FourBitRank1Tensor.zeros((6, 300), signed=True), signed=True, block_size=128
            )
        )

    def test_rank1_row_slices(self):
        # Rows of a rank-1 state (DCP's resharding of a row-sharded state): the codes and row maxima of those rows,
        # with the column maxima of the whole tensor, as views; they decode to those rows of the whole.
        x = torch.rand(8, 512)
        x[5, 3] = 40.0  # an outlier in a row outside the first slice: its column maximum is kept there
        q = FourBitRank1Tensor.from_float(x, signed=False)
        whole = q.dequantize()
        top, bottom = q[0:3], q[3:8]
        self.assertEqual((top.rows, bottom.rows), (3, 5))
        self.assertTrue(torch.equal(top.maxima()[1], q.maxima()[1]))
        self.assertTrue(torch.equal(top.dequantize(), whole[0:3]))
        self.assertTrue(torch.equal(bottom.dequantize(), whole[3:8]))
        # a copy, a pickle, a check: compact, as a state stored on its own
        copy = top.clone()
        self.assertEqual(copy.absmax.shape, (3 + 512,))
        self.assertTrue(torch.equal(copy.dequantize(), whole[0:3]))
        copy.check_fields()
        top.check_fields()
        buf = io.BytesIO()
        torch.save(top, buf)
        buf.seek(0)
        self.assertTrue(torch.equal(torch.load(buf, weights_only=True).dequantize(), whole[0:3]))
        # written into rows of another state, through the views: all of it, bit for bit
        other = FourBitRank1Tensor.zeros((8, 512), signed=False)
        other[3:8].copy_(bottom)
        other[0:3].copy_(top)
        self.assertTrue(torch.equal(other.codes, q.codes) and torch.equal(other.absmax, q.absmax))
        # padded with zero rows (an uneven shard before an all-gather) and joined: the rows, then zeros
        padded = torch.nn.functional.pad(bottom, (0, 0, 0, 2))
        self.assertEqual((padded.shape, padded.rows), ((7, 512), 7))
        self.assertTrue(torch.equal(padded.dequantize()[:5], whole[3:8]) and not padded.dequantize()[5:].any())
        self.assertTrue(torch.equal(torch.cat([top, bottom]).absmax, q.absmax))
        # rows cannot be requantized apart from the others: their column maxima are every row's
        with self.assertRaisesRegex(NotImplementedError, "cannot be requantized on their own"):
            top.copy_(torch.zeros(3, 512))
        with self.assertRaisesRegex(ValueError, "rows=7"):
            FourBitRank1Tensor.zeros((8, 512), signed=False, rows=7)

    def test_rank1_row_shard_with_the_whole_column_maxima(self):
        # a row shard quantized with the column maxima of the whole tensor holds exactly those rows of its state
        x = torch.rand(8, 512)
        x[6, 100] = 30.0
        q = FourBitRank1Tensor.from_float(x, signed=False)
        col_max = FourBitRank1Tensor.column_stat(x, 8, 512)
        self.assertEqual(FourBitRank1Tensor.shared_columns((8, 512), signed=False), 512)
        self.assertEqual(FourBitRank1Tensor.shared_columns((8, 512), signed=True), 0)
        attrs = FourBitRank1Tensor.shard_attrs((8, 512), (1, 512), signed=False, block_size=128)
        self.assertEqual(attrs["rows"], 1)  # one row of the matrix, not a vector
        shard = FourBitRank1Tensor.zeros((1, 512), **attrs)
        shard.assign(x[2:3], columns=col_max)
        assert_same_tensor(self, shard, q[2:3].clone())

    def test_rank1_in_adam(self):
        model = torch.nn.Linear(256, 64)
        ours = torchao_optim.AdamW(model.parameters(), state_format="4bit_rank1", compile=False)
        for _ in range(2):
            model.weight.grad, model.bias.grad = torch.randn(64, 256), torch.randn(64)
            ours.step()
        state = ours.state[model.weight]
        self.assertEqual((state["exp_avg"].rows, state["exp_avg_sq"].rows), (0, 64))
        restored = torchao_optim.AdamW(model.parameters(), state_format="4bit_rank1", compile=False)
        restored.load_state_dict(ours.state_dict())
        self.assertTrue(torch.equal(restored.state[model.weight]["exp_avg_sq"].absmax, state["exp_avg_sq"].absmax))
