"""bench_step's markdown report: the JSON result as the tables results/perf/*.md show."""
from __future__ import annotations


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(r: dict) -> str:
    L = [f"# Step cost, {r['preset']} — {r['label']}", "",
         f"{r['device_name']} ({r['dtype']}, batch 1, {r['prompt_len']}-token prompt, block {r['block_size']}), "
         f"torch {r['torch']}, transformers {r['transformers']}, target decode ops: {r.get('kernels', 'torch')}"
         f"{', refiners compiled: ' + str(r['compile']) if r.get('compile') else ''}. "
         f"Every number: **{r['label']}** "
         f"(per-arm rows at scripted {r['scripted_accept_per_arm']} accepted drafts per step).", "",
         f"- copy bandwidth (read+write): {r['copy_bandwidth_GBps']:.0f} GB/s",
         f"- roofline: {r['weight_bytes'] / 1e9:.2f} GB of target weights -> {r['roofline_ms']:.3f} ms "
         f"({r['weight_bytes_read_per_step'] / 1e9:.2f} GB without the embedding table -> "
         f"{r['roofline_read_ms']:.3f} ms)"]
    if "spec_over_ar_byte_floor" in r:
        L.append(f"- the drafter reads {r['drafter_bytes_per_step'] / 1e9:.2f} GB a speculative step (its layers, the "
                 f"lm_head again, the context write): spec/AR >= {r['spec_over_ar_byte_floor']:.3f} by weight bytes "
                 "at equal streaming rates")
    if "ratios" in r:
        q = r["ratios"]
        L.append(f"- graphed AR step / roofline: {q['AR_step_over_roofline']:.3f} "
                 f"(/ roofline without embedding: {q['AR_step_over_roofline_read']:.3f})")
    clock = ("CUDA events" if str(r.get("device", "cuda")).startswith("cuda") else
             "the host clock (time.perf_counter)")
    L += ["", f"ms per step. eager: stages from {clock} on the eager path (host-bound), median over steps. "
          "graph: whole-step CUDA graph replay (device) + host gap per step. stage graphs: each stage captured as "
          "its own graph (device time).", "",
          "| arm | eager step | eager draft | eager refine | eager verify | eager accept | eager observe | eager host "
          "| graph step | graph host | graph wall/step | spec/AR | sg draft | sg refine | sg verify | sg accept | sg observe |",
          "|---|" + "---|" * 16]
    for a in r["arms"]:
        e, g, sg = a["eager"], a.get("graph", {}), a.get("stage_graphs", {})
        ratio = r.get("ratios", {}).get("spec_step_over_AR_step", {}).get(a["arm"])
        L.append(f"| {a['arm']} | {_f(e.get('step'), 2)} | {_f(e.get('draft'), 2)} | {_f(e.get('refine'), 2)} | "
                 f"{_f(e.get('verify'), 2)} | {_f(e.get('accept'), 2)} | {_f(e.get('observe'), 2)} | "
                 f"{_f(e.get('host'), 2)} | {_f(g.get('step_ms'))} | {_f(g.get('host_ms'))} | "
                 f"{_f(g.get('wall_per_step_ms'))} | {_f(ratio)} | {_f(sg.get('draft'))} | {_f(sg.get('refine'))} | "
                 f"{_f(sg.get('verify'))} | {_f(sg.get('accept'))} | {_f(sg.get('observe'))} |")
    if r.get("fusion"):
        L += ["", "AR step, graphed device ms: " + "; ".join(f"{k}: {v:.3f}" for k, v in r["fusion"].items())]
        if r.get("fusion_drafter_only"):
            L += ["", "Drafter-only step, graphed device ms: " +
                  "; ".join(f"{k}: {v:.3f}" for k, v in r["fusion_drafter_only"].items())]
    if r["tau_sweep"]:
        L += ["", "Speedup over AR at scripted tau (full graphed loop, "
              f"{r['tau_sweep'][0]['new_tokens']} new tokens): predicted = tau x AR step / spec step, with the step "
              "times of the per-arm rows above (A) or the mean graphed device step of the same loop runs (B); "
              "measured = spec tok/s / AR tok/s.", "",
              "| arm | tau | predicted A | predicted B | measured | measured/A - 1 | measured/B - 1 | spec tok/s "
              "| AR tok/s |", "|---|---|---|---|---|---|---|---|---|"]
        for s in r["tau_sweep"]:
            L.append(f"| {s['arm']} | {s['tau']} | {s['predicted_speedup']:.3f} | "
                     f"{s.get('predicted_speedup_same_run', float('nan')):.3f} | {s['measured_speedup']:.3f} | "
                     f"{100 * s['rel_diff']:+.1f}% | {100 * s.get('rel_diff_same_run', float('nan')):+.1f}% | "
                     f"{s['spec_tok_s']:.1f} | {s['ar_tok_s']:.1f} |")
    if r["attention"]:
        L += ["", "Attention slots per graph: graphed device step (ms), KV length bucketed vs the whole cache "
              "(masked).", "", "| arm | " + " | ".join(next(iter(r["attention"].values()))) + " |",
              "|---|" + "---|" * len(next(iter(r["attention"].values())))]
        for arm, got in r["attention"].items():
            L.append(f"| {arm} | " + " | ".join(f"{v:.3f}" for v in got.values()) + " |")
    if r["hf_reference"]:
        L += ["", "Extra reference arms (HF `generate`, eager, greedy; ms per new token, prefill excluded):", ""]
        for k, v in r["hf_reference"].items():
            L.append(f"- {k}: " + (f"{v['ms_per_token']:.2f} ms/token" if "ms_per_token" in v else v["error"]))
    for pr in r.get("profile", []):
        L += ["", f"Kernels of the graphed {pr['arm']} step (torch.profiler, per step over {pr['steps']} steps): "
              f"step {pr['step_ms']:.3f} ms, kernels {pr['kernel_sum_ms']:.3f} ms, gaps {pr['gap_ms']:.3f} ms", "",
              "| kernel | calls/step | us/step |", "|---|---|---|"]
        L += [f"| `{k['kernel']}` | {k['calls_per_step']:.1f} | {k['us_per_step']:.1f} |" for k in pr["kernels"]]
    if r.get("long_prompt"):
        lp = r["long_prompt"]
        L += ["", f"Graphed device step after a {lp['prompt_len']}-token prompt (ms): " +
              "; ".join(f"{k}: {v:.3f}" for k, v in lp.items() if k != "prompt_len")]
    if r.get("graph_stats"):
        L += ["", f"Graphs: {r['graph_stats']}"]
    return "\n".join(L) + "\n"
