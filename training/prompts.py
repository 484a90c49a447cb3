"""Stage 1, prompts: user turns from JSONL files and Magpie-style from the target itself, filtered for length and
duplicates, checked against the benchmark prompts, split three ways (training/domains.py): train, selection (what
every choice reads: the Markov variant shipped, periodic evaluations) and held-out (reported only), the last two
stratified over the prompt sources.

Magpie: the target's chat template is rendered up to where the user's text would start, and the target samples
from there; what it writes before its end-of-turn token is a user prompt in its own distribution. With
`prompts.magpie_domains` it is steered: each domain's share of the prompts starts from its seed words (and system
prompt), e.g. "Write a Python function" for code, "Solve:" for math.
"""
from __future__ import annotations

from pathlib import Path

from core.errors import UsageError
from training import eval_sets
from training.config import fingerprint
from training.domains import apply_templates, group_counts, magpie_plan, split
from training.overlap import NgramIndex, eval_index, gram_frequencies, prompt_texts, read_jsonl
from training.store import is_done, repo_path, staged, write_json, write_jsonl

SENTINEL = "\x00MAGPIE\x00"


def out_dir(cfg: dict) -> Path:
    return Path(cfg["workdir"]) / "prompts"


def stage_key(cfg: dict, eval_files: list[str], pinned: str | None = None) -> str:
    """PINNED: the content digest of prompts.eval_sets' files (training/eval_sets.py), when the sets are pinned."""
    pc = cfg["prompts"]
    if not pc.get("more_magpie"):  # no extension: the key of a pool made before the field existed
        pc = {k: v for k, v in pc.items() if k not in ("more_magpie", "more_round")}
    pc = {k: v for k, v in pc.items() if k != "eval_sets"}  # the path: its files' content is PINNED
    key = {"prompts": pc, "target": cfg["target"], "seed": cfg["seed"], "eval": eval_files,
           **({"eval_sets": pinned} if pinned else {})}
    if cfg["prompts"]["magpie"] or cfg["prompts"].get("more_magpie"):  # generated prompts depend on the engine
        key["magpie_engine"] = cfg["responses"]["engine"]
    return fingerprint(key)


def jsonl_prompts(cfg: dict) -> list[dict]:
    pc, rows = cfg["prompts"], []
    for name in pc["jsonl"]:
        path = repo_path(name)
        if not path.is_file():
            raise UsageError(f"config prompts.jsonl: {name}: no such file")
        got = 0
        for i, row in enumerate(read_jsonl(path), 1):
            texts = prompt_texts(row)
            if not texts:
                raise UsageError(f"{path}:{i}: no user text (expected turns, question, prompt, instruction or text)")
            rows.append({"text": texts[0], "source": f"{path.name}:{i}"})
            got += 1
            if pc["jsonl_limit"] and got >= pc["jsonl_limit"]:
                break
    return rows


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
    if SENTINEL not in text:
        raise UsageError("the target's chat template does not place the user text verbatim; Magpie needs it")
    return text[:text.index(SENTINEL)]


