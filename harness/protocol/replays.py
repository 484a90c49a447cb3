"""The untimed passes after the measured rounds of a T=0 run: the gaps at each first divergence from AR, and AR
against a greedy reference in --reference-dtype (float32), AR's text scored teacher-forced (teacher_forced).

Nothing here runs inside a timer: the rounds are over, their rows are written, and this pass only adds records to
them (the rank's plain samples.jsonl, gzip'd only when the run ends, is rewritten whole; a resumed run replays
only rows that lack them).

What is replayed, and why not every token: a divergence needs one position, so only a turn-0 row whose tokens
differ from AR's of the same round is replayed, with its arm and the same stream, up to and including the first
differing token (the decode's steps do not depend on the budget left, so the step that produced that token is the
same step), and AR with it; the replay records every token's top-2 gap on the way (--record-logit-gaps's buffer),
and keeps the one at the divergence. A row identical to AR's costs nothing. At T=0 every round decodes the same
text, so a (arm, prompt, position) is replayed once. --record-logit-gaps still stores every token's gap, inside
the timer, for whoever wants the full profile.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.decode.loop import gap_lists, generate, top2
from harness.protocol import divergence, metrics
from harness.protocol.results_io import atomic_write, read_rows, rows_text

EMBEDDED_REFERENCE = "float32"  # --reference-dtype auto: float32 for the embedded default, else off


def reference_dtype(cfg) -> str | None:
    """The resolved --reference-dtype: None when off (T>0 has no greedy text to compare)."""
    if cfg.temperature >= 1e-5:
        return None
    if cfg.reference_dtype == "auto":
        from harness.protocol.setups import EMBEDDED
        return EMBEDDED_REFERENCE if cfg.preset == EMBEDDED else None
    return None if cfg.reference_dtype == "none" else cfg.reference_dtype


class Replayer:
    """Replays (arm, prompt, round) decodes untimed with gaps recorded, each (arm, prompt, position) once."""

    def __init__(self, target, backend, settings, arms: dict, prompts: dict, seed_of):
        self.target, self.backend, self.arms, self.prompts, self.seed_of = target, backend, arms, prompts, seed_of
        self.settings = dataclasses.replace(settings, record_gaps=True, use_graph=False)
        self.cache: dict = {}  # (arm, prompt, pos) -> (gap and top logit at pos, ok, the gaps before pos)
        self.replays = 0

    def at(self, arm: str, row: dict, pos: int) -> tuple[tuple[float, float] | None, bool]:
        """((top-2 gap, top logit) at `pos`, the replay reproduced the row's tokens through `pos`)."""
        key = (arm, row["question_id"], pos)
        if key not in self.cache:
            a = self.arms[arm]
            a.activate()
            s = dataclasses.replace(self.settings, max_new_tokens=pos + 1)
            gen = self.backend.generator(self.seed_of(row))
            g = generate(self.target, list(self.prompts[row["question_id"]]), s, self.backend, drafter=a.drafter,
                         refiner=a.refiner, generator=gen)
            self.replays += 1
            ok = pos < len(g.tokens) and g.tokens[: pos + 1] == row["tokens"][: pos + 1]
            self.cache[key] = ((g.top2_gaps[pos], g.top_logits[pos]) if pos < len(g.tokens) else None, ok,
                               g.top2_gaps[:pos] if ok else [])
        return self.cache[key][:2]

    def gaps_before(self, arm: str, row: dict, pos: int) -> list[float]:
        """The top-2 gaps of the replay that `at` made, at the positions before `pos` (where it reproduced the
        row's tokens; empty when it did not)."""
        self.at(arm, row, pos)
        return self.cache[(arm, row["question_id"], pos)][2]


def mark_divergences(rows: list[dict], ar: str, replayer: Replayer, dtype: str) -> int:
    """Every turn-0 row of a speculative arm without a "divergence" record gets one: None when its tokens equal
    AR's of the same round, else the replay's record (harness.protocol.divergence.record). Returns rows marked."""
    ref = {(r["round"], r["question_id"]): r for r in rows if r["arm"] == ar and r["turn"] == 0}
    n = 0
    for r in rows:
        other = ref.get((r["round"], r["question_id"]))
        if r["arm"] == ar or r["turn"] != 0 or "divergence" in r or other is None:
            continue
        pos = metrics.first_divergence(r["tokens"], other["tokens"])
        if pos is None:
            r["divergence"] = None
        else:
            (one, ok), (two, ok_ref) = replayer.at(r["arm"], r, pos), replayer.at(ar, other, pos)
            r["divergence"] = {"ref": ar, **divergence.record(pos, one, two, dtype, dtype, ok and ok_ref)}
        n += 1
    return n


def mark_reference(rows: list[dict], ar: str, replayer: Replayer, reference, run_dtype: str, ref_dtype: str) -> int:
    """Every turn-0 AR row without a "reference" record gets one against `reference` (an AR decode in ref_dtype
    of the same prompt, untimed, gaps recorded): same_run when the run's dtype is ref_dtype already (nothing to
    decode), else the first divergence with both runs' gaps. Returns rows marked."""
    n = 0
    for r in rows:
        if r["arm"] != ar or r["turn"] != 0 or "reference" in r:
            continue
        n += 1
        if run_dtype == ref_dtype:
            r["reference"] = {"dtype_ref": ref_dtype, "same_run": True, "position": None}
            continue
        g = reference(r)
        pos = metrics.first_divergence(r["tokens"], g.tokens)
        rec = {"dtype_ref": ref_dtype, "same_run": False, "position": None}
        if pos is not None:
            one, ok = replayer.at(ar, r, pos)
            two = (g.top2_gaps[pos], g.top_logits[pos]) if pos < len(g.tokens) else None
            rec.update(divergence.record(pos, one, two, run_dtype, ref_dtype, ok))
            if ok:  # the dtype's error on a gap, measured where both texts agree (divergence.gap_error)
                rec.update(divergence.gap_error(replayer.gaps_before(ar, r, pos), g.top2_gaps[:pos]))
        r["reference"] = rec
    return n


@dataclasses.dataclass
class Scored:
    """The reference's greedy choices along AR's text, through the first that differs (teacher_forced)."""
    tokens: list[int]
    top2_gaps: list[float]
    top_logits: list[float]


CHUNK = 256  # rows a teacher-forced forward pass takes at once: logits [CHUNK, vocab] in the reference dtype


@torch.no_grad()
def teacher_forced(target, prompt: list[int], tokens: list[int], backend) -> Scored:
    """The reference target's greedy choice, top-2 gap and top logit at every position of AR's text `tokens`,
    from forward passes over prompt + tokens (teacher-forced, CHUNK rows at a time), cut after the first choice that
    differs from AR's token.

    Up to and including that position the reference's context is AR's own tokens, which is exactly the context a
    greedy decode in the reference dtype has until it first disagrees with AR: so the first divergence and both
    gaps there are those of a full reference decode (to the reference dtype's rounding: these passes sum in another
    order than one-row decode steps), at the cost of one prefill of the text instead of a step per token (in
    float32 eager, about 15 ms a step on an H200 at SmolLM2's size, the largest part of an embedded T=0 cell's
    untimed passes). A text the reference agrees with throughout comes back whole: the rows are identical."""
    seq = list(prompt) + list(tokens[:-1])
    n, p = len(seq), len(prompt)
    target.ensure_capacity(n)
    target.reset()
    ids = torch.tensor(seq, dtype=torch.long, device=backend.device)
    choices, pairs = [], []
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        logits, _ = target.forward(ids[a:b], torch.arange(a, b, device=backend.device), b, False)
        lo = max(a, p - 1)  # rows from the prompt's last position on predict AR's tokens
        if lo < b:
            rows = logits[lo - a:]
            choices += rows.argmax(dim=-1).tolist()
            pairs += top2(rows).tolist()
    cut = next((i for i, (c, t) in enumerate(zip(choices, tokens)) if c != t), len(tokens) - 1)
    gaps, tops = gap_lists(pairs[: cut + 1])
    return Scored(tokens=choices[: cut + 1], top2_gaps=gaps, top_logits=tops)


def reference_target(plan, models, dtype: str):
    """A second target in `dtype` (float32), for the reference AR decodes: the same weights as the run's."""
    from core.devices import Backend
    from core.ops import TorchOps
    cfg = plan.config
    backend = Backend(plan.backend.device, divergence.DTYPES[dtype])
    if cfg.random_weights:
        from harness.protocol.presets import build_random
        target = build_random(cfg.random_weights, backend, block_size=plan.block_size, seed=cfg.seed,
                              ops=TorchOps()).target
    else:
        from harness.decode.hf_overrides import parse_overrides
        from harness.decode.loading import load_target
        target, _ = load_target(cfg.model_name_or_path, backend, attn_impl=cfg.attn_implementation,
                                tokenizer=models.tokenizer, overrides=parse_overrides(cfg.hf_overrides),
                                ops=TorchOps())
    target.ensure_capacity(models.target.capacity)
    return target, backend


def after_rounds(plan, models, settings, rows_path: str, ar: str | None, by_name: dict, seed_of, out,
                 load_reference=reference_target) -> dict:
    """The untimed passes of a T=0 run over this rank's rows (module docstring); rewrites rows_path when it
    marked anything. Returns {replays, divergences, references} for the console."""
    cfg = plan.config
    if cfg.temperature >= 1e-5 or ar is None:
        return {}
    rows = read_rows(rows_path)
    run_dtype = divergence.dtype_name(plan.backend.dtype)
    prompts = dict(enumerate(models.firsts))
    replayer = Replayer(models.target, plan.backend, settings, by_name, prompts, seed_of)
    # scripted acceptance changes the arms' text by design: no divergence from AR to measure (AR's reference still is)
    scripted = cfg.scripted_accept is not None
    done = {"divergences": 0 if scripted else mark_divergences(rows, ar, replayer, run_dtype), "references": 0}
    decoded: dict = {}  # question id -> its reference decode
    ref_dtype = reference_dtype(cfg)
    if ref_dtype is not None and any(r["arm"] == ar and r["turn"] == 0 and "reference" not in r for r in rows):
        reference = None
        if ref_dtype != run_dtype:
            target, backend = load_reference(plan, models, ref_dtype)

            def reference(r):  # greedy: one scoring per prompt and text serves every round that decoded it
                key = (r["question_id"], tuple(r["tokens"]))
                if key not in decoded:
                    decoded[key] = teacher_forced(target, list(prompts[r["question_id"]]), r["tokens"], backend)
                return decoded[key]
        done["references"] = mark_reference(rows, ar, replayer, reference, run_dtype, ref_dtype)
        if ref_dtype == run_dtype:
            print(f"[reference] the run is {run_dtype} already: AR is its own {ref_dtype} reference (the same run)",
                  file=out)
        if reference is not None:
            del target
            if plan.backend.device.type == "cuda":
                torch.cuda.empty_cache()
    done["replays"], done["reference_decodes"] = replayer.replays, len(decoded)
    if done["divergences"] or done["references"]:
        atomic_write(rows_path, rows_text(rows))
    return done
