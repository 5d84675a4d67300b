import io
from unittest import mock

import pytest
import torch

import torchao_optim
from torchao_optim import Factored4Tensor, FactoredTensor
from torchao_optim.state.rows import matrix_rows
from torchao_optim.testing import StateFormatTestCase, assert_same_tensor

# fp32 means against float64 ones: a sum of n fp32 values is within about n * 2**-24 of its exact value relative to
# the sum of magnitudes (all non-negative here); the shared cases' rows and columns are at most 4096 long
MEAN_RTOL = 4096 * 2**-24


class FactoredCase:
    """What the two formats' shared cases measure for a factored state: its row and column means against float64
    ones of the input, and its elements against the rank-1 matrix they stand for (the blockwise states as the
    shared case does)."""

    def quant_errors(self, q, x, signed=True):
        if not q.rows:
            return super().quant_errors(q, x, signed)
        matrix = torch.where(torch.isfinite(x), x, 0.0).double().reshape(q.rows, -1)
        row, col = matrix.mean(1), matrix.mean(0)
        want = row[:, None] * col[None, :] / col.mean()
        got = q.dequantize().double().reshape(q.rows, -1)
        lines = []
        for name, a, b in (("row means", q.row_mean, row), ("column means", q.col_mean, col), ("elements", got, want)):
            err = ((a.double() - b).abs() / (b.abs() + 1e-30)).max().item()
            if not err <= 3 * MEAN_RTOL:
                lines.append(f"shape {tuple(x.shape)}: {name} off by {err:.3g} relative, bound {3 * MEAN_RTOL:.3g}")
        return lines


