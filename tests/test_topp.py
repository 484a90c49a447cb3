"""core.kernels.topp: the top-p cut by bisection keeps exactly the reference's nucleus (harness.decode.sampling's
sort) on rows without ties, keeps a tie at the cut whole, always keeps the top token, and its threshold is the least
float whose mass above is under top_p; sample_rows_cut draws sample_rows' tokens from the same generator stream;
the batched engine's `threshold` sampler answers as its `sort` one. Triton's CPU interpreter here, compiled on a
GPU.

Power: a cut off by one token (the last kept token dropped, or the first dropped one kept) changes the keep mask
on every row whose nucleus is not the whole vocabulary, which the mask equality catches on each of 6 rows at
three top_p (nuclei of 1 to 4,679 of 5,000 tokens; asserted below: a 1-token and a >100-token nucleus; one such row
suffices); a threshold found on the wrong side of a tie keeps two, not all four, tied tokens. Rows are few: the
interpreter runs a row's program pass by pass in Python (~14 ms a pass and tile), so 24 rows took ~25 s a case
(12 rows before: the nuclei at 6 span 1, 3, 35 to 494 and 1,735 to 4,679 tokens, every tile count and size class
the 12 did)."""
import pytest
import torch

from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from core.errors import UsageError
from core.kernels.topp import START, passes, threshold
from harness.decode.sampling import (DEFAULT_SAMPLER, SamplingParams, filtered_logits, pick_sampler, sample_rows,
                                     sample_rows_cut)


