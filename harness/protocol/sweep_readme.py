"""What a sweep's folder says about itself: the run line its titles open with (sweep.md, steps.md, the plots) and
the folder's README.md (harness.protocol.sweep writes both)."""
from __future__ import annotations

import os

from harness.protocol import ci_text
from harness.protocol.replicates import seeds_short
from harness.protocol.rounds import imbalance, rotation

FILES = (("sweep.md", "total and per-request tok/s, τ, the speedup over AR at the same point with its paired 95% CI, "
                      "and each method's crossover"),
         ("steps.md", "the step breakdown: each point's token gain and step cost over AR's, and the rows' slot use"),
         ("sweep.json", "every number of sweep.md, with the conventions"),
         ("samples.jsonl.gz", "one row per (round, arm, point, request): the tokens, accepted counts and clocks "
                              "(gzip'd JSON lines)"),
         ("config.json", "every setting of the run, resolved"),
         ("env.json", "the machine, the packages and the commit (environment.json in sweeps written before "
                      "2026-12-05)"),
         ("speedup_vs_batch.png", "each method's speedup over AR against B, with the 95% CIs"),
         ("speedup_vs_context.png", "the same against context length (with several context lengths)"))
SAME = ("`same as B=1` (T=0): the requests whose tokens equal the same arm's tokens at B = 1 (same prompt, context and "
        "round), over the requests compared (every round, warmup included); `-` at B = 1 itself, at T > 0, and where "
        "B = 1 was not swept")


def run_line(cfg, plan, n_prompts: int) -> str:
    """The model, prompts, tokens, temperature, seed and rounds of a sweep, in one line."""
    model = f"random {cfg.random_weights}" if cfg.random_weights else \
        os.path.basename(str(cfg.model_name_or_path).rstrip("/"))
    scripted = "" if cfg.scripted_accept is None else f", scripted acceptance of {cfg.scripted_accept} drafts a step"
    return (f"{model} on {cfg.dataset}: {n_prompts} prompt{'' if n_prompts == 1 else 's'} (first turns), "
            f"{cfg.max_new_tokens} new tokens, "
            f"T={cfg.temperature:g}, seed {cfg.seed}, {plan.rounds - plan.warmup_rounds} measured + "
            f"{plan.warmup_rounds} warmup round(s){scripted}")


def replicates(plan, settings) -> str | None:
    """A sampled sweep's τ (sampled target or drafts) is a mean over its measured rounds, each on its own random
    streams: with fewer rounds than the paper's replicates it is labelled, as a single run's table is."""
    if settings.target_params.greedy and settings.draft_params.greedy:
        return None
    return seeds_short(plan.rounds - plan.warmup_rounds)


def unbalanced(plan) -> str | None:
    """The measured rounds' rotation when it is no Latin square over the arms (e.g. 5 arms in 4 measured rounds),
    labelled as a single run's table labels it (harness.protocol.replicates)."""
    spread = imbalance(rotation(list(plan.arm_names), plan.rounds)[plan.warmup_rounds:])
    return f"rotation unbalanced by {spread}" if spread else None


DECODE_ONLY = "speedups decode-only (prefills timed apart; steps.md counts them in)"


def caveats(plan, settings) -> list[str]:
    """The labels a sweep's numbers carry for what they leave out and how its rounds were laid out."""
    return [x for x in (DECODE_ONLY, replicates(plan, settings), unbalanced(plan)) if x]


def crossing(first, values: list, unit: str, ci=None) -> str:
    """A crossover (`first`: the first swept value below AR, None: none) in words; where that point's CI holds 1,
    the words say the crossing is the point estimate's alone."""
    if first is None:
        return f"at or above AR at every {unit} swept ({', '.join(map(str, values))})"
    note = (f" (by its point estimate; its CI [{ci[0]:.2f}, {ci[1]:.2f}] includes 1)"
            if ci and None not in ci and ci[0] <= 1 <= ci[1] else "")
    if first == values[0]:
        return f"below AR from the smallest {unit} swept, {unit}={first}{note}"
    return f"at or above AR below {unit}={first}, first below it at {unit}={first}{note}"


def crossover_lines(summary: dict) -> list[str]:
    """sweep.md's crossover lines: per arm, by batch size at each context, and by context at each B (several
    contexts swept)."""
    ci = {(p["batch_size"], p["context_len"], a): e.get("speedup_ci") for p in summary["points"]
          for a, e in p["arms"].items()}
    bs, cs, out = summary["batch_sizes"], summary["context_lengths"], []
    for a, x in summary["crossover"].items():
        at = "; ".join(f"context {c}: {crossing(v, bs, 'B', ci.get((v, int(c), a)))}"
                       for c, v in x["batch_at_context"].items())
        out.append(f"- {a} against AR by batch size: {at}")
        if len(cs) > 1:
            at = "; ".join(f"B={b}: {crossing(v, cs, 'context', ci.get((int(b), v, a)))}"
                           for b, v in x["context_at_batch"].items())
            out.append(f"- {a} against AR by context length: {at}")
    return out


def readme(summary: dict, plots: list[str] | None = None, missing: list[str] | tuple = ()) -> str:
    """The folder's README.md: what ran (the labels), what each file holds (`plots`: the plot files written, None:
    both listed; `missing`: why a plot is not, from sweep_plots.write_plots) and how the numbers are defined."""
    c = summary["conventions"]
    per_request = c.get("per_request_tok_s") or ("each request's decode tokens over its own decode seconds, "
                                                  "averaged over the requests (it can exceed the total rate)")
    lines = [f"# Sweep: batch sizes {summary['batch_sizes']} x context lengths {summary['context_lengths']}", "",
             *[f"- {x}" for x in summary["labels"]], "", "| file | what |", "|---|---|",
             *[f"| `{f}` | {what} |" for f, what in FILES if plots is None or not f.endswith(".png") or f in plots],
             *(["", *[f"Not plotted: {m}." for m in missing]] if missing else []),
             "", f"Speedup: {c['speedup']}; {c['unit']}. Total tok/s: {c['total_tok_s']}. Per-request tok/s: "
             f"{per_request}. Crossover: {c['crossover']}. {SAME}. CIs: {ci_text.FEW_CI_NOTE}.", ""]
    return "\n".join(lines)