class TestFactored(FactoredCase, StateFormatTestCase):
    format_name = "factored"
    max_error = {True: 0.9 / 128, False: 0.9 / 256}  # blockwise states: dtq8's codebooks (test_dtq8.py)

    @pytest.mark.slow
    def test_compiled_equals_eager_bit_for_bit(self):
        # 15-35 s on a 2-core CPU: CI compiles this format's signed (dtq8's codebook) and factored states together in
        # its AdamW conformance case (test_conformance.py: adamw-factored-compiled, parity, exact resume, containment)
        super().test_compiled_equals_eager_bit_for_bit()

    def test_repr_is_metadata_only(self):
        self.assertExpectedInline(
            repr(FactoredTensor.zeros((4, 8), signed=False)),
            """FactoredTensor(shape=(4, 8), dtype=torch.float32, device=cpu, signed=False, block_size=256, rows=4)""",
        )

    def test_which_states_are_factored(self):
        # non-negative states of matrices (rows: the first dimension after leading ones, as 4bit_rank1 reads them);
        # signed states, vectors and matrices of one row or column keep blockwise codes
        cases = {
            (6, 300): 6,
            (6, 3, 100): 6,
            (1, 6, 300): 6,
            (1800,): 0,
            (1, 1800): 0,
            (1800, 1): 0,
            (1, 1): 0,
            (0, 5): 0,
        }
        self.assertEqual({shape: matrix_rows(shape, False, FactoredTensor.min_rows) for shape in cases}, cases)
        self.assertEqual(matrix_rows((6, 300), True, FactoredTensor.min_rows), 0)
        q = FactoredTensor.from_float(torch.rand(6, 3, 100), signed=False)
        self.assertEqual((q.row_mean.shape, q.col_mean.shape, q.codes.numel(), q.absmax.numel()), ((6,), (300,), 0, 0))
        self.assertIsNone(q.fast_path_layout())  # not blockwise: the compiled path
        s = FactoredTensor.from_float(torch.randn(6, 300), signed=True)
        self.assertEqual((s.codes.shape, s.absmax.shape, s.row_mean.numel()), ((1800,), (8,), 0))
        self.assertEqual(s.fast_path_layout(), torchao_optim.DTQ8bitTensor.zeros((1,), signed=True).fast_path_layout())
        # the rows survive the optimizer's flat views
        flat = q.view(-1)
        self.assertEqual(flat.rows, 6)
        self.assertTrue(torch.equal(flat.dequantize(), q.dequantize().view(-1)))
        flat.zero_()
        self.assertFalse(q.dequantize().any())

    def test_rank1_values_round_trip(self):
        # a non-negative rank-1 matrix is exactly what the factors stand for: stored to within fp32 rounding
        a, b = torch.rand(40) + 0.1, torch.rand(3, 50) + 0.1
        x = a[:, None, None] * b[None]  # (40, 3, 50): 40 rows of 150
        q = FactoredTensor.from_float(x, signed=False)
        self.assertLess(((q.dequantize() - x).abs() / x).max().item(), 1e-5)
        # the row and column means of the matrix a state stands for are its factors: storing it again stores them
        again = FactoredTensor.from_float(q.dequantize(), signed=False)
        self.assertLess(((again.row_mean - q.row_mean).abs() / q.row_mean).max().item(), 1e-6)
        self.assertLess(((again.col_mean - q.col_mean).abs() / q.col_mean).max().item(), 1e-6)

    def test_adam_keeps_adafactor_factors(self):
        # Adam with a factored exp_avg_sq stores, step after step, exactly Adafactor's factored EMA: of the row and
        # column means of g * g, within fp32 rounding
        p = torch.nn.Parameter(torch.randn(24, 80))
        beta2 = 0.99
        opt = torchao_optim.AdamW(
            [p], lr=1e-2, betas=(0.9, beta2), state_format="factored", compile=False, min_quant_size=0
        )
        row, col = torch.zeros(24, dtype=torch.float64), torch.zeros(80, dtype=torch.float64)
        for step in range(5):
            g = torch.randn(24, 80) * torch.exp(torch.randn(24, 1) + torch.randn(1, 80))  # rows, columns of outliers
            p.grad = g
            opt.step()
            sq = g.double() ** 2
            row = beta2 * row + (1 - beta2) * sq.mean(1)
            col = beta2 * col + (1 - beta2) * sq.mean(0)
            v = opt.state[p]["exp_avg_sq"]
            self.assertEqual((type(v), v.rows), (FactoredTensor, 24))
            for what, got, want in (("row means", v.row_mean, row), ("column means", v.col_mean, col)):
                err = ((got.double() - want).abs() / want).max().item()
                self.assertLess(err, 1e-5, f"step {step + 1}: {what} off by {err:.3g} relative")
            self.assertEqual(type(opt.state[p]["exp_avg"]), FactoredTensor)
            self.assertEqual(opt.state[p]["exp_avg"].codes.numel(), 24 * 80)  # 8-bit codes

    def test_loaded_state_keeps_its_layout(self):
        # a checkpoint's state laid out as a new one keeps its factors (rows follows from the shape); the state_dict
        # round trip holds them bit for bit
        q = FactoredTensor.zeros((6, 300), signed=False)
        self.assertTrue(FactoredTensor.matches_layout(q, signed=False, block_size=256))
        self.assertFalse(FactoredTensor.matches_layout(q, signed=False, block_size=128))
        blockwise = FactoredTensor.zeros((6, 300), signed=False, rows=0)
        self.assertFalse(FactoredTensor.matches_layout(blockwise, signed=False, block_size=256))
        self.assertFalse(Factored4Tensor.matches_layout(q, signed=False, block_size=256))
        model = torch.nn.Linear(256, 64)
        ours = torchao_optim.AdamW(model.parameters(), state_format="factored", compile=False)
        for _ in range(2):
            model.weight.grad, model.bias.grad = torch.randn(64, 256), torch.randn(64)
            ours.step()
        restored = torchao_optim.AdamW(model.parameters(), state_format="factored", compile=False)
        restored.load_state_dict(ours.state_dict())
        for key in ("exp_avg", "exp_avg_sq"):
            for name, field in ours.state[model.weight][key].fields().items():
                self.assertTrue(torch.equal(restored.state[model.weight][key].fields()[name], field), (key, name))

    def test_bad_input_names_the_value(self):
        with self.assertRaisesRegex(ValueError, "rows=7"):
            FactoredTensor.zeros((8, 512), signed=False, rows=7)
        with self.assertRaisesRegex(ValueError, "rows=4"):
            FactoredTensor.zeros((8, 512), signed=True, rows=4)
        with self.assertRaisesRegex(TypeError, "got None"):
            FactoredTensor.zeros((8, 512))
        with self.assertRaisesRegex(ValueError, "negative values.*-1.5"):
            FactoredTensor.from_float(torch.tensor([[1.0, -1.5], [2.0, 3.0]]), signed=False)
        q = FactoredTensor.from_float(torch.rand(8, 512), signed=False)
        with self.assertRaisesRegex(NotImplementedError, r"shape \(8, 512\) \(rows=8\) is sliced along dim 0.*dim=1"):
            q[:, 2:4]
        with self.assertRaisesRegex(NotImplementedError, "cannot be requantized on their own"):
            q[2:4].copy_(torch.zeros(2, 512))
        with self.assertRaisesRegex(ValueError, "different column means"):
            torch.cat([q[0:4], FactoredTensor.from_float(torch.rand(4, 512), signed=False)])
        with self.assertRaisesRegex(NotImplementedError, "zeros after the last row only"):
            torch.nn.functional.pad(q, (0, 0, 2, 0))
        bad = FactoredTensor(q.shape, q.dtype, **dict(q.fields(), col_mean=-q.col_mean), **q.attrs())
        with self.assertRaisesRegex(ValueError, r"col_mean must be finite and non-negative.*entry 0 holds -"):
            bad.check_fields()

    def test_row_shards_with_the_whole_column_sums(self):
        # FSDP2's row shards (uneven, one of a single row, and an empty one): each quantized with the column sums and
        # row counts of every shard, summed, holds exactly its rows of the whole state (fp64 sums of these few rows
        # are exact, whatever their order), and dequantizes to them
        x = torch.rand(8, 3, 100)
        x[6, 1, 7] = 30.0
        q = FactoredTensor.from_float(x, signed=False)
        self.assertEqual(FactoredTensor.shared_columns((8, 3, 100), signed=False), 300)
        self.assertEqual(FactoredTensor.shared_columns((8, 3, 100), signed=True), 0)
        self.assertEqual(FactoredTensor.shared_columns((1, 300), signed=False), 0)  # a vector: blockwise
        shards = [(0, 3), (3, 7), (7, 8), (8, 8)]
        sums = sum(FactoredTensor.column_stat(x[a:b] if b > a else None, b - a, 300) for a, b in shards)
        self.assertEqual((sums.dtype, sums.shape, sums[-1].item()), (torch.float64, (301,), 8.0))
        for a, b in shards:
            attrs = FactoredTensor.shard_attrs((8, 3, 100), (b - a, 3, 100), signed=False, block_size=256)
            self.assertEqual(attrs["rows"], b - a)  # a shard of one row is one row of the matrix, not a vector
            shard = FactoredTensor.zeros((b - a, 3, 100), **attrs).assign(x[a:b], columns=sums)
            assert_same_tensor(self, shard, q[a:b].clone(), f"rows {a}:{b}")
            self.assertTrue(torch.equal(shard.dequantize(), q.dequantize()[a:b]), f"rows {a}:{b}")
        # on its own, a shard would store its own column means: other values
        alone = FactoredTensor.from_float(x[0:3], signed=False)
        self.assertFalse(torch.equal(alone.dequantize(), q.dequantize()[0:3]))

    def test_row_slices_keep_the_column_means(self):
        # DCP's resharding and full_tensor(): slices of rows are views (their row means, the whole tensor's column
        # means), written into rows of another state through them, padded with zero rows and joined again
        x = torch.rand(1, 8, 512)  # (1, 8, 512): 8 rows of 512 behind a leading one
        q = FactoredTensor.from_float(x[0], signed=False)
        whole = q.dequantize()
        top, bottom = q[0:3], q[3:8]
        self.assertEqual((top.rows, bottom.rows, q[3:3].rows), (3, 5, 0))
        self.assertEqual(top.col_mean.data_ptr(), q.col_mean.data_ptr())
        self.assertTrue(torch.equal(top.dequantize(), whole[0:3]) and torch.equal(bottom.dequantize(), whole[3:8]))
        # a copy, a pickle, a check: a state of its own, which may be requantized
        copy = top.clone()
        self.assertNotEqual(copy.col_mean.data_ptr(), q.col_mean.data_ptr())
        copy.check_fields()
        buf = io.BytesIO()
        torch.save(top, buf)
        buf.seek(0)
        self.assertTrue(torch.equal(torch.load(buf, weights_only=True).dequantize(), whole[0:3]))
        copy.copy_(torch.ones(3, 512))
        self.assertTrue(torch.equal(copy.dequantize(), torch.ones(3, 512)))
        # written into rows of another state, through the views: all of it, bit for bit
        other = FactoredTensor.zeros((8, 512), signed=False)
        other[3:8].copy_(bottom)
        other[0:3].copy_(top)
        self.assertTrue(torch.equal(other.row_mean, q.row_mean) and torch.equal(other.col_mean, q.col_mean))
        # padded with zero rows (an uneven shard before an all-gather) and joined: the rows, then zeros
        padded = torch.nn.functional.pad(bottom, (0, 0, 0, 2))
        self.assertEqual((padded.shape, padded.rows), ((7, 512), 7))
        self.assertTrue(torch.equal(padded.dequantize()[:5], whole[3:8]) and not padded.dequantize()[5:].any())
        joined = torch.cat([top, bottom])
        self.assertEqual(joined.rows, 8)
        self.assertTrue(torch.equal(joined.dequantize(), whole))
        # leading ones: dim 0's one index holds every row
        lead = FactoredTensor.from_float(x, signed=False)
        self.assertEqual((lead.rows, lead[0:1].rows, lead[1:1].rows), (8, 8, 0))

    def test_bytes_per_parameter(self):
        # Adam's two states of a (5632, 2048) matrix (TinyLlama's MLP): the 8-bit exp_avg, and 4 bytes per row and
        # column for exp_avg_sq
        shape, n = (5632, 2048), 5632 * 2048
        for fmt, exp_avg in ((FactoredTensor, 1 + 4 / 256), (Factored4Tensor, 0.5 + 4 / 128)):
            states = [fmt.zeros(shape, signed=signed, device="meta") for signed in (True, False)]
            got = sum(t.nbytes for s in states for t in s.fields().values()) / n
            self.assertAlmostEqual(got, exp_avg + 4 * (5632 + 2048) / n, places=9)


