"""xPress: a causal low-rank head that adds a logit bias to the drafter's block, resolved by K Jacobi passes.

One pass, for the block's B slots (slot 0 = the anchor), with g the mean of the B drafter hidden rows:
    x_k = in_proj [down_h(h_k) ; down_g(g) ; w1(prev_k)]          prev = [tok_am1, anchor, t_1 .. t_{B-2}]
    y   = x + (L ⊙ tril) x   per channel (raw form)   or   y = M x with M = L ⊙ tril + I (folded form)
    z   = y + down(silu(gate(y)) * up(y));   refined_k = base_k + w2(z_k)   for k = 1..B-1
refined_k depends on prev_0..prev_k only, so after p passes slots 1..p equal a strict left-to-right decode.
Everything that does not depend on the tokens (g and the hidden half of in_proj) is computed once per block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.protocols import Proposal, RefineContext
from core.ops import Ops, TorchOps

MAX_TOPC = 1024


class CausalMixer(nn.Module):
    """Per-channel causal mixing across the block. `L[c, k, j]` weighs input slot j into output slot k, channel c.

    The state-dict key is `L` for the raw (training) mixer and `M` once folded, so a folded matrix can never be
    loaded where a raw one is expected and folded a second time. `tril` may be present in a state dict or not.
    """

    def __init__(self, rank: int, block: int, folded: bool = False):
        super().__init__()
        self.L = nn.Parameter(torch.zeros(rank, block, block))
        self.register_buffer("tril", torch.ones(block, block).tril(), persistent=False)
        self.folded = folded

    @torch.no_grad()
    def fold(self) -> None:
        """L <- L ⊙ tril + I in the parameter's current dtype (cast first, then fold, as the reference does)."""
        if self.folded:
            raise RuntimeError("the xPress mixer is already folded; folding again would add the identity twice")
        eye = torch.eye(self.L.shape[-1], dtype=self.L.dtype, device=self.L.device)
        self.L.mul_(self.tril.to(self.L.dtype)).add_(eye)
        self.folded = True

    @torch.no_grad()
    def load_serving(self, m: torch.Tensor) -> None:
        """Install an already folded matrix (M = L ⊙ tril + I, e.g. vLLM's `mix_L`) without folding it again."""
        if m.shape != self.L.shape:
            raise ValueError(f"folded mixer has shape {tuple(m.shape)}, expected {tuple(self.L.shape)}")
        self.L.copy_(m)
        self.folded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, r] -> y [B, r]."""
        coeff = self.L if self.folded else self.L * self.tril.to(self.L.dtype)
        mixed = torch.bmm(coeff, x.t().unsqueeze(-1)).squeeze(-1).t()
        return mixed if self.folded else x + mixed

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.folded:
            destination[prefix + "M"] = destination.pop(prefix + "L")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        tril = state_dict.pop(prefix + "tril", None)  # load_state_dict hands each module its own copy
        if tril is not None and tril.shape != self.tril.shape:
            error_msgs.append(f"{prefix}tril has shape {tuple(tril.shape)}, expected {tuple(self.tril.shape)} "
                              "(the head's block size differs from the checkpoint's)")
        raw, folded = prefix + "L", prefix + "M"
        if self.folded and raw in state_dict:
            error_msgs.append(f"{raw} is a raw mixer but this head is folded; load it into an unfolded head "
                              "and call fold()")
            state_dict.pop(raw)
        elif not self.folded and folded in state_dict:
            error_msgs.append(f"{folded} is an already folded mixer; build the head with folded=True to load it")
            state_dict.pop(folded)
        elif self.folded and folded in state_dict:
            state_dict[raw] = state_dict.pop(folded)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class SwiGLU(nn.Module):
    def __init__(self, rank: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(rank, hidden, bias=False)
        self.up_proj = nn.Linear(rank, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, rank, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class XPressHead(nn.Module):
    """The refiner head with the training-side parameter names (`w1.weight`, ..., `mix.L`, ..., `w2.weight`).

    Fresh parameters follow the training init (normal(0, 0.02), L = 0: a head that changes nothing much).
    `folded=True` builds a head whose mixer already holds M = L ⊙ tril + I (state-dict key `mix.M`).
    """

    def __init__(self, vocab: int, hidden: int, rank: int, block: int, mlp_hidden: int | None = None,
                 folded: bool = False):
        super().__init__()
        if min(vocab, hidden, rank, block) <= 0 or block < 2:
            raise ValueError(f"bad xPress head geometry: vocab={vocab} hidden={hidden} rank={rank} block={block}")
        self.w1 = nn.Embedding(vocab, rank)
        self.down_h = nn.Linear(hidden, rank, bias=False)
        self.down_g = nn.Linear(hidden, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix = CausalMixer(rank, block, folded)
        self.mlp = SwiGLU(rank, mlp_hidden or 2 * rank)
        self.w2 = nn.Linear(rank, vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name != "mix.L":
                    p.normal_(0.0, 0.02)
            if folded:
                self.mix.L.copy_(torch.eye(block).expand(rank, block, block))

    vocab = property(lambda self: self.w1.num_embeddings)
    rank = property(lambda self: self.w1.embedding_dim)
    block = property(lambda self: self.mix.L.shape[-1])
    hidden_size = property(lambda self: self.down_h.in_features)
    folded = property(lambda self: self.mix.folded)
    w_tok = property(lambda self: self.in_proj.weight[:, 2 * self.rank:])  # in_proj's token half, [r, r]

    def fold(self) -> "XPressHead":
        self.mix.fold()
        return self

    def load_serving_mixer(self, m: torch.Tensor) -> "XPressHead":
        self.mix.load_serving(m)
        return self

    # --- the pass-invariant half, once per block -----------------------------------------------------------------
    def block_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> in_proj's hidden half applied to [down_h(h_k) ; down_g(g)], [B, r]."""
        r = self.rank
        g = self.down_g(hidden.mean(0, keepdim=True)).expand(hidden.shape[0], r)
        return F.linear(torch.cat((self.down_h(hidden), g), -1), self.in_proj.weight[:, : 2 * r])

    # --- per pass --------------------------------------------------------------------------------------------------
    def token_input(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [B] -> in_proj's token half applied to w1(prev), [B, r]: what a pass adds to the block cache."""
        return F.linear(self.w1(prev), self.w_tok)

    def latent(self, cache: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """cache [B, r], prev [B] -> z [B-1, r] for the draft slots 1..B-1 (slot 0 is never read out)."""
        x = cache + self.token_input(prev)
        y = self.mix(x)[1:]
        return y + self.mlp(y)

    def forward(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The training-form pass, nothing hoisted: hidden [B, H], prev [B] -> bias [B, V] (slot 0 included)."""
        g = hidden.mean(0, keepdim=True).expand_as(hidden)
        x = self.in_proj(torch.cat((self.down_h(hidden), self.down_g(g), self.w1(prev)), -1))
        y = self.mix(x)
        return self.w2(y + self.mlp(y))


def validate_topc(topc: int, vocab: int) -> int:
    limit = min(MAX_TOPC, vocab)
    if isinstance(topc, bool) or not isinstance(topc, int) or not (topc == 0 or 1 <= topc <= limit):
        raise ValueError(f"xPress top-C must be 0 (full vocabulary) or an integer in 1..{limit}, got {topc!r}")
    return topc


def validate_passes(passes: int) -> int:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 0:
        raise ValueError(f"xPress passes K must be an integer >= 0, got {passes!r}")
    return passes


def shortlist(base: torch.Tensor, c: int) -> torch.Tensor:
    """The C largest logits of each row, ties broken toward the lowest token id; [n, V] -> ids [n, C] ascending.

    topk alone leaves membership among values equal to the C-th largest unspecified, so the boundary is settled
    explicitly: everything above it, then the lowest ids equal to it. Fixed shapes, no host sync.
    """
    v = base.shape[-1]
    kth = base.topk(c, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = base > kth
    at = base == kth
    room = c - above.sum(-1, keepdim=True)
    take = above | (at & (at.cumsum(-1) <= room))
    key = torch.where(take, v - torch.arange(v, device=base.device), 0)  # distinct positive keys on the chosen
    return v - key.topk(c, dim=-1).values


def argmax_select(scores: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Pick per row; `ids` maps columns to token ids (None: column i is token i). First index wins ties."""
    pick = scores.argmax(-1)
    return pick if ids is None else ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


class _Block:
    """What no pass changes in one block (hidden cache, shortlist, gathered w2 rows), and the per-pass scoring.

    The latent is `ops.xpress_latent` (the Triton ops: one launch). Full-vocabulary scoring is one `ops.linear`:
    w2, the base add and (greedy) the argmax, which the Triton ops run as one matmul launch with the add and a
    per-tile argmax in its epilogue plus one small reduction."""

    def __init__(self, head: XPressHead, hidden: torch.Tensor, base: torch.Tensor, topc: int, ops: Ops):
        dt = head.w2.weight.dtype
        self.head, self.base, self.ops = head, base, ops
        self.cache = head.block_cache(hidden.to(dt))
        self.ids = None
        if topc:
            self.ids = shortlist(base, topc)                                   # [B-1, C]
            self.base_c = base.gather(-1, self.ids)
            self.w2_c = head.w2.weight.index_select(0, self.ids.flatten()).view(*self.ids.shape, -1)  # [B-1, C, r]

    def scores(self, prev: torch.Tensor, greedy: bool = False):
        """Refined logits of slots 1..B-1: [B-1, V], or [B-1, C] over the shortlist; greedy: (tokens, logits)."""
        z = self.ops.xpress_latent(self.head, self.cache, prev)
        if self.ids is None:
            out = self.ops.linear(z, self.head.w2.weight, residual=self.base, argmax=greedy)
            if not greedy:
                return out
            logits, tokens = out  # ops.linear with argmax gives (logits, tokens)
            return tokens, logits
        bias = torch.bmm(self.w2_c, z.unsqueeze(-1)).squeeze(-1)
        scores = torch.add(self.base_c, bias).to(self.base.dtype)
        return (argmax_select(scores, self.ids), scores) if greedy else scores

    def full(self, scores: torch.Tensor) -> torch.Tensor:
        """The proposal distribution over the whole vocabulary (-inf off the shortlist)."""
        if self.ids is None:
            return scores
        return torch.full_like(self.base, float("-inf")).scatter(-1, self.ids, scores)


def check_geometry(head: XPressHead, proposal: Proposal) -> None:
    """Shapes only (host ints, no sync): a head trained for another block, vocabulary or drafter fails clearly."""
    b, h = proposal.hidden.shape
    if (b, h, proposal.logits.shape[-1]) != (head.block, head.hidden_size, head.vocab):
        raise ValueError(f"xPress head expects block {head.block}, hidden {head.hidden_size}, vocab {head.vocab}; "
                         f"the drafter gives block {b}, hidden {h}, vocab {proposal.logits.shape[-1]}; load the "
                         "head trained with this drafter, at its block size")


def _lead(anchor: torch.Tensor, tok_am1: torch.Tensor) -> torch.Tensor:
    return torch.stack((tok_am1.reshape(()), anchor.reshape(()))).long()


class XPressRefiner:
    """K parallel Jacobi passes of the xPress head over the drafter's block (K = 0: the drafter's own seed).

    `prev_anchor=True` feeds the anchor itself as slot 0's predecessor (vLLM's convention) instead of the true
    token before it (the HF harness and training). `topc` > 0 restricts every pass to the C best base tokens per
    slot, fixed once per block; q is then -inf off the shortlist.
    """
    name = "xpress"

    def __init__(self, head: XPressHead, passes: int, prev_anchor: bool = False, topc: int = 0,
                 ops: Ops | None = None):
        self.head = head
        self.passes = validate_passes(passes)
        self.prev_anchor = prev_anchor
        self.topc = validate_topc(topc, head.vocab)
        self.ops = ops or TorchOps()

    @torch.no_grad()
    def refine(self, proposal: Proposal, ctx: RefineContext) -> Proposal:
        if self.passes == 0:
            return proposal
        check_geometry(self.head, proposal)
        blk = _Block(self.head, proposal.hidden, proposal.logits, self.topc, self.ops)
        lead = _lead(ctx.anchor, ctx.anchor if self.prev_anchor else ctx.prev_token)
        tokens = proposal.tokens
        for _ in range(self.passes):
            prev = torch.cat((lead, tokens[:-1]))
            if ctx.sampler is None:  # greedy: one frozen-noise-free pick per slot
                tokens, scores = blk.scores(prev, greedy=True)
            else:  # one noise tensor shared by every pass
                scores = blk.scores(prev)
                tokens = ctx.sampler.select(scores, blk.ids)
        return proposal.with_tokens(tokens, blk.full(scores))


@torch.no_grad()
def sequential_decode(head: XPressHead, hidden: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor,
                      tok_am1: torch.Tensor, topc: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict left-to-right decode with the same head: slot k is chosen once slots < k are final.

    The reference semantics of the Jacobi rollout. Slots not yet decided hold placeholder zeros, which causality
    makes irrelevant. Returns tokens [B-1] and each slot's refined logits at the time it was chosen [B-1, V].
    """
    blk = _Block(head, hidden, base, validate_topc(topc, head.vocab), TorchOps())
    lead = _lead(anchor, tok_am1)
    n = base.shape[0]
    tokens = torch.zeros(n, dtype=torch.long, device=base.device)
    rows = []
    for k in range(n):
        scores = blk.scores(torch.cat((lead, tokens[:-1])))
        pick = argmax_select(scores, blk.ids)
        tokens = torch.cat((tokens[:k], pick[k:k + 1], tokens[k + 1:]))
        rows.append(blk.full(scores)[k])
    return tokens, torch.stack(rows)


@torch.no_grad()
def random_xpress_head(vocab: int, hidden: int, rank: int, block: int, seed: int, mlp_hidden: int | None = None,
                       std: float = 0.02, mix_std: float = 0.1) -> XPressHead:
    """Random weights for tests and timing (values do not change the cost). L is non-zero so the mixer matters."""
    head = XPressHead(vocab, hidden, rank, block, mlp_hidden)
    g = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        p.copy_(torch.randn(p.shape, generator=g) * (mix_std if name == "mix.L" else std))
    return head


def xpress_head_from_state(state: dict[str, torch.Tensor], mixer: str = "raw", device=None, dtype=None,
                           fold: bool = True) -> XPressHead:
    """A head from training-named tensors (e.g. `RefinerCheckpoint.head_state`), geometry read off the shapes.

    `mixer="folded"` means `state["mix.L"]` already holds L ⊙ tril + I (vLLM's `mix_L`): it is installed as is.
    A raw mixer is folded after the cast to `dtype`, the reference's order (fold=False keeps it raw).
    """
    if mixer not in ("raw", "folded"):
        raise ValueError(f"mixer must be 'raw' or 'folded', got {mixer!r}")
    vocab, rank = state["w1.weight"].shape
    head = XPressHead(vocab, state["down_h.weight"].shape[1], rank, state["mix.L"].shape[-1],
                      state["mlp.gate_proj.weight"].shape[0], folded=mixer == "folded")
    sd = dict(state)
    if mixer == "folded":
        sd["mix.M"] = sd.pop("mix.L")
    head.load_state_dict(sd)
    head.to(device=device, dtype=dtype)
    if mixer == "raw" and fold:
        head.fold()
    return head.eval()
