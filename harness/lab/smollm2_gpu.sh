#!/usr/bin/env bash
# The SmolLM2-135M embedded default on one CUDA GPU (issue 15): train its drafter and heads, ship them, measure.
# Run from the repository root; each step is resumable (training stages skip what is done, a results folder that
# already has its summary is skipped).
#
#   bash harness/lab/smollm2_gpu.sh train        # python -m training stages; drafters, then every head, in parallel
#   bash harness/lab/smollm2_gpu.sh weights      # weights/smollm2-135m/{drafter,xpress,markov} + manifest.json
#   bash harness/lab/smollm2_gpu.sh tables T...  # results/smollm2-135m/<dataset>_t<T>/ for each dataset and T
#   bash harness/lab/smollm2_gpu.sh lossless     # fp32, 8 gsm8k prompts, every arm: output must equal AR's
#                                                # (KERNELS=triton: the same on the Triton kernels)
#
# TABLE_ARGS: flags appended to every cell; unset, the shipped tables' kernels (--kernels triton --batch-invariant:
# every arm's T=0 output equals AR's in bf16); set it empty for --kernels auto (2026-12-05 a candidate's tables ran
# so by mistake: results/perf/candidate_tables_h200/README.md).
# DEADLINE (epoch seconds) makes `tables` skip a cell that would not finish in time (CELL_S: the estimate); SKIP
# names cells not to run (ids, e.g. "gsm8k_t0 mbpp_t0": measured elsewhere, on another machine or commit).
# The tables are the embedded default's own CUDA run (its size: harness/protocol/setups.py EMBEDDED_CUDA, now 7
# prompts x 512 new tokens x 4 arms x 5 rounds; the tables of results/smollm2-135m/ ran at it, 60-120 s a cell on an
# H200 with K 1,2,4); mt-bench measures its first
# turn only.
# Run nothing else on the GPU meanwhile: a gsm8k cell beside another table process ran AR at 393 tok/s, against
# 858 alone (seen on the H200, not committed).
set -euo pipefail
cd "$(dirname "$0")/../.."
export TOKENIZERS_PARALLELISM=false
CONFIG=${CONFIG:-smollm2-gpu}
WORK=${WORK:-runs/smollm2-gpu}
RES=${RES:-results/smollm2-135m}
DATASETS=${DATASETS:-gsm8k math500 humaneval mbpp mt-bench}
DATASETS=${DATASETS//,/ }  # "gsm8k,mbpp" as "gsm8k mbpp" (a comma list made one cell of an unknown dataset)
SKIP=${SKIP:-}
SKIP=${SKIP//,/ }  # the cells not to run, "gsm8k_t0,mbpp_t0" as "gsm8k_t0 mbpp_t0" too
DRAFTERS=${DRAFTERS:-drafter}
HEADS=${HEADS:-xpress markov_vanilla markov_gated}
# time boxes in minutes (0: none); the shipped weights were trained with DRAFTER_MIN=2 HEAD_MIN=1.2 (the
# session's device time), a warm torch.compile cache and the data stages already done: see weights/smollm2-135m
DRAFTER_MIN=${DRAFTER_MIN:-0}
HEAD_MIN=${HEAD_MIN:-0}
# CELL_S: a cell's estimate for DEADLINE, unset: 130 s at T=0 and 160 s at T>0, about 1.4x what cells of K_LIST=1,2,4
# took on an H100 (2026-12-07: T=0 cells 82-93 s apart in env.json; T=1 about 110 s). The earlier 200 s skipped
# humaneval and mt-bench on 2026-12-07 with 197 s of a 470 s deadline unused.
cell_s() { if [[ -n ${CELL_S:-} ]]; then echo "$CELL_S"; elif [[ $1 == 0 ]]; then echo 130; else echo 160; fi; }

stage() { python3 -m training "$@" --config "$CONFIG" --workdir "$WORK"; }

parallel_train() {  # parallel_train MINUTES MODEL...: one process per model, each time-boxed; fails if any fails
  local minutes=$1; shift
  local pids=() m
  for m in "$@"; do
    stage train --models "$m" --set train.max_minutes="$minutes" >"$WORK/train_$m.log" 2>&1 &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for m in "$@"; do grep -E "held-out|train $m" "$WORK/train_$m.log" || true; done
  return $rc
}

case "${1:-}" in
  train)
    mkdir -p "$WORK"
    stage prompts && stage responses && stage hidden
    # shellcheck disable=SC2086
    parallel_train "$DRAFTER_MIN" $DRAFTERS
    # shellcheck disable=SC2086
    parallel_train "$HEAD_MIN" $HEADS
    stage export
    ;;
  weights)
    python3 -m training.ship --workdir "$WORK" --out weights/smollm2-135m
    ;;
  tables)
    shift
    mkdir -p "$RES"
    for T in "${@:-0}"; do
      for ds in $DATASETS; do
        id="${ds}_t${T}"
        if [[ -f "$RES/$id/summary.json" ]]; then echo "$id: done"; continue; fi
        if [[ " $SKIP " == *" $id "* ]]; then echo "$id: skipped (SKIP)"; continue; fi
        if [[ -n "${DEADLINE:-}" ]] && (( $(date +%s) + $(cell_s "$T") > DEADLINE )); then
          echo "$id: skipped (deadline)"; continue
        fi
        extra="--run-id $id ${TABLE_ARGS---kernels triton --batch-invariant}"
        [[ $ds == mt-bench ]] && extra+=" --first-turn-only"
        rm -rf "${RES:?}/$id"
        OUTDIR=$RES EXTRA_ARGS=$extra ./bench_fair_fast.sh "$ds" "$T" >"$RES/$id.log" 2>&1 || echo "$id: failed (see $RES/$id.log)"
        [[ -f "$RES/$id/table.md" ]] && { echo "== $id"; cat "$RES/$id/table.md"; }
      done
    done
    ;;
  lossless)
    # a warmup round and a measured one: every output of both is compared with AR's. --kernels auto takes the torch
    # ops in fp32; KERNELS=triton runs the same check on the Triton kernels (run id lossless_fp32_triton_gsm8k)
    k=${KERNELS:-auto}; id=lossless_fp32_gsm8k
    [[ $k == auto ]] || id=lossless_fp32_${k}_gsm8k
    python3 benchmark_compile_all.py --dtype float32 --max-samples 8 --max-new-tokens 96 --temperature 0 \
      --fair-interleave 2 --fair-warmup-rounds 1 --kernels "$k" --results-dir "$RES" --run-id "$id"
    ;;
  *)
    sed -n 2,14p "$0"
    exit 2
    ;;
esac