def magpie_prompts(cfg: dict, model, tokenizer) -> list[dict]:
    """Per domain (training/domains.py): the target continues its user-turn prefix (after the domain's system
    prompt) from each row's seed words; the prompt is the seed plus what it wrote before its end of turn."""
    from tqdm import tqdm
    from training.gen import generate_batch, generate_fast, stop_ids
    pc = cfg["prompts"]
    stops = stop_ids(model, tokenizer)
    fast = cfg["responses"]["engine"] == "fast"
    rows, batch, offset = [], max(1, pc["magpie_batch"]), 0
    for dom in magpie_plan(pc):
        prefix = user_turn_prefix(tokenizer, dom["system"])
        seeds = dom["seeds"]
        ids = [tokenizer(prefix + s, add_special_tokens=False)["input_ids"] for s in seeds]
        n_all = dom["count"]
        picks = [j % len(seeds) for j in range(n_all)]
        kw = dict(sample=True, temperature=pc["magpie_temperature"], top_p=pc["magpie_top_p"], keep_stop=False)
        if fast:  # the responses stage's engine, every row of the domain in one continuous batch
            outs = generate_fast(model, [ids[k] for k in picks], pc["magpie_max_new_tokens"], stops,
                                 seed=cfg["seed"] * 100003 + offset, rows=batch,
                                 attention=cfg["responses"]["attention"], **kw)
        else:
            outs = []
            for start in tqdm(range(0, n_all, batch), desc=f"magpie prompts{' ' + dom['name'] if dom['name'] else ''}",
                              unit="batch"):
                outs += generate_batch(model, [ids[k] for k in picks[start:start + batch]],
                                       pc["magpie_max_new_tokens"], stops, tokenizer.pad_token_id,
                                       seed=cfg["seed"] * 100003 + offset + start, **kw)
        for j, (k, out) in enumerate(zip(picks, outs)):
            text = (seeds[k] + tokenizer.decode(out, skip_special_tokens=True)).strip()
            rows.append({"text": text, "source": f"{dom['source']}:{j}"})
        offset += n_all
    if fast:
        from training.gen import release_fast
        release_fast(model)
    return rows


def more_prompts(cfg: dict, model, tokenizer, pool: list[dict], index) -> tuple[list[dict], dict]:
    """prompts.more_magpie more Magpie prompts, drawn with round more_round's seeds (never the pool's), over the
    same domains; kept when they pass the length and benchmark-overlap filters and duplicate neither each other
    nor any prompt of the pool (train, selection or held-out; `pool`: their text before templates, as the filters
    compare), then take prompts.templates as the pool's do (the round's own draws). Sources
    `magpie:<domain>:r<round>.<i>`, so they count in their domain's group. A round is filtered against the pool,
    not against other rounds' prompts."""
    pc = cfg["prompts"]
    rnd = pc["more_round"]
    ext = dict(cfg, seed=cfg["seed"] + 7919 * rnd, prompts=dict(pc, magpie=pc["more_magpie"]))
    made = [dict(r, source=f"{r['source'].rsplit(':', 1)[0]}:r{rnd}.{r['source'].rsplit(':', 1)[1]}")
            for r in magpie_prompts(ext, model, tokenizer)]
    fresh = check_overlap(made, index, pc["overlap_jaccard"], refuse=False)
    kept, dropped = filter_rows(fresh, cfg, pool)
    dropped["benchmark_overlap_generated"] = len(made) - len(fresh)
    kept = apply_templates(kept, pc["templates"], ext["seed"])
    return kept, {"round": rnd, "generated": len(made), "kept": len(kept), "dropped": dropped,
                  "sources": group_counts(kept)}


def check_overlap(rows: list[dict], index: NgramIndex, threshold: float, refuse: bool) -> list[dict]:
    """Rows from files that overlap a benchmark prompt are refused (UsageError); generated rows are dropped."""
    kept = []
    for r in rows:
        label, j = index.best(r["text"]) if len(index) else (None, 0.0)
        if j >= threshold:
            if refuse and not r["source"].startswith("magpie:"):
                raise UsageError(f"training prompt {r['source']} overlaps the benchmark prompt {label} "
                                 f"({index.n}-gram Jaccard {j:.2f} >= {threshold}); remove it from the training "
                                 "data (benchmark prompts must never be trained on)")
            continue
        kept.append(r)
    return kept


def filter_rows(rows: list[dict], cfg: dict, pool: list[dict] = ()) -> tuple[list[dict], dict]:
    """The rows within prompts.min_chars..max_chars that near-duplicate (prompts.dedup_jaccard) no row kept before
    them, nor any row of `pool` (prompts already kept: more_prompts' pool)."""
    pc = cfg["prompts"]
    seen = NgramIndex(pc["ngram"], pc["dedup_jaccard"],
                      gram_frequencies([r["text"] for r in [*pool, *rows]], pc["ngram"]))
    for r in pool:
        seen.add(r["text"], r["source"])
    kept, dropped = [], {"length": 0, "duplicate": 0}
    for r in rows:
        if not pc["min_chars"] <= len(r["text"]) <= pc["max_chars"]:
            dropped["length"] += 1
            continue
        if seen.best(r["text"])[1] >= pc["dedup_jaccard"]:
            dropped["duplicate"] += 1
            continue
        seen.add(r["text"], r["source"])
        kept.append(r)
    return kept, dropped


