#!/usr/bin/env bash
# The recorded GPU run, in one command: the CUDA tests, the step benchmark (every registered format, the
# test-only formats, torch's AdamW and whatever peers are installed) and Nsight Compute on the fused kernel.
#   OUT=results/gpu bash benchmarks/gpu_acceptance.sh
# Run from the repository root without installing (PYTHONPATH=.). Writes step_cuda.json/png, ncu.txt and
# the logs under $OUT.
set -u
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=.
python -m pytest test/test_cuda.py test/test_codec.py test/test_fused_coefficients.py test/test_rounding.py \
    -q -x 2>&1 | tail -5 | tee "$OUT/tests.txt"
python benchmarks/benchmark_step.py --steps 30 --formats-from test/made_up_formats.py --out "$OUT" \
    ${OPTIMS:+--optims "$OPTIMS"} 2>&1 | tee "$OUT/step.txt"
if command -v ncu >/dev/null; then
    # launch 4 is the third step's large quantized plan on TinyLlama (each step launches the quantized plan
    # and the plain-state plan of the norm weights)
    ncu --kernel-name adam_kernel --launch-skip 4 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section InstructionStats python benchmarks/tune_fused.py --geometry llama_1b \
        --iters 8 --prefetch 1 --warps 1 --steps 2 > "$OUT/ncu.txt" 2>&1
    grep -E "DRAM Throughput|Duration|Compute \(SM\)|Registers Per|Theoretical Occ|Achieved Occ|Issued Instructions  " \
        "$OUT/ncu.txt"
fi
