"""Greedy losslessness, stop/budget/context-limit bookkeeping and cache invariants of the decode loop."""
import pytest
import torch

from drafters.dflash import DFlashDrafter
from harness.decode.loop import DecodeSettings, PromptTooLong, generate
from doubles import ScriptedDrafter
from tiny import CPU32, VOCAB, tiny_drafter, tiny_target
from tolerance import assert_close

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")


STOPS = (3, 5)


def prompts(n, seed=0, lo=1, hi=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(8, 104, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request):
    t = tiny_target(request.param)
    return t, tiny_drafter(t, block=4)


def test_drafter_only_equals_ar_on_many_prompts(pair):
    t, d = pair
    reasons = set()
    for i, prompt in enumerate(prompts(22, seed=1)):
        # Budgets vary so that many runs end inside a block.
        s = DecodeSettings(max_new_tokens=9 + i % 7, max_model_len=512, stop_ids=STOPS)
        ar = generate(t, prompt, s, CPU32)
        sp = generate(t, prompt, s, CPU32, drafter=d)
        assert sp.tokens == ar.tokens, f"prompt {i}"
        assert sp.stop_reason == ar.stop_reason
        assert sum(sp.accept_lengths) == len(sp.tokens) - 1
        assert sp.host_syncs == len(sp.accept_lengths) == sp.spec_steps + sp.ar_steps
        reasons.add(sp.stop_reason)
    assert reasons == {"eos", "max_new_tokens"}, reasons


def reference(t, prompt, n=60):
    """The target's own greedy continuation, with no stop ids and a large budget."""
    return generate(t, prompt, DecodeSettings(n, 512, ()), CPU32).tokens


def first_unique(seq, lo, hi):
    """An index k in [lo, hi) whose token does not occur earlier in seq."""
    for k in range(lo, hi):
        if seq[k] not in seq[:k]:
            return k
    return None


def scripted_case(t, block, position_in_block):
    """Find a prompt whose reference has a first-occurrence token at output index 1 + position_in_block."""
    for prompt in prompts(40, seed=7, lo=3, hi=20):
        ref = reference(t, prompt)
        k = 1 + position_in_block
        if ref[k] not in ref[:k]:
            return prompt, ref, ref[k]
    pytest.skip("no suitable prompt found")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_oracle_drafter_accepts_whole_blocks(family):
    t = tiny_target(family)
    b = 5
    for prompt in prompts(5, seed=3, lo=2, hi=30):
        ref = reference(t, prompt)
        s = DecodeSettings(1 + 4 * b, 512, ())
        d = ScriptedDrafter(prompt + ref, b, VOCAB)
        sp = generate(t, prompt, s, CPU32, drafter=d)
        assert sp.tokens == ref[: 1 + 4 * b]
        assert sp.accept_lengths == [b] * 4


def test_stop_inside_an_accepted_block():
    t = tiny_target("qwen3")
    b = 6
    prompt, ref, stop = scripted_case(t, b, position_in_block=2)  # third token of the first block
    s = DecodeSettings(40, 512, (stop,))
    ar = generate(t, prompt, s, CPU32)
    sp = generate(t, prompt, s, CPU32, drafter=ScriptedDrafter(prompt + ref, b, VOCAB))
    assert sp.tokens == ar.tokens == ref[:4]
    assert sp.stop_reason == "eos"
    assert sp.accept_lengths == [3]  # the accepted drafts after the stop are dropped, and no extra step runs


def test_stop_as_bonus_token():
    t = tiny_target("qwen3")
    b = 4
    prompt, ref, stop = scripted_case(t, b, position_in_block=b - 1)  # the bonus of the first block
    s = DecodeSettings(40, 512, (stop,))
    ar = generate(t, prompt, s, CPU32)
    d = ScriptedDrafter(prompt + ref, b, VOCAB)
    sp = generate(t, prompt, s, CPU32, drafter=d)
    assert sp.tokens == ar.tokens == ref[: 1 + b]
    assert sp.accept_lengths == [b] and d.calls == 1  # no step after the EOS bonus


@pytest.mark.parametrize("budget", [2, 4, 5, 7, 9, 10])
def test_budget_ending_inside_a_block(budget):
    t = tiny_target("qwen3")
    b = 4
    prompt = [20, 30, 40, 50]
    ref = reference(t, prompt)
    s = DecodeSettings(budget, 512, ())
    sp = generate(t, prompt, s, CPU32, drafter=ScriptedDrafter(prompt + ref, b, VOCAB))
    assert sp.tokens == ref[:budget]
    assert sp.stop_reason == "max_new_tokens"
    assert sum(sp.accept_lengths) == budget - 1  # the last step's tau entry is clipped with the output
    assert all(x == b for x in sp.accept_lengths[:-1])


def test_scripted_partial_acceptance_counts():
    t = tiny_target("llama")
    b = 5
    prompt = [11, 12, 13]
    ref = reference(t, prompt)
    wrong = [0, 2, None, 3, 1, None]
    d = ScriptedDrafter(prompt + ref, b, VOCAB, wrong_at=wrong)
    sp = generate(t, prompt, DecodeSettings(1 + 1 + 3 + 5 + 4 + 2 + 5, 512, ()), CPU32, drafter=d)
    assert sp.accepted == [0, 2, 4, 3, 1, 4]
    assert sp.tokens == ref[: len(sp.tokens)]


class Spy:
    """Records the largest cache position written."""

    def __init__(self, kv):
        self.kv, self.max_pos, self._write = kv, -1, kv.write
        kv.write = self.write

    def write(self, layer, positions, k, v):
        self.max_pos = max(self.max_pos, int(positions.max()))
        return self._write(layer, positions, k, v)


@pytest.mark.parametrize("offset", [-1, 0, 1])
@pytest.mark.parametrize("oracle", [True, False])
def test_context_limit(offset, oracle):
    limit, b = 40, 4
    last_fit = limit - b - 1  # the last anchor position at which a whole block (and its bonus) fits
    t = tiny_target("qwen3")
    prompt = [(7 * i) % 90 + 8 for i in range(last_fit + offset)]
    s = DecodeSettings(500, limit, ())
    ar = generate(t, prompt, s, CPU32)
    ref = reference(t, prompt, limit)
    # A fresh target whose cache the loop sizes itself: exactly max_model_len slots, so a write past the end
    # would raise (index_copy_ checks bounds on CPU).
    t = tiny_target("qwen3", capacity=1)
    d = ScriptedDrafter(prompt + ref, b, VOCAB) if oracle else tiny_drafter(t, block=b)
    spy_t = Spy(t.kv)
    spy_d = Spy(d.kv) if not oracle else None
    sp = generate(t, prompt, s, CPU32, drafter=d)
    assert sp.tokens == ar.tokens
    assert len(prompt) + len(sp.tokens) == limit and sp.stop_reason == "max_model_len"
    assert t.kv.capacity == limit and spy_t.max_pos <= limit - 2
    if spy_d:
        assert spy_d.max_pos < d.kv.capacity
    if offset <= 0:
        assert sp.spec_steps >= 1
    else:
        assert sp.spec_steps == 0  # the first anchor is already past the last fitting position


def test_prompt_at_the_limit():
    t = tiny_target("qwen3")
    s = DecodeSettings(10, 12, ())
    g = generate(t, list(range(8, 19)), s, CPU32, drafter=tiny_drafter(t, block=4))
    assert len(g.tokens) == 1 and g.stop_reason == "max_model_len"
    with pytest.raises(PromptTooLong, match="max-model-len"):
        generate(t, list(range(8, 20)), s, CPU32)


def test_cache_invariants_and_no_leak_from_rejected_tails():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    prompt = [15, 16, 17, 18, 19, 20, 21]
    steps = []

    def on_step(rec):
        steps.append({"pos": rec["position"], "block": rec["block"].clone(), "logits": rec["logits"].clone(),
                      "draft_logits": rec["proposal"].logits.clone() if rec["proposal"] is not None else None,
                      "committed": int(t.pos), "ctx": int(d.ctx), "produced": rec["produced"],
                      "stop": rec["stop"], "accepted": rec["accepted"]})

    g = generate(t, prompt, DecodeSettings(30, 512, ()), CPU32, drafter=d, on_step=on_step)
    seq = prompt + g.tokens
    assert any(s["accepted"] < 3 for s in steps), "want rejected tails in this test"
    fresh_t = tiny_target("qwen3", taps=d.target_layer_ids)
    fresh_t.model.load_state_dict(t.model.state_dict())
    for s in steps:
        if not s["stop"]:
            # committed length == output length: slots 0..pos-1 hold every token but the newest (the anchor)
            assert s["committed"] == len(prompt) + s["produced"] - 1
            assert s["ctx"] == s["committed"]
        committed = torch.tensor(seq[: s["pos"]])
        with torch.no_grad():
            ref = t.model(torch.cat((committed, s["block"])).unsqueeze(0)).logits[0, -len(s["block"]):]
        assert_close(s["logits"], ref, steps=t.n_layers)
        # the drafter, too, sees exactly what a fresh drafter over the committed context would
        _, feats = fresh_t.prefill(committed, want_features=True)
        fresh_d = DFlashDrafter(d.model, fresh_t.embed, fresh_t.lm_head, CPU32)
        fresh_d.ensure_capacity(64)
        fresh_d.begin(feats)
        prop = fresh_d.propose(torch.tensor(seq[s["pos"]]), torch.tensor(s["pos"]), s["pos"] + 4)
        assert_close(s["draft_logits"], prop.logits, steps=t.n_layers)


def test_first_token_stop_ends_without_steps():
    t = tiny_target("qwen3")
    prompt = [30, 31, 32]
    first = reference(t, prompt, 1)[0]
    g = generate(t, prompt, DecodeSettings(10, 512, (first,)), CPU32, drafter=tiny_drafter(t))
    assert g.tokens == [first] and g.accept_lengths == [] and g.stop_reason == "eos"


def test_sampling_is_reproducible_per_stream():
    t = tiny_target("qwen3")
    d = tiny_drafter(t, block=4)
    s = DecodeSettings(20, 512, STOPS, temperature=1.0)
    runs = [generate(t, [9, 10, 11], s, CPU32, drafter=d, generator=CPU32.generator(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    other = generate(t, [9, 10, 11], s, CPU32, drafter=d, generator=CPU32.generator(8)).tokens
    assert other != runs[0]


def test_compat_reference_quirks():
    """--compat-reference: same tokens; an extra step after an EOS bonus; tau entries not clipped."""
    t = tiny_target("qwen3")
    b = 4
    prompt, ref, stop = scripted_case(t, b, position_in_block=b - 1)  # EOS is the first block's bonus
    fixed = DecodeSettings(40, 512, (stop,))
    compat = DecodeSettings(40, 512, (stop,), compat_reference=True)
    d1, d2 = ScriptedDrafter(prompt + ref, b, VOCAB), ScriptedDrafter(prompt + ref, b, VOCAB)
    a = generate(t, prompt, fixed, CPU32, drafter=d1)
    c = generate(t, prompt, compat, CPU32, drafter=d2)
    assert a.tokens == c.tokens == ref[: 1 + b]
    assert a.accept_lengths == [b] and d1.calls == 1
    assert len(c.accept_lengths) == 2 and c.accept_lengths[0] == b and d2.calls == 2  # one junk step
    # EOS inside the accepted drafts: no extra step, but the entry is accepted + 1, unclipped
    prompt, ref, stop = scripted_case(t, 6, position_in_block=2)
    c = generate(t, prompt, DecodeSettings(40, 512, (stop,), compat_reference=True), CPU32,
                 drafter=ScriptedDrafter(prompt + ref, 6, VOCAB))
    assert c.tokens == ref[:4] and c.accept_lengths == [6]
    # budget inside a block: the last entry is not clipped either
    prompt = [20, 30, 40, 50]
    ref = reference(t, prompt)
    c = generate(t, prompt, DecodeSettings(6, 512, (), compat_reference=True), CPU32,
                 drafter=ScriptedDrafter(prompt + ref, 4, VOCAB))
    assert c.tokens == ref[:6] and c.accept_lengths == [4, 4] and c.decode_tokens == 6


def test_bf16_on_cpu_runs_both_arms():
    """--dtype bfloat16 --device cpu: the loop runs; near-ties between 1- and B-token forwards may change a token,
    so only the shape of the result is asserted here (fp32 equality is tested above)."""
    import torch as th
    from core.devices import Backend
    b = Backend(th.device("cpu"), th.bfloat16)
    t = tiny_target("qwen3", backend=b)
    d = tiny_drafter(t, block=4, backend=b)
    s = DecodeSettings(12, 512, ())
    ar, sp = generate(t, [9, 10, 11], s, b), generate(t, [9, 10, 11], s, b, drafter=d)
    assert len(ar.tokens) == len(sp.tokens) == 12 and sp.spec_steps >= 1
