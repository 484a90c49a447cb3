"""Stage 2, responses: the target's own answers to the training prompts, greedy and sampled, through its chat
template. Stored as token ids (parts/part_NNNN.jsonl, one row per sequence: prompt ids, response ids, mode,
source) with a manifest. Parts are written one batch group at a time, so an interrupted run resumes where it
stopped.

responses.engine: "fast" (default) generates with harness.decode.batched_gen (a static KV cache, continuous
batching over responses.batch_size rows, CUDA graphs and bf16 on CUDA), several parts per call so that finished
rows are refilled; "hf" runs HF `generate` batch by batch. Both write the same rows in the same order."""
from __future__ import annotations

import random
from pathlib import Path

from tqdm import tqdm

from core.errors import UsageError
from training.config import fingerprint
from training.domains import group_of
from training.overlap import read_jsonl
from training.prompts import out_dir as prompts_dir
from training.store import read_manifest, resumable, write_json, write_jsonl

PART_PROMPTS = 256  # prompts per part file


def out_dir(cfg: dict) -> Path:
    return Path(cfg["workdir"]) / "responses"


def stage_key(cfg: dict) -> str:
    # a box is run control; the attention kernel is the engine's implementation (the same model's answers, to
    # bf16 rounding), so parts made with either are kept and the manifest says which made the last ones
    rc = {k: v for k, v in cfg["responses"].items() if k not in ("max_minutes", "attention")
          and not (k == "sampled_by_group" and not v)}  # added later: unset, the key of the parts made before it
    return fingerprint({"responses": rc, "order": "shuffled", "prompts": read_manifest(prompts_dir(cfg))["key"],
                        "seed": cfg["seed"]})


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def read_rows(cfg: dict) -> list[dict]:
    rows = []
    for f in sorted((out_dir(cfg) / "parts").glob("part_*.jsonl")):
        rows += read_jsonl(f)
    return rows


def _encoded(cfg, tokenizer, prompts: list[dict]) -> list[tuple[dict, list[int]]]:
    encoded = [(p, chat_ids(tokenizer, p["text"])) for p in prompts]
    encoded = [e for e in encoded if len(e[1]) <= cfg["responses"]["max_prompt_tokens"]]
    encoded.sort(key=lambda e: len(e[1]))
    return encoded


def sampled_for(cfg, source: str) -> int:
    """The sampled answers a prompt gets: responses.sampled, or its source group's responses.sampled_by_group (e.g.
    more answers to the GSM8K train questions than to the Magpie prompts)."""
    return cfg["responses"]["sampled_by_group"].get(group_of(source), cfg["responses"]["sampled"])


def _modes(cfg) -> list[tuple[str, int]]:
    most = max([cfg["responses"]["sampled"], *cfg["responses"]["sampled_by_group"].values()])
    return [("greedy", 0)] + [("sampled", k + 1) for k in range(most)]


def _takes(cfg, encoded, k: int) -> list:
    """The rows that get answer k (0: the greedy one): those whose group asks for at least k sampled answers."""
    return encoded if k == 0 else [e for e in encoded if sampled_for(cfg, e[0]["source"]) >= k]


def _rows(cfg, encoded, answer) -> list[dict]:
    """The part's rows, batch by batch and mode by mode; answer(mode, k, start, chunk) -> the chunk's answers, where
    chunk is the batch's rows that take answer k and start counts the part's rows that took it before them (the
    batch's start when every row takes every answer, as before sampled_by_group)."""
    rows, size, before = [], cfg["responses"]["batch_size"], {}
    for start in range(0, len(encoded), size):
        for mode, k in _modes(cfg):
            chunk = _takes(cfg, encoded[start:start + size], k)
            at = before.get(k, 0)
            before[k] = at + len(chunk)
            rows += [{"prompt": e[1], "response": o, "mode": mode, "source": e[0]["source"]}
                     for e, o in zip(chunk, answer(mode, k, at, chunk) if chunk else []) if o]
    return rows


def _part(cfg, model, tokenizer, prompts: list[dict], part: int) -> list[dict]:
    """HF generate, one batch at a time."""
    from training.gen import generate_batch, stop_ids
    rc = cfg["responses"]
    stops = stop_ids(model, tokenizer)

    def answer(mode, k, start, chunk):
        return generate_batch(model, [e[1] for e in chunk], rc["max_new_tokens"], stops, tokenizer.pad_token_id,
                              sample=mode == "sampled", temperature=rc["temperature"], top_p=rc["top_p"],
                              seed=cfg["seed"] * 1000003 + part * 7919 + start * 31 + k)
    return _rows(cfg, _encoded(cfg, tokenizer, prompts), answer)


def _fast_parts(cfg, model, tokenizer, parts: list[tuple[int, list[dict]]], attention: str) -> dict[int, list[dict]]:
    """The fast engine over several parts at once: one generation per mode over all their prompts."""
    from training.gen import generate_fast, stop_ids
    rc = cfg["responses"]
    stops = stop_ids(model, tokenizer)
    encoded = {g: _encoded(cfg, tokenizer, prompts) for g, prompts in parts}
    answers = {}
    for mode, k in _modes(cfg):
        takes = {g: _takes(cfg, encoded[g], k) for g, _ in parts}
        flat = [e[1] for g, _ in parts for e in takes[g]]
        if not flat:
            continue
        outs = generate_fast(model, flat, rc["max_new_tokens"], stops, sample=mode == "sampled",
                             temperature=rc["temperature"], top_p=rc["top_p"],
                             seed=cfg["seed"] * 1000003 + parts[0][0] * 7919 + k, rows=rc["batch_size"],
                             attention=attention)
        at = 0
        for g, _ in parts:
            answers[g, mode, k] = outs[at:at + len(takes[g])]
            at += len(takes[g])
    return {g: _rows(cfg, encoded[g], lambda mode, k, start, chunk, g=g: answers[g, mode, k][start:start + len(chunk)])
            for g, _ in parts}


