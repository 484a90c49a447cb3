#!/usr/bin/env bash
# The published xPress protocol as one paired run:  ./bench_fair_fast.sh <dataset> [temperature]
#
# Qwen3-8B + z-lab dFlash drafter (block 16), 2048 new tokens, 128 prompts (shuffle(seed=0) subset), and ONE
# rotation holding every arm: AR, drafter-only, Markov and xPress at each K of K_LIST, rotated left each round,
# the first round excluded. Unlike the reference script, AR and drafter-only are in the rotation, so every
# speedup is a paired measurement, and the temperature is compared as a number (0.0 is greedy).
#
# Environment overrides: K_LIST, ROUNDS (default: warmup + number of arms), DRAFT_T (default: the temperature),
# XPRESS_CKPT, MK_CKPT, OUTDIR (results folder, default ./results), TARGET, DRAFT, DATA_DIR (local JSONL
# prompts instead of the hub), MAX_SAMPLES, MAX_NEW_TOKENS, BLOCK, DEVICE, USE_GRAPH (1: whole-step CUDA graphs, the
# default off CPU), EXTRA_ARGS (appended verbatim).
set -euo pipefail
cd "$(dirname "$0")"

DATASET="${1:-gsm8k}"
TEMP="${2:-0}"
if ! python3 -c "import sys; float(sys.argv[1])" "$TEMP" 2>/dev/null; then
  echo "error: temperature '$TEMP' is not a number" >&2
  exit 2
fi
GREEDY=$(python3 -c "import sys; print(1 if float(sys.argv[1]) < 1e-5 else 0)" "$TEMP")
if [ "$GREEDY" = 1 ]; then DEFAULT_K="4,5,6,7"; else DEFAULT_K="6,7,8"; fi
K_LIST="${K_LIST:-$DEFAULT_K}"
DRAFT_T="${DRAFT_T:-$TEMP}"
TARGET="${TARGET:-Qwen/Qwen3-8B}"
DRAFT="${DRAFT:-z-lab/Qwen3-8B-DFlash-b16}"
XPRESS_CKPT="${XPRESS_CKPT:-UIUC-SSAIL/Qwen3-8B-XPress-b16}"
MK_CKPT="${MK_CKPT:-UIUC-SSAIL/Qwen3-8B-Markov-b16}"
OUTDIR="${OUTDIR:-./results}"
BLOCK="${BLOCK:-16}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-2048}"
MAX_SAMPLES="${MAX_SAMPLES:-128}"
export TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

args=(--model-name-or-path "$TARGET" --draft-name-or-path "$DRAFT"
      --xpress-refiner-path "$XPRESS_CKPT" --markov-refiner-path "$MK_CKPT"
      --fair-interleave ${ROUNDS:+"$ROUNDS"} --fair-warmup-rounds 1 --fair-k-list "$K_LIST"
      --block-size "$BLOCK" --dataset "$DATASET" --max-new-tokens "$MAX_NEW_TOKENS" --max-samples "$MAX_SAMPLES"
      --temperature "$TEMP" --draft-temperature "$DRAFT_T" --results-dir "$OUTDIR"
      --run-id "fairfast_T${TEMP}_draftT${DRAFT_T}_${DATASET}_K${K_LIST//,/-}_$(date +%Y%m%d-%H%M%S)")
[ -n "${DATA_DIR:-}" ] && args+=(--data-dir "$DATA_DIR")
[ -n "${DEVICE:-}" ] && args+=(--device "$DEVICE")
# the fast path (whole-step CUDA graphs) everywhere but on CPU; USE_GRAPH=0 turns it off
if [ "${USE_GRAPH:-1}" = 1 ] && [ "${DEVICE:-cuda}" != cpu ]; then args+=(--use-graph); fi
echo "dataset=$DATASET T=$TEMP draftT=$DRAFT_T K_LIST=$K_LIST rounds=${ROUNDS:-auto} (first 1 discarded, order rotates)"
# shellcheck disable=SC2086
exec python3 benchmark_compile_all.py "${args[@]}" ${EXTRA_ARGS:-}
