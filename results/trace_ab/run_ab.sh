#!/usr/bin/env bash
# The --trace A/B of issue 13 item 1, on CPU with random weights (tiny preset) and scripted acceptance.
#   results/trace_ab/run_ab.sh BEFORE_TREE AFTER_TREE OUT
# BEFORE_TREE: a checkout of the code before the change (e.g. `git archive <commit> | tar -x -C DIR`), AFTER_TREE:
# this one. Runs, interleaved, {before, after} x {untraced, traced}: AR, drafter-only, Markov and xPress(K=3) in 5
# paired rounds (1 warmup) over the 8 prompts of data/ab.jsonl, 64 new tokens each, three times over, then summarises with
# results/trace_ab/summarize.py.
set -euo pipefail
before=$(realpath "$1"); after=$(realpath "$2"); out=$(realpath -m "$3")
data=$(realpath "$(dirname "$0")/data")
mkdir -p "$out"
for rep in 1 2 3; do
  for tree in before after; do
    dir=$([ "$tree" = before ] && echo "$before" || echo "$after")
    for trace in off on; do
      extra=()
      [ "$trace" = on ] && extra=(--trace "$out/${tree}_trace.jsonl")
      (cd "$dir" && OMP_NUM_THREADS=1 python3 benchmark_compile_all.py --random-weights tiny --dataset ab \
        --data-dir "$data" --device cpu --max-new-tokens 64 --scripted-accept 3 --fair-interleave 5 \
        --results-dir "$out" --run-id "${tree}_trace_${trace}_${rep}" "${extra[@]}" > "$out/${tree}_trace_${trace}_${rep}.log" 2>&1)
    done
  done
done
python3 "$(dirname "$0")/summarize.py" "$out"
