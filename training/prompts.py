"""Stage 1, prompts: user turns from JSONL files and Magpie-style from the target itself, filtered for length and
duplicates, checked against the benchmark prompts, split into training and held-out prompts.

Magpie: the target's chat template is rendered up to where the user's text would start, and the target samples
from there; what it writes before its end-of-turn token is a user prompt in its own distribution.
"""
from __future__ import annotations

import random
from pathlib import Path

from core.errors import UsageError
from training.config import REPO_ROOT, fingerprint
from training.overlap import NgramIndex, eval_index, prompt_texts, read_jsonl
from training.store import is_done, staged, write_json, write_jsonl

SENTINEL = "\x00MAGPIE\x00"


def out_dir(cfg: dict) -> Path:
    return Path(cfg["workdir"]) / "prompts"


def stage_key(cfg: dict, eval_files: list[str]) -> str:
    return fingerprint({"prompts": cfg["prompts"], "target": cfg["target"], "seed": cfg["seed"],
                        "eval": eval_files})


def _repo_path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path


def jsonl_prompts(cfg: dict) -> list[dict]:
    pc, rows = cfg["prompts"], []
    for name in pc["jsonl"]:
        path = _repo_path(name)
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


def user_turn_prefix(tokenizer) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if SENTINEL not in text:
        raise UsageError("the target's chat template does not place the user text verbatim; Magpie needs it")
    return text[:text.index(SENTINEL)]


def magpie_prompts(cfg: dict, model, tokenizer) -> list[dict]:
    from training.gen import generate_batch, stop_ids
    pc = cfg["prompts"]
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    stops = stop_ids(model, tokenizer)
    rows, batch = [], max(1, pc["magpie_batch"])
    from tqdm import tqdm
    for start in tqdm(range(0, pc["magpie"], batch), desc="magpie prompts", unit="batch"):
        n = min(batch, pc["magpie"] - start)
        outs = generate_batch(model, [prefix] * n, pc["magpie_max_new_tokens"], stops, tokenizer.pad_token_id,
                              sample=True, temperature=pc["magpie_temperature"], top_p=pc["magpie_top_p"],
                              seed=cfg["seed"] * 100003 + start, keep_stop=False)
        for j, ids in enumerate(outs):
            rows.append({"text": tokenizer.decode(ids, skip_special_tokens=True).strip(),
                         "source": f"magpie:{start + j}"})
    return rows


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


def filter_rows(rows: list[dict], cfg: dict) -> tuple[list[dict], dict]:
    pc = cfg["prompts"]
    seen = NgramIndex(pc["ngram"])
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
    edir = _repo_path(eval_dir or pc["eval_dir"])
    index, eval_files = eval_index(edir, pc["ngram"])
    out = out_dir(cfg)
    key = stage_key(cfg, eval_files)
    rows = jsonl_prompts(cfg)
    # benchmark overlap is checked on the raw input, before anything is generated or written
    rows = check_overlap(rows, index, pc["overlap_jaccard"], refuse=True)
    if not force and is_done(out, key):
        print(f"prompts: up to date ({out})")
        return out
    if not eval_files:
        print(f"note: no benchmark prompts under {edir}; the overlap check had nothing to compare against "
              "(pass --eval-dir)")
    generated = 0
    if pc["magpie"]:
        model, tokenizer = load()
        magpie = magpie_prompts(cfg, model, tokenizer)
        generated = len(magpie)
        rows += check_overlap(magpie, index, pc["overlap_jaccard"], refuse=False)
    kept, dropped = filter_rows(rows, cfg)
    dropped["benchmark_overlap_generated"] = generated - sum(r["source"].startswith("magpie:") for r in rows)
    if len(kept) <= pc["heldout"]:
        raise UsageError(f"prompts: only {len(kept)} prompts left after filtering, need more than prompts.heldout="
                         f"{pc['heldout']}")
    order = list(range(len(kept)))
    random.Random(cfg["seed"]).shuffle(order)
    held = sorted(order[:pc["heldout"]])
    train = [kept[i] for i in sorted(order[pc["heldout"]:])]
    with staged(out) as tmp:
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "heldout.jsonl", [kept[i] for i in held])
        write_json(tmp / "manifest.json", {"key": key, "train": len(train), "heldout": len(held),
                                           "magpie_generated": generated, "dropped": dropped,
                                           "eval_files": eval_files, "eval_dir": str(edir)})
    print(f"prompts: {len(train)} train + {len(held)} held-out -> {out} (dropped {dropped})")
    return out
