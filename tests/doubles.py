"""Test doubles for the Drafter protocol."""
from __future__ import annotations

import torch

from core.protocols import Proposal


class ScriptedDrafter:
    """Proposes the target's own continuation (read from a reference sequence), so whole blocks are accepted.

    `wrong_at` optionally lists, call by call, the first draft slot to corrupt (None = leave all correct), which
    scripts the accepted count of each step exactly.
    """

    def __init__(self, reference: list[int], block_size: int, vocab: int, wrong_at=None, hidden: int = 8):
        self.ref = torch.tensor(reference + [0] * (block_size + 1), dtype=torch.long)
        self.block_size, self.vocab, self.hidden = block_size, vocab, hidden
        self.target_layer_ids = ()
        self.mask_token_id = vocab - 1
        self.wrong_at = list(wrong_at or [])
        self.calls = 0
        self.ctx = torch.zeros((), dtype=torch.long)

    def ensure_capacity(self, n):
        pass

    def begin(self, features):
        self.ctx.fill_(0 if features is None else features.shape[0])

    def observe(self, features, count):
        self.ctx.add_(count)

    def propose(self, anchor, position, length):
        dev = position.device if isinstance(position, torch.Tensor) else self.ref.device
        if self.ref.device != dev:  # a CUDA decode: the script moves to the decode's device once
            self.ref, self.ctx = self.ref.to(dev), self.ctx.to(dev)
        idx = position + 1 + torch.arange(self.block_size - 1, device=dev)
        tokens = self.ref.index_select(0, idx).clone()
        if self.calls < len(self.wrong_at) and self.wrong_at[self.calls] is not None:
            j = self.wrong_at[self.calls]
            tokens[j] = (tokens[j] + 1) % (self.vocab - 1)
        self.calls += 1
        logits = torch.nn.functional.one_hot(tokens, self.vocab).float() * 10
        return Proposal(tokens=tokens, logits=logits, hidden=torch.zeros(self.block_size, self.hidden, device=dev))
