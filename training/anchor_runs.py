"""Why a drafter's training `eal` reads higher than its decode τ: the accepted run at every anchor of AR's own text,
against the anchors a greedy decode visits.

    python -m training.anchor_runs --out FILE.json [--weights DIR] [--model-name-or-path SPEC] [--dataset gsm8k]
                                   [--max-samples 16] [--max-new-tokens 96] [--device cpu] [--dtype float32]
                                   [--refiner none|xpress|markov] [--passes 4] [--topc 0]

For each prompt: AR's greedy text, then, at every anchor p of it (the first new token up to the last position a
whole block fits), the drafter's block from the target's taps before p and the token at p, teacher-forced as
speculators' training forward computes it (tests/test_dflash_speculators.py checks the two agree): the run of
drafts equal to AR's next tokens. speculators' `eal` is the mean of run + 1 over randomly chosen anchors, i.e.
over all of them. A decode does not visit all of them: it starts at the first new token and jumps run + 1 ahead,
so its next anchor is, unless the whole block was accepted, the token right after a draft the drafter got wrong.
Replaying that jump over the recorded runs gives the decode's τ (tokens per step) from the same numbers, and the
decode itself is run to check the replay: in fp32 the two agree step for step; in bf16 the teacher-forced taps are
rounded differently from the decode's, and the count of prompts that agree says how far that goes.

What the file holds (every number is over the prompts and anchors it names): all-anchor eal, replayed τ and
decoded τ, the run at decode anchors (after the first) against all anchors, per-position accuracy over all anchors
(as speculators' position_k_acc), and per prompt its anchors, steps and whether the replay equals the decode.
Drafter-only by default; `--refiner xpress` (K = `--passes`, shortlist `--topc`) or `markov` refines every draft,
teacher-forced and in the decode alike, with the head in WEIGHTS/xpress or WEIGHTS/markov (heads trained on the
drafter in WEIGHTS/drafter, as training.ship writes them; a head with its own co-trained drafter is refused). With
xPress the file also holds `xpress_inputs`: per slot, how large a pass's input from the drafter's states is against
its input from the previous token (InputNorms), over the teacher-forced passes. At every teacher-forced anchor whose
block has a wrong draft, `first_miss` records where AR's token stood in the logits that draft was chosen from (the
drafter's, or the head's refined ones): how many tokens were put above it (1: it was the runner-up), over the first
draft slot and the later ones apart: how near the drafter's (or the head's) best the token a refinement had to pick
was."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from core.errors import Parser, UsageError, cli_exit

ROWS = 256  # logits rows softmaxed at a time (a 49K vocabulary: 50 MB in fp32)


class InputNorms:
    """What an xPress pass takes from each of its inputs, per block slot: the L2 norm of the drafter's half of x
    (the head's block_cache: in_proj over [down_h(h_k) ; down_g(g)]) and of the token half (in_proj over
    w1(prev_k)), summed over every pass it sees (`watch` wraps the head's latent for the teacher-forced runs)."""

    def __init__(self, block: int):
        self.hidden, self.token, self.passes = [0.0] * block, [0.0] * block, 0

    def watch(self, head):
        real = head.latent

        def latent(cache, prev):
            tok = head.token_input(prev)
            for k, (h, t) in enumerate(zip(cache.float().norm(dim=-1).tolist(), tok.float().norm(dim=-1).tolist())):
                self.hidden[k] += h
                self.token[k] += t
            self.passes += 1
            return real(cache, prev)
        head.latent = latent  # an instance attribute over the method: `del head.latent` restores it

    def record(self) -> dict:
        n = max(self.passes, 1)
        share = [round(t / (t + h), 4) if t + h else None for h, t in zip(self.hidden, self.token)]
        return {"what": "per block slot, the mean L2 norm of an xPress pass's input from the drafter's states "
                        "(in_proj's hidden half) and from the previous token (its token half), over the "
                        "teacher-forced passes; token_share = token / (token + hidden)",
                "passes": self.passes, "hidden_norm": [round(h / n, 4) for h in self.hidden],
                "token_norm": [round(t / n, 4) for t in self.token], "token_share": share}


def miss_rank(logits: torch.Tensor, truth: torch.Tensor, run: int) -> list[int] | None:
    """[slot, rank] of the first wrong draft of a block (slot = the accepted run before it), rank = the tokens its
    logits row puts above the true token (greater, or equal with a lower id, as argmax breaks ties: a miss has
    rank >= 1); None when every draft is right. A true token off an xPress shortlist (its logit -inf: the arm could
    not pick it) has rank None, whatever its id."""
    if run >= truth.shape[0]:
        return None
    row, t = logits[run].float(), int(truth[run])
    if not torch.isfinite(row[t]):
        return [run, None]
    return [run, int((row > row[t]).sum()) + int((row[:t] == row[t]).sum())]


def teacher_forced_runs(target, drafter, ids: list[int], start: int, refiner=None
                        ) -> tuple[dict[int, int], dict[int, float], dict[int, list[int]]]:
    """({anchor p: accepted drafts}, {p: the target's probability of token p after what precedes it}, {p: the first
    wrong draft's [slot, rank] (miss_rank), for the anchors that have one}) for p in [start, len(ids) - block]:
    drafts (refined by `refiner` when given, as the decode refines them) compared with ids[p+1 : p+block]."""
    from core.protocols import RefineContext
    from harness.decode.verify import leading_run
    block = drafter.block_size
    t = torch.tensor(ids, device=target.pos.device)
    n = len(ids)
    target.ensure_capacity(n)
    drafter.ensure_capacity(n)
    target.reset()
    logits, feats = target.forward(t, torch.arange(n, device=t.device), n, want_features=True)
    chosen = torch.cat([logits[a:min(a + ROWS, n - 1)].float().softmax(-1).gather(1, t[a + 1:a + ROWS + 1, None])[:, 0]
                        for a in range(0, n - 1, ROWS)])  # chosen[i]: P(token i+1 | up to i), ROWS rows at a time
    drafter.begin(feats)
    runs, probs, misses = {}, {}, {}
    for p in range(start, n - block + 1):
        pos = torch.tensor(p, device=t.device)
        prop = drafter.propose(t[p], pos, p + block)
        if refiner is not None:
            prop = refiner.refine(prop, RefineContext(anchor=t[p], prev_token=t[p - 1]))
        runs[p] = int(leading_run(prop.tokens == t[p + 1:p + block]))
        probs[p] = round(float(chosen[p - 1]), 5)
        miss = miss_rank(prop.logits, t[p + 1:p + block], runs[p])
        if miss is not None:
            misses[p] = miss
        # the block wrote its K/V over slots p .. p+block-1: the context's rows go back for the next anchor
        drafter.model.write_context(feats[p:p + block], torch.arange(p, p + block, device=t.device), drafter.kv,
                                    drafter.ops)
    return runs, probs, misses


def visited(runs: dict[int, int], start: int) -> list[int]:
    """The anchors a greedy decode from `start` would visit over `runs` (those replay() reads)."""
    out, p = [], start
    for _ in range(len(runs)):  # each jump is at least one position: never more steps than anchors
        if p not in runs:
            break
        out.append(p)
        p += runs[p] + 1
    return out


def decode_anchors(accepted: list[int], start: int) -> list[int]:
    """The anchor of each verify step of a real decode, from its accepted drafts (each step emits accepted + 1)."""
    out, p = [], start
    for a in accepted:
        out.append(p)
        p += a + 1
    return out


def replay(runs: dict[int, int], start: int) -> list[int]:
    """The accepted drafts per step of a greedy decode that starts at `start`, while its anchor has a whole block."""
    return [runs[p] for p in visited(runs, start)]


def auc_lower(pos: list[float], neg: list[float]) -> float | None:
    """P(a value of `pos` < one of `neg`), ties counted half: how well a low value picks out `pos`."""
    if not pos or not neg:
        return None
    ranked = sorted([(v, 0) for v in pos] + [(v, 1) for v in neg])
    below = wins = 0.0
    i = 0
    while i < len(ranked):  # walk groups of equal values: each pos value beats the neg values above it
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        n_pos = sum(1 for k in range(i, j) if ranked[k][1] == 0)
        n_neg = (j - i) - n_pos
        wins += n_pos * (len(neg) - below - n_neg) + 0.5 * n_pos * n_neg
        below += n_neg
        i = j
    return wins / (len(pos) * len(neg))


def miss_ranks(prompts: list[dict]) -> dict | None:
    """Where AR's token stood at the first wrong draft of each block (the prompts' `first_miss`), the first draft
    slot and the later slots apart: the misses, the share whose token was the runner-up (rank 1), in the top 5 and
    in the top 16, and the median rank (the lower one of an even count), each over all the misses; a token off an
    xPress shortlist (rank None) is in none of them, ranks past every other, and is counted in `off_shortlist`.
    None when no prompt has a `first_miss` record; a group without misses is {"misses": 0}."""
    if not any("first_miss" in q for q in prompts):
        return None

    def group(ranks):
        if not ranks:
            return {"misses": 0}
        off = sum(r is None for r in ranks)
        ranks = sorted(r for r in ranks if r is not None) + [None] * off

        def share(k):
            return round(sum(r is not None and r <= k for r in ranks) / len(ranks), 4)
        return {"misses": len(ranks), "runner_up": share(1), "top5": share(4), "top16": share(15),
                "median_rank": ranks[(len(ranks) - 1) // 2], "off_shortlist": off}
    ms = [m for q in prompts for m in q.get("first_miss", {}).values()]
    return {"what": "at each teacher-forced anchor with a wrong draft, the first one's rank of AR's token in the "
                    "logits it was chosen from (tokens above it; 1 = runner-up)",
            "first_slot": group([r for slot, r in ms if slot == 0]),
            "later_slots": group([r for slot, r in ms if slot > 0])}


def summary(prompts: list[dict], block: int) -> dict:
    """The file's totals from each prompt's runs (keyed by anchor), replay and decode. The decode's anchors and
    their runs are the real decode's (its accepted drafts, the steps whose anchor has a whole block: the replay
    checks them against the teacher-forced runs, which are rounded otherwise in bf16)."""
    from harness.protocol.metrics import tau_per_step
    every = [r for q in prompts for r in q["runs"].values()]
    steps = sum(len(q["replay"]) for q in prompts)
    hits = [0] * (block - 1)
    for r in every:
        for j in range(min(r, block - 1)):
            hits[j] += 1
    first_runs, at_decode, chosen, others = [], [], [], []
    for q in prompts:
        if not q["runs"]:
            continue
        start = min(q["runs"])
        real = [(p, a) for p, a in zip(decode_anchors(q["decode_accepted"], start), q["decode_accepted"])
                if p in q["runs"]]
        first_runs += [a for p, a in real[:1] if p == start]
        at_decode += [a for p, a in real if p != start]  # after the first: the tokens after a miss
        seen = {p for p, _ in real}
        for p, v in q.get("target_prob", {}).items():  # the decode's anchors after the first against the others
            if p != start:
                (chosen if p in seen else others).append(v)

    def mean(xs):
        return round(sum(xs) / len(xs), 4) if xs else None
    auc = auc_lower(chosen, others)
    compared = [q for q in prompts if q["replay"]]
    return {
        "anchors": len(every), "all_anchor_eal": mean([r + 1 for r in every]),
        "replayed_tau": round(tau_per_step([[r + 1 for r in q["replay"]] for q in prompts]), 4) if steps else None,
        "replayed_steps": steps, "decode_steps": sum(len(q["decode_accepted"]) for q in prompts),
        "decoded_tau": round(tau_per_step([q["decode_lengths"] for q in prompts]), 4) if prompts else None,
        "decode_anchors_after_first": len(at_decode), "decode_anchor_eal": mean([r + 1 for r in at_decode]),
        "first_anchor_eal": mean([r + 1 for r in first_runs]),
        "p_first_draft_accepted": {"all_anchors": mean([int(r > 0) for r in every]),
                                   "decode_anchors": mean([int(r > 0) for r in at_decode])},
        # conditional on nothing: the share of anchors whose run reaches slot j (speculators' position_j_acc
        # counts slot j right even after a miss, so it reads higher from slot 2 on)
        "run_reaches_slot": [round(h / len(every), 4) if every else None for h in hits],
        # how well a low target probability of the anchor token picks out the decode's anchors (0.5: not at all)
        "decode_anchor_auc_target_prob": None if auc is None else round(auc, 4),
        # of the prompts with a replay (a whole block after the answer's start), those whose replay is the decode
        "replay_equals_decode": sum(q["replay_equals_decode"] for q in compared), "replay_prompts": len(compared),
        "prompts": len(prompts),
        **({"first_miss": fm} if (fm := miss_ranks(prompts)) is not None else {}),
    }


def parse(argv):
    from harness.protocol.setups import REPO
    ap = Parser(prog="python -m training.anchor_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write (refused if it exists)")
    ap.add_argument("--weights", default=None, help="a folder with drafter/ (default: the embedded weights)")
    ap.add_argument("--model-name-or-path", default=None, help="the target (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--dataset", default="gsm8k", help="a benchmark file of --data-dir (default gsm8k)")
    ap.add_argument("--data-dir", default=str(REPO / "data" / "eval"), help="the benchmark files (default data/eval)")
    ap.add_argument("--max-samples", type=int, default=16,
                    help="prompts, the protocol's seeded subset of the dataset (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="AR's greedy text per prompt (default 96)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--refiner", default="none", choices=("none", "xpress", "markov"),
                    help="refine each draft with the head in WEIGHTS/xpress or WEIGHTS/markov (default: drafter-only)")
    ap.add_argument("--passes", type=int, default=None, help="xPress's refinement passes K (--refiner xpress only; "
                    "default 4)")
    ap.add_argument("--topc", type=int, default=None, help="xPress's shortlist: every pass picks among the drafter's "
                    "C best tokens a slot (--refiner xpress only; default 0, the full vocabulary, as --xpress-topc)")
    return ap.parse_args(argv)


def check_refiner_args(args, weights: Path) -> None:
    """--refiner and --passes, from the arguments and the folder alone."""
    for flag, value in (("--passes", args.passes), ("--topc", args.topc)):
        if value is not None and args.refiner != "xpress":
            raise UsageError(f"{flag} {value} refines with xPress only; add --refiner xpress or drop {flag}")
    if args.passes is None:
        args.passes = 4
    if args.topc is None:
        args.topc = 0
    from refiners.xpress import MAX_TOPC
    if not 0 <= args.topc <= MAX_TOPC:
        raise UsageError(f"--topc must be 0 (the full vocabulary) or a shortlist of 1..{MAX_TOPC} tokens "
                         f"(got {args.topc})")
    if args.refiner == "xpress" and args.passes < 1:
        raise UsageError(f"--passes must be >= 1 for --refiner xpress (got {args.passes}); K=0 is drafter-only")
    if args.refiner != "none" and not (weights / args.refiner).is_dir():
        raise UsageError(f"--refiner {args.refiner}: {weights / args.refiner} is not a folder; --weights must hold "
                         f"{args.refiner}/ beside drafter/")


def refiner_checkpoint(args, weights: Path, dcfg, vocab: int):
    """The head's checkpoint for --refiner, checked against the drafter and target (None for drafter-only)."""
    from refiners.formats import load_refiner_checkpoint, validate_against
    if args.refiner == "none":
        return None
    ck = load_refiner_checkpoint(weights / args.refiner, args.refiner)
    validate_against(ck, vocab, dcfg.hidden_size, dcfg.block_size if args.refiner == "xpress" else None,
                     dcfg.expected_shapes())
    if ck.draft_state:
        raise UsageError(f"--refiner {args.refiner}: {weights / args.refiner} carries its own co-trained drafter; "
                         "anchor_runs measures heads on the drafter in drafter/ only")
    return ck


def build_refiner(args, ck, backend):
    """The refiner as the main CLI builds it for a head without a co-trained drafter (harness/protocol/build.py)."""
    from refiners.markov import MarkovRefiner, markov_head_from_state
    from refiners.xpress import XPressRefiner, validate_topc, xpress_head_from_state
    if ck is None:
        return None, "drafter-only"
    if args.refiner == "xpress":
        head = xpress_head_from_state(ck.head_state, mixer=ck.mixer, device=backend.device, dtype=backend.dtype)
        try:
            topc = validate_topc(args.topc, head.vocab)
        except ValueError as e:  # a vocabulary smaller than the shortlist (the bound above is MAX_TOPC)
            raise UsageError(f"--topc: {e}") from None
        arm = f"xPress(K={args.passes}, top-C {topc})" if topc else f"xPress(K={args.passes})"
        return XPressRefiner(head, args.passes, topc=topc), arm
    head = markov_head_from_state(ck.head_state, ck.variant, device=backend.device, dtype=backend.dtype)
    return MarkovRefiner(head), f"Markov ({ck.variant})"


def run(args) -> dict:
    from drafters.dflash import DFlashDrafter, load_dflash, read_dflash_config
    from core.devices import resolve_backend
    from harness.decode.accounting import STANDARD, model_stop_ids
    from harness.decode.loading import load_target, load_target_config
    from harness.decode.loop import DecodeSettings, generate
    from harness.protocol.data import load_samples, render_prompt, validate_dataset_args
    from harness.protocol.results_io import atomic_write
    from harness.protocol.setups import REPO, embedded_target, weights_dir
    out = Path(args.out)
    if out.exists():
        raise UsageError(f"--out {out} exists; pass a new file name")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    validate_dataset_args(args.dataset, args.data_dir, args.max_samples)
    weights = Path(args.weights) if args.weights else weights_dir()
    if not (weights / "drafter" / "config.json").is_file():
        raise UsageError(f"--weights {weights}: no drafter/config.json there; pass the folder holding drafter/")
    dcfg = read_dflash_config(weights / "drafter")
    if args.max_new_tokens < dcfg.block_size:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} is under the drafter's block of {dcfg.block_size}: "
                         "no anchor would have a whole block; raise it")
    check_refiner_args(args, weights)
    backend = resolve_backend(args.device, args.dtype)
    spec = args.model_name_or_path or embedded_target()
    tcfg = load_target_config(spec)
    dcfg.check_target(tcfg, "--weights drafter")
    ck = refiner_checkpoint(args, weights, dcfg, tcfg.vocab_size)
    target, tok = load_target(spec, backend, taps=dcfg.target_layer_ids)
    drafter = DFlashDrafter(load_dflash(weights / "drafter", dcfg, backend), target.embed, target.lm_head, backend)
    refiner, arm = build_refiner(args, ck, backend)
    norms = InputNorms(drafter.block_size) if args.refiner == "xpress" else None
    settings = DecodeSettings(max_new_tokens=args.max_new_tokens, max_model_len=8192,
                              stop_ids=model_stop_ids(target.model, tok, STANDARD))
    prompts = []
    for s in load_samples(args.dataset, args.data_dir, args.max_samples):
        ids = render_prompt(tok, [{"role": "user", "content": s.turns[0]}])
        ar = generate(target, ids, settings, backend)
        dec = generate(target, ids, settings, backend, drafter=drafter, refiner=refiner)
        if norms is not None:
            norms.watch(refiner.head)
        runs, probs, misses = teacher_forced_runs(target, drafter, ids + ar.tokens, len(ids), refiner)
        if norms is not None:
            del refiner.head.latent
        rep = replay(runs, len(ids))
        prompts.append({"row": s.row, "prompt_tokens": len(ids), "new_tokens": len(ar.tokens),
                        "decode_equals_ar": dec.tokens == ar.tokens, "runs": runs, "target_prob": probs,
                        "first_miss": misses,
                        "replay": rep,
                        "decode_accepted": dec.accepted, "decode_lengths": dec.accept_lengths,
                        # the decode's steps the replay covers (its last ones run out of room for a whole block)
                        "replay_equals_decode": bool(rep) and dec.accepted[:len(rep)] == rep})
        print(f"row {s.row}: {len(runs)} anchors, replay {len(rep)} steps, decode {len(dec.accepted)} steps",
              flush=True)
    shown = weights.resolve()
    rec = {"what": "teacher-forced accepted runs at every anchor of AR's greedy text, and the decode's anchors",
           "arm": arm,
           "weights": str(shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown),
           "target": Path(spec).name if spec.endswith(".gguf") else spec,
           "target_weights": f"GGUF, de-quantized to {args.dtype}" if spec.endswith(".gguf") else args.dtype,
           "dataset": args.dataset, "max_new_tokens": args.max_new_tokens,
           "device": backend.device.type, "dtype": str(backend.dtype).replace("torch.", ""),
           "block_size": drafter.block_size, **summary(prompts, drafter.block_size),
           **({"xpress_inputs": norms.record()} if norms is not None else {}),
           "per_prompt": [{**q, **{k: {str(p): v for p, v in q[k].items()}
                                   for k in ("runs", "target_prob", "first_miss")}}
                          for q in prompts]}
    atomic_write(out, json.dumps(rec, indent=1) + "\n")
    replayed, decoded = (sum(len(q[k]) for q in prompts) for k in ("replay", "decode_accepted"))
    print(f"{arm}: all-anchor eal {rec['all_anchor_eal']}, replayed tau {rec['replayed_tau']} (over the {replayed} "
          f"steps a whole block fits), decoded tau {rec['decoded_tau']} (all {decoded} decode steps); decode "
          f"anchors' eal {rec['decode_anchor_eal']} -> {out}")
    return rec


def main(argv=None) -> int:
    return cli_exit(lambda: run(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
