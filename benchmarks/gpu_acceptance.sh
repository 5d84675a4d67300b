#!/usr/bin/env bash
# The recorded GPU run, in one command: the CUDA tests, Nsight Compute on the fused kernel, and the step benchmark
# (every registered format, the test-only formats, torch's AdamW and whatever peers are installed).
#   OUT=results/gpu bash benchmarks/gpu_acceptance.sh
# PARTS picks what runs (default "tests ncu step"; "rules" tests and times the rules of three states on CUDA, "rank1" the
# rank-1 and factored scales, "targets" times every new rule and matrix-scale format against its floor, "rank1_ncu"
# profiles the rank-1 step's two kernels, "rule_caps" times register caps of RMSprop's kernels, "rank1_grouped" times
# the rank-1 first pass with each tile's rows' loads first, "muon" Muon8bit's fused momentum against its compiled
# path; the memory benchmark's parts, each within ten minutes, are
# "memory_1b memory_fit memory_fit_offload memory_fit_ours_offload"; "compiled_first" times the compiled path's
# first step, cold, one optimizer per process (COMPILED_OPTIMS picks them); "convergence" trains the gpt10m preset with
# fp32 AdamW and every built-in format, two seeds, one optimizer a run under $OUT/convergence/, so that whatever
# finishes is kept; CONVERGENCE_OPTIMS picks the optimizers); OPTIMS, GEOMETRIES, DTYPES and STEPS are
# handed to benchmark_step.py. Run from the repository root without installing (PYTHONPATH=.). Writes tests.txt
# (and tests_full.txt, with the slowest tests), ncu.txt, step.txt and step_cuda.json/png under $OUT, and
# memory_*.txt with memory/*/memory_*.json/png.
set -u
OUT=${OUT:-results/gpu}
PARTS=${PARTS:-"tests ncu step"}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
    python -m pytest test/test_cuda.py test/test_codec.py test/test_fused_coefficients.py test/test_rounding.py \
        test/test_one_state_optimizers.py test/test_step_graphs.py test/test_fused_tiles.py \
        test/test_benchmark_step.py test/test_tune_fused.py -q --durations=15 2>&1 | tee "$OUT/tests_full.txt" | tail -5 | tee "$OUT/tests.txt"
    # a user's torch.compile of a train step over our step, also under CUDA-graph capture (reduce-overhead)
    python -m pytest test/test_compiled_step.py -q -k cuda 2>&1 | tail -3 | tee -a "$OUT/tests.txt"
    # the conformance cases on the fused executor, on the GPU: every format and every optimizer
    python -m pytest test/test_conformance.py -q -k Fused 2>&1 | tail -3 \
        | tee -a "$OUT/tests.txt"
fi
if has ncu && command -v ncu >/dev/null; then
    # launch 4 is the third step's large quantized plan on TinyLlama (each step launches the quantized plan
    # and the plain-state plan of the norm weights)
    # (the ALU pipe's share: integer and logic instructions issue at half rate, and it was the busiest pipe)
    ncu --clock-control none --kernel-name adam_kernel --launch-skip 4 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section InstructionStats --section ComputeWorkloadAnalysis \
        --metrics sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active \
        python benchmarks/tune_fused.py --geometry llama_1b --iters 8 --prefetch 1 --warps 1 --steps 2 > "$OUT/ncu.txt" 2>&1
    grep -E "DRAM Throughput|Duration|Compute \(SM\)|Registers Per|Theoretical Occ|Achieved Occ|Issued Instructions  |pipe_" \
        "$OUT/ncu.txt"
fi
if has step; then
    python benchmarks/benchmark_step.py --steps "${STEPS:-30}" --formats-from test/made_up_formats.py --out "$OUT" \
        ${OPTIMS:+--optims "$OPTIMS"} ${GEOMETRIES:+--geometries "$GEOMETRIES"} ${DTYPES:+--dtypes "$DTYPES"} \
        2>&1 | tee "$OUT/step.txt"
fi
# The rules of three states (AdEMAMix, amsgrad, centered RMSprop with momentum) and centered RMSprop without momentum
# on the Triton kernels: their tests against the C step and the compiled path, then their step beside torch's and
# bitsandbytes' (TinyLlama geometry, fp32 and bf16 parameters), under $OUT/rules.
if has rules; then
    mkdir -p "$OUT/rules"
    python -m pytest test/test_triton_three_states.py test/test_conformance.py -q \
        -k "ademamix or amsgrad or centered" 2>&1 | tail -3 | tee "$OUT/rules/tests.txt"
    python benchmarks/benchmark_step.py --geometries llama_1b --dtypes fp32,bf16 --out "$OUT/rules" \
        --optims AdamWTorchFused,AdamW8bit,AdEMAMix,AdEMAMix8bit,AdEMAMixBnb8bit,AdamWAmsgradTorchFused,AdamW8bitAmsgrad,RMSpropCentered,RMSpropCentered8bit,RMSpropCenteredNoMomentum,RMSpropCenteredNoMomentum8bit,Adagrad8bit,AdagradBnb8bit,RMSprop8bit,RMSpropBnb8bit \
        2>&1 | tee "$OUT/rules/step.txt"
