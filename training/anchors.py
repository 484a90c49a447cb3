"""`models.NAME.anchor_bias` (dflash drafters): training anchors drawn toward the tokens the target was unsure of.

speculators 0.9.0 draws a drafter's anchors uniformly, without replacement, over the positions its loss mask keeps
(`speculators.models.dflash.utils.select_anchors`, which `DFlashDraftModel._build_attention_mask` calls through the
name `select_anchors` in `speculators.models.dflash.core`). A greedy decode does not visit anchors uniformly: after
its first, each anchor is the token right after a draft the drafter got wrong (training/anchor_runs.py), and there
the drafter accepts less at every slot. Those tokens are more often ones the target itself gave a low probability:
a low target probability picks out the decode's anchors with AUC 0.69-0.72 on SmolLM2 (results/perf/anchor_runs/).

With bias b in (0, 1], a training step's anchors are drawn without replacement with probability proportional to

    (1 - b) / N  +  b * u_i / sum(u),    u_i = 1 - P_target(token i | the tokens before it),

over the N positions speculators would draw from (the loss-masked ones, less the row's last block), so b = 0 would
be the uniform draw and b = 1 draws by u alone. P_target comes from the verifier's last hidden states that the
step already carries (the online target's, or the offline files'), through the drafter's own copies of the
verifier's norm and lm_head, in chunks of rows. Validation steps (the model in eval mode) keep speculators' uniform
draw, so validation losses and `eal` stay comparable between recipes. b = 0 (the default) replaces nothing.

How it hooks in, without forking speculators: a forward pre-hook computes u for the step (after the online taps'
hook), and while the model trains (`installed`) the name `select_anchors` in speculators' dflash module points at
this draw, which falls back to speculators' own when no step's u is set. The name is restored afterwards, so the
heads trained next in the same process draw uniformly. Not with `train.compile=model` (the whole forward traced by
torch.compile; refused when the config loads).
"""
from __future__ import annotations

import contextlib

import torch

CHUNK = 4096  # rows of verifier logits at a time: 4096 x a 49K vocabulary in fp32 is 0.8 GB


@torch.no_grad()
def target_unsure(model, last_hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """u [T] for one packed row: u[i] = 1 - P_target(input_ids[i] | before i), from the verifier's last hidden
    states [1, T, H] (before its final norm) through the model's verifier_norm and verifier_lm_head; u[0] = 0 (no
    position precedes it). Sequences packed in a row: position 0 of each is a prompt token, never an anchor."""
    h, ids = last_hidden[0], input_ids[0].to(last_hidden.device)
    u = torch.zeros(ids.shape[0], dtype=torch.float32, device=h.device)
    for s in range(0, ids.shape[0] - 1, CHUNK):
        e = min(s + CHUNK, ids.shape[0] - 1)
        logp = model.verifier_lm_head(model.verifier_norm(h[s:e])).float().log_softmax(-1)
        u[s + 1:e + 1] = 1.0 - logp.gather(1, ids[s + 1:e + 1, None])[:, 0].exp()
    return u


class AnchorBias:
    """The forward pre-hook (register_forward_pre_hook(..., with_kwargs=True)) and the biased draw."""

    def __init__(self, bias: float):
        self.bias = float(bias)
        self.unsure: torch.Tensor | None = None
        self.steps = 0  # training steps drawn with the bias (the box record)
        self.original = None

    def __call__(self, module, args, kwargs):
        last = kwargs.get("verifier_last_hidden_states")
        if not module.training or last is None or last.shape[-1] == 0:
            self.unsure = None
            return args, kwargs
        self.unsure = target_unsure(module, last, kwargs["input_ids"])
        return args, kwargs

    def select(self, loss_mask: torch.Tensor, num_anchors: int, block_size: int):
        """speculators' select_anchors (same arguments and results: anchors [num_anchors] sorted, valid flags),
        drawn with the bias when this step set u."""
        u, self.unsure = self.unsure, None  # one draw per step's u: a second call falls back
        if u is None:
            return self.original(loss_mask, num_anchors, block_size)
        valid = loss_mask.bool().clone()
        valid[:, -block_size:] = False
        idx = torch.nonzero(valid[0], as_tuple=False)[:, 0]
        anchors = torch.zeros(num_anchors, dtype=torch.long, device=loss_mask.device)
        flags = torch.zeros(num_anchors, dtype=torch.bool, device=loss_mask.device)
        k = min(num_anchors, idx.numel())
        if k:
            w = u.to(idx.device)[idx]
            p = (1.0 - self.bias) / idx.numel() + self.bias * w / w.sum().clamp_min(1e-12)
            pick = torch.multinomial(p, k, replacement=False)
            anchors[:k] = torch.sort(idx[pick]).values
            flags[:k] = True
            self.steps += 1
        return anchors, flags

    def record(self) -> dict:
        return {"bias": self.bias, "biased_steps": self.steps}


@contextlib.contextmanager
def installed(bias: AnchorBias | None):
    """speculators' dflash module draws through `bias` inside the block (nothing changes for None)."""
    if bias is None:
        yield
        return
    from speculators.models.dflash import core
    bias.original = core.select_anchors
    core.select_anchors = bias.select
    try:
        yield
    finally:
        core.select_anchors = bias.original
        bias.unsure = None
