"""`models.NAME.anchor_bias` (dflash drafters): training anchors drawn toward the tokens the target was unsure of.

speculators 0.9.0 draws a drafter's anchors uniformly, without replacement, over the positions its loss mask keeps
(`speculators.models.dflash.utils.select_anchors`, which `DFlashDraftModel._build_attention_mask` calls through the
name `select_anchors` in `speculators.models.dflash.core`). A greedy decode does not visit anchors uniformly: after
its first, each anchor is the token right after a draft the drafter got wrong (training/anchor_runs.py), and there
the drafter accepts less at every slot. The decode's anchors are more often tokens the target itself was unsure of:
a low target probability of the anchor token picks them out with AUC 0.69-0.72 on SmolLM2's greedy text
(results/perf/anchor_runs/).

With bias b in (0, 1], a training step's anchors are drawn with torch.multinomial, without replacement, from

    (1 - b) / N  +  b * u_i / sum(u),    u_i = 1 - max_v P_target(v | the tokens before i),

over the N positions speculators would draw from (the loss-masked ones, less the row's last block): b = 0 would be
the uniform draw, b = 1 draws by u alone. u is the target's uncertainty at i, not its surprise at the token there:
on greedy rows the two are equal (the token is the target's top choice), and on sampled rows (responses.sampled) a
token the target would not have chosen is not weighted for that. The weights hold for each successive draw; the
chance that a position is among the k drawn is flattened toward uniform as k/N grows (speculators draws up to
max_anchors per row). How far the bias moves the draw, computed on the shipped drafter's anchor_runs file (16 greedy
gsm8k texts, one draw's probabilities per text, averaged; about the draw, not about training): the share of a draw
that lands on the decode's anchors after the first goes from 0.35 (uniform) to 0.41 at b = 0.5 and 0.46 at b = 1.
A modest shift: an A/B at b = 0.5 may show nothing even where the idea holds; b = 1 is the stronger test.

P_target comes from the verifier's last hidden states that the step already carries (the online target's, or the
offline files'), through the drafter's own copies of the verifier's norm and lm_head (how speculators computes its
KL targets), in chunks of rows. Validation steps (the model in eval mode) keep speculators' uniform draw, so
validation losses and `eal` stay comparable between recipes. b = 0 (the default) replaces nothing.

How it hooks in, without forking speculators: a forward pre-hook computes u for the step (after the online taps'
hook), and while the model trains (`installed`) the name `select_anchors` in speculators' dflash module points at
this draw, which falls back to speculators' own when no step's u is set. The name is restored afterwards, so the
heads trained next in the same process draw uniformly. `train.compile=model` (the whole forward traced by
torch.compile) is refused with it: not tested together.
"""
from __future__ import annotations

import contextlib

import torch

CHUNK = 2048  # rows of verifier logits at a time: with a 49K vocabulary about 1 GB of transient buffers


@torch.no_grad()
def target_unsure(model, last_hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """u [T] for one packed row: u[i] = 1 - max_v P_target(v | before i), from the verifier's last hidden states
    [1, T, H] (before its final norm) through the model's verifier_norm and verifier_lm_head; u[0] = 0 (no position
    precedes it). Sequences packed in a row: position 0 of each is a prompt token, never an anchor."""
    h = last_hidden[0]
    n = input_ids.shape[-1]
    u = torch.zeros(n, dtype=torch.float32, device=h.device)
    for s in range(0, n - 1, CHUNK):
        e = min(s + CHUNK, n - 1)
        z = model.verifier_lm_head(model.verifier_norm(h[s:e])).float()
        top, at = z.max(-1)
        others = z.scatter_(-1, at[:, None], float("-inf")).logsumexp(-1)  # every token but the top one
        # 1 - p_top = the others' mass = sigmoid(lse(others) - top): exact however certain the target is, where
        # 1 - exp(log p_top) rounds to 0 and would leave such positions no weight at all
        u[s + 1:e + 1] = torch.sigmoid(others - top)
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
            w = torch.nan_to_num(u.to(idx.device)[idx], nan=0.0)  # a NaN would be a device assert in multinomial
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