class TestFactored4(FactoredCase, StateFormatTestCase):
    format_name = "factored4"
    block_size = 128
    max_error = {True: 15 / 64, False: 1 / 16}  # blockwise states: 4bit's codebooks (test_fourbit.py)

    @pytest.mark.slow
    def test_compiled_equals_eager_bit_for_bit(self):
        # 15-35 s on a 2-core CPU, and nothing CI does not compile already: its blockwise states are "4bit"'s
        # codebooks (test_fourbit.py), held by FactoredState as "factored"'s
        super().test_compiled_equals_eager_bit_for_bit()

    def test_codes_are_4bit(self):
        x = torch.randn(64, 256)
        m, v = Factored4Tensor.from_float(x, signed=True), Factored4Tensor.from_float(x.square(), signed=False)
        self.assertEqual((m.codes.numel(), m.absmax.numel(), m.fast_path_layout().bits), (64 * 128, 128, 4))
        self.assertEqual((v.rows, v.row_mean.numel(), v.col_mean.numel()), (64, 64, 256))
        vector = Factored4Tensor.from_float(x.square().view(-1), signed=False)
        self.assertEqual(
            vector.fast_path_layout(), torchao_optim.FourBitTensor.zeros((1,), signed=False).fast_path_layout()
        )


@pytest.mark.parametrize("fmt", ["factored", "factored4"])
def test_every_non_negative_state_is_factored(fmt):
    # each optimizer's never-negative state of a matrix is factored, and the signed ones are blockwise codes
    w = torch.nn.Parameter(torch.randn(32, 64))
    options = dict(state_format=fmt, compile=False, min_quant_size=0)
    kinds = {
        "exp_avg_sq": torchao_optim.AdamW([w], **options),
        "sum": torchao_optim.Adagrad8bit([w], **options),
        "square_avg": torchao_optim.RMSprop8bit([w], momentum=0.9, **options),
        "momentum_buffer": torchao_optim.SGD8bit([w], lr=0.1, momentum=0.9, **options),
    }
    for key, opt in kinds.items():
        w.grad = torch.randn_like(w)
        opt.step()
        rows = {k: v.rows for k, v in opt.state[w].items() if k != "step"}
        assert rows[key] == (0 if key == "momentum_buffer" else 32), (key, rows)
        assert all(r == 0 for k, r in rows.items() if k != key), (key, rows)


@pytest.mark.parametrize("state_format", ["factored", "4bit_rank1"])
def test_row_counts_share_one_compiled_graph(state_format):
    # rows travels as the size of a field (row_mean, row_marks), not a constant: matrices of five row counts (none
    # dividing another's block count) take at most two graphs (a first and a dynamic one), where a constant took one
    # each
    from torch._dynamo.utils import counters

    from torchao_optim.optim import compiled as compiled_module

    with mock.patch.object(compiled_module, "BACKEND", "eager"):
        shapes = [(96, 128), (160, 64), (224, 128), (352, 64), (480, 64)]
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = torchao_optim.AdamW(params, state_format=state_format, fused=False, min_quant_size=0)
        graphs = counters["stats"]["unique_graphs"]
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        assert [opt.state[p]["exp_avg_sq"].rows for p in params] == [s[0] for s in shapes]
        assert counters["stats"]["unique_graphs"] - graphs <= 2
