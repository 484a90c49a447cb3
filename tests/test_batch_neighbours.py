"""A request's output does not depend on its batch neighbours where the kernels are row-invariant (issue 29,
item 2): with kernels.Launch(batch_invariant=True) a batch of B requests whose rows fit the kernels (B x W <=
MAX_ROWS) runs every matmul on the batch-invariant kernels and every attention on the batch-invariant kernel, one
launch for all requests, each over its own cache row. On a GPU in bf16 that makes request X's tokens the same
whoever shares its batch (tests/test_batch_neighbours_gpu.py); here (Triton's interpreter, fp32) the route is
checked: nothing falls back to the torch ops, and X's tokens equal its B = 1 tokens with either neighbour."""
import dataclasses

import pytest
import torch

from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first; skips without Triton)
from core import kernels
from core.ops import triton_ops

BLOCK = 4


def _case(backend):
    from drafters.dflash import DFlashDrafter
    from drafters.dflash_batch import DFlashGroup
    from tiny import tiny_drafter, tiny_target
    # 2 target layers: every layer runs the same kernels, each a few seconds in the interpreter (6 took ~60 s a case).
    # On the interpreter also hidden 32, 2 query heads per K/V head of 16 as the tiny default's, over 1 K/V head (its
    # 2 made twice the interpreter's programs a launch; the rows' requests, not the heads, are what it checks). On a
    # GPU (test_batch_neighbours_gpu.py) the tiny default's shapes, as it passed on an H200: there bf16 rounding
    # must differ between routes for the test to mean anything, which needs matmuls of more than one K tile
    small = {} if backend.device.type == "cuda" else dict(hidden_size=32, intermediate_size=64,
                                                          num_attention_heads=2, num_key_value_heads=1)
    t = tiny_target("qwen3", capacity=128, backend=backend, layers=2, **small)
    base = tiny_drafter(t, block=BLOCK, backend=backend, target_layer_ids=[0, 1])
    ops = triton_ops(backend.device)
    t.use_ops(triton_ops(backend.device, launch=dataclasses.replace(ops.launch, batch_invariant=True)))
    g = torch.Generator().manual_seed(4)
    x, a, b = (torch.randint(8, 104, (n,), generator=g).tolist() for n in (11, 5, 23))

    def run(prompts, drafted: bool):
        from harness.decode.batch_loop import generate_batch
        from harness.decode.loop import DecodeSettings
        s = DecodeSettings(6, 512, (3,))  # 6 tokens: several steps, each a few interpreter launches a layer
        fresh = lambda: DFlashDrafter(base.model, t.embed, t.lm_head, backend)
        members = DFlashGroup(fresh(), len(prompts)).members if drafted else None
        return [gen.tokens for gen in generate_batch(t, prompts, s, backend, drafters=members)]
    return t, x, a, b, run


@pytest.mark.parametrize("drafted", [False, True])
def test_a_request_decodes_its_b1_tokens_beside_any_neighbour_on_the_invariant_route(monkeypatch, drafted):
    """AR and drafter-only (a DFlashGroup): X alone, X beside A, X beside B (B = 2, W = 1 or the block), the same
    tokens; the target's batched forwards launch the batch-invariant kernels only (no torch fallback counted) and
    attention once per layer for both requests (2-d positions). Power: with the rows' attention on SDPA or a
    linear on cuBLAS the fallback counter or the launch count shows it."""
    from tiny import CPU32
    if DEV.type != "cpu":
        pytest.skip("the CPU interpreter's route check; the GPU's bf16 check is tests/test_batch_neighbours_gpu.py")
    t, x, a, b, run = _case(CPU32)
    batched = []
    real = kernels.attention
    monkeypatch.setattr(kernels, "attention", lambda *q, **k: (batched.append(q[6].dim() == 2), real(*q, **k))[1])
    alone = run([x], drafted)[0]
    assert run([x, a], drafted)[0] == alone
    assert run([x, b], drafted)[0] == alone
    assert any(batched) and not t.ops.fallbacks, t.ops.fallbacks
