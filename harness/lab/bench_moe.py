"""MoE verify cost: python -m harness.lab.bench_moe --preset gemma4-26b-a4b --out results/perf/moe_gemma4.json

A verify of B rows reads the union of the experts its rows route to, so a MoE target's verify cost grows with the
block where a dense target's stays flat. At one preset's real shapes (random weights, built on the device) and
after a prompt of --context tokens, this measures:
- the AR step (the whole decode step, eager, median over --steps steps);
- the target's verify forward alone at each block in --blocks (median over --reps calls);
- the full speculative step (draft + verify + accept + observe, drafter-only, scripted acceptance) at each block;
- the expert-union size per MoE layer for each block (mean over layers and blocks, untimed), both for the verify
  alone (the prompt's last B tokens: distinct random ids) and for the verifies inside the speculative step (an
  untimed replay: they check the drafter's block, and a random drafter repeats a few tokens, so its rows route to
  fewer experts and the spec step reads less than a real drafter's would);
then the spec/AR cost ratio per block and, at each scripted tau, the block with the most tokens per second
(min(tau, B) tokens a step over the measured spec step). Every number is labelled random weights / scripted
acceptance. Writes JSON (--out) and a markdown table beside it.
"""
from __future__ import annotations

import statistics
import sys

import torch

from harness.protocol.algorithms import DFlashDrafter
from core.devices import resolve_backend
from harness.decode.loop import DecodeSettings, generate
from core.errors import Parser, UsageError, cli_exit
from harness.protocol.presets import PRESETS, RANDOM_LABEL, build_random
from harness.protocol.results_io import write_record


