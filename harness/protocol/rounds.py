"""Interleaved paired rounds (flag names as the reference harness's --fair-interleave ROUNDS and
--fair-warmup-rounds W): how many, in which order each arm runs, and the per-round paired ratios.

Every arm runs the whole evaluation once per round. Round r (1-based) runs the arms rotated left by (r-1) mod n,
so over n consecutive rounds every arm sits in every slot once, and slot effects (clock warm-up, thermal drift,
allocator state left by the previous arm) cancel in the paired ratios. Rounds 1..warmup are run but not measured.

Balance: the measured rounds form a Latin square over the arms (each arm takes each slot exactly once) when their
count is one rotation (n rounds) or a whole number of them; otherwise the run says it is unbalanced and by how much
(`imbalance`: max - min, over arms and slots, of the times an arm ran in a slot; 0 for a balanced design).

Seeds: every round is one sampling replicate, the warmup rounds included: a (prompt, turn, round) decodes on its
own stream (`stream_seed` below, of --seed, the dataset row, the turn and the round), which every
arm of that round replays, and each row records it (`stream_seed`). At T>0 tau is the mean over these replicates.
"""
from __future__ import annotations

import hashlib
import math
from typing import Mapping

from core.errors import UsageError


def default_rounds(n_arms: int, warmup: int) -> int:
    """The fewest rounds that keep the rotation balanced: every arm in every slot once after the warmup."""
    return warmup + n_arms


def validate_rounds(rounds: int, warmup: int, n_arms: int) -> str | None:
    """Raise UsageError when nothing would be measured; return a warning line when the rotation is unbalanced."""
    if n_arms < 1:
        raise UsageError(f"no arms to run (n_arms={n_arms}); enable at least one of AR, drafter-only, Markov, xPress")
    if warmup < 0:
        raise UsageError(f"--fair-warmup-rounds {warmup}: must be >= 0")
    if rounds < warmup + 1:
        raise UsageError(f"--fair-interleave {rounds} leaves no measured round after {warmup} warmup round(s); use "
                         f"--fair-interleave >= {warmup + 1}, ideally {default_rounds(n_arms, warmup)} "
                         "(warmup + one round per arm)")
    measured = rounds - warmup
    if measured % n_arms:
        spread = imbalance(rotation([f"a{i}" for i in range(n_arms)], rounds)[warmup:])
        return (f"rotation unbalanced by {spread}: {measured} measured round(s) is not a multiple of {n_arms} arms, "
                f"so some arms run in some slots {spread} more time(s) than others; use --fair-interleave "
                f"{warmup + n_arms * math.ceil(measured / n_arms)}")
    return None


def run_prompts(where: str, planned: list[int] | None, rows: list[dict]) -> list[int]:
    """A run's question ids: those its config.json planned (resolved.prompt_rows: question id i is dataset row
    planned[i]), every row checked against that plan; in a folder written before runs recorded it, those its rows
    hold (a prompt with no row at all then goes unnoticed, e.g. a lost samples.rank{r}.jsonl)."""
    if planned is None:
        return sorted({r["question_id"] for r in rows})
    for r in rows:
        q = r["question_id"]
        if not (isinstance(q, int) and 0 <= q < len(planned)) or r.get("dataset_row", planned[q]) != planned[q]:
            plan = f"dataset row {planned[q]}" if isinstance(q, int) and 0 <= q < len(planned) else "no prompt"
            raise UsageError(f"{where}: a row of question id {q} (dataset row {r.get('dataset_row')}) is not the "
                             f"run's: its config.json planned {plan} there (resolved.prompt_rows, "
                             f"{len(planned)} prompts); rows of another run were added to it, so its tables would "
                             "mix two runs")
    return list(range(len(planned)))


def run_order(rows: list[dict], order: list[list[str]]) -> list[dict]:
    """Rows in a single-process run's order: round, the arm's slot in that round (`order`, the rotation), question
    id, turn; how a torchrun run's rows from every rank are put together."""
    slot = {(rnd, arm): i for rnd, names in enumerate(order, start=1) for i, arm in enumerate(names)}
    return sorted(rows, key=lambda r: (r.get("round", 0), slot.get((r.get("round"), r.get("arm")), len(slot)),
                                       r.get("question_id", 0), r.get("turn", 0)))


def complete_rounds(done: set, rounds, arms, qids) -> list[int]:
    """The rounds (of `rounds`) in which every arm decoded every prompt: `done` holds the (round, arm, question id)
    decodes in a run's rows (a decode's turns are written together, once it finished), as --resume counts them."""
    return [n for n in rounds if all((n, a, q) in done for a in arms for q in qids)]


