"""Split attention's arrival counters belong to the cache (StaticKV.counters): a leftover count from an aborted
launch is caught by the debug check between steps instead of making a later merge run early; a second stream
with its own cache cannot disturb this one's."""
import pytest
import torch

from kernel_env import DEV, pytestmark, rnd, tol  # noqa: F401  (sets TRITON_INTERPRET first)
from core import kernels
from core.cache import StaticKV
from core.ops import Span, TorchOps, triton_ops

N_KV, GROUPS, D, CAP = 2, 2, 16, 512


def case(seed=0, start=300, t=1):
    """A layer whose 300-slot history spreads over several splits (4 x 64-slot blocks each at least)."""
    kv = StaticKV(1, N_KV, D, CAP, torch.float32, DEV)
    kv.k.copy_(rnd(*kv.k.shape, seed=seed))
    kv.v.copy_(rnd(*kv.v.shape, seed=seed + 1))
    qkv = rnd(t, (N_KV * GROUPS + 2 * N_KV) * D, seed=seed + 2)
    ang = (torch.arange(start, start + t).float()[:, None] * 0.3 ** torch.arange(D // 2).float()).repeat(1, 2)
    return kv, qkv, ang.cos().to(DEV), ang.sin().to(DEV), Span(torch.arange(start, start + t, device=DEV),
                                                               start + t)


def attend(ops, kv, qkv, cos, sin, span):
    return ops.attention(qkv, kv, 0, span, cos, sin, N_KV * GROUPS, D ** -0.5)


def test_a_leftover_count_is_caught_not_merged_early():
    kv, qkv, cos, sin, span = case()
    ref_kv = StaticKV(1, N_KV, D, CAP, torch.float32, DEV)
    ref_kv.k.copy_(kv.k), ref_kv.v.copy_(kv.v)
    want = attend(TorchOps(), ref_kv, qkv, cos, sin, span)
    fast = triton_ops(DEV, kernels.Launch(attention_splits=4), debug=False)
    torch.testing.assert_close(attend(fast, kv, qkv, cos, sin, span), want, **tol(torch.float32))
    assert not kv.counters.any()
    kv.counters[0, 0] = 1  # what a launch that stopped after one split's arrival leaves behind
    # unchecked, head 0's merge runs when the first split arrives, over partial results that are not there
    wrong = attend(fast, kv, qkv, cos, sin, span)
    assert not torch.allclose(wrong[:, : GROUPS * D], want[:, : GROUPS * D], **tol(torch.float32))
    kv.counters[0, 0] = 1
    checked = triton_ops(DEV, kernels.Launch(attention_splits=4), debug=True)
    with pytest.raises(RuntimeError, match="layer\\(s\\) \\[0\\] were not 0"):
        attend(checked, kv, qkv, cos, sin, span)
    assert not kv.counters.any()  # the check put them back: the next step merges correctly
    torch.testing.assert_close(attend(checked, kv, qkv, cos, sin, span), want, **tol(torch.float32))


def test_each_cache_counts_on_its_own_counters():
    a, b = (StaticKV(3, N_KV, D, 64, torch.float32, DEV) for _ in range(2))
    assert a.counters.shape == (3, N_KV) and a.counters.data_ptr() != b.counters.data_ptr()
    a.check_counters()  # all zero: passes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_streams_with_their_own_caches_merge_correctly():
    """Split attentions of two caches queued on two streams at once (their programs interleave on the GPU):
    each merges over its own counters, so both match the torch ops, many times over."""
    fast = triton_ops(DEV, kernels.Launch(attention_splits=8))
    cases = [case(seed=s) for s in (0, 10)]
    wants = []
    for kv, qkv, cos, sin, span in cases:
        ref = StaticKV(1, N_KV, D, CAP, torch.float32, DEV)
        ref.k.copy_(kv.k), ref.v.copy_(kv.v)
        wants.append(attend(TorchOps(), ref, qkv, cos, sin, span))
    streams = [torch.cuda.Stream() for _ in cases]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(50):
        for i, (s, c) in enumerate(zip(streams, cases)):
            with torch.cuda.stream(s):
                outs[i].append(attend(fast, *c))
    torch.cuda.synchronize()
    for i, want in enumerate(wants):
        for o in outs[i]:
            torch.testing.assert_close(o, want, **tol(torch.float32))
        cases[i][0].check_counters()