def _median_ms(fn, backend, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = backend.now()
        fn()
        times.append((backend.now() - t0) * 1e3)
    return statistics.median(times)


def expert_union(target, block: torch.Tensor, length: int) -> float:
    """Mean over MoE layers of the number of distinct experts the block's rows route to (untimed)."""
    target.route_log = []
    target.verify(block, length, False)
    sizes = [int(torch.unique(ids).numel()) for ids in target.route_log]
    target.route_log = None
    return sum(sizes) / len(sizes)


def _settings(target, steps: int, drafter, accept: int) -> DecodeSettings:
    return DecodeSettings(max_new_tokens=steps * (accept + 1) + 1, max_model_len=target.capacity, stop_ids=(),
                          scripted_accept=accept if drafter is not None else None)


def step_ms(target, prompt, backend, steps: int, drafter=None, accept: int = 0) -> float:
    """Mean decode step: decode seconds / steps of a scripted generation (after an untimed warm one)."""
    s = _settings(target, steps, drafter, accept)
    generate(target, prompt, s, backend, drafter=drafter)
    g = generate(target, prompt, s, backend, drafter=drafter)
    n = g.spec_steps + g.ar_steps
    return g.decode_s * 1e3 / max(n, 1)


def spec_expert_union(target, prompt, backend, steps: int, drafter, block: int) -> float:
    """Mean over MoE layers and verify calls of the experts that the speculative step's own verifies route to: an
    untimed replay of step_ms's generation, the prefill's routing left out (it routes the whole prompt; --context
    is larger than every block, so no prefill has a block's row count)."""
    target.route_log = []
    try:
        generate(target, prompt, _settings(target, steps, drafter, block - 1), backend, drafter=drafter)
        sizes = [int(torch.unique(ids).numel()) for ids in target.route_log if ids.shape[0] == block]
    finally:
        target.route_log = None
    if not sizes:
        raise RuntimeError(f"bench_moe: the speculative generation logged no verify of {block} rows")
    return sum(sizes) / len(sizes)


def measure(preset: str, device: str | None, blocks: list[int], context: int, steps: int, reps: int,
            taus: list[float], seed: int = 0) -> dict:
    backend = resolve_backend(device, None)
    top = max(blocks)
    models = build_random(preset, backend, block_size=top, capacity=context + steps * top + 2 * top, seed=seed)
    t, d = models.target, models.drafter
    if not any(getattr(layer, "enable_moe_block", False) for layer in t.layers):
        raise UsageError(f"--preset {preset}: the target has no mixture-of-experts layers")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(8, t.vocab_size, (context,), generator=g).tolist()
    ids = torch.tensor(prompt, device=backend.device)
    t.prefill(ids, want_features=False)
    length = context + top
    row = {"AR": {"step_ms": step_ms(t, prompt, backend, steps), "expert_union": float(PRESETS[preset].config["top_k_experts"])}}
    t.prefill(ids, want_features=False)
    for b in blocks:
        blk = ids[-b:]
        drafter = DFlashDrafter(d.model, t.embed, t.lm_head, backend, block_size=b, capacity=t.capacity)
        row[b] = {"verify_ms": _median_ms(lambda: t.verify(blk, length, True), backend, reps),
                  "expert_union": expert_union(t, blk, length)}
        row[b]["spec_step_ms"] = step_ms(t, prompt, backend, steps, drafter, accept=b - 1)
        row[b]["spec_expert_union"] = spec_expert_union(t, prompt, backend, steps, drafter, b)
        t.prefill(ids, want_features=False)
    ar = row["AR"]["step_ms"]
    for b in blocks:
        row[b]["spec_over_ar"] = row[b]["spec_step_ms"] / ar
        row[b]["verify_over_ar"] = row[b]["verify_ms"] / ar
    best = {str(tau): max(blocks, key=lambda b: min(tau, b) / row[b]["spec_step_ms"]) for tau in taus}
    return {"label": RANDOM_LABEL, "preset": preset, "device": str(backend.device), "dtype": str(backend.dtype),
            "gpu": torch.cuda.get_device_name(backend.device) if backend.device.type == "cuda" else None,
            "torch": torch.__version__, "context": context, "steps": steps, "reps": reps,
            "experts": PRESETS[preset].config.get("num_experts"), "top_k": PRESETS[preset].config.get("top_k_experts"),
            "rows": {str(k): v for k, v in row.items()}, "best_block_at_tau": best}


def table(r: dict) -> str:
    L = [f"# MoE verify cost: {r['preset']} ({r['label']})", "",
         f"{r['gpu'] or r['device']}, {r['dtype']}, torch {r['torch']}, context {r['context']}, "
         f"{r['experts']} experts top-{r['top_k']}", "",
         "| block | verify ms | verify/AR | expert union / layer (verify) | spec step ms | spec/AR | "
         "expert union / layer (spec step) |", "|---|---|---|---|---|---|---|"]
    ar = r["rows"]["AR"]
    L.append(f"| AR (1) | - | - | {ar['expert_union']:.1f} | {ar['step_ms']:.2f} | 1.00 | {ar['expert_union']:.1f} |")
    for k, v in r["rows"].items():
        if k != "AR":
            L.append(f"| {k} | {v['verify_ms']:.2f} | {v['verify_over_ar']:.2f} | {v['expert_union']:.1f} | "
                     f"{v['spec_step_ms']:.2f} | {v['spec_over_ar']:.2f} | {v['spec_expert_union']:.1f} |")
    L += ["", "AR and spec steps: eager decode steps (decode seconds / steps, drafter-only, scripted acceptance of "
          "B-1 drafts). verify: the target's B-row forward alone, median. expert union: distinct experts the block's "
          "rows route to, mean over MoE layers; for the verify alone the block is the prompt's last B tokens (random, "
          "distinct ids, routed near-uniformly by random weights: an upper bound for real text), for the spec step it "
          "is the random drafter's blocks, which repeat a few tokens: where that union is smaller the spec step read "
          "fewer experts than the verify alone, and can cost less than it.",
          "", "Throughput-optimal block at scripted tau (tokens/s = min(tau, B) / spec step): "
          + ", ".join(f"tau {k}: B={v}" for k, v in r["best_block_at_tau"].items())]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m harness.lab.bench_moe", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gemma4-26b-a4b", choices=sorted(PRESETS))
    p.add_argument("--device")
    p.add_argument("--blocks", default="4,8,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=24, help="decode steps per timed generation")
    p.add_argument("--reps", type=int, default=20, help="timed verify calls per block")
    p.add_argument("--taus", default="3,5,7,9", help="scripted tau values for the optimal-block line")
    p.add_argument("--out", help="JSON path; the markdown table goes beside it (.md)")
    a = p.parse_args(argv)

    def work():
        blocks = sorted({int(b) for b in a.blocks.split(",")})
        if min(blocks) < 2:
            raise UsageError(f"--blocks {a.blocks}: a verify block needs >= 2 rows")
        r = measure(a.preset, a.device, blocks, a.context, a.steps, a.reps, [float(x) for x in a.taus.split(",")])
        text = table(r)
        print(text)
        if a.out:
            write_record(a.out, r, text)
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
