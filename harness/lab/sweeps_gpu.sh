#!/usr/bin/env bash
# Issue 29's sweeps on a lent GPU, within the device tool's limits (see tables_gpu.sh, whose setup, gguf and part
# calls come first: wheels, the SmolLM2 GGUF, the shipped weights carried in .gpuw and .gpum):
#   device:  bash harness/lab/tables_gpu.sh setup; bash harness/lab/tables_gpu.sh gguf; tables_gpu.sh part .gpum
#            bash harness/lab/sweeps_gpu.sh start       # carry .gpuw (optional when `part` brought every piece): the
#                                                       # job below, in its own session (ONLY="ID ...": just those
#                                                       # sweeps; DEADLINE_S: seconds for all; SWEEP_ARGS: flags added
#                                                       # to the embedded default's sweeps, e.g. --fair-k-list 1,4;
#                                                       # BENCH_ARGS: bench_batch's, e.g. --batch-sizes 1,2,4,8,16;
#                                                       # NOCHECK=1: no GPU tests or bench_batch first)
#            bash harness/lab/sweeps_gpu.sh poll [S]    # until the job ends or S seconds pass; sweeps.tgz in $OUT
#   here:    tar xzf sweeps.tgz -C results/sweeps
# The job: the GPU tests of the batched graphs, bench_batch --graphs at Qwen3-8B's shape (results/perf/), then each
# sweep while DEADLINE_S (seconds from start) allows:
# the embedded default's batch sweep on gsm8k (static, then with --refill over 128 prompts at B = 16 and 64) and
# mt-bench, its context sweep on gsm8k, and Qwen3-8B with random weights and scripted acceptance (3 and 6 accepted
# drafts a step: tau 4 and 7) on gsm8k prompts. XSW and XSWRES move the job's log and the sweeps' folders. Make the
# calls back to back: the job dies with the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
J=${XSW:-/tmp/xsw}      # the job's log and done-file
R=${XSWRES:-/tmp/sweeps}  # the sweeps' folders and logs
CODE="core data drafters harness refiners training scripts tests conftest.py pytest.ini benchmark_compile_all.py bench_fair_fast.sh
  requirements.txt"
ENVS="PYTHONPATH=/tmp/site:/tmp/code XPRESS_BENCH_CACHE=/tmp/xb TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1"
COMMON="--temperature 0 --use-graph --fair-interleave 5 --fair-warmup-rounds 1 --results-dir $R"

sweep() {  # sweep ID ARGS...: one sweep, unless the deadline has passed or ONLY (sweep ids) leaves it out
  local id=$1; shift
  if [[ -n ${ONLY:-} && " $ONLY " != *" $id "* ]]; then echo "$id: skipped (ONLY)"; return 0; fi
  if (( $(date +%s) + ${SWEEP_S:-120} > DEADLINE )); then echo "$id: skipped (deadline)"; return 0; fi
  echo "== $id $(date +%T)"
  python3 benchmark_compile_all.py --run-id "$id" $COMMON "$@" > "$R/$id.log" 2>&1 || echo "$id: failed"
  tail -n 40 "$R/$id.log"
}

case "${1:-}" in
  start)
    mkdir -p /tmp/w $J $R && { [[ ! -d .gpuw ]] || cp -r .gpuw/. /tmp/w/; } && ls /tmp/w/smollm2-135m
    for m in drafter xpress markov; do
      [[ -d /tmp/w/smollm2-135m/$m ]] || { echo "error: /tmp/w/smollm2-135m/$m is missing: carry it (tables_gpu.sh part DIR)" >&2; exit 3; }
    done
    rm -rf /tmp/code && mkdir -p /tmp/code && cp -r $CODE /tmp/code/
    [[ ! -f .xb_commit ]] || cp .xb_commit /tmp/code/  # the commit (device_tree.sh stash): the copy has no .git
    deadline=$(( $(date +%s) + ${DEADLINE_S:-1200} ))
    (cd /tmp/code && env $ENVS XPRESS_BENCH_WEIGHTS=/tmp/w/smollm2-135m DEADLINE=$deadline ONLY="${ONLY:-}" \
        NOCHECK="${NOCHECK:-}" SWEEP_ARGS="${SWEEP_ARGS:-}" BENCH_ARGS="${BENCH_ARGS:-}" setsid nohup \
        bash harness/lab/sweeps_gpu.sh job &) > $J/job.log 2>&1 < /dev/null
    sleep 20; tail -n 5 $J/job.log
    ;;
  job)
    export -f sweep; export R COMMON
    if [[ -z ${NOCHECK:-} ]]; then  # NOCHECK=1: the sweeps only (a session whose code ran these already)
      python3 -m pytest -o addopts="" -q tests/test_batch_graphs_gpu.py tests/test_bench_batch.py \
          tests/test_batch_rows_attention.py tests/test_batch_neighbours_gpu.py 2>&1 | tail -n 15
      # issue 29 item 5: the batched AR and verify steps against their byte floors, graphed, at Qwen3-8B's shape
      python3 -m harness.lab.bench_batch --preset qwen3-8b --kernels triton --graphs ${BENCH_ARGS:-} \
          --out $R/bench_batch_qwen3-8b_graphs.json > $R/bench_batch.log 2>&1 || echo "bench_batch: failed"
      tail -n 3 $R/bench_batch.log
    fi
    S=smollm2-135m; B=1,2,4,8,16,32,64; A=${SWEEP_ARGS:-}
    sweep ${S}_gsm8k_batch --preset $S --dataset gsm8k --batch-sizes $B --max-samples 16 --max-new-tokens 128 $A
    # continuous batching: 128 requests in one queue over B rows (at B = 16 each row serves about 8)
    sweep ${S}_gsm8k_batch_refill --preset $S --dataset gsm8k --refill --batch-sizes 16,64 --max-samples 128 \
        --max-new-tokens 128 $A
    sweep ${S}_mt-bench_batch --preset $S --dataset mt-bench --first-turn-only --batch-sizes $B --max-samples 16 \
        --max-new-tokens 128 $A
    sweep ${S}_gsm8k_context --preset $S --dataset gsm8k --batch-sizes 1,8 --context-lengths 0,1024,4096 \
        --max-samples 8 --max-new-tokens 128 $A
    sweep qwen3-8b_tau4_batch --random-weights qwen3-8b --scripted-accept 3 --dataset gsm8k --data-dir data/eval \
        --batch-sizes $B --max-samples 8 --max-new-tokens 64
    sweep qwen3-8b_tau7_batch --random-weights qwen3-8b --scripted-accept 6 --dataset gsm8k --data-dir data/eval \
        --batch-sizes $B --max-samples 8 --max-new-tokens 64
    echo "rc=0" > $J/done
    ;;
  poll)
    [[ -f $J/job.log ]] || { echo "error: no sweeps job on this machine ($J/job.log is missing): it was given" \
        "back and the job died with it; run setup, gguf, the parts and start again" >&2; exit 3; }
    t=${2:-540}; end=$(( $(date +%s) + t ))
    while [[ ! -f $J/done ]] && (( $(date +%s) < end )); do sleep 5; done
    tail -n 60 $J/job.log
    mkdir -p "${OUT:-/tmp/out}"
    (cd $R && tar czf "${OUT:-/tmp/out}/sweeps.tgz" . 2>/dev/null) || true
    [[ -f $J/done ]] && echo "job: done" || echo "job: running"
    ;;
  *)
    sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 2
    ;;
esac