def run(cfg: dict, eval_dir: str | None = None, force: bool = False, load=None) -> Path:
    pc = cfg["prompts"]
    edir = repo_path(eval_dir or pc["eval_dir"])
    index, eval_files = eval_index(edir, pc["ngram"], pc["overlap_jaccard"])
    out = out_dir(cfg)
    pinned = eval_sets.read(cfg)  # (selection, held-out, digest) or None; checked before anything loads
    key = stage_key(cfg, eval_files, pinned and pinned[2])
    rows = jsonl_prompts(cfg)
    # benchmark overlap is checked on the raw input, before anything is generated or written
    rows = check_overlap(rows, index, pc["overlap_jaccard"], refuse=True)
    if not force and is_done(out, key):
        print(f"prompts: up to date ({out})")
        return out
    if not eval_files:
        print(f"note: no benchmark prompts under {edir}; the overlap check had nothing to compare against "
              "(pass --eval-dir)")
    generated, magpie_counts = 0, {}
    if pc["magpie"] or pc["more_magpie"]:
        if cfg["responses"]["engine"] == "fast":
            from training.gen import check_engine
            check_engine(cfg)
        model, tokenizer = load()
    if pc["magpie"]:
        magpie = magpie_prompts(cfg, model, tokenizer)
        generated, magpie_counts = len(magpie), group_counts(magpie)
        rows += check_overlap(magpie, index, pc["overlap_jaccard"], refuse=False)
    kept, dropped = filter_rows(rows, cfg)
    dropped["benchmark_overlap_generated"] = generated - sum(r["source"].startswith("magpie:") for r in rows)
    if pinned:
        kept, dropped["eval_sets_overlap"] = eval_sets.drop_near(kept, pinned[0] + pinned[1], cfg)
        if not kept:
            raise UsageError("prompts: no training prompt is left after the filters and prompts.eval_sets' overlap "
                             "filter; add prompts (prompts.jsonl, prompts.magpie)")
    bare = kept  # what the filters compare: the text before any template (more_prompts compares against it too)
    kept = apply_templates(kept, pc["templates"], cfg["seed"])
    train, selection, held = (kept, pinned[0], pinned[1]) if pinned else \
        split(kept, pc["heldout"], pc["selection"], cfg["seed"])
    more, more_info = ([], None) if not pc["more_magpie"] else more_prompts(cfg, model, tokenizer, bare, index)
    if pinned and more_info:
        more, more_info["dropped"]["eval_sets_overlap"] = eval_sets.drop_near(more, pinned[0] + pinned[1], cfg)
        more_info["kept"], more_info["sources"] = len(more), group_counts(more)
    with staged(out) as tmp:
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "selection.jsonl", selection)
        write_jsonl(tmp / "heldout.jsonl", held)
        if more_info:
            write_jsonl(tmp / "more.jsonl", more)
        write_json(tmp / "manifest.json", {
            "key": key, "train": len(train), "selection": len(selection), "heldout": len(held),
            "sources": {"train": group_counts(train), "selection": group_counts(selection),
                        "heldout": group_counts(held)},
            "magpie_generated": generated, "magpie_domains": magpie_counts, "dropped": dropped,
            "templated": sum("template" in r for r in kept),
            "eval_files": eval_files, "eval_dir": str(edir), **({"more": more_info} if more_info else {}),
            **({"eval_sets": {"path": pc["eval_sets"], "digest": pinned[2]}} if pinned else {})})
    extra = f" + {len(more)} more (round {pc['more_round']})" if more_info else ""
    print(f"prompts: {len(train)} train + {len(selection)} selection + {len(held)} held-out{extra} -> {out} "
          f"(dropped {dropped})")
    return out