def _rows(n=12, vocab=1000, seed=0):
    """Logits from peaked to flat: the nucleus from one token to most of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(1, -1.5, n)[:, None]
    return (torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale * 4).float().to(DEV)


def _mass_above(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.where(p > x[:, None], p, 0).sum(-1)


@pytest.mark.parametrize("probes", [1, 4, 16, 32])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_the_cut_is_the_sorts_nucleus(top_p, probes):
    logits = _rows(n=6, vocab=5000)  # several tiles at every probe count (a tile is 512 to 4,096 tokens)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    want = torch.isfinite(filtered_logits(logits, params))
    p = logits.softmax(-1)
    t = threshold(p, top_p, probes=probes)
    got = p >= t[:, None]
    assert torch.equal(got, want)
    sizes = want.sum(-1)
    assert sizes.min() == 1 and sizes.max() > 100  # peaked and flat rows both
    # t is exact: the least float whose mass above is under top_p
    p64 = p.double()
    assert (_mass_above(p64, t.double()) < top_p).all()
    below = torch.nextafter(t, torch.zeros_like(t)).double()
    assert (_mass_above(p64, below) >= top_p).all()


@pytest.mark.parametrize("probes", [1, 16])
def test_a_tie_at_the_cut_is_kept_whole_and_the_top_token_always(probes):
    p = torch.tensor([[0.4, 0.2, 0.2, 0.2] + [0.0] * 4,
                      [1.0] + [0.0] * 7,
                      [0.3, 0.3, 0.2, 0.2] + [0.0] * 4], device=DEV)
    keep = p >= threshold(p, 0.5, probes=probes)[:, None]
    assert keep[0, :4].all() and not keep[0, 4:].any()   # the sort would keep two of the three 0.2s
    assert keep[1].tolist() == [True] + [False] * 7
    assert keep[2].tolist() == [True, True] + [False] * 6
    assert (p >= threshold(p, 1e-6, probes=probes)[:, None]).sum(-1).tolist() == [1, 1, 2]


@pytest.mark.parametrize("probes", [1, 16])
def test_a_row_whose_mass_is_under_top_p_keeps_every_token(probes):
    """fp32 rounding can leave a row's mass under top_p (top_p within an ulp of 1): the reference keeps the whole
    row there; the bisection's last halving once probed -1, NaN's pattern, and returned t = NaN, which kept
    nothing, so every draw was token 0."""
    p = torch.tensor([[0.2, 0.1, 0.1, 0.0], [0.25] * 4], device=DEV)
    t = threshold(p, 0.9, probes=probes)
    assert t.tolist() == [0.0, 0.25]
    logits = (torch.randn(8, 5000, generator=torch.Generator().manual_seed(0)) * 3).to(DEV)
    p = logits.softmax(-1)
    bound = p.shape[1] * torch.finfo(torch.float32).eps  # an fp32 sum of V terms of total <= 1, in any order
    for top_p in (0.9999999, 0.99999994):
        t = threshold(p, top_p, probes=probes)
        assert not t.isnan().any()
        # whether a row's fp32 sum lands under top_p here depends on the order a machine sums in (it did on one
        # CPU, not on another, nor on an H200): where it does, the whole row is kept
        assert ((p >= t[:, None]) == (p > 0))[t == 0].all()
        want = torch.isfinite(filtered_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)))
        # elsewhere the reference's nucleus, but for tokens whose mass above is within rounding of top_p
        for r, i in (want & ~(p >= t[:, None])).nonzero().tolist():
            row = p[r].double()
            assert abs(row[row > row[i]].sum().item() - top_p) <= bound
    # rows whose mass is under top_p by more than any order's rounding (bound: 3e-4 here), on every machine (two rows:
    # each row's program finds its own t, and the NaN bug above hit every such row)
    under = p[:2] * (1 - 1e-3)
    t = threshold(under, 0.9999999, probes=probes)
    assert (t == 0).all() and (under >= t[:, None]).all()


def test_bad_input_is_refused():
    p = torch.full((2, 4), 0.25, device=DEV)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="top_p must be in"):
            threshold(p, bad)
    with pytest.raises(ValueError, match="fp32"):
        threshold(p.double(), 0.5)
    for bad in (0, 3, 64):
        with pytest.raises(ValueError, match="probes must be a power of two from 1 to 32"):
            threshold(p, 0.5, probes=bad)
    assert threshold(p[:0], 0.5).shape == (0,)


def _narrow(target: int, probes: int, n: int) -> int:
    """The kernel's interval search over bit patterns, in Python, against f(q) < top_p iff q >= target."""
    lo, hi = -1, START
    for _ in range(n):
        qs = [lo + (hi - lo) * j // (probes + 1) for j in range(1, probes + 1)]
        hi = min([q for q in qs if q >= target and q >= 0] + [hi])
        lo = max([q for q in qs if q < target or q < 0] + [lo])
    return hi


@pytest.mark.parametrize("probes", [1, 2, 16, 32])
def test_the_pass_count_narrows_every_interval_and_no_fewer_do(probes):
    """passes(probes) passes end on the least pattern whatever it is; one pass fewer misses some."""
    g = torch.Generator().manual_seed(probes)
    targets = [0, 1, 2, START - 1, START, START // 2] + torch.randint(0, START + 1, (200,), generator=g).tolist()
    n = passes(probes)
    assert all(_narrow(t, probes, n) == t for t in targets)
    assert any(_narrow(t, probes, n - 1) != t for t in targets)
    assert (passes(1), passes(16)) == (30, 8)


def test_sample_rows_cut_draws_sample_rows_tokens():
    logits = _rows(n=6, vocab=500, seed=3)  # 6 rows x 3 seeds: a stream out of step changes most of 18 draws
    params = SamplingParams(temperature=0.8, top_p=0.9)
    for seed in range(3):
        a = sample_rows(logits, params, torch.Generator(DEV).manual_seed(seed))
        b = sample_rows_cut(logits, params, torch.Generator(DEV).manual_seed(seed))
        assert torch.equal(a, b)
    greedy, topk = SamplingParams(), SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
    assert torch.equal(sample_rows_cut(logits, greedy, None), logits.argmax(-1))
    assert torch.equal(sample_rows_cut(logits, topk, torch.Generator(DEV).manual_seed(1)),
                       sample_rows(logits, topk, torch.Generator(DEV).manual_seed(1)))


def test_the_engines_threshold_sampler_answers_as_its_sort():
    from harness.decode.batched_gen import BatchedGenerator
    from tiny import tiny_hf_model
    model = tiny_hf_model("llama").to(DEV)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(8, 100, (n,), generator=g).tolist() for n in (4, 7, 5)]
    kw = dict(sample=True, temperature=0.8, top_p=0.9, seed=11)
    use_graph = DEV.type == "cuda"
    runs = {}
    for sampler in ("sort", "threshold"):
        gen = BatchedGenerator(model, rows=2, bucket=16, check_every=2, sampler=sampler, use_graph=use_graph,
                               dtype=torch.float32)
        assert gen.sampler == sampler
        runs[sampler] = gen.generate(prompts, 4, [], **kw)  # 4 tokens: 2 checks a row, and a refill
    assert runs["sort"] == runs["threshold"]
    default = BatchedGenerator(model, rows=2, bucket=16, use_graph=use_graph).sampler  # auto: what it resolved to
    assert default == ("threshold" if DEV.type == "cuda" else "sort")
    assert pick_sampler("threshold", "cuda") == "threshold"
    with pytest.raises(UsageError, match="sampler 'radix' is not one of auto, sort, threshold"):
        BatchedGenerator(model, rows=2, sampler="radix")
    for bad in (0.0, 1.5):
        with pytest.raises(UsageError, match="0 < top_p <= 1"):
            gen.generate(prompts, 6, [], sample=True, top_p=bad)


def test_auto_takes_the_threshold_cut_on_cuda_with_triton_and_the_sort_elsewhere(monkeypatch):
    """The default sampler: the Triton cut where it runs compiled, the sort where it does not; off CUDA, and for the
    sort anywhere, the kernels' package is never consulted (the CPU main job runs without Triton)."""
    from core import kernels
    assert DEFAULT_SAMPLER == "auto"
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert pick_sampler("auto", "cuda") == "threshold" and pick_sampler("auto", torch.device("cuda", 0)) == "threshold"
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert pick_sampler("auto", "cuda") == "sort"
    monkeypatch.setattr(kernels, "available", lambda: pytest.fail("the kernels consulted for a CPU device"))
    assert pick_sampler("auto", "cpu") == "sort" and pick_sampler("sort", "cuda") == "sort"
