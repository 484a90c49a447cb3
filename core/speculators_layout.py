"""Reading the speculators (vLLM) checkpoint layout: `config.json` with `speculators_model_type` dflash, xpress or
dspark, and the model's own tensor names (speculators 0.9.0).

* the drafter: a Qwen3 `transformer_layer_config`, `aux_hidden_state_layer_ids` (speculators ids: the INPUT of
  that target layer, so the z-lab/harness tap is the id minus one), `mask_token_id`, `block_size`; tensors named
  as z-lab's (fc, hidden_norm, layers.*, norm). Only the full-vocabulary fill-in layout runs here.
* xPress (`xpress`): the head under `refiner_head.` (token_embed, down_h, down_g, in_proj, mix_l raw, mlp_gate,
  mlp_up, mlp_down, readout).
* Markov (`dspark`): `markov_head.` (markov_w1, markov_w2, gated: gate_proj, rnn: joint_proj) and a confidence
  head, which never changes a token and is not used here.
Heads are returned under the harness's training names (refiners.formats); backbone tensors, when present, are
the co-trained drafter. Both sides read it (drafters.dflash the drafter config, refiners the heads), so it lives
here, with the other checkpoint readers; refiners.speculators_layout builds a refiner checkpoint from it.
"""
from __future__ import annotations

from core.errors import UsageError

XPRESS_PREFIX, MARKOV_PREFIX, CONFIDENCE_PREFIX = "refiner_head.", "markov_head.", "confidence_head."
XPRESS_NAMES = {"token_embed.weight": "w1.weight", "down_h.weight": "down_h.weight", "down_g.weight": "down_g.weight",
                "in_proj.weight": "in_proj.weight", "mix_l": "mix.L", "mlp_gate.weight": "mlp.gate_proj.weight",
                "mlp_up.weight": "mlp.up_proj.weight", "mlp_down.weight": "mlp.down_proj.weight",
                "readout.weight": "w2.weight"}
MARKOV_NAMES = {"markov_w1.weight": "w1.weight", "markov_w2.weight": "w2.weight", "gate_proj.weight": "gate.weight",
                "gate_proj.bias": "gate.bias", "joint_proj.weight": "cell.weight", "joint_proj.bias": "cell.bias"}
KIND_OF_TYPE = {"xpress": "xpress", "dspark": "markov"}


def is_speculators(cfg: dict) -> bool:
    return "speculators_model_type" in cfg


def zlab_config(cfg: dict, where: str) -> dict:
    """The z-lab drafter config dict (what drafters.dflash.DFlashConfig reads) of a speculators config."""
    from transformers import AutoConfig
    if cfg.get("sample_from_anchor"):
        raise UsageError(f"{where}: sample_from_anchor=true (every slot predicts, the DSpark default) is not "
                         "supported; the harness runs the fill-in layout (train with sample_from_anchor=false)")
    tl = dict(cfg.get("transformer_layer_config") or {})
    if not tl:
        raise UsageError(f"{where}: speculators config without transformer_layer_config")
    full = AutoConfig.for_model(tl.pop("model_type", "qwen3"), **tl).to_dict()  # the diff dict, defaults filled in
    vocab, draft_vocab = full["vocab_size"], cfg.get("draft_vocab_size", full["vocab_size"])
    if draft_vocab != vocab:
        raise UsageError(f"{where}: draft_vocab_size {draft_vocab} differs from the vocab {vocab}; reduced "
                         "draft vocabularies (d2t/t2d) are not supported")
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not ids or min(ids) < 1:
        raise UsageError(f"{where}: aux_hidden_state_layer_ids {ids} must be non-empty ids >= 1 (id 0, the "
                         "embedding output, has no harness tap)")
    full.update(architectures=["DFlashDraftModel"], block_size=cfg.get("block_size"),
                num_target_layers=int(cfg.get("num_target_layers") or 0),
                dflash_config={"mask_token_id": cfg.get("mask_token_id"), "target_layer_ids": [i - 1 for i in ids]})
    return full


def split_tensors(cfg: dict, tensors: dict, where: str) -> tuple[str, dict, dict, str]:
    """(kind, drafter tensors, head tensors under training names, Markov variant)."""
    mtype = cfg["speculators_model_type"]
    if mtype not in KIND_OF_TYPE:
        raise UsageError(f"{where}: speculators model type {mtype!r} holds no refiner head (xpress or dspark)")
    kind = KIND_OF_TYPE[mtype]
    prefix, names = (XPRESS_PREFIX, XPRESS_NAMES) if kind == "xpress" else (MARKOV_PREFIX, MARKOV_NAMES)
    head, draft = {}, {}
    for k, v in tensors.items():
        if k.startswith(prefix):
            name = k[len(prefix):]
            if name not in names:
                raise UsageError(f"{where}: unknown head tensor {k}")
            head[names[name]] = v
        elif not k.startswith(CONFIDENCE_PREFIX):
            draft[k] = v
    variant = cfg.get("markov_head_type", "vanilla") if kind == "markov" else ""
    if kind == "markov" and not cfg.get("markov_rank"):
        raise UsageError(f"{where}: markov_rank is 0: this DSpark checkpoint has no Markov head")
    return kind, draft, head, variant
