"""tau over sampling seeds, its paired comparison between arms, and the measured rounds' design, from the rows.

A sampling replicate is one round (harness.protocol.rounds: each round decodes on its own seeded streams), the
warmup rounds included: the warmup is excluded from timing, not from tau. A replicate counts for an arm when the arm
has a turn-0 row for every prompt of the run in it. At T=0 with greedy drafts every round decodes the same text, so
there is one replicate (the first measured round, as the report has always taken it).
"""
from __future__ import annotations

import numpy as np

from harness.protocol import metrics
from harness.protocol.rounds import MIN_SEEDS, balance, balance_note


def turn0(rows: list[dict], arm: str) -> dict[int, dict[int, dict]]:
    """round -> question id -> the arm's turn-0 row, over every round (warmup included)."""
    out: dict[int, dict[int, dict]] = {}
    for r in rows:
        if r["arm"] == arm and r["turn"] == 0:
            out.setdefault(r["round"], {})[r["question_id"]] = r
    return out


def replicate_rounds(rows: list[dict], arm: str, prompts: list[int]) -> list[int]:
    """The rounds, ascending and warmup included, in which `arm` decoded every prompt's first turn."""
    want = set(prompts)
    return [rnd for rnd, qs in sorted(turn0(rows, arm).items()) if want <= set(qs)]


def seeds_short(n: int) -> str | None:
    """The warning of a sampled run with fewer replicates than the paper's protocol; None when enough."""
    return None if n >= MIN_SEEDS else f"FEWER THAN {MIN_SEEDS} SEEDS ({n}; the paper averages tau over {MIN_SEEDS})"


def sampled_tau(rows: list[dict], arm: str, prompts: list[int], per_round, keys, why: str) -> dict:
    """tau_source, tau_rounds_agree, tau_seeds, tau_rounds and the tau statistics (`keys` of per_round(rows)) of a
    sampled run: the mean of the per-replicate values over every replicate round (a warmup round's too, named as
    such; a run without one says so)."""
    by = turn0(rows, arm)
    reps = replicate_rounds(rows, arm, prompts)
    pr = [per_round([by[rnd][q] for q in prompts]) for rnd in reps]
    short = seeds_short(len(reps))
    warm = sorted({r["round"] for r in rows if r["warmup"]} & set(reps))
    which = (f"warmup included: round{'s' * (len(warm) > 1)} {', '.join(map(str, warm))}" if warm
             else "no warmup round among them")
    source = (f"mean over {len(reps)} sampling replicates (rounds {', '.join(map(str, reps))}: {which}, each "
              f"round its own seeded stream; {why})" + (f"; {short}" if short else ""))
    return {"tau_source": source, "tau_rounds_agree": None, "tau_seeds": len(reps), "tau_rounds": reps,
            **{k: np.mean([m[k] for m in pr], axis=0).tolist() if pr else float("nan") for k in keys}}


