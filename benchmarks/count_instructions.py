"""Count the instructions of the fused Adam kernel's loop, without a GPU.

Compiles ``adam_kernel`` for one configuration to SASS for a chosen architecture (default sm_90, the H100/H200)
with the installed Triton and its bundled ``nvdisasm``, finds the kernel's main loop (its longest backward branch)
and prints the loop's length, its instructions per element (the loop walks one tile: ``BLOCK / (32 *
num_warps)`` elements per thread), the registers per thread (under the planner's register cap unless
``--maxnreg`` says otherwise) and a count by opcode. The fused step is bound by
issuing instructions (docs/performance.md), so this is the first figure to look at when changing the kernel;
it needs Triton with its CUDA backend but no driver and no device, and Triton's interpreter off (``TRITON_INTERPRET``
unset: the interpreter never compiles).

    python benchmarks/count_instructions.py                          # dtq8-like: 8-bit codes, fp32 params
    python benchmarks/count_instructions.py --bits 4 --block 128 --dtype bf16
    python benchmarks/count_instructions.py --rule ademamix          # the three-state form (N_STATES=3)
    python benchmarks/count_instructions.py --bits 4 --block 128 --rank1 --dtype bf16   # "4bit_rank1"'s step
    python benchmarks/count_instructions.py --kernel stats --dtype bf16  # and its first pass (rank1_stats_kernel)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_kernel(kernel, signature: dict, constants: dict, arch: int = 90, num_warps: int = 1, maxnreg=None):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_``arch`` with Triton's CUDA backend, no GPU needed:
    ``signature`` types its tensor and scalar arguments (``"*fp32"``, ...), ``constants`` gives its constexprs (and
    arguments given as None); a constexpr it leaves out takes its default, as in a launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constants = {**{k: v for k, v in defaults.items() if k not in signature}, **constants}
    signature = dict(signature, **{name: "constexpr" for name in constants})
    names = kernel.arg_names
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_adam(
    dtype: str,
    bits: int,
    block: int,
    arch: int,
    num_warps: int,
    maxnreg: str = "auto",
    rule_name: str = "adam",
    rank1: int = 0,
    fold: bool = False,
):
    """``adam_kernel`` compiled for a plan of ``rule_name``'s (a package rule of two or three states with a Triton
    update: its states' signs, its option set, a third state under ``N_STATES=3``), every state in ``bits``-bit codes
    of the built-in format of that width, and the number of elements per thread of its loop. ``rank1``: its second
    state's scales over the matrix (the index of their kind in ``state.layout.SCALE_KINDS``: 1 rank-1, as
    ``"4bit_rank1"``'s ``exp_avg_sq``; 2 factored, as ``"factored4"``'s). ``fold``: a factored state's sums taken in
    the kernel (``FOLD``: its programs strips of rows, as the planner makes them where the rows are whole tiles)."""
    import torch
    import triton.language as tl

    from torchao_optim.kernels.tables import flat_shift
    from torchao_optim.kernels.triton_adam import adam_kernel
    from torchao_optim.optim.fused import MIN_TILE, PREFETCH, register_cap
    from torchao_optim.rules import BUILT_IN_RULES
    from torchao_optim.state import get_state_format
    from torchao_optim.state.layout import SCALE_KINDS, StateLayout

    rules = {r.name: r for r in BUILT_IN_RULES if r.triton_update is not None and len(r.state_keys) in (2, 3)}
    if rule_name not in rules:
        raise ValueError(f"rule {rule_name!r}: the kernel runs {sorted(rules)}")
    rule = rules[rule_name]
    n_states = len(rule.state_keys)
    param = {"fp32": tl.float32, "bf16": tl.bfloat16}[dtype]
    signature = {
        "ptrs": "*i64",
        "grad_ptrs": "*i64",
        "numels": "*i64",
        "coefs": "*fp32",
        "prog_tensor": "*i32",
        "prog_block": "*i32",
        "prog_tiles": "*i32",
        "steps": "*fp32",
        "round_info": "*i64",
        "m_values": "*fp32",
        "m_level1": "*i32",
        "m_level2": "*i32",
        "v_values": "*fp32",
        "v_level1": "*i32",
        "v_level2": "*i32",
    }
    if n_states == 3:
        signature.update(w_values="*fp32", w_level1="*i32", w_level2="*i32")
        constants = dict(N_STATES=3, N_COEFS=rule.n_coefs, W_QUANT=True, W_BITS=bits, W_SIGNED=rule.signed[2])
    else:
        constants = dict(w_values=None, w_level1=None, w_level2=None)  # as a two-state launch passes them
    constants.update(
        rank1=None,  # blockwise scales: as a launch without a rank-1 state passes it
        V_SCALE=rank1,
        PARAM_DTYPE=param,
        GRAD_DTYPE=param,
        QBLOCK=block,
        BLOCK=max(block, MIN_TILE),
        VEC=16 // (4 if dtype == "fp32" else 2),
        PREFETCH=PREFETCH,
        ALIGNED=True,
        UPDATE=rule.triton_update(),
        OPTION=rule.option is not None,  # Adam's: decoupled weight decay (AdamW)
        MAXIMIZE=False,
        PTX=True,
        SR=False,
        M_QUANT=True,
        M_BITS=bits,
        V_QUANT=True,
        V_BITS=bits,
        M_SIGNED=rule.signed[0],
        V_SIGNED=rule.signed[1],
        PDL=True,
        FOLD=fold,
        ROW_TILES=2 if rank1 == 1 else 0,  # as the planner gives a rank-1 plan of whole rows of tiles (TinyLlama)
    )
    # the encoders' form as the planner picks it for the built-in format of this code width
    layouts = [
        get_state_format("dtq8" if bits == 8 else "4bit").zeros((256,), signed=signed).fast_path_layout()
        for signed in rule.signed
    ]
    constants.update(M_FLAT=flat_shift(layouts[0], "triton"), V_FLAT=flat_shift(layouts[1], "triton"))
    if n_states == 3:
        constants.update(W_FLAT=flat_shift(layouts[2], "triton"))
    # the register cap the planner gives such a plan (optim.fused.register_cap; none with three states), unless one
    # is given
    layout = StateLayout("codes", "scales", block, (-1.0, 1.0), bits)
    second = dataclasses.replace(layout, scale=SCALE_KINDS[rank1])
    param_bytes = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype].itemsize
    if maxnreg == "auto":
        cap = register_cap((layout, second), param_bytes, fold) if n_states == 2 else None
    else:
        cap = int(maxnreg)
    if rank1:
        signature["rank1"] = "*i64"
        del constants["rank1"]
    compiled = compile_kernel(adam_kernel, signature, constants, arch, num_warps, cap)
    return compiled, max(block, MIN_TILE) // (32 * num_warps)


def compile_stats(dtype: str, arch: int = 90):
    """``rank1_stats_kernel`` compiled as a ``"4bit_rank1"`` plan of Adam launches it where its matrices are aligned
    (TinyLlama's are): 4-bit codes for both states, ``exp_avg_sq``'s scales rank-1, the tile, strip and row-by-row
    reading of ``kernels.triton_rank1.STATS_TILES``. Returns it and the elements a thread reads per iteration of its
    main loop (the row loop unrolled once per row of the tile, ``RUN`` contiguous columns a row)."""
    import triton.language as tl

    from torchao_optim.kernels.triton_rank1 import RUN, STATS_TILES, rank1_stats_kernel
    from torchao_optim.rules import BUILT_IN_RULES

    rule = next(r for r in BUILT_IN_RULES if r.name == "adam")
    tile = STATS_TILES["rank1"]
    signature = {
        "ptrs": "*i64",
        "grad_ptrs": "*i64",
        "numels": "*i64",
        "coefs": "*fp32",
        "rank1": "*i64",
        "prog_tensor": "*i32",
        "prog_tile": "*i32",
        "s0_values": "*fp32",
        "s1_values": "*fp32",
    }
    param = {"fp32": tl.float32, "bf16": tl.bfloat16}[dtype]
    constants = dict(
        s2_values=None,
        PARAM_DTYPE=param,
        GRAD_DTYPE=param,
        QBLOCK=128,
        UPDATE=rule.triton_update(),
        OPTION=True,
        MAXIMIZE=False,
        PTX=True,
        ALIGNED=True,
        ROWS=tile.rows,
        COLS=tile.cols,
        STRIP=tile.strip,
        ROWWISE=tile.rowwise,
        GROUPED=tile.grouped,
        N_STATES=2,
        N_COEFS=rule.n_coefs,
        S0_QUANT=True,
        S0_BITS=4,
        S0_SCALE=0,
        S1_QUANT=True,
        S1_BITS=4,
        S1_SCALE=1,
    )
    compiled = compile_kernel(rank1_stats_kernel, signature, constants, arch, tile.warps, tile.maxnreg)
    per_thread = tile.rows * RUN.value if tile.rowwise else tile.rows * tile.cols // (32 * tile.warps)
    return compiled, per_thread


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    """The output of one of the CUDA binary tools Triton bundles, run on ``cubin``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str):
    """The instructions between the target and the source of the longest backward branch."""
    labels, instructions, pending = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if ins:
            address = int(ins.group(1), 16)
            instructions.append((address, ins.group(2)))
            labels.update({name: address for name in pending})
            pending = []
    loops = [
        (labels[m.group(1)], a)
        for a, text in instructions
        for m in [re.search(r"BRA.*?\(\.(L_x_\d+)\)", text)]
        if m and labels[m.group(1)] < a
    ]
    if not loops:
        raise RuntimeError("no loop found in the kernel's SASS")
    start, end = max(loops, key=lambda x: x[1] - x[0])
    return [text for a, text in instructions if start <= a <= end]


