"""summary.json: the documented schema of a run's summary (written by harness.protocol.report.summarize).

Every top-level key and every per-arm key is listed below with its JSON type(s) and meaning; `problems(summary)`
lists where a summary departs from it (a test checks a written summary against it). Numbers that are undefined
(NaN, inf: no measured round, a zero denominator) are written as null.

Versions (`schema_version`; readers accept every version up to SCHEMA_VERSION):
  1  no `schema_version` key, `schema` = "xpress-bench/summary/1"; otherwise the keys of version 2.
  2  `schema_version` = 2 and `schema` = "xpress-bench/summary/2" added; nothing else changed.
  3  tau over sampling seeds: per arm `tau_seeds`, `tau_rounds` and `tau_gain`; at T>0 `tau_*` is the mean over
     every replicate round, warmup included (was: the measured rounds); top-level `design` (the rounds' balance).
     Also in 3: `run` (the run's facts: model, quantization, device, dtype, kernels, ...: harness.protocol.facts) and, per arm,
     `speedup_e2e`, `steps`, `step_s` and `break_even_tau` (harness.protocol.costs) added. Older summaries lack
     them: readers show "unknown" / "-" there.
     Also in 3, per arm: `reference_match` (AR against a greedy reference in --reference-dtype, AR's text scored
     teacher-forced); `token_match` gains `divergence`
     and each first divergence the replay's gaps, bound and near_tie (harness.protocol.divergence). Rows of an
     older run have no replay records: --rebuild writes version 3 with those fields empty (measured 0).
     Also in 3: top-level `tau_order` (xPress > Markov > drafter-only as paired tau CIs; older summaries lack it).
"""
from __future__ import annotations

from core.errors import UsageError
from harness.protocol import ci_text, divergence, metrics

SCHEMA_VERSION = 3
SCHEMA = f"xpress-bench/summary/{SCHEMA_VERSION}"

NUM = (int, float, type(None))      # a number, or null when undefined
OPT = type(None)

TOP = {
    "schema": (str, "the schema's name: xpress-bench/summary/<version>"),
    "schema_version": (int, "the version of this schema (see the module docstring)"),
    "run": (dict, "{model, target_source, quantization, device, dtype, kernels, seed, max_new_tokens, "
                  "compat_reference, draft_temperature, scripted_accept} from config.json; 'unknown' where it does "
                  "not say (scripted_accept: None)"),
    "dataset": (str, "the dataset every row comes from"),
    "temperature": (float, "target sampling temperature of every row"),
    "greedy": (bool, "temperature < 1e-5: the target decodes greedily"),
    "block_size": (int, "the widest arm's block (anchor + drafts)"),
    "rounds": (dict, "{all, warmup, measured}: lists of 1-based round numbers"),
    "prompts": (int, "prompts with a measured row (turn 0 of a non-warmup round)"),
    "reference_arm": ((str, OPT), "the AR arm that speedups are paired against; null without one"),
    "drafter_only_arm": ((str, OPT), "the drafter-only arm that gains are paired against; null without one"),
    "incomplete_rounds": (list, "[[arm, round, rows, prompts]]: measured rounds missing prompts, left out"),
    "duplicate_rows_dropped": (int, "rows repeated by a resume (same arm, prompt, turn, round); the last kept"),
    "arms": (dict, "arm name -> the per-arm dict (ARM), in method order (AR, drafter-only, Markov, xPress by K)"),
    "optimal": (dict, "method -> {arm, K, pooled_tok_s, selected_on, selection_tok_s}: the throughput-optimal K"),
    "tau_order": ((dict, OPT), "xPress > Markov > drafter-only in tau, paired over prompts x seeds: {markov, "
                               "drafter_only, markov_vs_drafter_only, xpress: [{arm, K, vs_markov, vs_drafter_only, "
                               "shown}], optimal_xpress, shown} (each comparison as tau_gain; shown: every CI's lower "
                               "bound above zero; the Markov arm and optimal_xpress the throughput-optimal ones); "
                               "null without all three methods"),
    "ar_rounds_off_median": (list, "[{round, pooled_tok_s, off_median}]: AR rounds far from the AR median"),
    "design": (dict, "{rounds, arms, latin_square, imbalance, slots, note}: the measured rounds' rotation; "
                     "imbalance = max - min times an arm ran in a slot (0: balanced); slots: arm -> times per slot"),
    "labels": (list, "strings shown on every table title: random weights, traced, compat, untimed, ..."),
    "conventions": (dict, "name -> the one-line convention of each number"),
}
# Added beside the rows' statistics by the runner (and kept by --rebuild where noted).
OPTIONAL = {
    "compile": (dict, "--compile-refiner / --compile-all: {backend, functions, graphs, compile_s, "
                      "recompile_guard} (kept by --rebuild)"),
    "kernel_fallbacks": (dict, "'op: why' -> calls the Triton kernels handed to torch ops (kept by --rebuild)"),
    "ranks": (dict, "torchrun / accelerate launch: per-rank AR throughput (harness.protocol.rank_report)"),
}
STATS = "{n, mean, std, median, min, max, values (per round)}"
COMPARED = ("{n, mean, std, median, min, max, values (per-round ratios), ref, ci95 [lo, hi] (null from one paired "
            "unit: one prompt of one round), ci_point, ci_prompts}")
