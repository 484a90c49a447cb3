#!/usr/bin/env bash
# One training run of `python -m training all --config smollm2-gpu` on a lent GPU machine, within the device tool's
# limits (a 64 MiB working tree a call, 10 minutes a command, the machine given back after ~30 s idle, at most 8
# files of 16 MiB back from $OUT). How the second run at scale was made (results/perf/NOTES.md, "Training at scale
# on the H200, the second run"), as one script:
#
#   here:    bash harness/lab/training_gpu.sh prepare [WARM]   # wheels in .whl/, the GGUF in .gpu1/ and .gpu2/, a
#                                                              # warm-start export (e.g. weights/smollm2-135m)
#                                                              # in .gpu3/; then harness/lab/device_tree.sh stash DIR
#   device:  bash harness/lab/training_gpu.sh setup            # carry .whl .gpu1: installs, keeps GGUF part 1
#            bash harness/lab/training_gpu.sh warm             # carry .gpu3 (with a warm start only): keeps it
#            bash harness/lab/training_gpu.sh data DIR NAME    # carry DIR (pieces of `python -m training.travel
#                                                              # pack`): stages made in an earlier session
#            bash harness/lab/training_gpu.sh warmheads        # carry .gpu4 (after warm): the shipped heads beside
#                                                              # the warm drafter, for smollm2-gpu-heads-continue
#            bash harness/lab/training_gpu.sh cache            # carry .gpu5 (when an earlier session brought a
#                                                              # compile cache back): train.compile_cache loads it
#            bash harness/lab/training_gpu.sh start [ARGS...]  # carry .gpu2: the GGUF whole, the job started
#                                                              # in its own session (ARGS: more --set overrides);
#                                                              # returns after START_WAIT s (default 20) with the
#                                                              # log's tail
#            bash harness/lab/training_gpu.sh poll [SECONDS]   # until the job ends or SECONDS (default 540) pass
#            bash harness/lab/training_gpu.sh back [WHAT...]   # into $OUT: records.tgz, and WHAT (e.g. drafter, or
#                                                              # xpress markov_gated) of the export in tar parts of
#                                                              # 15 MB, as many as one call brings back (8 files,
#                                                              # 64 MiB together); it says what is left
#            bash harness/lab/training_gpu.sh rest             # the parts back left, in the next call
#            bash harness/lab/training_gpu.sh pack             # after back: the job's prompts and responses stages
#                                                              # as travel pieces (of 15 MiB, four a call; about 8 for 120k
#                                                              # sequences), brought back by this call and `rest`
#                                                              # calls, for a later session's `data` (kept outside
#                                                              # the repository: data are never committed)
#            bash harness/lab/training_gpu.sh tables DS:T...   # after the job: ship its export (training.ship) to
#                                                              # /tmp/w/smollm2-135m and start those table cells
#                                                              # (smollm2_gpu.sh tables; TABLE_ARGS, K_LIST pass on;
#                                                              # DEADLINE skips a cell that would end past it); like
#                                                              # `start`, it returns at once; then tpoll
#            bash harness/lab/training_gpu.sh tpoll [SECONDS]  # until the cells end; `back tables` brings them
#                                                              # (TRES: where the cells go, default /tmp/res; a
#                                                              # second set of cells on one machine needs another)
#            bash harness/lab/training_gpu.sh shipped          # carry .gpu4 (after `warm`): the shipped folder's
#                                                              # heads and files beside the warm drafter make
#                                                              # /tmp/w/smollm2-135m, and `tables` then measures
#                                                              # those weights instead of shipping the job's export
#            bash harness/lab/training_gpu.sh jobhead [MODEL]  # after the job and `shipped`: the job's MODEL (default
#                                                              # xpress, an xpress_* or markov_* head) in place of
#                                                              # the shipped head of its kind, so `tables` measures
#                                                              # the shipped drafter and other head with the head
#                                                              # the job trained
#                                                              # (a heads-only job's export has no drafter to ship)
#   here, for `shipped`:  bash harness/lab/training_gpu.sh heads weights/smollm2-135m   # into .gpu4/ (32 MB)
#
# With a warm export (warm), the job's copy of the code holds it at weights/smollm2-135m/ (the tree travels without
# weights/), so a config whose heads start from that folder (smollm2-gpu-heads: init_from
# weights/smollm2-135m/drafter) finds it there.
#   here:    harness/lab/device_tree.sh restore DIR; tar xzf records.tgz; cat WHAT.tar.part.* | tar xf -
#            mkdir -p .gpu5 && cat compile_cache.part.* > .gpu5/compile_cache.bin   # for the next session's `cache`
#
# Make the calls back to back (the job dies with the machine). The job runs from a copy of the code in /tmp/code,
# so the tree that each call re-sends cannot change it, and writes $XRUN (default /tmp/xrun) and $XRUN.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
XRUN=${XRUN:-/tmp/xrun}  # the workdir on the device (its log: $XRUN.log)
WARM=${WARM:-/tmp/warm}  # the warm export on the device (`warm`); SHIPPED_DIR: the shipped heads' carry (`heads`)
WDIR=${WDIR:-/tmp/w}     # where the weights that `tables` measures are put together
JOB_CODE=${JOB_CODE:-/tmp/code}  # the copy of the code that `start` makes and the jobs run from
# train.compile_cache on the device (training/compiling.py load_cache); not named CC, the C compiler's variable: the
# H200 machine of 2026-12-05 sets CC=/opt/gcc/bin/gcc, so the job saved its compile cache over gcc
XB_CACHE=${XB_CACHE:-/tmp/compile_cache.bin}
GPARTS=${GPARTS:-/tmp/g}  # the GGUF's first part (setup), joined with the second by start
XB_DIR=${XB_DIR:-/tmp/xb}  # XPRESS_BENCH_CACHE of the jobs: the joined GGUF
SHIPPED_DIR=${SHIPPED_DIR:-.gpu4}
TRES=${TRES:-/tmp/res}    # where `tables` writes its cells and `back tables` reads them
CODE="core data drafters harness refiners training scripts benchmark_compile_all.py bench_fair_fast.sh requirements.txt"

