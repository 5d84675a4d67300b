#!/usr/bin/env bash
# Language-model quality on one GPU: byte-level GPTs of 114M (gpt125m) and 354M (gpt350m) parameters trained on
# the Python standard library's and torch's sources (benchmark_convergence.py), in parts that each fit a call of
# ten minutes, then merged into one table.
#
#   PART=125m-4bit-s0 OUT=results/lm_quality bash benchmarks/lm_quality.sh
#
# PART names one part or several (space-separated, run in turn while the time allows); PART=list prints them. Each
# part writes $OUT/<part>/results.json (rewritten after every run, so a stopped call keeps what finished) and
# $OUT/<part>/log.txt (the part's table is at its end). BUDGET_S (default 510) is the call's time: a run starts only
# if it is expected to end within it (estimated from timed steps, then from the runs before it), and stops once its
# own pace says it would end later; the runs left out are named in the log and in results.json, for a later part.
# Optimizers whose package (bitsandbytes, torchao) does not import are skipped with a line saying so. EXTRA_ARGS go to every run (runs with other settings do not merge);
# DEVICE (default cuda) and PART=custom with MODEL, OPTIMS and SEEDS make a smoke run, e.g. on a CPU: PART=custom
# MODEL=tiny OPTIMS=AdamW,AdamW4bit SEEDS=0 DEVICE=cpu EXTRA_ARGS="--steps 20" bash benchmarks/lm_quality.sh
#
# The full acceptance, about 1.6 minutes a gpt125m run and 2.6 minutes a gpt350m run on one H200 (estimate: 6 x
# parameters x tokens at 250 TFLOP/s in bf16), each part about 5 to 7 minutes:
#   gpt125m, seeds 0, 1 and 2 of every optimizer (fp32 AdamW's seed range decides):
#     125m-4bit-s0  125m-4bit-s1  125m-4bit-s2    AdamW, AdamW4bit, AdamWTorchao4bit; seed 0, 1, 2
#     125m-8bit-s0  125m-8bit-s1  125m-8bit-s2    AdamW8bit, AdamWFp8, AdamWBnb8bit, AdamWTorchao8bit; seed 0, 1, 2
#     125m-rank1                                  AdamW-4bit_rank1, seeds 0, 1, 2
#   gpt350m, seed 0 (each low-bit format within 1% of fp32 AdamW):
#     350m-a  350m-b                              AdamW, AdamW4bit; AdamW8bit, AdamWFp8
# and the 4-bit variants (benchmarks/fourbit_variants.py, loaded by --formats_from; each one change from AdamW4bit,
# on the fused path), to compare with the 125m-4bit part of the same seed:
#     125m-4bitvar-s0  125m-4bitvar-s1  125m-4bitvar-s2
#         AdamW-4bit_dyn (exp_avg's codebook the dynamic tree map), AdamW-4bit_b64 (blocks of 64), AdamW4bit-emb8
#         (the embeddings in 8-bit), AdamW4bit-small8 (every tensor of at most 2**19 elements in 8-bit); seed 0, 1, 2
# and, for the 4-bit gap on gpt350m (seed 0; compare with 350m-a's AdamW and AdamW4bit):
#     350m-4bitvar   AdamW-4bit_b64, AdamW4bit-small8, AdamW4bit-emb8
#     350m-rank1     AdamW-4bit_rank1
#     350m-sr        AdamW-4bit_srm, AdamW-4bit_sr (codes rounded stochastically: exp_avg's; both states'; the
#                    per-parameter compiled path)
# and the factored second moment beside the 125m parts' fp32 AdamW (a second call
# takes the seeds the first leaves out):
#     125m-factored  AdamW-factored4, AdamW-factored; seeds 0, 1, 2
#     125m-adafactor torch.optim.Adafactor (benchmarks/optimizers.py: lr x15); seeds 0, 1, 2
# and exp_avg stored over sqrt(exp_avg_sq) (benchmarks/normalized_momentum.py), with the "4bit", "4bit_rank1" and
# "4bit_vsq" formats, beside the same seed's AdamW and AdamW4bit:
#     350m-nm-s0  350m-nm-s1  125m-nm-s0  125m-nm-s1  125m-nm-s2
# and exp_avg held to Adam's bound |m| <= C sqrt(v) (benchmarks/clipped_momentum.py), with the "4bit_vsq", "4bit" and
# "4bit_rank1" formats, beside 350m-a's AdamW and AdamW4bit:
#     350m-clip
# and torchao's floor on the block scales (each block's absmax clipped at 1e-12; benchmarks/small_gradients.py), with
# torchao's maps (its AdamW4bit state, on our compiled path) and with "4bit"'s, beside the 125m-4bit parts:
#     125m-floor-s0  125m-floor-s1  125m-floor-s2
# and on gpt350m beside 350m-a's AdamW and AdamW4bit:
#     350m-floor
# then, wherever the parts' folders were gathered (any machine, no GPU needed):
#   python benchmarks/benchmark_convergence.py --merge results/lm_quality/125m-{4bit,8bit}-s* \
#       results/lm_quality/125m-rank1 --out results/lm_quality/gpt125m
#   python benchmarks/benchmark_convergence.py --merge results/lm_quality/125m-4bit-s* \
#       results/lm_quality/125m-4bitvar-s* --out results/lm_quality/gpt125m-4bitvar
#   python benchmarks/benchmark_convergence.py --merge results/lm_quality/350m-* --out results/lm_quality/gpt350m
# which write results.md (mean ± range over seeds, state bytes per parameter, time, and the targets), results.json
# and val_loss.png. Start with 125m-4bit-s0 and 125m-4bit-s1: fp32 AdamW, 4-bit and torchao's 4-bit on two seeds.
set -u -o pipefail
OUT=${OUT:-results/lm_quality}
PART=${PART:?"set PART to a part's name (PART=list prints them)"}
BUDGET_S=${BUDGET_S:-510}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VARIANTS="AdamW-4bit_dyn,AdamW-4bit_b64,AdamW4bit-emb8,AdamW4bit-small8"
NORMALIZED="AdamW4bit-nm,AdamW4bit-nm-rank1,AdamW4bit-nm-vsq"  # exp_avg stored over sqrt(exp_avg_sq)

