"""The decode's accounting policy (harness.decode.accounting): compat stop ids, the traced extra step after an
EOS, tail steps near the context limit kept out of tau, and per-step callbacks kept out of the timer."""
import time
from types import SimpleNamespace

import pytest
import torch

from harness.decode.accounting import REFERENCE, STANDARD, model_stop_ids
from harness.decode.loop import DecodeSettings, generate
from harness.protocol.trace import StepTracer, timed_then_traced
from doubles import ScriptedDrafter
from test_loop import reference, scripted_case
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")


def test_compat_stops_on_the_tokenizer_eos_only():
    """REFERENCE.md 11.2 item 15: the reference stops only on tokenizer.eos_token_id (151645 for Qwen3), though
    Qwen3's generation config also lists 151643."""
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[151645, 151643]),
                            config=SimpleNamespace(eos_token_id=151643))
    tok = SimpleNamespace(eos_token_id=151645)
    assert model_stop_ids(model, tok, STANDARD) == (151643, 151645)
    assert model_stop_ids(model, tok, REFERENCE) == (151645,)
    # no tokenizer eos: the reference policy falls back to the model's ids rather than never stopping
    assert model_stop_ids(model, SimpleNamespace(eos_token_id=None), REFERENCE) == (151643, 151645)
    assert DecodeSettings(4, 64, (), compat_reference=True).accounting is REFERENCE


def test_the_compat_extra_step_appears_in_the_trace(tmp_path):
    t = tiny_target("qwen3")
    b = 4
    prompt, ref, stop = scripted_case(t, b, position_in_block=b - 1)  # EOS is the first block's bonus
    path = tmp_path / "trace.jsonl"
    tracer = StepTracer(str(path))
    g = generate(t, prompt, DecodeSettings(40, 512, (stop,), compat_reference=True), CPU32,
                 drafter=ScriptedDrafter(prompt + ref, b, VOCAB), on_step=tracer)
    tracer.close()
    import json
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert g.extra_steps == 1 and len(g.accept_lengths) == 2
    assert len(rows) == 2 == g.host_syncs
    assert rows[0]["extra_step"] is False and rows[1]["extra_step"] is True and rows[1]["emitted"] == 0
    assert rows[1]["anchor"] == stop  # the reference drafts from the EOS it missed


def test_tail_steps_near_the_context_limit_are_not_tau_entries():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    prompt = [20, 30, 40, 50]
    limit = len(prompt) + 10
    g = generate(t, prompt, DecodeSettings(100, limit, ()), CPU32, drafter=d)
    assert g.stop_reason == "max_model_len" and g.tail_steps > 0 and g.ar_steps == g.tail_steps
    assert len(g.accept_lengths) == len(g.accepted) == g.spec_steps
    assert sum(g.accept_lengths) + g.tail_steps == len(g.tokens) - 1
    ar = generate(t, prompt, DecodeSettings(100, limit, ()), CPU32)  # the AR arm's steps stay its tau = 1 entries
    assert ar.tail_steps == 0 and ar.accept_lengths == [1] * ar.ar_steps


class SlowTracer(StepTracer):
    delay = 0.05

    def __init__(self, path):
        super().__init__(path)
        self.calls = []  # perf_counter() of every call

    def __call__(self, rec):
        self.calls.append(time.perf_counter())
        time.sleep(self.delay)
        super().__call__(rec)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tracing_runs_outside_the_timer_on_the_same_tokens(tmp_path, temperature):
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    s = DecodeSettings(16, 512, (), temperature=temperature)
    spans = []  # (traced?, start, end) of every decode

    def decode(gen, on_step):
        start = time.perf_counter()
        out = generate(t, [9, 10, 11], s, CPU32, drafter=d, generator=gen, on_step=on_step)
        spans.append((on_step is not None, start, time.perf_counter()))
        return out

    plain_rng, traced_rng = CPU32.generator(3), CPU32.generator(3)
    plain = decode(plain_rng, None)
    tracer = SlowTracer(str(tmp_path / "t.jsonl"))
    g = timed_then_traced(decode, traced_rng, tracer)
    tracer.close()
    steps = len((tmp_path / "t.jsonl").read_text().splitlines())
    assert steps == g.host_syncs >= 2 and g.timed
    # the reported time is the untraced decode's: every tracer call (and its sleep) falls outside that decode, and
    # the time fits inside it (an ordering check, not a wall-clock bound, so a loaded machine cannot fail it)
    (_, start, end), = [sp for sp in spans[1:] if not sp[0]]
    assert len(tracer.calls) == steps and all(c > end or c < start for c in tracer.calls)
    assert g.decode_s <= end - start
    assert g.tokens == plain.tokens
    assert torch.equal(traced_rng.get_state(), plain_rng.get_state())  # the stream continues as if untraced
    # a generation given a step callback says that its timing is not a measurement
    assert not decode(CPU32.generator(3), lambda rec: None).timed


def test_logit_gaps_are_recorded_per_token_and_fp32_logits_keep_the_tokens():
    from harness.decode.loop import top2_gap
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    prompt = [9, 10, 11]
    g = generate(t, prompt, DecodeSettings(12, 512, (), record_gaps=True), CPU32, drafter=d)
    assert generate(t, prompt, DecodeSettings(12, 512, ()), CPU32).top2_gaps is None  # off by default
    with torch.no_grad():
        logits = t.model(torch.tensor([prompt + g.tokens])).logits[0, len(prompt) - 1:-1]
    # cached decode vs one full forward: fp32 summation order over 6 layers, a few hundred eps of the logits' size
    tol = 256 * torch.finfo(torch.float32).eps * float(logits.abs().max())
    torch.testing.assert_close(torch.tensor(g.top2_gaps), top2_gap(logits), atol=tol, rtol=0)
    t.use_fp32_logits()
    assert generate(t, prompt, DecodeSettings(12, 512, ()), CPU32, drafter=d).tokens == g.tokens
