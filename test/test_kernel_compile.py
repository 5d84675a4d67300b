"""The fused CUDA kernels compile for a GPU with the installed Triton, on any machine.

Triton's interpreter, which runs the kernels in the CPU tests, executes them as Python: it never compiles them,
so a construct the compiler rejects (a branch compiled for a shape it does not fit, say) passes there and fails
on the first GPU. Here the Adam kernel is compiled to SASS for sm_90 (Triton's CUDA backend and its bundled
tools, no GPU) in the configurations the built-in formats use, in a process of its own without the
interpreter, under the register cap the planner gives it (``optim.fused.REGISTER_CAPS``), and must not spill
registers to the stack, nor load or store a single byte in its loop; so must its three-state form (AdEMAMix, amsgrad,
centered RMSprop with momentum), with the slow tests. The one-state kernel (SGD, Lion) is compiled the same way, for its
inline PTX.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchao_optim.state.layout import SCALE_KINDS

ROOT = Path(__file__).resolve().parent.parent


def _backend_tools():
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(tools, name)) for name in ("ptxas", "nvdisasm", "cuobjdump"))


def _count(dtype: str, bits: int, block: int, rule: str = "adam", maxnreg="auto", *flags: str) -> dict:
    """benchmarks/count_instructions.py's figures for ``adam_kernel`` with ``rule``'s update, in a process without
    Triton's interpreter (``maxnreg``: the register cap, "auto" the planner's, 0 none; ``flags``: more of its
    options)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(ROOT / "benchmarks" / "count_instructions.py"),
            "--dtype",
            dtype,
            "--bits",
            str(bits),
            "--block",
            str(block),
            "--rule",
            rule,
            "--maxnreg",
            str(maxnreg),
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _backend_tools(), reason="Triton with its CUDA backend's tools is not installed")
@pytest.mark.parametrize("dtype,bits,block", [("fp32", 8, 256), ("bf16", 8, 256), ("fp32", 4, 128), ("bf16", 4, 128)])
def test_adam_kernel_compiles_for_sm90_without_spilling(dtype, bits, block):
    stats = _count(dtype, bits, block)
    assert stats["stack_bytes"] == 0, stats
    assert stats["instructions"] > 0 and stats["per_thread"] == 8, stats
    # whole tiles move a thread's codes as words (4-bit: one per state each way), never byte by byte
    assert stats["byte_accesses"] == 0, stats


@pytest.mark.skipif(not _backend_tools(), reason="Triton with its CUDA backend's tools is not installed")
def test_rank1_kernels_read_rows_without_moving_values():
    """``"4bit_rank1"`` on CUDA (bf16 parameters, aligned rows, as TinyLlama's): the first pass reads each row with
    every access in one register layout, so nothing goes through shared memory in its loop, about 31 instructions an
    element (a 2-D tile took 49 with Triton 3.6, moving every element between layouts through shared memory, and 39-42
    with Triton 3.9); and the step over rows of whole tiles takes its rank-1 scales with no division (a division per
    element and per tile made it 135 instructions an element against ``"4bit"``'s 56, now about 65). Neither
    spills."""
    first_pass = _count("bf16", 4, 128, "adam", "auto", "--kernel", "stats")
    assert first_pass["shared"] == 0 and first_pass["stack_bytes"] == 0, first_pass
    assert first_pass["per_element"] < 35, first_pass
    rank1 = _count("bf16", 4, 128, "adam", "auto", "--rank1")
    blockwise = _count("bf16", 4, 128)
    assert rank1["shared"] == 0 and rank1["stack_bytes"] == 0, rank1
    assert rank1["per_element"] < 1.3 * blockwise["per_element"], (rank1, blockwise)


_MOMENTUM = """
import sys
import triton.language as tl
from benchmarks.count_instructions import compile_kernel
from torchao_optim.kernels.triton_momentum import momentum_kernel
from torchao_optim.kernels.tables import flat_shift
from torchao_optim.rules import ADAGRAD, LION, MUON, RMSPROP, SGD
from torchao_optim.state import get_state_format

dtype, bits = sys.argv[1], int(sys.argv[2])
rule = {"sgd": SGD, "lion": LION, "adagrad": ADAGRAD, "rmsprop": RMSPROP, "muon": MUON}[sys.argv[3]]
signed = rule.signed[0]
param = {"fp32": tl.float32, "bf16": tl.bfloat16}[dtype]
signature = {"ptrs": "*i64", "grad_ptrs": "*i64", "numels": "*i64", "coefs": "*fp32", "prog_tensor": "*i32",
             "prog_block": "*i32", "prog_tiles": "*i32", "steps": "*fp32", "round_info": "*i64", "s_values": "*fp32",
             "s_level1": "*i32", "s_level2": "*i32"}
constants = dict(rank1=None, PARAM_DTYPE=param, GRAD_DTYPE=param, QBLOCK=256 if bits == 8 else 128, BLOCK=256,
                 VEC=16 // (4 if dtype == "fp32" else 2), ALIGNED=True, UPDATE=rule.triton_update(), OPTION=False,
                 MAXIMIZE=False, SR=False, S_QUANT=True, S_BITS=bits, PTX=True, S_SIGNED=signed,
                 S_FLAT=flat_shift(get_state_format("dtq8" if bits == 8 else "4bit").zeros((256,), signed=signed)
                                   .fast_path_layout(), "triton"))
print(len(compile_kernel(momentum_kernel, signature, constants).asm["cubin"]))
"""


