"""The bf16 side of tests/test_batch_neighbours.py on a real GPU (compiled kernels): with
kernels.Launch(batch_invariant=True), request X decodes the same tokens alone, beside A and beside B (B = 2 and 4,
AR and drafter-only), while on the default tiles the batched rows' matmuls tile by their count (no promise).
Passed on an H200 on 2026-12-04 (with tests/test_batch_rows_attention.py: 8 passed, results/perf/NOTES.md)."""
import pytest
import torch

from core.devices import Backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("drafted", [False, True])
def test_bf16_tokens_do_not_depend_on_the_neighbours_under_batch_invariant(drafted):
    from test_batch_neighbours import _case
    t, x, a, b, run = _case(Backend(torch.device("cuda"), torch.bfloat16))
    alone = run([x], drafted)[0]
    assert run([x, a], drafted)[0] == alone
    assert run([x, b], drafted)[0] == alone
    assert run([x, a, b, a], drafted)[0] == alone
    assert not t.ops.fallbacks, t.ops.fallbacks
