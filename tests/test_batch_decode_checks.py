"""generate_batch's refusals: bad input is a one-line UsageError naming the problem, raised before any request is
prefilled; other target families are refused by the batched target."""
import pytest

from core.errors import UsageError
from harness.decode.batch_loop import generate_batch
from harness.decode.batch_target import BatchTarget
from harness.decode.loop import DecodeSettings, PromptTooLong
from harness.decode.state import DecodeState
from tiny import CPU32, tiny_drafter, tiny_target

S = DecodeSettings(8, 64, (3,))


@pytest.fixture(scope="module")
def pair():
    t = tiny_target("qwen3")
    return t, tiny_drafter(t, block=4)


def refused(match, *args, **kw):
    with pytest.raises(UsageError, match=match) as e:
        generate_batch(*args, **kw)
    assert "\n" not in str(e.value)
    return e.value


def test_bad_batches_are_one_line_usage_errors(pair, monkeypatch):
    """Guards each refusal (empty batch, one drafter/generator/limit count that is not the prompt count, one drafter
    object for two requests, mixed block sizes, a too-small state, graphs, an empty or too-long prompt), and that
    none of them prefills anything."""
    t, d = pair
    calls = []
    monkeypatch.setattr(t, "prefill", lambda *a, **k: calls.append(a))
    two = [[9, 10], [11, 12, 13]]
    refused("no prompts", t, [], S, CPU32)
    refused("got 1 drafters for 2 rows: pass one per row", t, two, S, CPU32, drafters=[d])
    # continuous batching: rows from 1 to the prompt count, one drafter per row (not per prompt)
    refused("rows must be an integer from 1 to the 2 prompts, got 3", t, two, S, CPU32, rows=3)
    refused("rows must be an integer from 1 to the 2 prompts, got 0", t, two, S, CPU32, rows=0)
    refused("got 2 drafters for 1 rows", t, two, S, CPU32, drafters=[d, tiny_drafter(t)], rows=1)
    refused("got 3 generators for 2 prompts", t, two, S, CPU32, generators=[None] * 3)
    refused("got 1 output limits for 2 prompts", t, two, S, CPU32, max_new_tokens=[4])
    refused("output limits must be integers >= 1", t, two, S, CPU32, max_new_tokens=[4, 0])
    refused("one drafter object for several requests", t, two, S, CPU32, drafters=[d, d])
    refused("block sizes differ", t, two, S, CPU32, drafters=[d, tiny_drafter(t, block=3)])
    refused("needs a DecodeState of >= 2 slots", t, two, S, CPU32, state=DecodeState(t, slots=1))
    refused("needs --device cuda", t, two, DecodeSettings(8, 64, (), use_graph=True), CPU32)
    refused("prompt 1 of the batch: empty prompt", t, [[9], []], S, CPU32)
    e = refused("prompt 0 of the batch: prompt has 64 tokens but --max-model-len is 64", t, [[9] * 64, [9]], S,
                CPU32)
    assert isinstance(e, PromptTooLong)
    assert calls == []


def test_a_target_with_its_own_forward_is_refused():
    """Guards the batched target against running a family whose layer loop it does not drive (Gemma 4)."""
    from gemma_tiny import gemma_target
    with pytest.raises(UsageError, match="Gemma4Target has its own forward"):
        BatchTarget(gemma_target(), 2)
