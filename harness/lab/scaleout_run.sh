#!/usr/bin/env bash
# The two-GPU scale-out run and its one-GPU comparison (issue 18), then the checks (harness.lab.scaleout_compare).
#
#   bash harness/lab/scaleout_run.sh            # on a host with >= 2 GPUs, from the repository root
#
# Both runs: the qwen3-8b random-weights preset, scripted acceptance, every arm (AR, drafter-only, Markov,
# xPress(K=$K)) in paired rounds (warmup + one per arm), $SAMPLES gsm8k prompts, launched by torchrun with
# $NPROC processes and with one (same launcher, same code path; CUDA_VISIBLE_DEVICES=0). Wall time is taken around
# each whole command. Results: results/perf/scaleout_{2gpu,1gpu}_qwen3-8b/ and results/perf/scaleout_qwen3-8b.{md,json}.
# Budget (an estimate from results/perf, not a measurement: AR 4.3-7 ms/step, the speculative arms at tau 7 about
# 5x faster): MAX_NEW_TOKENS=128 puts the one-GPU run at about 1.5-2.5 minutes on an H200 (16 prompts x 5 rounds x
# 4 arms, plus start-up and graph capture), under the 4-minute limit. Every variable below can be overridden.
set -euo pipefail
cd "$(dirname "$0")/../.."

NPROC=${NPROC:-2}
SAMPLES=${SAMPLES:-16}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
SCRIPTED=${SCRIPTED:-6}
K=${K:-6}
PRESET=${PRESET:-qwen3-8b}        # PRESET=tiny DEVICE=cpu: a CPU smoke run of this script (gloo, no GPU)
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-results/perf}
if [[ -z "${DATA_DIR:-}" ]]; then
  for d in data/eval .assets/eval; do
    [[ -f "$d/gsm8k.jsonl" ]] && DATA_DIR=$d && break
  done
fi
[[ -n "${DATA_DIR:-}" ]] || { echo "error: no gsm8k.jsonl found; set DATA_DIR to a folder holding it" >&2; exit 2; }
ARGS=(--random-weights "$PRESET" --scripted-accept "$SCRIPTED" --dataset gsm8k --data-dir "$DATA_DIR"
      --max-samples "$SAMPLES" --max-new-tokens "$MAX_NEW_TOKENS" --device "$DEVICE"
      --fair-interleave --fair-k-list "$K" --results-dir "$OUT")
if [[ $DEVICE == cuda ]]; then
  GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
  (( GPUS >= NPROC )) || { echo "error: $GPUS GPU(s) visible, NPROC=$NPROC needs $NPROC" >&2; exit 2; }
  ARGS+=(--dtype bfloat16 --use-graph)
fi
MULTI=scaleout_${NPROC}gpu_$PRESET
SINGLE=scaleout_1gpu_$PRESET
for d in "$OUT/$MULTI" "$OUT/$SINGLE"; do
  [[ ! -e $d ]] || { echo "error: $d exists; move it away (or set OUT) before a rerun" >&2; exit 2; }
done

run() {  # run NAME NPROC [env...]: prints the command's wall seconds on stdout, its output on stderr
  local name=$1 n=$2; shift 2
  local t0 t1
  t0=$(date +%s.%N)
  env "$@" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" benchmark_compile_all.py "${ARGS[@]}" --run-id "$name" \
    > "$OUT/$name.console.log" 2>&1 || { tail -40 "$OUT/$name.console.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  python3 -c "print(f'{$t1 - $t0:.2f}')"
}

mkdir -p "$OUT"
WALL_MULTI=$(run "$MULTI" "$NPROC" OMP_NUM_THREADS=4)
echo "[scaleout] $NPROC GPUs: ${WALL_MULTI} s (log $OUT/$MULTI.console.log)"
WALL_SINGLE=$(run "$SINGLE" 1 OMP_NUM_THREADS=4 CUDA_VISIBLE_DEVICES=0)
echo "[scaleout] 1 GPU: ${WALL_SINGLE} s (log $OUT/$SINGLE.console.log)"
mv "$OUT/$MULTI.console.log" "$OUT/$MULTI/console.log"
mv "$OUT/$SINGLE.console.log" "$OUT/$SINGLE/console.log"
python3 -m harness.lab.scaleout_compare --multi "$OUT/$MULTI" --single "$OUT/$SINGLE" \
  --wall-multi "$WALL_MULTI" --wall-single "$WALL_SINGLE" --out "$OUT/scaleout_$PRESET.md"
