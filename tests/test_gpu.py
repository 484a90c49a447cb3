"""CUDA checks of the same decode path (skipped without a GPU)."""
import dataclasses
import warnings

import pytest
import torch

from core.devices import Backend
from harness.decode.loop import DecodeSettings, generate
from harness.decode.state import DecodeState
from tiny import tiny_drafter, tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def backend(dtype):
    return Backend(torch.device("cuda"), dtype)


def count_syncs(run):
    """Implicit host syncs CUDA reports while `run()` executes (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def prompts(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(8, 104, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_cuda_fp32_drafter_only_equals_ar(family):
    b = backend(torch.float32)
    t = tiny_target(family, backend=b)
    d = tiny_drafter(t, block=4, backend=b)
    for i, p in enumerate(prompts(12)):
        s = DecodeSettings(10 + i % 6, 512, (3, 5))
        ar = generate(t, p, s, b)
        sp = generate(t, p, s, b, drafter=d)
        assert sp.tokens == ar.tokens and sp.stop_reason == ar.stop_reason


def test_cuda_bf16_runs_and_reports_match():
    b = backend(torch.bfloat16)
    t = tiny_target("qwen3", backend=b)
    d = tiny_drafter(t, block=4, backend=b)
    same = 0
    for p in prompts(8):
        s = DecodeSettings(16, 512, ())
        ar, sp = generate(t, p, s, b), generate(t, p, s, b, drafter=d)
        assert len(sp.tokens) == len(ar.tokens) == 16
        same += sp.tokens == ar.tokens
    print(f"bf16 drafter-only == AR on {same}/8 prompts (near-ties may differ between 1- and B-token forwards)")


def test_cuda_syncs_are_only_the_named_ones():
    b = backend(torch.float32)
    t = tiny_target("qwen3", backend=b)
    d = tiny_drafter(t, block=4, backend=b)
    s = DecodeSettings(24, 512, ())
    generate(t, [9, 10, 11], s, b, drafter=d)  # warm
    g, syncs = count_syncs(lambda: generate(t, [9, 10, 11], s, b, drafter=d))
    print(f"implicit syncs: {syncs} for {g.host_syncs} steps")
    # exactly one per step, plus three outside the steps: prompt upload, the prefill's first token and the final copy
    # of the output. The stop ids are uploaded once per slot (harness.decode.state.Slot.stop_ids), by the warm run:
    # the H200 run at 2c4f9db+merges gave 25 for 22 steps (26 before the slot kept them)
    assert syncs == g.host_syncs + 3


def _refiners(vocab=128, hidden=64, block=4):
    from refiners.markov import MarkovRefiner, random_markov_head
    from refiners.xpress import XPressRefiner, random_xpress_head
    xp = random_xpress_head(vocab, hidden, 8, block, seed=2, std=0.3).cuda().fold()
    yield "xpress-K3", XPressRefiner(xp, 3)
    yield "xpress-K2-C8", XPressRefiner(xp, 2, topc=8)
    for v in ("vanilla", "rnn"):
        yield f"markov-{v}", MarkovRefiner(random_markov_head(v, vocab, hidden, 8, seed=3, std=0.3).cuda())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_and_compile_give_the_same_tokens(temperature):
    from harness.lab.captured import CapturedRefiner
    b = backend(torch.float32)
    t = tiny_target("qwen3", backend=b)
    d = tiny_drafter(t, block=4, backend=b)
    s = DecodeSettings(20, 512, (3, 5), temperature=temperature)
    for name, r in _refiners():
        variants = {"eager": r, "graph": CapturedRefiner(r)}
        if temperature == 0.0:
            variants["compiled+graph"] = CapturedRefiner(r, compile=True)
        outs = {}
        for label, rr in variants.items():
            outs[label] = [generate(t, p, s, b, drafter=d, refiner=rr, generator=b.generator(i)).tokens
                           for i, p in enumerate(prompts(4))]
        for label in variants:
            assert outs[label] == outs["eager"], f"{name}: {label} differs from eager"
        assert variants["graph"].graph_count == 1


# --- whole-step CUDA graphs (DecodeSettings.use_graph) -------------------------------------------------------------

def _arms(t, block=8):
    from harness.lab.captured import CapturedRefiner
    from refiners.markov import MarkovRefiner, random_markov_head
    from refiners.xpress import XPressRefiner, random_xpress_head
    d = tiny_drafter(t, block=block, backend=backend(torch.float32))
    xp = random_xpress_head(t.vocab_size, t.hidden_size, 8, block, seed=2, std=0.3).cuda().fold()
    mk = random_markov_head("vanilla", t.vocab_size, t.hidden_size, 8, seed=3, std=0.3).cuda()
    return {"AR": (None, None), "drafter-only": (d, None), "xpress-K6": (d, XPressRefiner(xp, 6)),
            "xpress-K2-C8": (d, XPressRefiner(xp, 2, topc=8)), "markov": (d, MarkovRefiner(mk)),
            # a refiner captured as its own graph (the lab's) runs uncaptured inside the step graph
            "xpress-K6-wrapped": (d, CapturedRefiner(XPressRefiner(xp, 6)))}


@pytest.mark.parametrize("bucket", [16, 512])  # 512: one bucket over the whole cache (graph_bucket >= 1)
def test_step_graphs_give_the_eager_tokens(bucket):
    b = backend(torch.float32)
    t = tiny_target("qwen3", backend=b)
    for name, (d, r) in _arms(t).items():
        for i, p in enumerate(prompts(6)):
            s = DecodeSettings(10 + 7 * i, 512, (3, 5))
            eager = generate(t, p, s, b, drafter=d, refiner=r)
            g = generate(t, p, dataclasses.replace(s, use_graph=True, graph_bucket=bucket), b, drafter=d,
                         refiner=r)
            assert g.tokens == eager.tokens, f"{name}, prompt {i}, bucket {bucket}"
            assert g.accepted == eager.accepted and g.stop_reason == eager.stop_reason
            assert g.graph_steps == len(g.accepted) and g.graph_note == ""
    print("graph stats", DecodeState.of(t).graphs.stats())


def test_step_graphs_near_the_context_limit_and_scripted():
    b = backend(torch.float32)
    t = tiny_target("qwen3", backend=b)
    d = tiny_drafter(t, block=4, backend=b)
    limit = 40
    for n in (limit - 6, limit - 5, limit - 4):
        p = [(7 * i) % 90 + 8 for i in range(n)]
        s = DecodeSettings(500, limit, ())
        eager = generate(t, p, s, b, drafter=d)
        g = generate(t, p, dataclasses.replace(s, use_graph=True, graph_bucket=16), b, drafter=d)
        assert g.tokens == eager.tokens and g.stop_reason == "max_model_len"
    s = DecodeSettings(30, 512, (), scripted_accept=2, use_graph=True)
    g = generate(t, [9, 10, 11], s, b, drafter=d)
    assert g.accepted == [2] * len(g.accepted) and len(g.tokens) == 30


def test_step_graphs_capture_once_and_sync_once_per_step():
    b = backend(torch.float32)
    t = tiny_target("qwen3", backend=b)
    d = tiny_drafter(t, block=4, backend=b)
    s = DecodeSettings(24, 512, (), use_graph=True)
    generate(t, [9, 10, 11], s, b, drafter=d)  # warm: captures
    before = DecodeState.of(t).graphs.captures
    g, syncs = count_syncs(lambda: generate(t, [9, 10, 11], s, b, drafter=d))
    print(f"graphed: implicit syncs {syncs} for {g.host_syncs} steps")
    assert DecodeState.of(t).graphs.captures == before, "a warm generation must not capture again"
    assert syncs <= g.host_syncs + 4


def test_step_graphs_sampling():
    """T > 0: a graph draws from the per-(prompt, turn) generator's state (register_generator_state), so the
    tokens equal the eager ones for the same seed; without that API the steps run eagerly and say so."""
    b = backend(torch.float32)
    t = tiny_target("qwen3", backend=b)
    for name, (d, r) in _arms(t).items():
        if name == "xpress-K6-wrapped":
            continue
        s = DecodeSettings(24, 512, (3, 5), temperature=1.0)
        for i, p in enumerate(prompts(3)):
            eager = generate(t, p, s, b, drafter=d, refiner=r, generator=b.generator(i))
            g = generate(t, p, dataclasses.replace(s, use_graph=True), b, drafter=d, refiner=r,
                         generator=b.generator(i))
            assert g.tokens == eager.tokens, f"{name}, prompt {i}: {g.graph_note}"
    print("T>0 graphs:", g.graph_note or "captured with the generator registered")
