#!/usr/bin/env bash
# The embedded default's ten tables (results/smollm2-135m/<dataset>_t<T>/) and the batch-invariant kernels' step cost
# (issue 28) on a lent GPU machine, within the device tool's limits (64 MiB a call, 10 minutes a command, the machine
# given back after ~30 s idle, at most 8 files of 16 MiB back). How the tables of 2026-12-03 were made:
#
#   here:    bash harness/lab/training_gpu.sh prepare    # the GGUF in .gpu1/ and .gpu2/ (and wheels in .whl/: only
#                                                        # gguf is needed here)
#            mkdir -p .gpuw/smollm2-135m .gpum && cp -r weights/smollm2-135m/{drafter,xpress} .gpuw/smollm2-135m/ &&
#                cp -r weights/smollm2-135m/markov .gpum/   # the shipped weights (69 MB), carried apart in two
#            bash harness/lab/device_tree.sh stash DIR   # the tree without weights/ and results/
#   device:  bash harness/lab/tables_gpu.sh setup        # carry .whl .gpu1: installs, starts the step benchmarks
#            bash harness/lab/tables_gpu.sh gguf         # carry .gpu2: the GGUF whole
#            bash harness/lab/tables_gpu.sh part DIR     # carry DIR (only when the weights are over 64 MiB: a
#                                                        # piece, e.g. DIR/markov/, carried apart from .gpuw)
#            bash harness/lab/tables_gpu.sh start [T...] # carry .gpuw: the tables job (after the SmolLM2 step
#                                                        # benchmarks end; Qwen3-8B's after the tables, if the
#                                                        # deadline leaves 240 s)
#            bash harness/lab/tables_gpu.sh poll [S]     # until the job ends or S seconds (default 540) pass
#            bash harness/lab/tables_gpu.sh back         # into $OUT: tables.tgz (the folders), bench.tgz
#   here:    harness/lab/device_tree.sh restore DIR; tar xzf tables.tgz -C results/smollm2-135m; tar xzf bench.tgz
#
# TABLE_ARGS (flags appended to every cell; unset: --kernels triton --batch-invariant, the shipped tables'),
# DEADLINE_S (seconds from `start` after which no new cell begins), SKIP (cell ids not to run, e.g. the T=0 cells
# another session measured), DATASETS, K_LIST, ROUNDS and MAX_SAMPLES pass
# through to smollm2_gpu.sh and bench_fair_fast.sh; XRES and XTAB move the folders and logs (a second job's: with
# NOBENCH, `start` alone in its XTAB suffices). Both jobs run from a copy of the code in /tmp/code (JOB_CODE; WDIR
# moves /tmp/w, the weights), so the tree that each call re-sends cannot change them; START_WAIT (default 5) is how
# long `start` waits before it shows the logs' tails. Make the calls back to back: the jobs die with the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
CODE="core data drafters harness refiners training scripts benchmark_compile_all.py bench_fair_fast.sh requirements.txt"
J=${XTAB:-/tmp/xtab}  # the jobs' logs and done-files
R=${XRES:-/tmp/res}   # the tables' folders
TCODE=${JOB_CODE:-/tmp/code}  # the copy of the code the jobs run from (setup makes it)
TW=${WDIR:-/tmp/w}            # where the weights the tables measure are put together (part, start)
ENVS="PYTHONPATH=/tmp/site:$TCODE XPRESS_BENCH_CACHE=/tmp/xb TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1"

bench_job() {  # bench_job PRESET...: the AR and verify steps with and without the batch-invariant tiles
  local p inv
  for p in "$@"; do
    for inv in "" --batch-invariant; do
      python3 -m harness.lab.bench_step --preset "$p" --kernels triton --ks 1 --topc 0 --taus 4 \
        --sweep-arms drafter-only --skip-hf --long-prompt 0 --loop-tokens 128 $inv \
        --out "/tmp/bench/h200_${p}${inv:+_invariant}.json"
    done
  done
}