ARM = {
    "arm": (str, "the arm's display name"),
    "method": (str, "ar | drafter-only | markov | xpress"),
    "K": ((int, OPT), "xPress refinement passes; null for the other methods"),
    "block_size": (int, "the arm's block (1 for AR)"),
    "rounds": (list, "complete measured rounds used"),
    "samples": (int, "measured turn-0 rows used (prompts x rounds)"),
    "prompts": (int, "prompts of the run"),
    "tau_source": (str, "where tau comes from (first measured round, mean over rounds, warmup for compat)"),
    "tau_seeds": (int, "sampling replicates tau is averaged over (1 for a deterministic run)"),
    "tau_rounds": (list, "the rounds tau comes from (at T>0 every complete round, warmup included)"),
    "tau_gain": ((dict, OPT), "tau against the drafter-only arm over the shared replicates: {ref, seeds, prompts, "
                              "rounds, diff, diff_ci95, ratio, ratio_ci95} (paired bootstrap over prompts x seeds); "
                              "null for it or without it"),
    "tau_rounds_agree": ((bool, OPT), "deterministic runs: tau equal in every round; null when sampling"),
    "tau_per_step": (NUM, "accepted tokens per speculative step (bonus included)"),
    "tau_per_sample": (NUM, "tau per prompt, averaged over prompts"),
    "histogram": ((list, OPT), "share of steps that accepted 1..block tokens"),
    "per_position": ((list, OPT), "acceptance rate of each draft position"),
    "tau_per_step_by_round": (list, "tau_per_step of each used round"),
    "pooled_tok_s": (dict, f"pooled decode tok/s over rounds: {STATS}"),
    "per_sample_tok_s": (dict, f"mean per-prompt decode tok/s over rounds: {STATS}"),
    "ttft_s": (NUM, "mean time to first token, seconds"),
    "drafter_prefill_s": (NUM, "mean drafter prefill, seconds"),
    "new_tokens": (int, "new tokens of the used rows"),
    "decode_tokens": (int, "decode tokens of the used rows (new tokens minus the prefill's)"),
    "stop_reasons": (dict, "stop reason -> rows of the measured rounds (turn 0)"),
    "speedup": ((dict, OPT), f"against the AR arm: {COMPARED}; null for AR itself or without AR"),
    "speedup_e2e": ((dict, OPT), f"end-to-end (TTFT + drafter prefill + decode) against AR: {COMPARED}; null "
                                 "as speedup"),
    "steps": (int, "decode steps of the used rows (accept_lengths entries + tail_steps)"),
    "step_s": (NUM, "decode seconds per decode step, pooled over the used rows"),
    "break_even_tau": (NUM, "step_s over AR's step_s: the arm wins iff its tau exceeds it; null without AR"),
    "speedup_per_sample": ((dict, OPT), f"per-sample tok/s ratios against AR: {STATS}; null as speedup"),
    "gain": ((dict, OPT), f"against the drafter-only arm: {COMPARED}; null for it or without it"),
    "token_match": ((dict, OPT), "{ref, rows_compared, rows_identical, token_match_rate, first_divergence "
                                 "[{question_id, position, round, gap_arm, gap_ref, top_arm, top_ref, gap, bound, "
                                 "near_tie, dtype, dtype_ref, replay_ok}], divergence {divergences, measured, "
                                 "gap_median, gap_max, not_near_tie, unmeasured, gap_err_max, gap_err_n, "
                                 "beyond_measured}} against AR; null for AR or "
                                 "without it"),
    "reference_match": ((dict, OPT), "{dtype, same_run, rows_compared, rows_identical, first_divergence, "
                                     "divergence} of the arm against its decode in --reference-dtype (AR only; "
                                     "its first divergences add gap_err_max and gap_err_n, the dtype's measured "
                                     "error on a top-2 gap before them); "
                                     "null without a reference pass"),
}