BACK=${BACK:-$XRUN.back}  # what `back` staged; each call moves into $OUT what one call can bring back
MAX_BACK=${MAX_BACK:-8}; MAX_BACK_BYTES=${MAX_BACK_BYTES:-65011712}  # 8 files, 62 MiB (64 MiB less a margin)

send_back() {  # records.tgz, the export's parts in order, then the compile cache's, while a call's limits allow;
  local f n=0 total=0 size  # the rest stays in $BACK
  for f in $(ls "$BACK" | sort | awk '$0 == "records.tgz" {print; next} /^compile_cache/ {cc = cc $0 "\n"; next}
                                      {rest = rest $0 "\n"} END {printf "%s%s", rest, cc}'); do
    size=$(stat -c %s "$BACK/$f")
    (( n < MAX_BACK && total + size <= MAX_BACK_BYTES )) || break
    mv "$BACK/$f" "$OUT/" && n=$((n + 1)) && total=$((total + size))
  done
  ls -la "$OUT"
  left=$(ls "$BACK" | wc -l)
  if (( left )); then echo "left on the machine: $left file(s); run 'training_gpu.sh rest' in the next call"
  else echo "nothing left to bring back"; fi
}

case "${1:-}" in
  prepare)
    warm=${2:-}
    mkdir -p .whl .gpu1 .gpu2
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d .whl \
        -r training/GPU_WHEELS.txt
    src=$(python3 -m harness.protocol.assets smollm2)
    split -b 50000000 "$src" /tmp/gguf.part.
    mv /tmp/gguf.part.aa .gpu1/ && mv /tmp/gguf.part.ab .gpu2/
    # the export's manifest and drafter/ (37 MB): what a warm start of the drafter and heads trained on it read; the
    # shipped folder's heads (xpress/, markov/) would take the carry over 64 MiB
    if [[ -n $warm ]]; then rm -rf .gpu3 && mkdir -p .gpu3/warm && cp -r "$warm"/manifest.json "$warm"/drafter .gpu3/warm/; fi
    du -sh .whl .gpu1 .gpu2 ${warm:+.gpu3}
    ;;
  heads)  # here: the shipped folder without its drafter (which `warm` carries), for `shipped`
    src=${2:?heads DIR: the shipped weights folder, e.g. weights/smollm2-135m}
    rm -rf "$SHIPPED_DIR" && mkdir -p "$SHIPPED_DIR/shipped"
    find "$src" -mindepth 1 -maxdepth 1 ! -name drafter -exec cp -r {} "$SHIPPED_DIR/shipped/" \;
    du -sh "$SHIPPED_DIR"
    ;;
  shipped)
    [[ -d $WARM/drafter ]] || { echo "error: no warm drafter on this machine ($WARM/drafter); run warm first" >&2; exit 3; }
    rm -rf "$WDIR/smollm2-135m" && mkdir -p "$WDIR" && cp -r "$WARM" "$WDIR/smollm2-135m"
    cp -r "$SHIPPED_DIR/shipped/." "$WDIR/smollm2-135m/" && touch "$WDIR/.shipped" && ls "$WDIR/smollm2-135m"
    ;;
  jobhead)
    what=${2:-xpress}
    case $what in
      xpress*) slot=xpress ;;
      markov_*) slot=markov ;;
      *) echo "error: jobhead takes an xpress* or markov_* head of the job's export, not '$what'" >&2; exit 2 ;;
    esac
    [[ -f $WDIR/.shipped ]] || { echo "error: no shipped folder to swap a head into ($WDIR/.shipped is missing:" \
        "run shipped after the job's start)" >&2; exit 3; }
    [[ -f $XRUN.done ]] || { echo "error: the training job has not ended ($XRUN.done is missing; its workdir may" \
        "still hold an earlier job's export): poll first" >&2; exit 3; }
    [[ -d $XRUN/export/$what ]] || { echo "error: no $XRUN/export/$what (the export holds:" \
        "$(ls "$XRUN/export" 2>/dev/null | xargs)); poll until the job ends" >&2; exit 3; }
    rm -rf "${WDIR:?}/smollm2-135m/$slot" && cp -r "$XRUN/export/$what" "$WDIR/smollm2-135m/$slot"
    echo "$slot: the job's export/$what ($XRUN), not the shipped head" >> "$WDIR/smollm2-135m/JOBHEAD"
    cat "$WDIR/smollm2-135m/JOBHEAD" && ls "$WDIR/smollm2-135m/$slot"
    ;;
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p "$GPARTS" "$XB_DIR" && cp .gpu1/gguf.part.aa "$GPARTS/"
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
    ;;
  cache)  # torch.compile's artifacts from an earlier session's job (`back` brings them as compile_cache.part.*)
    cp .gpu5/compile_cache.bin "$XB_CACHE" && ls -la "$XB_CACHE"
    ;;
  warm)  # its own call: the GGUF's part 2 (47 MB) and a warm export (37 MB) are over 64 MiB together
    rm -rf "$WARM" && cp -r .gpu3/warm "$WARM" && du -sh "$WARM"
    ;;
  warmheads)  # carry .gpu4 (`heads` here), after `warm`: the shipped heads beside the warm drafter, so that a heads
    # config warm-starts them on it (smollm2-gpu-heads-continue; training/warm.py maps markov/ to the model
    # heads.json names); the warm export's own manifest.json stays
    [[ -d $WARM/drafter ]] || { echo "error: no warm drafter on this machine ($WARM/drafter); run warm first" >&2
                                exit 3; }
    for f in xpress markov heads.json; do  # every one checked before any is copied: no half-filled warm folder
      [[ -e $SHIPPED_DIR/shipped/$f ]] || { echo "error: $SHIPPED_DIR/shipped/$f is missing: run 'training_gpu.sh" \
          "heads weights/smollm2-135m' here and carry $SHIPPED_DIR" >&2; exit 3; }
    done
    for f in xpress markov heads.json; do rm -rf "${WARM:?}/$f" && cp -r "$SHIPPED_DIR/shipped/$f" "$WARM/"; done
    ls "$WARM"
    ;;
  data)
    dir=${2:?data DIR NAME: the folder of travel pieces}; name=${3:?data DIR NAME: the pack name}
    PYTHONPATH=/tmp/site:. python3 -m training.travel unpack "$dir" --workdir $XRUN --name "$name"
    ls $XRUN
    ;;
  start)
    shift
    cat "$GPARTS/gguf.part.aa" .gpu2/gguf.part.ab > "$XB_DIR/$GGUF"
    sha256sum "$XB_DIR/$GGUF" | cut -c1-16
    rm -rf "$JOB_CODE" && mkdir -p "$JOB_CODE" && cp -r $CODE "$JOB_CODE/"
    [[ ! -f .xb_commit ]] || cp .xb_commit "$JOB_CODE/"  # the commit (device_tree.sh stash): the copy has no .git
    if [[ -d $WARM ]]; then mkdir -p "$JOB_CODE/weights" && rm -rf "$JOB_CODE/weights/smollm2-135m" && cp -r "$WARM" "$JOB_CODE/weights/smollm2-135m"; fi
    args=(--set train.compile_cache="$XB_CACHE" "$@")  # loaded if `cache` put one there; saved after the train stage
    # WARM_START=0: the warm export is only a folder the config names (e.g. models.drafter.init_from with grow,
    # smollm2-gpu-grow), not train.warm_start
    if [[ -d $WARM && ${WARM_START:-1} != 0 ]]; then args+=(--set train.warm_start="$WARM"); fi
    rm -f $XRUN.done "$WDIR/.shipped"  # a new job's tables ship its own export unless `shipped` runs again after it
    date +%s > $XRUN.t0
    (cd "$JOB_CODE" && PYTHONPATH=/tmp/site:$JOB_CODE XPRESS_BENCH_CACHE="$XB_DIR" TOKENIZERS_PARALLELISM=false \
        PYTHONUNBUFFERED=1 setsid nohup bash -c 'python3 -m training all --config smollm2-gpu --workdir "$0" "${@}";
        echo "rc=$?" > "$0.done"' "$XRUN" "${args[@]}" &) >> $XRUN.log 2>&1 < /dev/null
    sleep "${START_WAIT:-20}"; tail -n 5 $XRUN.log
    ;;
  poll)
    # a machine given back takes the job with it, and the next call gets a bare one: say so at once instead of
    # waiting out the poll (a 2026-12-02 call spent 500 s of device time waiting for a job that was not there)
    [[ -f $XRUN.t0 ]] || { echo "error: no training job on this machine ($XRUN.t0 is missing): it was given back" \
        "and the job died with it; run setup, warm and start again" >&2; exit 3; }
    end=$(( $(date +%s) + ${2:-540} ))
    while [[ ! -f $XRUN.done ]] && (( $(date +%s) < end )); do sleep 5; done
    echo "elapsed $(( $(date +%s) - $(cat $XRUN.t0) )) s; $(cat $XRUN.done 2>/dev/null || echo running)"
    grep -E "^(prompts|responses|hidden|train|fit|held-out|box|acceptance|export|error)|Traceback" $XRUN.log | tail -n 40
    tail -c 1500 $XRUN.log
    ;;
  tables)
    shift
    shipped=; [[ -f $WDIR/.shipped ]] && shipped=1
    if [[ -z $shipped && ! -f $XRUN.done ]]; then
      echo "error: the training job has not ended ($XRUN.done is missing); poll first, or run shipped" >&2; exit 3
    fi
    cells=("$@")
    # a second `tables` job on the same machine (e.g. the T=1 cells after the T=0 ones) must not find the first
    # job's .done, or `tpoll` returns at once (2026-12-06: it did, while the second job ran on)
    rm -f "$XRUN.tables.done"
    # after `shipped`, the shipped weights are measured as they are; otherwise the job's export is shipped first
    (cd "$JOB_CODE" && PYTHONPATH=/tmp/site:$JOB_CODE XPRESS_BENCH_CACHE="$XB_DIR" TOKENIZERS_PARALLELISM=false \
        SHIPPED=$shipped W="$WDIR/smollm2-135m" TRES="$TRES" PYTHONUNBUFFERED=1 setsid nohup \
        bash -c '{ if [[ -n $SHIPPED ]]; then
          echo "ship: the shipped weights (training_gpu.sh shipped), not the job export"
          cat "$W/JOBHEAD" 2>/dev/null || true; else
          python3 -m training.ship --workdir "$0" --out "$W"; fi; } &&
        for c in "${@}"; do DATASETS=${c%%:*} RES="$TRES" XPRESS_BENCH_WEIGHTS=$W \
          bash harness/lab/smollm2_gpu.sh tables "${c##*:}"; done; echo "rc=$?" > "$0.tables.done"' \
        "$XRUN" "${cells[@]}" &) > $XRUN.tables.log 2>&1 < /dev/null
    sleep "${TABLES_WAIT:-10}"; tail -n 5 $XRUN.tables.log
    ;;
  tpoll)
    [[ -f $XRUN.tables.log ]] || { echo "error: no tables job on this machine: it was given back" >&2; exit 3; }
    end=$(( $(date +%s) + ${2:-540} ))
    while [[ ! -f $XRUN.tables.done ]] && (( $(date +%s) < end )); do sleep 5; done
    cat $XRUN.tables.done 2>/dev/null || echo running
    grep -E "^ship|^== |: (done|skipped|failed)|^\| (AR|drafter|Markov|xPress)|error|Traceback" $XRUN.tables.log | tail -n 40
    ;;
  back)
    : "${OUT:?back runs on the device machine, where \$OUT is set}"
    if [[ ${2:-} == tables ]]; then
      tar czf "$OUT/tables.tgz" -C "$TRES" . $XRUN.tables.log && tar czf "$OUT/shipped.tgz" -C "$WDIR" \
          smollm2-135m/manifest.json $(cd "$WDIR" && ls smollm2-135m/JOBHEAD 2>/dev/null)
      ls -la "$OUT"; exit 0
    fi
    rm -rf "$BACK" && mkdir -p "$BACK" && cd "$XRUN"
    { find . -maxdepth 3 \( -name '*.json' -o -name metrics.jsonl \) -not -path './prompts/*' -not -path './export/*/*' \
        -not -path './responses/parts/*'; ls ./prompts/{manifest.json,selection.jsonl,heldout.jsonl} 2>/dev/null || true; } |
        tar czf "$BACK/records.tgz" -T - $XRUN.log  # the prompts stage's manifest and the prompts its τ is measured
        # on (selection, held-out: a few KB), not its training prompts; a regenerated pool draws other sets
    shift
    missing=()
    for w in "$@"; do [[ -e export/$w ]] || missing+=("$w"); done
    if (( ${#missing[@]} )); then  # the records still come back; the export is not split
      send_back; echo "error: no export/${missing[0]} in $XRUN (the export holds: $(ls export 2>/dev/null | xargs))" >&2
      exit 3
    fi
    if (( $# )); then tar cf - export/manifest.json "${@/#/export/}" | split -b 15000000 - "$BACK/$1.tar.part."; fi
    if [[ -f $XB_CACHE ]]; then split -b 15000000 "$XB_CACHE" "$BACK/compile_cache.part."; fi
    send_back
    ;;
  pack)
    : "${OUT:?pack runs on the device machine, where \$OUT is set}"
    [[ -f $XRUN.done ]] || { echo "error: the training job has not ended ($XRUN.done is missing); poll first" >&2; exit 3; }
    mkdir -p "$BACK"
    PYTHONPATH=/tmp/site:. python3 -m training.travel pack --workdir "$XRUN" --out "$BACK" --stages prompts,responses \
        --max-mib "${PACK_MIB:-15}" --name stages  # 15 MiB: four pieces and the index a call
    send_back
    ;;
  rest)  # what `back` left on the machine (over the 8 files or 64 MiB that one call brings back)
    : "${OUT:?rest runs on the device machine, where \$OUT is set}"
    [[ -d $BACK ]] || { echo "error: nothing to bring back ($BACK is missing): run back first" >&2; exit 3; }
    send_back
    ;;
  *)
    sed -n '2,/^set -euo pipefail/{/^set -euo/!p}' "$0"; exit 2
    ;;
esac