fi
# Muon8bit's momentum on the Triton kernels: its tests against the compiled path, then its step beside the compiled
# path's (fused=False) and torch's fused AdamW (TinyLlama geometry, fp32 and bf16 parameters), under $OUT/muon.
if has muon; then
    mkdir -p "$OUT/muon"
    python -m pytest test/test_one_state_optimizers.py test/test_conformance.py test/test_kernel_compile.py -q \
        -k "muon or Muon" 2>&1 | tail -3 | tee "$OUT/muon/tests.txt"
    python benchmarks/benchmark_step.py --geometries llama_1b --dtypes fp32,bf16 --out "$OUT/muon" \
        --optims AdamWTorchFused,AdamW8bit,Muon,Muon8bit,Muon8bitCompiled 2>&1 | tee "$OUT/muon/step.txt"
fi
# Scales over a whole matrix on the Triton kernels (rank-1: "4bit_rank1"; factored: "factored", "factored4"): their
# tests on the GPU, then the step beside "4bit"'s, "dtq8"'s and torch's fused AdamW (TinyLlama geometry, fp32 and
# bf16 parameters), under $OUT/rank1.
if has rank1; then
    mkdir -p "$OUT/rank1"
    python -m pytest --runslow test/test_triton_rank1.py test/test_kernel_compile.py::test_matrix_scale_kernels_compile_for_sm90 -q \
        2>&1 | tail -3 | tee "$OUT/rank1/tests.txt"
    python benchmarks/benchmark_step.py --geometries llama_1b --dtypes fp32,bf16 --out "$OUT/rank1" \
        --optims AdamWTorchFused,AdamW8bit,AdamW-4bit,AdamW-4bit_rank1,AdamW-factored,AdamW-factored4 2>&1 \
        | tee "$OUT/rank1/step.txt"
fi
# The memory benchmark: every configuration on TinyLlama-1.1B (the offload acceptance), then the largest Llama
# that fits on the machine, in three runs (state on the GPU; torchao's CPU offload; ours with offload_state).
# Every new rule and matrix-scale format against its floor, beside torch's fused AdamW (the rules issue's targets):
# TinyLlama geometry, bf16 and fp32 parameters, under $OUT/targets.
if has targets; then
    mkdir -p "$OUT/targets"
    python benchmarks/benchmark_step.py --geometries llama_1b --dtypes bf16,fp32 --steps 20 --out "$OUT/targets" \
        --optims AdamWTorchFused,AdamW8bit,AdamW-4bit,AdamW-4bit_rank1,AdamW-factored,AdamW-factored4,AdEMAMix8bit,AdamW8bitAmsgrad,RMSpropCentered8bit,RMSpropCenteredNoMomentum8bit,RMSprop8bit,Adagrad8bit \
        2>&1 | tee "$OUT/targets/step.txt"
fi
# The rank-1 first pass with each tile's rows' loads first (StatsTile.grouped) against the compiler's order, tiles of 2,
# 4 and 8 rows, in one process each dtype, under $OUT/rank1_grouped.
if has rank1_grouped; then
    mkdir -p "$OUT/rank1_grouped"
    for dtype in bf16 fp32; do
        python benchmarks/tune_fused.py --state-format 4bit_rank1 --dtype "$dtype" --iters 8 --prefetch 1 --warps 1 \
            --stats-rows 2,4,8 --stats-grouped 0,1 --steps 10 2>&1 | tee "$OUT/rank1_grouped/$dtype.txt"
    done
fi
# Register caps of the rules whose updates hold the most registers (RMSprop with momentum, two states, and centered
# with momentum, three), under $OUT/rule_caps.
if has rule_caps; then
    mkdir -p "$OUT/rule_caps"
    for dtype in bf16 fp32; do
        for optim in RMSpropCentered8bit RMSprop8bit; do
            python benchmarks/tune_fused.py --optim "$optim" --dtype "$dtype" --iters 8 --prefetch 1 --warps 1 \
                --maxnreg 0,96,112,128 --steps 10 2>&1 | tee "$OUT/rule_caps/${optim}_$dtype.txt"
        done
    done
