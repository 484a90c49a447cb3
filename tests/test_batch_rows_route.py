"""A forward over several requests' rows is sized per request (TritonOps.sized(request_rows=...)), issue 29 item 5:
the rows' attention is one request's launch shape, so Qwen3-8B's verify at B = 4 (4 x 16 rows at 4 query heads per
K/V head: 256 query rows in all, 64 a request) runs on the Triton kernels instead of sending every op of the
forward to the torch ops, and past 64 rows only the matmuls and norms take the torch ops, call by call, while the
rows still attend on the kernel. Checked here on a tiny Qwen3 with Qwen3-8B's 4 query heads per K/V head (Triton's
CPU interpreter, fp32) at B = 4 (64 rows) and B = 8 (128 rows: the matmuls on the torch ops): the batched verify's
logits equal the torch ops' and each request's own B = 1 verify, no fallback is counted, and every layer attends
in one launch over 2-d positions. Power: the old sizing (all rows at once) counts a "forward" fallback and
launches no attention kernel at B = 4 and B = 8."""
import pytest
import torch

from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from core import kernels
from core.ops import triton_ops
from tolerance import assert_close

W = 16  # the verify block


def test_sizing_takes_one_request_rows_for_the_attention():
    ops = triton_ops(DEV)
    assert ops.sized(64, 4, request_rows=16) is ops  # 16 x 4 query rows a request: the kernel's
    assert ops.sized(8 * 16, 4, request_rows=16) is ops  # 128 rows: matmuls on torch call by call, attention here
    assert not ops.fallbacks
    with pytest.raises(ValueError, match="not whole requests"):
        ops.sized(60, 4, request_rows=16)
    assert ops.sized(64, 4) is ops.torch  # one request of 64 rows x 4: more query rows than one program keeps
    assert ops.fallbacks == {("forward", "64 rows x 4 query heads per K/V head"): 1}


def _verify(t, prompts, blocks):
    from harness.decode.batch_target import BatchTarget
    r = len(prompts)
    bt = BatchTarget(t, r)
    bt.ensure_capacity(max(len(p) for p in prompts) + W + 1)
    for b, p in enumerate(prompts):
        t.reset()
        t.prefill(torch.tensor(p, device=DEV), want_features=False)
        bt.load_prompt(b, len(p))
    length = int(bt.pos.max()) + W
    logits, _ = bt.verify(blocks, length, want_features=False)
    return logits


@pytest.mark.parametrize("requests", [1, 4, 8])
def test_four_verify_blocks_at_four_query_heads_per_kv_head_run_on_the_kernels(monkeypatch, requests):
    from tiny import CPU32, tiny_target
    if DEV.type != "cpu":
        pytest.skip("the CPU interpreter's route check")
    t = tiny_target("qwen3", capacity=128, backend=CPU32, layers=2, num_attention_heads=8, num_key_value_heads=2)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(8, 104, (n,), generator=g).tolist() for n in (7, 12, 3, 9, 5, 1, 10, 4)][:requests]
    blocks = torch.randint(8, 104, (requests, W), generator=g)
    want = _verify(t, prompts, blocks)  # the torch ops
    alone = [_verify(t, [p], blocks[i:i + 1]) for i, p in enumerate(prompts)]
    t.use_ops(triton_ops(DEV))
    launches = []
    real = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *q, **k: (launches.append(q[6].dim()), real(*q, **k))[1])
    got = _verify(t, prompts, blocks)
    assert not t.ops.fallbacks, t.ops.fallbacks
    assert launches == [2 if requests > 1 else 1] * 2  # one launch a layer, 2-d positions for several requests
    assert_close(got, want, steps=4, magnitude=float(want.abs().max()))
    for i in range(requests):
        assert_close(got[i], alone[i][0], steps=4, magnitude=float(want.abs().max()))


def test_the_drafter_group_sizes_its_rows_per_request_too():
    """DFlashGroup's ops for B blocks are BatchOps over the drafter's own Triton ops (sized by one block), for the
    block forward (B x W rows), the lm_head (B x (W-1)) and the context write; one request keeps the drafter's
    own ops. Power: sizing all B x W rows at once gives BatchOps over the torch ops at B = 4."""
    from core.ops.batch import BatchOps
    from drafters.dflash import DFlashDrafter
    from drafters.dflash_batch import DFlashGroup
    from tiny import CPU32, tiny_drafter, tiny_target
    t = tiny_target("qwen3", capacity=128, backend=CPU32, layers=4, num_attention_heads=8, num_key_value_heads=2)
    base = tiny_drafter(t, block=W, backend=CPU32)
    ops = triton_ops(DEV)
    group = DFlashGroup(DFlashDrafter(base.model, t.embed, t.lm_head, CPU32, ops=ops), 4)
    for rows in (4 * W, 4 * (W - 1)):
        got = group._ops(rows)
        assert isinstance(got, BatchOps) and got.inner is ops
    assert not ops.fallbacks
    one = DFlashGroup(DFlashDrafter(base.model, t.embed, t.lm_head, CPU32, ops=ops), 1)
    assert one._ops(W) is ops