def tau_matrices(rows: list[dict], arm: str, rounds: list[int], prompts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    by = turn0(rows, arm)
    lengths = [[sum(by[rnd][q]["accept_lengths"]) for q in prompts] for rnd in rounds]
    steps = [[len(by[rnd][q]["accept_lengths"]) for q in prompts] for rnd in rounds]
    return np.asarray(lengths, np.float64).reshape(len(rounds), len(prompts)), \
        np.asarray(steps, np.float64).reshape(len(rounds), len(prompts))


def tau_gain(rows: list[dict], arm: str, ref: str, rounds_of: dict[str, list[int]], prompts: list[int],
             n_boot: int, seed: int) -> dict | None:
    """tau of `arm` against `ref` over the replicates both have (rounds_of: arm -> its tau rounds): {ref, seeds,
    prompts, rounds, diff, diff_ci95, ratio, ratio_ci95} (metrics.paired_tau_ci); None without a shared one."""
    common = [r for r in rounds_of.get(arm, []) if r in set(rounds_of.get(ref, []))]
    if not common or not prompts:
        return None
    ci = metrics.paired_tau_ci(*tau_matrices(rows, arm, common, prompts), *tau_matrices(rows, ref, common, prompts),
                               n_boot=n_boot, seed=seed)
    return {"ref": ref, "seeds": len(common), "prompts": len(prompts), "rounds": common, **ci}


def measured_order(rows: list[dict], warm_rounds: list[int]) -> list[list[str]] | None:
    """The arms of each measured round in the order they ran, from each row's `slot`; None when a measured row
    does not record its slot (rows written before slots were recorded: their order is not known)."""
    slots: dict[int, dict[str, int]] = {}
    for r in rows:
        if r["round"] in warm_rounds:
            continue
        if "slot" not in r:
            return None
        slots.setdefault(r["round"], {})[r["arm"]] = r["slot"]
    return [sorted(arms, key=arms.get) for _, arms in sorted(slots.items())]


def design(rows: list[dict], warm_rounds: list[int]) -> dict:
    """rounds.balance of the measured rounds, with its note (None when balanced); latin_square and imbalance are
    None when the rows do not record their slots."""
    order = measured_order(rows, warm_rounds)
    if order is None:
        n = len({r["round"] for r in rows if r["round"] not in warm_rounds})
        return {"rounds": n, "arms": len({r["arm"] for r in rows}), "latin_square": None, "imbalance": None,
                "slots": {}, "note": "slots not recorded (rows written before they were): balance unknown"}
    d = balance(order)
    return {**d, "note": balance_note(d)}


def add_tau_gains(rows: list[dict], out_arms: dict, ref: str | None, prompts: list[int], n_boot: int,
                  seed: int) -> None:
    """Every arm's `tau_gain` against `ref` (the drafter-only arm); None for it, or without it."""
    rounds_of = {a: s.get("tau_rounds") or [] for a, s in out_arms.items()}
    for a, s in out_arms.items():
        s["tau_gain"] = tau_gain(rows, a, ref, rounds_of, prompts, n_boot, seed) if ref and a != ref else None


def _above(g: dict | None) -> bool:
    """The paired CI's lower bound is above zero (the difference is shown, not equality)."""
    lo = (g or {}).get("diff_ci95", [None])[0]
    return lo is not None and np.isfinite(lo) and lo > 0


def tau_order(rows: list[dict], arms: dict, out_arms: dict, optimal: dict, base: str | None, prompts: list[int],
              n_boot: int, seed: int) -> dict | None:
    """The xPress paper's claim in tau, xPress > Markov > drafter-only, as paired comparisons over the shared
    replicates (metrics.paired_tau_ci, the tau_gain statistic): the throughput-optimal Markov arm against
    drafter-only and every xPress arm against drafter-only (their tau_gain, from add_tau_gains, which runs first),
    and every xPress arm against that Markov arm. `shown` for an xPress arm:
    both of its steps' CIs exclude equality (lower bounds above zero); the top-level `shown` is the throughput-optimal
    xPress arm's. None unless the run has all three methods."""
    markov = (optimal.get("markov") or {}).get("arm")
    xpress = [a for a, i in arms.items() if i["method"] == "xpress"]
    if base is None or markov is None or not xpress:
        return None
    rounds_of = {a: s.get("tau_rounds") or [] for a, s in out_arms.items()}
    m_vs_d = out_arms[markov].get("tau_gain")  # add_tau_gains' Markov against drafter-only, not bootstrapped again
    per = []
    for a in xpress:
        x_vs_m = tau_gain(rows, a, markov, rounds_of, prompts, n_boot, seed)
        per.append({"arm": a, "K": arms[a]["K"], "vs_markov": x_vs_m, "vs_drafter_only": out_arms[a].get("tau_gain"),
                    "shown": _above(x_vs_m) and _above(m_vs_d)})
    best = (optimal.get("xpress") or {}).get("arm")
    return {"markov": markov, "drafter_only": base, "markov_vs_drafter_only": m_vs_d, "xpress": per,
            "optimal_xpress": best, "shown": next((p["shown"] for p in per if p["arm"] == best), False)}


def labels(out_arms: dict, design_: dict, deterministic: bool) -> list[str]:
    """Table labels: a sampled run with fewer than MIN_SEEDS replicates, and an unbalanced rotation."""
    out = []
    if not deterministic:
        n = min((s.get("tau_seeds") or 0 for s in out_arms.values()), default=0)
        if seeds_short(n):
            out.append(f"tau over {n} seed(s), fewer than {MIN_SEEDS}")
    if design_.get("imbalance"):
        out.append(f"rotation unbalanced by {design_['imbalance']}")
    return out


CAPPED_SHARE = 0.05  # a label from this share of a speculative arm's verify steps cut at a request's token limit


def capped_label(rows: list[dict]) -> list[str]:
    """A label when --max-new-tokens cuts many verify steps: a request that ends at its limit may end on a step
    whose entry is cut to the tokens left (accept_lengths' last below its accepted drafts + 1), so tau reads low by
    up to that share of steps. The share: such cut steps over the verify steps, per speculative arm (AR takes no
    verify step); a request that lands on its limit exactly, or an accounting that does not cut (the reference's),
    counts none. The label names the largest share."""
    worst = None
    for arm in sorted({r["arm"] for r in rows if r.get("method") not in ("ar", None)}):
        mine = [r for r in rows if r["arm"] == arm]
        steps = sum(len(r.get("accept_lengths") or ()) for r in mine)
        cut = sum(r.get("stop_reason") == "max_new_tokens" and bool(r.get("accept_lengths")) and bool(r.get("accepted"))
                  and r["accept_lengths"][-1] < r["accepted"][-1] + 1 for r in mine)
        if steps and (worst is None or cut / steps > worst[0]):
            worst = (cut / steps, arm)
    if worst is None or worst[0] < CAPPED_SHARE:
        return []
    return [f"tau capped by --max-new-tokens: {worst[0]:.0%} of {worst[1]}'s verify steps were a request's last, "
            "cut to the tokens its limit left (tau reads low; a larger --max-new-tokens narrows it)"]


def context_label(rows: list[dict]) -> list[str]:
    """A label when the context limit ends many requests (CAPPED_SHARE or more of them, every arm's together):
    they stopped short of --max-new-tokens, each arm timed on fewer tokens than asked, and a speculative arm's last
    steps before the limit were plain target steps (tail_steps)."""
    cut = sum(r.get("stop_reason") == "max_model_len" for r in rows)
    if not rows or cut / len(rows) < CAPPED_SHARE:
        return []
    return [f"generation cut by --max-model-len: {cut} of {len(rows)} measured requests stopped at the context "
            "limit, short of --max-new-tokens (a larger --max-model-len lets them finish)"]
