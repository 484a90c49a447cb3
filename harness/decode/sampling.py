"""Sampling primitives that need no host sync (and so can later live inside a CUDA graph).

Temperature, then top-k, then top-p, as usual. The same filtering is applied wherever a distribution is used:
to sample the target, to draw drafts, and to build p and q for rejection verification, so that verification
stays exact for the filtered target distribution.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy, as in the reference


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0        # 0 = off
    top_p: float = 1.0    # 1 = off

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits / T with -inf outside the top-k set and outside the smallest top-p nucleus."""
    z = logits.float() / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = z.topk(params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        cum = sorted_z.softmax(-1).cumsum(-1)
        # keep a token if the mass strictly before it is < top_p (so the top token is always kept)
        drop_sorted = (cum - sorted_z.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return filtered_logits(logits, params).softmax(-1)


def sample_from(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A draw per row proportional to non-negative `weights`: argmax(w / E), E ~ Exponential(1) i.i.d.

    An exact categorical sample that, unlike torch.multinomial, never waits on the device.
    """
    e = torch.empty_like(weights).exponential_(generator=generator)
    return (weights / e).argmax(-1)


def sample_rows(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits` [..., V]: argmax when greedy, else a draw from the filtered distribution."""
    if params.greedy:
        return logits.argmax(-1)
    return sample_from(probabilities(logits, params), generator)


SAMPLERS = ("auto", "sort", "threshold")
DEFAULT_SAMPLER = "auto"  # the batched engine's (and so the responses stage's): threshold where it runs compiled


def pick_sampler(choice: str, device) -> str:
    """How a batch of rows is cut to its top-p nucleus. `sort`: filtered_logits, a full sort of every row (the
    reference). `threshold`: core.kernels.topp, a search over each row's float bit patterns in one Triton launch,
    no sort (ties at the cut kept together); it runs on CUDA, or on the CPU under Triton's interpreter (the tests).
    `auto` (the default): threshold on a CUDA device where Triton is installed, sort elsewhere. On an H200 the responses engine's sampled
    rate was 74.6k tokens/s with threshold (then a bisection: 31 passes over each row) against 49.4k with the sort,
    same prompts and card (results/perf/gpu_check_h200_quick/). Returns the cut that runs, never `auto`."""
    if choice not in SAMPLERS:
        raise ValueError(f"sampler {choice!r} is not one of {', '.join(SAMPLERS)}")
    cuda = torch.device(device).type == "cuda"
    if choice == "sort" or (choice == "auto" and not cuda):
        return "sort"  # the kernels are not imported for the sort: the CPU main job runs without Triton
    from core import kernels
    if choice == "auto":
        return "threshold" if kernels.available() else "sort"
    if choice == "threshold":
        if not kernels.available():
            raise ValueError("sampler 'threshold' needs the triton package (pip install triton), or use sort")
        if not cuda and not kernels.interpreted():
            raise ValueError("sampler 'threshold' runs on a CUDA device (or under TRITON_INTERPRET=1); use sort")
    return choice


def sample_rows_cut(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """sample_rows for [rows, V] logits with the top-p cut found by core.kernels.topp instead of a sort (top-k set:
    sample_rows itself). The draw is the same exponential race over the kept tokens' probabilities, from the same
    generator stream: with the same kept set the token is sample_rows', to rounding of the weights."""
    if params.greedy or params.top_k or logits.dim() != 2:
        return sample_rows(logits, params, generator)
    p = probabilities(logits, dataclasses.replace(params, top_p=1.0))  # the temperature's softmax, uncut
    if params.top_p < 1.0:
        from core.kernels.topp import threshold
        p = torch.where(p >= threshold(p, params.top_p)[:, None], p, 0.0)
    return sample_from(p, generator)


NOISE_KINDS = ("gumbel", "uniform")


class DraftSampler:
    """Draws drafts at the draft temperature with noise frozen for a whole block.

    One noise draw per block is shared by the drafter's seed and every refinement pass, so a draft token is a
    deterministic function of (its logits, its slot's noise): a settled prefix stays settled, and the final token
    of each slot is an exact sample from the distribution of the logits it was last chosen from (honest q).
    gumbel: argmax(z + G) with one Gumbel vector per slot (the reference). uniform: inverse CDF with one uniform
    per slot (V times fewer random numbers; same distribution, different realisations).
    """

    @classmethod
    def kept_in(cls, store: dict, params: SamplingParams, noise: str, slots: int, vocab: int,
                device: torch.device) -> "DraftSampler":
        """One sampler (one noise buffer) per configuration in `store`, reused across generations: a captured CUDA
        graph reads the buffer by address, so it lives as long as its owner (the target's `samplers`, beside
        the step graphs that read it), not one prompt."""
        key = (params, noise, slots, vocab, str(device))
        if key not in store:
            store[key] = cls(params, noise, slots, vocab, device)
        return store[key]

    def __init__(self, params: SamplingParams, noise: str, slots: int, vocab: int, device: torch.device):
        if noise not in NOISE_KINDS:
            raise ValueError(f"draft noise {noise!r}: use one of {', '.join(NOISE_KINDS)}")
        self.params, self.noise = params, noise
        shape = (slots, vocab) if noise == "gumbel" else (slots,)
        self.frozen = torch.zeros(shape, dtype=torch.float32, device=device)

    def new_block(self, generator: torch.Generator | None) -> None:
        if self.noise == "gumbel":
            u = torch.rand(self.frozen.shape, generator=generator, device=self.frozen.device)
            # two clamps, each before its negation, so neither log sees 0 (the reference's construction)
            self.frozen.copy_(-torch.log(torch.clamp(-torch.log(torch.clamp(u, min=1e-20)), min=1e-20)))
        else:
            self.frozen.uniform_(generator=generator)

    def select(self, scores: torch.Tensor, ids: torch.Tensor | None = None, slot: int | None = None,
               low_precision: bool = False) -> torch.Tensor:
        """Tokens for all slots (scores [S, n]) or for one slot (scores [n], slot index). `ids` maps columns of a
        shortlist to token ids (None: column i is token i).

        `low_precision` draws from a softmax computed in the scores' own dtype (bf16 in bf16 runs), as DeepSpec's
        Markov sampler does; q stays the fp32 softmax, so this reproduces the reference's small mismatch
        (--compat-reference only)."""
        noise = self.frozen if slot is None else self.frozen[slot]
        z = filtered_logits(scores, self.params)
        if low_precision:
            lowp = (scores / self.params.temperature).softmax(-1).float().log()
            z = torch.where(torch.isinf(z), z, lowp)
        if self.noise == "gumbel":
            g = noise if ids is None else noise.gather(-1, ids)
            pick = (z + g).argmax(-1)
        else:
            cdf = z.softmax(-1).cumsum(-1)
            u = noise.unsqueeze(-1) * cdf[..., -1:]
            pick = torch.searchsorted(cdf, u.contiguous(), right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
        return pick if ids is None else ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)

    def q(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the drafts were drawn from, given the logits they were last chosen from."""
        return probabilities(logits, self.params)
