"""The Markov-head baseline (DeepSpec): a low-rank bigram correction applied sequentially over the block.

For slot k = 1..B-1, with prev_1 = the anchor and prev_k = the token just chosen for slot k-1:
    vanilla  bias_k = w2(w1[prev_k])
    gated    bias_k = w2(sigmoid(gate([h_k ; w1[prev_k]])) * w1[prev_k])
    rnn      [g ; c ; o] = cell([s_{k-1} ; w1[prev_k] ; h_k]),  s_0 = 0
             s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c),   bias_k = w2(tanh(o))
    corrected_k = base_k + bias_k,   token_k = select(corrected_k)

Parameter names: `w1.weight` [V, r] and `w2.weight` [V, r] (the training names for all variants); gated adds
`gate.weight` [r, H + r] and `gate.bias` [r]; rnn adds `cell.weight` [3r, 2r + H] and `cell.bias` [3r], whose
output rows are [g ; c ; o] in that order.

h_k is the drafter's hidden row k, the row whose lm_head gives base_k: the row that predicts slot k. That is the
conditioning DeepSpec trains with (its hidden row and the Markov step address the same predicted position), and it
is the same per-slot row xPress reads through down_h. Row 0 (the anchor slot) is never used.
"""
from __future__ import annotations

import torch
from torch import nn

from core.protocols import Proposal, RefineContext
from core.ops import Ops, TorchOps

VARIANTS = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, variant: str, vocab: int, rank: int, hidden: int | None = None):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown Markov head variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        if variant != "vanilla" and not hidden:
            raise ValueError(f"the {variant} Markov head needs the drafter hidden size")
        self.variant = variant
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Linear(rank, vocab, bias=False)
        if variant == "gated":
            self.gate = nn.Linear(hidden + rank, rank)
        elif variant == "rnn":
            self.cell = nn.Linear(2 * rank + hidden, 3 * rank)

    vocab = property(lambda self: self.w1.num_embeddings)
    rank = property(lambda self: self.w1.embedding_dim)
    reads_hidden = property(lambda self: self.variant != "vanilla")

    def initial_state(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.rank, dtype=self.w1.weight.dtype, device=like.device)

    def latent(self, prev: torch.Tensor, h: torch.Tensor | None, state: torch.Tensor):
        """prev: 0-d token, h: [H] hidden row of the predicted slot, state: [r] -> (w2's input [r], next state)."""
        e = self.w1(prev)
        if self.variant == "vanilla":
            return e, state
        if self.variant == "gated":
            return torch.sigmoid(self.gate(torch.cat((h, e)))) * e, state
        g, c, o = self.cell(torch.cat((state, e, h))).chunk(3)
        keep = torch.sigmoid(g)
        state = keep * state + (1 - keep) * torch.tanh(c)
        return torch.tanh(o), state

    def step(self, prev: torch.Tensor, h: torch.Tensor | None, state: torch.Tensor):
        """As `latent`, through w2: (bias [V], next state)."""
        z, state = self.latent(prev, h, state)
        return self.w2(z), state


class MarkovRefiner:
    """Sequential over the B-1 draft slots starting from prev = anchor; K does not apply (passes = 0).

    q is the stack of each step's corrected logits, the distribution its token was chosen from.
    """
    name = "markov"
    passes = 0
    # --compile-all leaves this refinement uncompiled (--compile-refiner still compiles it); why: results/perf/NOTES.md
    compile_helps = False

    def __init__(self, head: MarkovHead, low_precision_sampling: bool = False, ops: Ops | None = None):
        self.head = head
        # --compat-reference: DeepSpec samples from a softmax in the logits' dtype (bf16), not fp32
        self.low_precision_sampling = low_precision_sampling
        self.ops = ops or TorchOps()

    @torch.no_grad()
    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        """Each step's latent is `ops.markov_latent` (the Triton ops: one launch for the gated head), its bias, the
        base add and (greedy) the argmax one `ops.linear` over w2."""
        head = self.head
        base = proposal.logits
        rows = proposal.hidden[1:].to(head.w2.weight.dtype) if head.reads_hidden else None
        prev = ctx.anchor.reshape(()).long()
        state = head.initial_state(base)
        greedy = ctx.sampler is None
        tokens, q = [], []
        for k in range(base.shape[0]):
            z, state = self.ops.markov_latent(head, prev, None if rows is None else rows[k], state)
            out = self.ops.linear(z.view(1, -1), head.w2.weight, residual=base[k].view(1, -1), argmax=greedy)
            if greedy:
                corrected, prev = out[0].view(-1), out[1].view(())
            else:
                corrected = out.view(-1)
                prev = ctx.sampler.select(corrected, slot=k, low_precision=self.low_precision_sampling)
            tokens.append(prev)
            q.append(corrected)
        return proposal.with_tokens(torch.stack(tokens), torch.stack(q))


@torch.no_grad()
def random_markov_head(variant: str, vocab: int, hidden: int, rank: int, seed: int, std: float = 0.02) -> MarkovHead:
    head = MarkovHead(variant, vocab, rank, hidden)
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * std)
    return head


def markov_head_from_state(state: dict[str, torch.Tensor], variant: str = "vanilla", device=None,
                           dtype=None) -> MarkovHead:
    """A head from training-named tensors (`w1.weight`, `w2.weight`, plus `gate.*` / `cell.*`), shapes read off."""
    vocab, rank = state["w1.weight"].shape
    extra = {"gated": ("gate.weight", rank), "rnn": ("cell.weight", 2 * rank)}.get(variant)
    hidden = state[extra[0]].shape[1] - extra[1] if extra and extra[0] in state else None
    head = MarkovHead(variant, vocab, rank, hidden)
    head.load_state_dict(state)
    return head.to(device=device, dtype=dtype).eval()
