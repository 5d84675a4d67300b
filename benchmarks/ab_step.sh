#!/usr/bin/env bash
# The optimizer step of this tree against another tree's, alternated in one run (BASE, this, BASE, this, ...), with
# the same benchmark_step.py arguments for both: what a change to the engine costs or gains, free of the drift
# between runs. BASE is a directory holding the other tree's torchao_optim/ and benchmarks/ (for example
# `mkdir .base && git archive <commit> torchao_optim benchmarks test/made_up_formats.py | tar -x -C .base`).
#   BASE=.base OUT=results/ab REPEATS=2 bash benchmarks/ab_step.sh --geometries vit_b,llama_1b --dtypes fp32,bf16
# Writes $OUT/<base|this>_<k>/step_*.json and $OUT/ab.txt, the step times side by side (benchmarks/ab_table.py).
set -eu
BASE=${BASE:?BASE: a directory holding the other tree}
OUT=${OUT:-results/ab}
REPEATS=${REPEATS:-2}
mkdir -p "$OUT"
# one compile cache for both trees: identical kernels compile once, and neither tree's first run pays for it alone
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(dirname "$TORCHINDUCTOR_CACHE_DIR")/triton}
for k in $(seq 1 "$REPEATS"); do
    for tree in base this; do
        root=$([ "$tree" = base ] && echo "$BASE" || echo .)
        # benchmark_step.py puts its own tree first on sys.path: each run imports the torchao_optim beside it
        python "$root/benchmarks/benchmark_step.py" --warm-cache --out "$OUT/${tree}_$k" "$@" \
            > "$OUT/${tree}_$k.txt" 2>&1 || { tail -20 "$OUT/${tree}_$k.txt"; exit 1; }
        echo "$tree run $k done"
    done
done
python benchmarks/ab_table.py "$OUT" | tee "$OUT/ab.txt"
