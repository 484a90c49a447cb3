"""Stage 3, hidden states, in the layout speculators' offline trainer reads (speculators 0.9.0
`speculators.train.data.ArrowDataset` with its `FileTransfer`):

    hidden/                  a `datasets` arrow dataset, torch format: input_ids, loss_mask, seq_len per sequence
    hidden/hidden_states/hs_<i>.safetensors
                             token_ids [T] and hidden_states [T, len(layer_ids) + 1, H]: the tapped layers, then
                             the target's last layer before its final norm (speculators splits that one off as
                             `verifier_last_hidden_states` and applies the verifier norm and lm_head itself)

With `hidden.mode=online` only the arrow dataset is written (no hidden_states/: 4.4 KB a token for SmolLM2's
3 taps + last in bf16) and the training step computes the same tensors from the token ids (training/online.py).
`hidden.target_dtype` is the dtype the target runs in for them (both modes; float32 by default).

Layer ids follow speculators: id i is the input of decoder layer i (0 = the embedding output), i.e. the output of
layer i - 1. The harness's (z-lab) taps are these ids minus one. They are captured with forward hooks, not HF's
`hidden_states` tuple, whose last entry is already normed.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from core.errors import UsageError
from training.config import fingerprint
from training.responses import out_dir as responses_dir
from training.responses import read_rows
from training.store import read_manifest, resumable, write_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def out_dir(cfg: dict) -> Path:
    return Path(cfg["workdir"]) / "hidden"


def layer_ids(cfg: dict, n_layers: int) -> list[int]:
    """The configured ids, else speculators' default [2, N//2, N-3]; all must be in 1..N-1 (the harness taps
    layer outputs 0..N-2 this way; N, the last layer, is always stored apart)."""
    ids = cfg["hidden"]["layer_ids"] or [2, n_layers // 2, n_layers - 3]
    bad = [i for i in ids if not isinstance(i, int) or not 1 <= i <= n_layers - 1]
    if bad or len(set(ids)) != len(ids):
        raise UsageError(f"config hidden.layer_ids {ids}: need distinct integers in 1..{n_layers - 1} for a "
                         f"{n_layers}-layer target (speculators ids: the input of that layer)")
    return sorted(ids)


def stage_key(cfg: dict) -> str:
    return fingerprint({"hidden": cfg["hidden"], "responses": read_manifest(responses_dir(cfg))["key"]})


class Capture:
    """Forward hooks: the output of layers ids-1 and the input of the final norm."""

    def __init__(self, model, ids: list[int]):
        inner = model.model
        self.store: dict[int, torch.Tensor] = {}
        self.hooks = []
        n = len(inner.layers)
        for i in ids:
            self.hooks.append(inner.layers[i - 1].register_forward_hook(self._out(i)))
        self.hooks.append(inner.norm.register_forward_pre_hook(lambda mod, args: self.store.__setitem__(n, args[0])))
        self.order = list(ids) + [n]

    def _out(self, i):
        def hook(mod, args, out):
            self.store[i] = out[0] if isinstance(out, tuple) else out
        return hook

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.store[i] for i in self.order], dim=2)  # [B, T, L+1, H]

    def close(self):
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def hidden_states(model, seqs: list[list[int]], ids: list[int]) -> list[torch.Tensor]:
    cap = Capture(model, ids)
    try:
        width = max(len(s) for s in seqs)
        x = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, s in enumerate(seqs):
            x[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        model(input_ids=x.to(model.device), attention_mask=mask.to(model.device))
        full = cap.stacked()
        return [full[i, :len(s)] for i, s in enumerate(seqs)]
    finally:
        cap.close()


def target_in_dtype(hf_model, dtype: torch.dtype):
    """The target that computes hidden states (hidden.target_dtype): the pipeline's model itself when it is in
    `dtype`, else a copy (the pipeline's fp32 model keeps serving generation and held-out acceptance)."""
    import copy
    if next(hf_model.parameters()).dtype == dtype:
        return hf_model
    return copy.deepcopy(hf_model).to(dtype)


def write_dataset(out: Path, rows: list[dict]) -> None:
    import datasets
    ids = [r["prompt"] + r["response"] for r in rows]
    mask = [[0] * len(r["prompt"]) + [1] * len(r["response"]) for r in rows]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask, "seq_len": [len(s) for s in ids]})
    ds.set_format("torch")
    ds.save_to_disk(str(out))


def manifest(cfg: dict, key: str, rows: list[dict], ids: list[int], tcfg) -> dict:
    return {"key": key, "complete": True, "mode": cfg["hidden"]["mode"], "sequences": len(rows), "layer_ids": ids,
            "num_layers": tcfg.num_hidden_layers, "hidden_size": tcfg.hidden_size, "dtype": cfg["hidden"]["dtype"],
            "tokens": sum(len(r["prompt"]) + len(r["response"]) for r in rows)}


def run(cfg: dict, load, force: bool = False) -> Path:
    from safetensors.torch import save_file
    from training.target import target_config
    out = out_dir(cfg)
    key = stage_key(cfg)
    state = resumable(out, key, force, "hidden")
    if state == "done":
        return out
    tcfg = target_config(cfg["target"])
    ids = layer_ids(cfg, tcfg.num_hidden_layers)
    rows = read_rows(cfg)
    import random
    random.Random(cfg["seed"]).shuffle(rows)  # the trainer's val split is the dataset's tail
    if state == "fresh":
        write_dataset(out, rows)
        write_json(out / "manifest.json", {"key": key, "complete": False})
    if cfg["hidden"]["mode"] == "online":  # the training step computes them (training/online.py)
        write_json(out / "manifest.json", manifest(cfg, key, rows, ids, tcfg))
        print(f"hidden: {len(rows)} sequences (token ids only; hidden.mode=online) -> {out}")
        return out
    model = target_in_dtype(load()[0], DTYPES[cfg["hidden"]["target_dtype"]])
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(exist_ok=True)
    dtype = DTYPES[cfg["hidden"]["dtype"]]
    todo = [i for i in range(len(rows)) if not (hs_dir / f"hs_{i}.safetensors").exists()]
    todo.sort(key=lambda i: len(rows[i]["prompt"]) + len(rows[i]["response"]))
    bs = cfg["hidden"]["batch_size"]
    for start in tqdm(range(0, len(todo), bs), desc="hidden states", unit="batch"):
        chunk = todo[start:start + bs]
        seqs = [rows[i]["prompt"] + rows[i]["response"] for i in chunk]
        for i, s, h in zip(chunk, seqs, hidden_states(model, seqs, ids)):
            tmp = hs_dir / f"hs_{i}.tmp"
            save_file({"hidden_states": h.to(dtype).cpu().contiguous(), "token_ids": torch.tensor(s)}, str(tmp))
            tmp.rename(hs_dir / f"hs_{i}.safetensors")
    write_json(out / "manifest.json", manifest(cfg, key, rows, ids, tcfg))
    print(f"hidden: {len(rows)} sequences, layers {ids} + last -> {out}")
    return out