def prompt_parts(cfg: dict) -> list[list[dict]]:
    """The training prompts in parts of PART_PROMPTS: the pool's (train.jsonl) in a seeded random order (it lists
    them source by source), so that the parts a box cuts short leave every source in proportion (an H200 run cut
    at 96 of 230 parts kept only GSM8K and Magpie chat); then, when the prompts stage drew more
    (prompts.more_magpie: more.jsonl), theirs in their own seeded order, as parts after the pool's. The pool's
    parts do not move, so `responses.first_part` = the pool's part count starts a run on the new prompts alone."""
    def chunks(rows):
        return [rows[i:i + PART_PROMPTS] for i in range(0, len(rows), PART_PROMPTS)]
    pool = read_jsonl(prompts_dir(cfg) / "train.jsonl")
    random.Random(cfg["seed"] * 7919 + 3).shuffle(pool)
    groups = chunks(pool)
    more = prompts_dir(cfg) / "more.jsonl"
    if more.is_file():
        rows = read_jsonl(more)
        random.Random(cfg["seed"] * 7919 + 5 + cfg["prompts"]["more_round"]).shuffle(rows)
        groups += chunks(rows)
    return groups


def parts_per_call(cfg) -> int:
    """Parts the fast engine generates together: about 4 x batch_size prompts, so that rows are refilled."""
    return max(1, -(-4 * cfg["responses"]["batch_size"] // PART_PROMPTS))


def run(cfg: dict, load, force: bool = False) -> Path:
    from training.gen import check_engine
    check_engine(cfg)
    out = out_dir(cfg)
    key = stage_key(cfg)
    if resumable(out, key, force, "responses") == "done":
        return out
    groups = prompt_parts(cfg)
    first = cfg["responses"]["first_part"]
    if first >= len(groups):
        raise UsageError(f"responses.first_part {first}: there are only {len(groups)} parts of {PART_PROMPTS} prompts; "
                         "lower it")
    named = {group_of(p["source"]) for part in groups[first:] for p in part}  # the parts this run generates
    if set(cfg["responses"]["sampled_by_group"]) - named:
        raise UsageError(f"responses.sampled_by_group names {sorted(set(cfg['responses']['sampled_by_group']) - named)}, "
                         f"no source group of the training prompts; the groups are {sorted(named)}")
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    before = read_manifest(out) or {}  # parts kept from earlier processes (same key): which engine settings wrote them
    wrote = {k: set(before.get(k) or []) for k in ("attentions", "top_p_cuts")}
    write_json(out / "manifest.json", {"key": key, "complete": False, **{k: sorted(v) for k, v in wrote.items()}})
    model, tokenizer = load()
    todo = [(g, group) for g, group in enumerate(groups)
            if g >= first and not (parts / f"part_{g:04d}.jsonl").exists()]
    hf = cfg["responses"]["engine"] == "hf"
    step = 1 if hf else parts_per_call(cfg)
    if not hf:
        from harness.decode.batched import pick_attention
        attention = pick_attention(model, cfg["responses"]["attention"])  # what the manifest records
        from harness.decode.sampling import DEFAULT_SAMPLER, pick_sampler
        top_p_cut = pick_sampler(DEFAULT_SAMPLER, model.device)  # the cut the engine generate_fast builds takes
        if todo:
            wrote["attentions"].add(attention)
            wrote["top_p_cuts"].add(top_p_cut)
        print(f"responses: the fast engine's decode attention is {attention} "
              f"(responses.attention={cfg['responses']['attention']}), its top-p cut {top_p_cut}")
    import time
    box = cfg["responses"]["max_minutes"] * 60
    deadline = time.monotonic() + box
    cut = 0
    with tqdm(total=len(todo), desc="responses", unit="part") as bar:
        for at in range(0, len(todo), step):
            if at and box and time.monotonic() > deadline:  # the box is spent: the stage ends with the parts written
                cut = len(todo) - at
                print(f"responses: responses.max_minutes={cfg['responses']['max_minutes']} reached; {cut} of "
                      f"{len(groups)} parts not generated (their prompts are left out)")
                break
            batch = todo[at:at + step]
            done = ({g: _part(cfg, model, tokenizer, group, g) for g, group in batch} if hf
                    else _fast_parts(cfg, model, tokenizer, batch, attention))
            for g, _ in batch:
                final = parts / f"part_{g:04d}.jsonl"
                tmp = final.with_suffix(".tmp")
                write_jsonl(tmp, done[g])
                tmp.rename(final)
                bar.update(1)
    if not hf:
        from training.gen import release_fast
        release_fast(model)
    rows = read_rows(cfg)
    write_json(out / "manifest.json", {"key": key, "complete": True, "sequences": len(rows),
                                       "parts": len(groups) - first - cut, "parts_planned": len(groups),
                                       "first_part": first, "engine": cfg["responses"]["engine"],
                                       **{k: sorted(v) for k, v in wrote.items()},
                                       "response_tokens": sum(len(r["response"]) for r in rows),
                                       "prompt_tokens": sum(len(r["prompt"]) for r in rows)})
    print(f"responses: {len(rows)} sequences -> {out}")
    return out
