#!/usr/bin/env bash
# The multi-GPU acceptance of sharded training, in one command, on every GPU of one host (two or more):
#   OUT=results/fsdp_multi bash benchmarks/fsdp_multi_gpu.sh
# 1. the distributed tests that need GPUs: CPUOffloadPolicy on a CUDA mesh over NCCL (TestCudaMesh, two ranks);
# 2. benchmark_fsdp.py over NCCL on every GPU: its bit-for-bit check against one process and its DCP resume, then
#    the sharded step of the TinyLlama-1.1B geometry for every optimizer row (ours in each format, offloaded state,
#    torch's fused and foreach AdamW, torchao's AdamW8bit when importable), fp32 and bf16 parameters.
# With fewer than two GPUs it says so and exits 2 (one GPU: benchmark_fsdp.py with --nproc-per-node 1 measures the
# same rows on one rank). NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Writes $OUT/tests.txt, $OUT/fsdp_*.json
# and $OUT/fsdp_*.txt. Run from the repository root without installing (PYTHONPATH=.).
set -u -o pipefail
OUT=${OUT:-results/fsdp_multi}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if ((gpus < 2)); then
    echo "fsdp_multi_gpu.sh needs two or more GPUs on this host; found ${gpus}." >&2
    echo "On one GPU: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 benchmarks/benchmark_fsdp.py" >&2
    exit 2
fi
mkdir -p "$OUT"
status=0
python -m pytest -q -p no:cacheprovider test/test_distributed.py -k TestCudaMesh -rs 2>&1 | tail -5 | tee "$OUT/tests.txt" \
    || status=1
for dtype in float32 bfloat16; do
    torchrun --nproc-per-node "$gpus" benchmarks/benchmark_fsdp.py --dtype "$dtype" --out "$OUT" 2>&1 \
        | grep -v "^W[0-9]" | tee "$OUT/fsdp_${gpus}gpu_${dtype}.txt" || status=1
done
exit $status