fi
# Where "4bit_rank1"'s step goes: register caps of the step kernel and of the first pass timed, then Nsight Compute on
# its two kernels (first pass and step) with bf16 parameters, with the source view's stall samples, under
# $OUT/rank1_ncu.
if has rank1_ncu; then
    mkdir -p "$OUT/rank1_ncu"
    for dtype in fp32 bf16; do
        python benchmarks/tune_fused.py --state-format 4bit_rank1 --dtype "$dtype" --iters 8 --prefetch 1 --warps 1 \
            --maxnreg 0,96,112 --stats-maxnreg 0,64,48 --steps 10 2>&1 | tee "$OUT/rank1_ncu/caps_$dtype.txt"
    done
    if command -v ncu >/dev/null; then
        ncu --set full --import-source yes --clock-control none --kernel-name regex:"rank1_stats_kernel|adam_kernel" \
            --launch-skip 6 --launch-count 2 -o "$OUT/rank1_ncu/rank1" python benchmarks/tune_fused.py \
            --state-format 4bit_rank1 --dtype bf16 --iters 8 --prefetch 1 --warps 1 --steps 3 >/dev/null 2>&1
        ncu --import "$OUT/rank1_ncu/rank1.ncu-rep" --print-summary none > "$OUT/rank1_ncu/ncu.txt" 2>&1
        ncu --import "$OUT/rank1_ncu/rank1.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/rank1_ncu/source.csv" 2>&1
        grep -E "rank1_stats_kernel|adam_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occ|L1/TEX Hit|Mem Busy" \
            "$OUT/rank1_ncu/ncu.txt"
    fi
fi
if has memory_1b; then
    python benchmarks/benchmark_memory.py --geometry llama_1b --out "$OUT/memory/llama_1b" 2>&1 \
        | tee "$OUT/memory_1b.txt"
fi
if has memory_fit; then
    python benchmarks/benchmark_memory.py --configs AdamWTorchFused,AdamWTorchFused-bf16,AdamWBnb8bit,AdamWTorchao8bit,AdamW8bit,AdamW4bit,AdamW8bitSR-bf16,AdamW8bitSR-backward \
        --out "$OUT/memory/fit" 2>&1 | tee "$OUT/memory_fit.txt"
fi
if has memory_fit_offload; then
    python benchmarks/benchmark_memory.py --configs TorchaoOffload,TorchaoOffload-grads --host-gb 118 --fit-iters 1 \
        --iters 2 --warmup 1 --out "$OUT/memory/fit_offload" 2>&1 | tee "$OUT/memory_fit_offload.txt"
fi
if has memory_fit_ours_offload; then
    python benchmarks/benchmark_memory.py --configs AdamW8bitSR-offload,AdamW8bitSR-offload-backward --iters 3 \
        --warmup 1 --out "$OUT/memory/fit_ours_offload" 2>&1 | tee "$OUT/memory_fit_ours_offload.txt"
fi
# The compiled path's first step with cold caches: each optimizer alone in a fresh process (a process's first
# compile pays for loading the compiler stack too, as a user's does), ViT-B fp32; then its CUDA tests.
# Python's bytecode caches are part of an installation (pip writes them), not a compile cache: where the
# environment forbids writing them (PYTHONDONTWRITEBYTECODE), every process compiles the compiler stack's
# modules from source again, which is what PYCACHE=1 (the default) spares. It writes them under a prefix, and a
# first, discarded run fills it; each timed run still starts with empty inductor and Triton caches. INDUCTOR_OPTIONS
# (space-separated name=value) go to each timed run as --option, for an A/B of an inductor config.
if has compiled_first; then
    if [[ "${PYCACHE:-1}" == 1 ]]; then
        unset PYTHONDONTWRITEBYTECODE
        export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$(mktemp -d)}
        first=${COMPILED_OPTIMS:-AdamWCompiled-dtq8}
        TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/benchmark_step.py \
            --geometries vit_b --dtypes fp32 --optims "${first%% *}" --steps 3 --out "$(mktemp -d)" >/dev/null 2>&1
    fi
    for optim in ${COMPILED_OPTIMS:-AdamWCompiled-dtq8 AdamWCompiled-4bit AdamWCompiled-4bit_rank1}; do
        TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/benchmark_step.py \
            --geometries vit_b --dtypes fp32 --optims "$optim" --steps 20 --out "$OUT/compiled_first/$optim" \
            $(for o in ${INDUCTOR_OPTIONS:-}; do printf -- '--option %s ' "$o"; done) 2>&1 \
            | grep -E "^\| $optim " | tee -a "$OUT/compiled_first.txt"
    done
    python -m pytest test/test_compiled_step.py -q -k cuda 2>&1 | tail -2 | tee -a "$OUT/compiled_first.txt"
fi
if has convergence; then
    for optim in ${CONVERGENCE_OPTIMS:-AdamW AdamW-dtq8 AdamW-4bit AdamW-fp8}; do
        python benchmarks/benchmark_convergence.py --model_size gpt10m --device cuda --optims "$optim" --seeds 0,1 \
            --out "$OUT/convergence/$optim" 2>&1 | grep -E "^\| " | tee -a "$OUT/convergence.txt"
    done
fi