part() {  # the model, optimizers and seeds of part $1, then any flags of its own
    case "$1" in
        125m-4bit-s[0-9]) echo "gpt125m AdamW,AdamW4bit,AdamWTorchao4bit ${1#125m-4bit-s}" ;;
        125m-4bitvar-s[0-9]) echo "gpt125m $VARIANTS ${1#125m-4bitvar-s} --formats_from $HERE/fourbit_variants.py" ;;
        125m-8bit-s[0-9]) echo "gpt125m AdamW8bit,AdamWFp8,AdamWBnb8bit,AdamWTorchao8bit ${1#125m-8bit-s}" ;;
        125m-rank1) echo "gpt125m AdamW-4bit_rank1 0,1,2" ;;
        350m-a) echo "gpt350m AdamW,AdamW4bit 0" ;;
        350m-b) echo "gpt350m AdamW8bit,AdamWFp8 0" ;;
        350m-4bitvar) echo "gpt350m AdamW-4bit_b64,AdamW4bit-small8,AdamW4bit-emb8 0 --formats_from $HERE/fourbit_variants.py" ;;
        350m-rank1) echo "gpt350m AdamW-4bit_rank1 0" ;;
        350m-sr) echo "gpt350m AdamW-4bit_srm,AdamW-4bit_sr 0 --formats_from $HERE/fourbit_variants.py" ;;
        125m-factored) echo "gpt125m AdamW-factored4,AdamW-factored 0,1,2" ;;
        125m-adafactor) echo "gpt125m Adafactor 0,1,2" ;;
        350m-nm-s[0-9]) echo "gpt350m $NORMALIZED ${1#350m-nm-s} --formats_from $HERE/normalized_momentum.py" ;;
        125m-nm-s[0-9]) echo "gpt125m $NORMALIZED ${1#125m-nm-s} --formats_from $HERE/normalized_momentum.py" ;;
        350m-clip) echo "gpt350m AdamW4bit-clip-vsq,AdamW4bit-clip,AdamW4bit-clip-rank1 0 --formats_from $HERE/clipped_momentum.py" ;;
        125m-floor-s[0-9]) echo "gpt125m AdamW-4bit_dyn_floor,AdamW-4bit_floor ${1#125m-floor-s} --formats_from $HERE/fourbit_variants.py" ;;
        350m-floor) echo "gpt350m AdamW-4bit_floor,AdamW-4bit_dyn_floor 0 --formats_from $HERE/fourbit_variants.py" ;;
        custom) echo "${MODEL:?PART=custom needs MODEL} ${OPTIMS:?PART=custom needs OPTIMS} ${SEEDS:?PART=custom needs SEEDS}" ;;
        *) return 1 ;;
    esac
}
if [[ "$PART" == list ]]; then
    for p in 125m-4bit-s0 125m-4bit-s1 125m-4bit-s2 125m-8bit-s0 125m-8bit-s1 125m-8bit-s2 125m-rank1 350m-a 350m-b \
        125m-4bitvar-s0 125m-4bitvar-s1 125m-4bitvar-s2 350m-4bitvar 350m-rank1 350m-sr 125m-factored 125m-adafactor 350m-nm-s0 \
        125m-nm-s0 350m-clip 125m-floor-s0 350m-floor; do
        read -r model optims seeds flags <<<"$(part "$p")"
        echo "$p: --model_size $model --optims $optims --seeds $seeds${flags:+ $flags}"
    done
    exit 0
fi
for p in $PART; do
    part "$p" >/dev/null || { echo "unknown part $p; PART=list prints the parts" >&2; exit 2; }
done

status=0
for p in $PART; do
    read -r model optims seeds flags <<<"$(part "$p")"
    # the budget left to this part, less the interpreter's start (imports) before the script starts its clock
    left=$((BUDGET_S - SECONDS - 15))
    if ((left < 60)); then
        echo "part $p not started: ${left} s of BUDGET_S=${BUDGET_S} left"
        status=1
        continue
    fi
    mkdir -p "$OUT/$p"
    echo "part $p: --model_size $model --optims $optims --seeds $seeds${flags:+ $flags}, budget ${left} s"
    # shellcheck disable=SC2086  # EXTRA_ARGS and the part's flags are lists of flags
    python benchmarks/benchmark_convergence.py --model_size "$model" --device "${DEVICE:-cuda}" --optims "$optims" \
        --seeds "$seeds" --skip_missing --budget_s "$left" --out "$OUT/$p" ${flags:-} ${EXTRA_ARGS:-} 2>&1 \
        | tee "$OUT/$p/log.txt" | grep -vE "it/s|s/it" || status=1
    # the merge draws the plots and tables; a part keeps results.json and its log (few files to carry back)
    rm -f "$OUT/$p/results.md" "$OUT/$p/val_loss.png"
done
exit $status