def rotation(arms: list[str], rounds: int) -> list[list[str]]:
    """Order of the arms in each round; element r-1 is round r, the list rotated left by (r-1) mod n."""
    n = len(arms)
    if not n:
        return [[] for _ in range(rounds)]
    return [arms[(r % n):] + arms[:(r % n)] for r in range(rounds)]


MIN_SEEDS = 5  # the paper averages tau at T>0 over 5 sampling seeds


def slot_counts(order: list[list[str]]) -> dict[str, list[int]]:
    """arm -> how many of the given rounds ran it in slot 1, 2, ..., n (n = the most arms of any round)."""
    width = max((len(r) for r in order), default=0)
    out: dict[str, list[int]] = {}
    for names in order:
        for slot, arm in enumerate(names):
            out.setdefault(arm, [0] * width)[slot] += 1
    return out


def imbalance(order: list[list[str]]) -> int:
    """max - min, over every arm and slot, of the times the arm ran in that slot (0: each arm took each slot
    equally often, a Latin square or a whole number of them; 0 too for no rounds)."""
    counts = [c for per_slot in slot_counts(order).values() for c in per_slot]
    return max(counts) - min(counts) if counts else 0


def balance(order: list[list[str]]) -> dict:
    """The design of the measured rounds `order`: {rounds, arms, latin_square, imbalance, slots (arm -> times in
    each slot)}; latin_square means every slot count is equal (one rotation is one square)."""
    counts = slot_counts(order)
    spread = imbalance(order)
    return {"rounds": len(order), "arms": len(counts), "latin_square": bool(counts) and spread == 0,
            "imbalance": spread, "slots": counts}


def balance_note(design: dict) -> str | None:
    """The line an unbalanced run prints and puts on its tables; None when balanced."""
    if design["latin_square"] or not design["arms"]:
        return None
    low = min(c for s in design["slots"].values() for c in s)
    return (f"rotation unbalanced by {design['imbalance']}: over {design['rounds']} measured round(s) an arm ran "
            f"{low}..{low + design['imbalance']} times in a slot (a Latin square needs a multiple of "
            f"{design['arms']} measured rounds)")


def _usable(x) -> bool:
    return x is not None and math.isfinite(x)


def paired_ratios(tput: Mapping[int, Mapping[str, float]], ref: str) -> dict[str, list[float]]:
    """Per measured round (ascending), each arm's value / the reference arm's value in that same round.

    `tput` maps round -> arm -> value and should hold only measured rounds. A round contributes only if every arm
    seen in any round has a usable value there (not missing, None or NaN) and the reference's is positive, so every
    arm's list covers the same rounds and ratios stay paired. The reference's own list is all 1.0.
    """
    arms: list[str] = []
    for values in tput.values():
        arms.extend(a for a in values if a not in arms)
    if ref not in arms:
        raise KeyError(f"reference arm {ref!r} has no value in any round (arms: {arms})")
    out: dict[str, list[float]] = {a: [] for a in arms}
    for r in sorted(tput):
        values = tput[r]
        if not all(_usable(values.get(a)) for a in arms) or values[ref] <= 0:
            continue
        for a in arms:
            out[a].append(values[a] / values[ref])
    return out


def refuse_captures(rows: list[dict], rows_path: str) -> None:
    """A whole-step CUDA graph captured inside a measured decode puts its warmup and capture into decode_s: the
    run ends there (as --compile-all ends on a recompile), with the rows measured so far kept."""
    bad = [r for r in rows if not r["warmup"] and r.get("graph_captures")]
    if bad:
        r = bad[0]
        raise UsageError(f"--use-graph: {r['graph_captures']} CUDA graph(s) captured inside measured round "
                         f"{r['round']} ({r['arm']}, prompt {r['question_id']}, turn {r['turn']}), after the "
                         "pre-capture of every shape; a cache grew past the size presized for every turn (a reply that "
                         f"re-tokenised longer than it decoded?); the rows so far stay in {rows_path}")


def stream_seed(seed: int, row: int, turn: int, round_: int = 1, copy: int = 0) -> int:
    """An independent stream per (seed, prompt, turn, round, sweep copy); every arm of a round replays it."""
    digest = hashlib.sha256((f"{seed}:{row}:{turn}:{round_}" + (f":{copy}" if copy else "")).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