case "${1:-}" in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p /tmp/g /tmp/xb /tmp/bench $J && cp .gpu1/gguf.part.aa /tmp/g/
    rm -rf "$TCODE" && mkdir -p "$TCODE" && cp -r $CODE "$TCODE/"
    [[ ! -f .xb_commit ]] || cp .xb_commit "$TCODE/"  # the commit (device_tree.sh stash): the copy has no .git
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
    if [[ -n ${NOBENCH:-} ]]; then echo "rc=skipped" > $J/bench.done; exit 0; fi   # the tables only
    export -f bench_job
    (cd "$TCODE" && env $ENVS setsid nohup bash -c 'bench_job smollm2-135m; echo "rc=$?" > '$J'/bench.done' \
        &) > $J/bench.log 2>&1 < /dev/null
    sleep 15; tail -n 3 $J/bench.log
    ;;
  gguf)
    cat /tmp/g/gguf.part.aa .gpu2/gguf.part.ab > /tmp/xb/$GGUF
    sha256sum /tmp/xb/$GGUF | cut -c1-16
    tail -n 2 $J/bench.log 2>/dev/null || true   # none with NOBENCH
    ;;
  part)  # part DIR: a piece of the weights carried apart (DIR/markov/ ...) goes to $TW/smollm2-135m/
    d=${2:?part DIR}; mkdir -p "$TW/smollm2-135m" && cp -r "$d"/. "$TW/smollm2-135m/" && ls "$TW/smollm2-135m"
    tail -n 2 $J/bench.log 2>/dev/null || true   # none with NOBENCH
    ;;
  start)
    shift
    mkdir -p "$TW" && { [[ ! -d .gpuw ]] || cp -r .gpuw/. "$TW/"; } && ls "$TW/smollm2-135m"  # .gpuw: optional when every piece came by part
    for m in drafter xpress markov; do
      [[ -d $TW/smollm2-135m/$m ]] || { echo "error: $TW/smollm2-135m/$m is missing: carry it (part DIR)" >&2; exit 3; }
    done
    # NOBENCH: no step benchmark to wait for, in this XTAB too (a second job's, whose setup never ran)
    mkdir -p $J && if [[ -n ${NOBENCH:-} && ! -f $J/bench.done ]]; then echo "rc=skipped" > $J/bench.done; fi
    ts=${*:-0 1}
    deadline=$(( $(date +%s) + ${DEADLINE_S:-1200} ))
    export -f bench_job
    (cd "$TCODE" && env $ENVS XPRESS_BENCH_WEIGHTS=$TW/smollm2-135m RES=$R DEADLINE=$deadline \
        TABLE_ARGS="${TABLE_ARGS---kernels triton --batch-invariant}" CELL_S=${CELL_S:-} SKIP="${SKIP:-}" \
        setsid nohup bash -c \
        'while [[ ! -f '$J'/bench.done ]]; do sleep 2; done; bash harness/lab/smollm2_gpu.sh tables '"$ts"';
         echo "rc=$?" > '$J'/tables.done
         if [[ -z ${NOBENCH:-} ]] && (( $(date +%s) + 240 < DEADLINE )); then bench_job qwen3-8b; fi' \
        &) > $J/tables.log 2>&1 < /dev/null
    sleep "${START_WAIT:-5}"; tail -n 3 $J/bench.log $J/tables.log 2>/dev/null || true
    ;;
  poll)
    [[ -f $J/tables.log ]] || { echo "error: no tables job on this machine ($J/tables.log is missing): it was" \
        "given back and the job died with it; run setup, gguf and start again" >&2; exit 3; }
    end=$(( $(date +%s) + ${2:-540} ))
    while [[ ! -f $J/tables.done ]] && (( $(date +%s) < end )); do sleep 5; done
    cat $J/bench.done $J/tables.done 2>/dev/null || echo running
    # every line below must survive a missing file (set -e and pipefail): on 2026-12-03 a grep of the bench log,
    # absent with NOBENCH, ended the poll before it listed or brought back the finished cells
    { grep -E "^\[bench\] (AR|drafter)|error|Traceback" $J/bench.log 2>/dev/null || true; } | tail -n 12
    { grep -E "^== |: (done|skipped|failed)|^\| (AR|drafter|Markov|xPress)" $J/tables.log || true; } | tail -n 30
    ls $R 2>/dev/null || true
    # what is done comes back with every poll: a machine given back between calls takes the rest with it
    if [[ -n ${OUT:-} ]]; then tar czf "$OUT/tables.tgz" -C $R . 2>/dev/null || true; fi
    ;;
  back)
    : "${OUT:?back runs on the device machine, where \$OUT is set}"
    tar czf "$OUT/tables.tgz" -C $R . 2>/dev/null || true   # the folders and each cell's log
    tar czf "$OUT/bench.tgz" -C /tmp bench xtab
    ls -la "$OUT"
    ;;
  *)
    awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 2  # the header: every comment line after the shebang
    ;;
esac