@pytest.mark.skipif(not _backend_tools(), reason="Triton with its CUDA backend's tools is not installed")
@pytest.mark.parametrize(
    "dtype,bits,rule",
    # Muon's: its direction written as fp32 parameters are, with NaN where an element is skipped
    [("fp32", 8, "sgd"), ("bf16", 8, "lion"), ("fp32", 4, "lion"), ("bf16", 4, "sgd"), ("fp32", 8, "muon")]
    # Adagrad's and RMSprop's tile updates, with an unsigned state (about 8 s each: --runslow)
    + [pytest.param(*c, marks=pytest.mark.slow) for c in [("fp32", 8, "adagrad"), ("bf16", 4, "rmsprop")]],
)
def test_momentum_kernel_compiles_for_sm90(dtype, bits, rule):
    """The one-state kernel (SGD with momentum, Lion, Adagrad, RMSprop, Muon's momentum), with its inline PTX, compiles
    too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _MOMENTUM, dtype, str(bits), rule],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) > 0


@pytest.mark.slow  # about 7 s each
@pytest.mark.skipif(not _backend_tools(), reason="Triton with its CUDA backend's tools is not installed")
@pytest.mark.parametrize(
    "rule,dtype,bits,block",
    [
        ("ademamix", "fp32", 8, 256),
        ("adam_amsgrad", "bf16", 4, 128),
        ("rmsprop_centered_momentum", "bf16", 8, 256),
        ("rmsprop_momentum", "bf16", 8, 256),
    ],
)
def test_other_rules_kernels_compile_for_sm90_without_spilling(rule, dtype, bits, block):
    """``adam_kernel`` with each three-state rule's update (``N_STATES=3``; the planner gives three-state plans no
    register cap) and with RMSprop's momentum (two states, its first unsigned, its second signed; compiled without a
    cap, as its plan runs once REGISTER_CAPS' spills it): no spill, the codes moved in words."""
    stats = _count(dtype, bits, block, rule, maxnreg=0)
    assert stats["stack_bytes"] == 0, stats
    assert stats["instructions"] > 0 and stats["per_thread"] == 8, stats
    assert stats["byte_accesses"] == 0, stats


_MATRIX_SCALES = """
import sys
import triton.language as tl
from count_instructions import compile_adam, compile_kernel
from torchao_optim.kernels.triton_rank1 import STATS_TILES, normalize_columns_kernel, rank1_stats_kernel
from torchao_optim.rules import BUILT_IN_RULES

dtype, kind = sys.argv[1], int(sys.argv[2])  # kind: exp_avg_sq's scales, 1 rank-1, 2 factored (SCALE_KINDS' index)
compiled, _ = compile_adam(dtype, 4, 128, 90, 2, rank1=kind)
folded = compile_adam(dtype, 4, 128, 90, 1, rank1=kind, fold=True)[0] if kind == 2 else compiled
rule = next(r for r in BUILT_IN_RULES if r.name == "adam")
param = {"fp32": tl.float32, "bf16": tl.bfloat16}[dtype]
signature = {"ptrs": "*i64", "grad_ptrs": "*i64", "numels": "*i64", "coefs": "*fp32", "rank1": "*i64",
             "prog_tensor": "*i32", "prog_tile": "*i32", "s0_values": "*fp32", "s1_values": "*fp32"}
constants = dict(s2_values=None, PARAM_DTYPE=param, GRAD_DTYPE=param, QBLOCK=128, UPDATE=rule.triton_update(),
                 OPTION=True, MAXIMIZE=False, PTX=True, N_STATES=2, N_COEFS=7, S0_QUANT=True, S0_BITS=4,
                 S0_SCALE=False, S1_QUANT=True, S1_BITS=4, S1_SCALE=kind, ALIGNED=True)
shape = STATS_TILES[["rank1", "factored"][kind - 1]]
tile = dict(ROWS=shape.rows, COLS=shape.cols, STRIP=shape.strip, ROWWISE=shape.rowwise)
stats = compile_kernel(rank1_stats_kernel, signature, dict(constants, **tile), 90, shape.warps, shape.maxnreg)
# and the first pass with each tile's rows' loads first (StatsTile.grouped), where it reads rows (rank-1 scales)
grouped = compile_kernel(rank1_stats_kernel, signature, dict(constants, **tile, GROUPED=True), 90, shape.warps,
                         shape.maxnreg) if shape.rowwise else stats
columns = compile_kernel(normalize_columns_kernel, {"columns": "*i64"}, {"BLOCK": 1024}, 90, 4)
print(len(compiled.asm["cubin"]), len(folded.asm["cubin"]), len(stats.asm["cubin"]), len(grouped.asm["cubin"]),
      len(columns.asm["cubin"]))
"""


@pytest.mark.skipif(not _backend_tools(), reason="Triton with its CUDA backend's tools is not installed")
@pytest.mark.parametrize("kind", ["rank1", "factored"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_matrix_scale_kernels_compile_for_sm90(dtype, kind):
    """Scales over a whole matrix on the Triton kernels ("4bit_rank1"'s and "factored4"'s ``exp_avg_sq``): the
    two-state kernel's form for each and the first pass that finds the new maxima or sums (its atomics, fp64 for
    the sums; also in its form with each tile's rows' loads first) compile for sm_90 with their inline PTX, and so
    does the columns' normalization before it; for factored states, also the kernel's form that takes the sums itself
    (``FOLD``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "benchmarks")] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _MATRIX_SCALES, dtype, str(SCALE_KINDS.index(kind))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(int(n) > 0 for n in proc.stdout.strip().splitlines()[-1].split())
