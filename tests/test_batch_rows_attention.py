"""core.ops.BatchOps over the Triton ops: the attention of the rows of several requests runs as one launch of the
attention kernel (TritonOps.rows_attention), each request over its own cache row, instead of SDPA under a per-row
mask over the span's host bound (Triton's CPU interpreter here, compiled on a GPU)."""
import pytest
import torch

from kernel_env import DEV, pytestmark, rnd, tol  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from core import kernels
from core.cache import StaticKV
from core.ops import triton_ops
from core.ops.base import Span
from core.ops.batch import BatchOps
from core.ops.torch_impl import TorchOps


def _case(limit: bool):
    r, t, n_kv, groups, d, cap = 3, 4, 2, 3, 16, 384  # 300.. reads two of three 256-slot splits
    n_q = n_kv * groups
    starts = torch.tensor([5, 300, 0])
    pos = (starts[:, None] + torch.arange(t)).to(DEV)
    ang = (pos.flatten().float().cpu()[:, None] * 0.3 ** torch.arange(d // 2).float()).repeat(1, 2)
    args = dict(qkv=rnd(r * t, (n_q + 2 * n_kv) * d, seed=21), cos=ang.cos().to(DEV), sin=ang.sin().to(DEV),
                n_q=n_q, scale=d ** -0.5, q_norm=rnd(d, seed=22), k_norm=rnd(d, seed=23), eps=1e-6)
    caches = []
    for _ in range(2):
        kv = StaticKV(1, n_kv, d, cap, torch.float32, DEV, rows=r)
        kv.k.copy_(rnd(*kv.k.shape, seed=24))
        kv.v.copy_(rnd(*kv.v.shape, seed=25))
        caches.append(kv)
    span = Span(pos, int(pos.max()) + 1, limit=pos[:, -1] + 1 if limit else None)
    return args, caches, span


@pytest.mark.parametrize("limit", [False, True])
def test_rows_attention_is_one_kernel_launch_and_equals_the_torch_rows(monkeypatch, limit):
    """Three requests at positions 5.., 300.. (two active splits, merged) and 0.., causal (the target's verify) and with a limit (the drafter's
    block): the Triton rows give the torch rows' outputs and cache contents to fp32 rounding, in one kernel launch
    with 2-d positions and no SDPA. Power: falling back to the torch path (e.g. a `fits` that refuses every
    batched shape) launches no kernel, and a launch over one request's positions gives other outputs."""
    args, (kv_t, kv_k), span = _case(limit)
    launches, sdpa = [], []
    real_attention, real_sdpa = kernels.attention, torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(kernels, "attention", lambda *a, **k: launches.append(a[6].dim()) or real_attention(*a, **k))
    ref = BatchOps(TorchOps()).attention(kv=kv_t, layer=0, span=span, **args)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa.append(1) or real_sdpa(*a, **k))
    out = BatchOps(triton_ops(DEV)).attention(kv=kv_k, layer=0, span=span, **args)
    assert launches == [2] and not sdpa
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    torch.testing.assert_close(kv_k.k, kv_t.k, **tol(torch.float32))
    torch.testing.assert_close(kv_k.v, kv_t.v, atol=0, rtol=0)
    assert not kv_k.counters.any()


def test_rows_attention_runs_the_invariant_kernel_under_batch_invariant_and_leaves_windows_to_torch():
    """Under Launch.batch_invariant the rows go to the batch-invariant attention kernel, to the torch rows' outputs
    at fp32 rounding; a sliding window goes to the torch rows (None), counted among the fallbacks."""
    import dataclasses
    args, (kv_t, kv_k), span = _case(False)
    ops = triton_ops(DEV)
    inv = triton_ops(DEV, launch=dataclasses.replace(ops.launch, batch_invariant=True))
    ref = BatchOps(TorchOps()).attention(kv=kv_t, layer=0, span=span, **args)
    out = inv.rows_attention(kv=kv_k, layer=0, span=span, **args)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    windowed = Span(span.positions, span.length, window=8)
    assert ops.rows_attention(kv=kv_k, layer=0, span=windowed, **args) is None
    assert ops.fallbacks == {("batched attention", "a sliding window"): 1}  # counted, as the one-request path counts


def test_the_debug_check_refuses_a_limit_the_kernel_would_not_honour_and_positions_outside_the_cache():
    """XPRESS_BENCH_DEBUG's check (host syncs): the kernel attends over [0, last position] and writes unchecked,
    so a limit other than last + 1, or a position past the cache, is an error instead of other numbers."""
    args, (_, kv), span = _case(True)
    ops = triton_ops(DEV, debug=True)
    assert ops.rows_attention(kv=kv, layer=0, span=span, **args) is not None
    with pytest.raises(RuntimeError, match="limit is not its last position"):
        ops.rows_attention(kv=kv, layer=0, span=Span(span.positions, span.length, limit=span.limit + 1), **args)
    far = span.positions.clone()
    far[1] += kv.capacity
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rows_attention(kv=kv, layer=0, span=Span(far, span.length), **args)
