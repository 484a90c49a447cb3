#!/usr/bin/env bash
# The GPU side of issue 12 ("no behaviour change"): the GPU tests, and bench_step on the code before and after the
# redesign, the same arguments, one after the other on one machine. Run from the repository root on a CUDA machine.
#
#   bash harness/lab/gpu_check.sh tests                 # the gpu and kernel tests (-m "gpu or device"), log kept
#   bash harness/lab/gpu_check.sh bench before DIR      # bench_step in DIR, a copy of the tree before the redesign
#                                                       #   (e.g. `git archive cb7493b | tar -x -C DIR`)
#   bash harness/lab/gpu_check.sh bench after           # bench_step in this tree
#   bash harness/lab/gpu_check.sh compare               # step times side by side, from the two JSON files
#   bash harness/lab/gpu_check.sh quick                 # the CPU-built pieces never run on a GPU, in one call
#                                                       #   (a few minutes; after tables_gpu.sh setup and gguf)
#
# Files go to $OUT (default results/perf/gpu_check). Numbers are random weights / scripted acceptance.
# PRESET picks the bench_step preset (default qwen3-8b; smollm2-135m is the launch-bound case and takes a minute).
set -euo pipefail
OUT=${OUT:-results/perf/gpu_check}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
# the qwen3-8b preset, the arms NOTES.md compares (AR, drafter-only, Markov, xPress K=6 with and without C=128),
# one tau, the split-attention comparison after a 2048-token prompt; a few minutes per run on one H200
BENCH=(--preset "${PRESET:-qwen3-8b}" --device cuda --dtype bfloat16 --reps 10 --skip-hf --ks 6 --topc 0,128 --taus 4
       --sweep-arms "xPress(K=6)" --long-prompt 2048)

case "${1:-}" in
  tests)
    # the tests marked gpu (15) and the kernel tests, which run on CUDA when it is present (marked device): 80, in
    # parallel where pytest-xdist is installed (with -n 8 on one H200: 226 s on random weights, over 330 s when the
    # SmolLM2 GGUF is cached and the publish tests decode the real model; results/perf/NOTES.md); they are
    # correctness checks, not timings
    par=(); python -c "import xdist" 2>/dev/null && par=(-n 8)
    python -m pytest -v "${par[@]}" --durations=20 -m "gpu or device" tests 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  bench)
    which=${2:?before or after}
    if [ "$which" = before ]; then
      dir=${3:?the directory holding the tree before the redesign}
      # the old bench_step had a prefetch sweep in its lever table: 0 skips the extra rows, as NOTES.md's runs did
      (cd "$dir" && python -m harness.lab.bench_step "${BENCH[@]}" --prefetch-sweep 0 --out "$OUT/before.json")
    else
      python -m harness.lab.bench_step "${BENCH[@]}" --out "$OUT/after.json"
    fi
    ;;
  compare)
    python - "$OUT/before.json" "$OUT/after.json" <<'PY'
import json, sys
before, after = (json.load(open(p)) for p in sys.argv[1:3])
def steps(r):
    rows = {a["arm"]: a["graph"]["step_ms"] for a in r["arms"] if a.get("graph")}
    rows.update({f"long prompt: {k}": v for k, v in r.get("long_prompt", {}).items() if k != "prompt_len"})
    return rows
b, a = steps(before), steps(after)
print(f"copy bandwidth GB/s: before {before['copy_bandwidth_GBps']:.0f}, after {after['copy_bandwidth_GBps']:.0f}")
print(f"{'graphed step, device ms':48s} {'before':>8s} {'after':>8s} {'after/before':>12s}")
for k in b:
    if k in a:
        print(f"{k:48s} {b[k]:8.3f} {a[k]:8.3f} {a[k] / b[k]:12.4f}")
PY
    ;;
  quick)
    # what the sessions without a GPU built, each the cheapest check of it (results/perf/NOTES.md, "After the
    # tenth session"): the top-p cut (core.kernels.topp) against the sort, compiled, and alone at 1 to 32 probes
    # a pass (the twelfth session's change), and the fused
    # xPress latent's fp32 refusal on a GPU; then the responses engine's sampled rate with either cut and its greedy
    # rate, on the same card, one after the other; and an xPress pass's kernels, profiled. Needs tables_gpu.sh's
    # (or training_gpu.sh's) setup: the wheels in /tmp/site; and its gguf: the GGUF in /tmp/xb. (The ninth
    # session's quick check, the fused passes' cost and the batched steps' floors: results/perf/gpu_check_h100_quick/.)
    export PYTHONPATH=/tmp/site:. XPRESS_BENCH_CACHE=/tmp/xb TOKENIZERS_PARALLELISM=false
    { python3 -m pytest -o addopts="" -q tests/test_topp.py tests/test_xpress_latent.py tests/test_stacked_ops.py \
        tests/test_batched_generate.py 2>&1 || true; } | tail -n 12 | tee "$OUT/quick_tests.log"
    # the top-p cut alone at the engine's batch, device ms a call: the bisection (probes=1, the measured default)
    # against 4 to 32 thresholds a pass (core.kernels.topp); rows whose threshold differs from the bisection's are
    # counted with the exact mass (fp64) above the lower threshold, which must be within fp32 rounding of top_p
    python3 - <<'PY' 2>&1 | tee "$OUT/topp_probes.txt" || true
import torch
from core.kernels.topp import PROBES, threshold
p = (torch.randn(1024, 49152, device="cuda") * 3).softmax(-1)
bound = p.shape[1] * torch.finfo(torch.float32).eps
ref = threshold(p, 0.95, probes=1)
for probes in (1, 4, 8, 16, 32):
    threshold(p, 0.95, probes=probes)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        threshold(p, 0.95, probes=probes)
    b.record(); torch.cuda.synchronize()
    t = threshold(p, 0.95, probes=probes)
    rows = (t != ref).nonzero().flatten()
    # at the lower of the two thresholds one search saw the mass above under top_p and the other did not
    x = torch.minimum(t, ref)
    off = max((abs(torch.where(p[r] > x[r], p[r], 0).double().sum().item() - 0.95) for r in rows.tolist()), default=0.0)
    print(f"probes {probes:2d}{' (default)' if probes == PROBES else ''}: {a.elapsed_time(b) / 20:.3f} ms a call of "
          f"[1024, 49152]; {len(rows)} rows' thresholds differ from the bisection's, their mass above at most "
          f"{off:.2e} from top_p (rounding: <= {bound:.2e}: {off <= bound})")
PY
    GEN=(--target smollm2 --device cuda --dtype bfloat16 --prompts 2048 --batch 1024 --max-new-tokens 512
         --skip-hf --attention triton)
    for s in threshold sort; do
      python3 -m harness.lab.bench_generate "${GEN[@]}" --sampled --sampler $s \
          --out "$OUT/generate_sampled_$s.json" | tail -n 4 || true
    done
    python3 -m harness.lab.bench_generate "${GEN[@]}" --out "$OUT/generate_greedy.json" | tail -n 4 || true
    # where an xPress pass's 0.028 ms (H100, graphed) goes: its kernels' own times, eager, per call of K=4
    python3 -m harness.lab.bench_refiner --preset smollm2-135m --device cuda --dtype bfloat16 --use-graph \
        --kernels triton --passes 0,1,4 --topc 0 --repeats 50 --profile 4 --out "$OUT/refiner_profile.json" \
        | tail -n 16 || true
    ls "$OUT"
    ;;
  *)
    sed -n 2,14p "$0"
    exit 2
    ;;
esac
