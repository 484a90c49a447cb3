"""Stage 2, responses: the target's own answers to the training prompts, greedy and sampled, through its chat
template, batched with HF `generate`. Stored as token ids (parts/part_NNNN.jsonl, one row per sequence:
prompt ids, response ids, mode, source) with a manifest. Parts are written one batch group at a time, so an
interrupted run resumes where it stopped."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from training.config import fingerprint
from training.prompts import out_dir as prompts_dir
from training.store import read_manifest, resumable, write_json, write_jsonl

PART_PROMPTS = 256  # prompts per part file


def out_dir(cfg: dict) -> Path:
    return Path(cfg["workdir"]) / "responses"


def stage_key(cfg: dict) -> str:
    return fingerprint({"responses": cfg["responses"], "prompts": read_manifest(prompts_dir(cfg))["key"],
                        "seed": cfg["seed"]})


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def read_rows(cfg: dict) -> list[dict]:
    rows = []
    for f in sorted((out_dir(cfg) / "parts").glob("part_*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def _part(cfg, model, tokenizer, prompts: list[dict], part: int) -> list[dict]:
    from training.gen import generate_batch, stop_ids
    rc = cfg["responses"]
    stops = stop_ids(model, tokenizer)
    encoded = [(p, chat_ids(tokenizer, p["text"])) for p in prompts]
    encoded = [e for e in encoded if len(e[1]) <= rc["max_prompt_tokens"]]
    encoded.sort(key=lambda e: len(e[1]))
    rows = []
    modes = [("greedy", 0)] + [("sampled", k + 1) for k in range(rc["sampled"])]
    for start in range(0, len(encoded), rc["batch_size"]):
        chunk = encoded[start:start + rc["batch_size"]]
        for mode, k in modes:
            outs = generate_batch(model, [e[1] for e in chunk], rc["max_new_tokens"], stops, tokenizer.pad_token_id,
                                  sample=mode == "sampled", temperature=rc["temperature"], top_p=rc["top_p"],
                                  seed=cfg["seed"] * 1000003 + part * 7919 + start * 31 + k)
            rows += [{"prompt": e[1], "response": o, "mode": mode, "source": e[0]["source"]}
                     for e, o in zip(chunk, outs) if o]
    return rows


def run(cfg: dict, load, force: bool = False) -> Path:
    out = out_dir(cfg)
    key = stage_key(cfg)
    if resumable(out, key, force, "responses") == "done":
        return out
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    write_json(out / "manifest.json", {"key": key, "complete": False})
    prompts = [json.loads(line) for line in (prompts_dir(cfg) / "train.jsonl").read_text().splitlines()]
    groups = [prompts[i:i + PART_PROMPTS] for i in range(0, len(prompts), PART_PROMPTS)]
    model, tokenizer = load()
    for g, group in enumerate(tqdm(groups, desc="responses", unit="part")):
        final = parts / f"part_{g:04d}.jsonl"
        if final.exists():
            continue
        tmp = final.with_suffix(".tmp")
        write_jsonl(tmp, _part(cfg, model, tokenizer, group, g))
        tmp.rename(final)
    rows = read_rows(cfg)
    write_json(out / "manifest.json", {"key": key, "complete": True, "sequences": len(rows),
                                       "response_tokens": sum(len(r["response"]) for r in rows),
                                       "prompt_tokens": sum(len(r["prompt"]) for r in rows)})
    print(f"responses: {len(rows)} sequences -> {out}")
    return out