def _kind(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is no number
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, types)


def _check(d: dict, spec: dict, where: str, optional: dict | None = None) -> list[str]:
    out = [f"{where}: missing {k!r}" for k in spec if k not in d]
    known = {**spec, **(optional or {})}
    out += [f"{where}: undocumented {k!r}" for k in d if k not in known]
    out += [f"{where}[{k!r}]: {type(v).__name__} is not {known[k][0]}" for k, v in d.items()
            if k in known and not _kind(v, known[k][0])]
    return out


def problems(summary: dict) -> list[str]:
    """Where `summary` (the current version) departs from the schema: missing, undocumented or mistyped keys."""
    out = _check(summary, TOP, "summary", OPTIONAL)
    for name, arm in (summary.get("arms") or {}).items():
        out += _check(arm, ARM, f"arms[{name!r}]")
    return out


def version(summary: dict, where: str) -> int:
    """The schema version of a summary read from disk: 1 for one written before versions were recorded; a
    newer one than this code reads is refused."""
    v = summary.get("schema_version", 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UsageError(f"{where}: schema_version {v!r} is not a positive integer; is this an xpress-bench summary?")
    if v > SCHEMA_VERSION:
        raise UsageError(f"{where}: schema_version {v} is newer than this xpress-bench reads ({SCHEMA_VERSION}); "
                         "update xpress-bench")
    return v


def conventions() -> dict[str, str]:
    c = {k: metrics.CONVENTIONS[k] for k in (
        "tau_per_step", "tau_per_sample", "acceptance_histogram", "per_position_acceptance", "pooled_tok_per_s",
        "per_sample_tok_per_s", "round_stats", "median_round_speedup", "off_median_rounds", "paired_ratio_stats",
        "pooled_speedup_ci_over_prompts", "token_match_rate", "first_divergence", "mean_latency_s")}
    c["scope"] = ("throughput uses turn 0 of the measured rounds (warmup rounds excluded), tau at T>0 every round "
                  "(tau_source); tok/s counts decode tokens (new tokens minus the prefill's first token) over decode "
                  "seconds")
    c["tau_source"] = ("tau of a deterministic run (T=0 and greedy drafts): from the first MEASURED round (identical "
                       "every round, checked); when anything is sampled (T>0, or a draft temperature > 0): the mean "
                       "of the per-replicate values over every complete round, the warmup's included (each round "
                       "decodes on its own seeded streams; fewer than 5 is labelled). A speculative arm's plain "
                       "target steps near the context limit are counted apart (tail_steps), not as tau entries")
    c["tau_gain"] = metrics.CONVENTIONS["paired_tau_ci"]
    c["tau_order"] = ("the paper's claim xPress > Markov > drafter-only in tau: xPress against the throughput-optimal "
                      "Markov arm and that arm against drafter-only, each the tau_gain statistic; shown = both "
                      "paired CIs exclude equality")
    c["design"] = ("balanced = the measured rounds form a Latin square over the arms (each arm in each slot equally "
                   "often); otherwise labelled with the imbalance, max - min times an arm ran in a slot")
    c["speedup"] = ("Sp. = the primary statistic: median over measured rounds of the per-round paired speedup, with "
                    "its own 95% CI (paired bootstrap over prompts and rounds); summary.json keeps the mean +- std "
                    "of the same per-round ratios and the pooled speedup with its bootstrap over prompts (pooled)")
    from harness.protocol.costs import BREAK_EVEN_NOTE, E2E_NOTE
    c["speedup_e2e"] = E2E_NOTE
    c["break_even_tau"] = BREAK_EVEN_NOTE
    c["divergence"] = divergence.convention()
    c["gain"] = "x gain = the same statistic against the drafter-only arm"
    c["ci_units"] = ci_text.FEW_CI_NOTE
    c["optimal"] = ("throughput-optimal K = the arm of a method with the highest POOLED tok/s on the warmup rounds "
                    "(held out: never reported), reported from the measured rounds; a run without a complete warmup "
                    "round selects on the measured rounds and says so (selected_on: biased upward)")
    c["labels"] = ("random weights / scripted acceptance (timing only), traced (steps replayed untimed), compat "
                   "(the reference's accounting) are on every table title, in table.csv and in every plot title")
    return c