def count(
    dtype: str = "fp32",
    bits: int = 8,
    block: int = 256,
    arch: int = 90,
    num_warps: int = 1,
    maxnreg: str = "auto",
    rule: str = "adam",
    rank1: bool = False,
    kernel: str = "adam",
) -> dict:
    """The main loop's figures for one configuration: instructions, per element, by opcode; registers, stack.
    ``rank1``: the second state's scales rank-1 (``adam_kernel``); ``kernel`` ``"stats"``: the rank-1 first pass
    (:func:`compile_stats`) instead of ``adam_kernel``."""
    if kernel == "stats":
        compiled, per_thread = compile_stats(dtype, arch)
    else:
        compiled, per_thread = compile_adam(dtype, bits, block, arch, num_warps, maxnreg, rule, rank1=int(rank1))
    cubin = compiled.asm["cubin"]
    loop = main_loop(_tool("nvdisasm", cubin, "-c"))
    usage = re.search(r"REG:(\d+).*?STACK:(\d+)", _tool("cuobjdump", cubin, "--dump-resource-usage"))
    opcodes = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in loop)
    # global loads and stores of single bytes: a thread's codes are 4 or 8 contiguous bytes, one access when the
    # compiler can prove the mask the same for all of them
    byte_accesses = sum(1 for t in loop if re.search(r"\b[LS]TG\.E\.U8\b", t))
    # shared memory and barriers: what moving values between register layouts costs
    shared = sum(opcodes[op] for op in ("STS", "LDS", "BAR"))
    return dict(
        instructions=len(loop),
        per_thread=per_thread,
        per_element=len(loop) / per_thread,
        opcodes=opcodes,
        registers=int(usage.group(1)),
        stack_bytes=int(usage.group(2)),
        byte_accesses=byte_accesses,
        shared=shared,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="parameter and gradient dtype")
    ap.add_argument("--bits", type=int, default=8, choices=[8, 4], help="bits per code, every state")
    ap.add_argument(
        "--rule",
        default="adam",
        help="the rule whose update the kernel inlines (adam; rmsprop_momentum; three states: ademamix, "
        "adam_amsgrad, rmsprop_centered_momentum)",
    )
    ap.add_argument("--block", type=int, default=256, help="quantization block size")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, as 90 for sm_90")
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument(
        "--maxnreg", default="auto", help="register cap (auto: the planner's, optim.fused.REGISTER_CAPS; 0: none)"
    )
    ap.add_argument(
        "--flat-bits",
        type=int,
        default=None,
        help="the one-load encoder (codec.flat_keyed) for codebooks needing at most this many mantissa "
        "bits per exponent (default: kernels.tables.FLAT_MAX_BITS; 0: two loads always; 7: dtq8 too)",
    )
    ap.add_argument("--rank1", action="store_true", help="the second state's scales rank-1 (\"4bit_rank1\"'s)")
    ap.add_argument(
        "--kernel", default="adam", choices=["adam", "stats"], help="stats: the rank-1 first pass (rank1_stats_kernel)"
    )
    ap.add_argument(
        "--stats-grouped",
        type=int,
        default=None,
        help="--kernel stats: 1, each tile's rows' loads first (StatsTile.grouped); 0, the compiler's order (default: "
        "STATS_TILES' own)",
    )
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args()
    if args.stats_grouped is not None:
        import torchao_optim.kernels.triton_rank1 as triton_rank1

        rank1 = triton_rank1.STATS_TILES["rank1"]._replace(grouped=bool(args.stats_grouped))
        triton_rank1.STATS_TILES = dict(triton_rank1.STATS_TILES, rank1=rank1)
    if args.flat_bits is not None:
        import torchao_optim.kernels.tables as tables

        tables.FLAT_MAX_BITS = args.flat_bits
    c = count(
        args.dtype, args.bits, args.block, args.arch, args.warps, args.maxnreg, args.rule, args.rank1, args.kernel
    )
    if args.json:
        print(json.dumps(c))
        return
    rule = "" if args.rule == "adam" else f" ({args.rule}'s update)"
    what = (
        f'rank1_stats_kernel ("4bit_rank1"\'s first pass), {args.dtype} params'
        + (", each tile's rows' loads first" if args.kernel == "stats" and args.stats_grouped else "")
        if args.kernel == "stats"
        else f"adam_kernel{rule}, {args.dtype} params, {args.bits}-bit codes, blocks of {args.block}"
        + (", rank-1 scales" if args.rank1 else "")
    )
    print(
        f"{what}, sm_{args.arch}: {c['registers']} registers, {c['stack_bytes']} bytes of stack, "
        f"{c['byte_accesses']} single-byte global loads and stores and {c['shared']} shared-memory accesses and "
        f"barriers in the loop"
    )
    print(
        f"main loop: {c['instructions']} instructions for {c['per_thread']} elements per thread, "
        f"{c['per_element']:.1f} per element"
    )
    print("by opcode:", ", ".join(f"{op} {n}" for op, n in c["opcodes"].most_common()))


if __name__ == "__main__":
    main()
