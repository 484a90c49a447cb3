"""Every step graph is captured before the measured rounds (harness.decode.capture_plan), captures are counted per
generation, and a capture inside a measured round fails the run. On CPU through a fake graph layer that keys,
counts and runs steps exactly as harness.decode.graphs.StepGraphs does, minus the CUDA capture itself."""
import pytest
import torch

from harness.decode import capture_plan, loop, state
from harness.decode.graphs import StepGraphs
from harness.decode.loop import DecodeSettings, generate
from harness.decode.state import DecodeState
from core.errors import UsageError
from harness.protocol.rounds import refuse_captures
from tiny import CPU32, tiny_drafter, tiny_target

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread")


class FakeGraphs:
    """StepGraphs' interface on CPU: a new key is a capture; a step runs eagerly at the graph's bucket length. As in
    StepGraphs, a graph reads the output buffer (the decode state's) by address: when the buffer is reallocated,
    the graphs captured with the old one are dropped."""
    rng_unsupported = StepGraphs.rng_unsupported
    capacity_for, length = staticmethod(StepGraphs.capacity_for), staticmethod(StepGraphs.length)

    def __init__(self):
        self.keys, self.captures = set(), 0

    def adopt_rng(self, generator):
        return False

    def run(self, stepper, speculative, width, length):
        key = (id(stepper.drafter), speculative, width, length, stepper.out.data_ptr())
        self.keys = {k for k in self.keys if k[-1] == key[-1]}
        if key not in self.keys:
            self.keys.add(key)
            self.captures += 1
        return stepper.step(speculative, width, length)


@pytest.fixture
def fake(monkeypatch):
    g = FakeGraphs()
    monkeypatch.setattr(loop, "_check", lambda settings, backend: None)  # --use-graph is CUDA-only otherwise
    monkeypatch.setattr(state, "StepGraphs", lambda device: g)  # what a DecodeState makes
    return g


def test_shapes_cover_every_position():
    got = capture_plan.shapes(limit=90, capacity=96, bucket=16, width=4)
    assert (True, 4, 16) in got and (True, 4, 96) in got and (False, 1, 96) in got  # the tail near the limit
    assert all(length % 16 == 0 for _, _, length in got)
    assert capture_plan.shapes(limit=100, capacity=96, bucket=0, width=1) == [(False, 1, 96)]


@pytest.mark.parametrize("compat", [False, True])
def test_after_the_pre_capture_no_generation_captures(fake, compat):
    t = tiny_target("qwen3", capacity=128)
    d = tiny_drafter(t, block=4)
    s = DecodeSettings(40, 120, (), use_graph=True, graph_bucket=16, compat_reference=compat)
    t.ensure_capacity(128)
    d.ensure_capacity(128)
    capture_plan.reserve_output(t, 4)  # the widest arm's block (the runner's presize does this)
    for drafter, width in ((None, 1), (d, 4)):
        decode = lambda tokens, st: generate(t, tokens, st, CPU32, drafter=drafter, generator=CPU32.generator(0))
        before = fake.captures
        assert capture_plan.capture_every_shape(decode, [9, 10, 11], s, t.capacity, width) == fake.captures - before
    keys = set(fake.keys)
    for n in (1, 7, 30, 60, 75, 100):  # prompts of every length, to the context limit
        for drafter in (None, d):
            g = generate(t, list(range(8, 8 + n)), s, CPU32, drafter=drafter, generator=CPU32.generator(1))
            assert g.graph_captures == 0, (n, drafter is not None)
            assert g.graph_steps > 0
    assert fake.keys == keys and t.capacity == 128


def test_a_wider_arm_growing_the_output_buffer_drops_the_graphs_before(fake):
    """Why the output buffer is reserved: AR's graphs, captured first, are dropped when a block arm grows the buffer,
    so AR captures again in its next (measured) generation; the runner's presize reserves it for the widest arm."""
    s = DecodeSettings(20, 120, (), use_graph=True, graph_bucket=16)
    for reserve in (False, True):
        t = tiny_target("qwen3", capacity=128)  # a fresh target: a fresh decode state, output buffer and graphs
        d = tiny_drafter(t, block=4)
        fake.__init__()
        if reserve:
            capture_plan.reserve_output(t, 4)
        generate(t, [9, 10, 11], s, CPU32)                 # AR first (the rotation's first arm)
        generate(t, [9, 10, 11], s, CPU32, drafter=d)      # then a block arm
        again = generate(t, [9, 10, 11], s, CPU32).graph_captures
        assert again == (0 if reserve else 2), reserve  # buckets 16 and 32


def test_runner_presize_reserves_the_output_for_the_widest_arm(fake):
    from harness.protocol.runner import presize
    t = tiny_target("qwen3", capacity=64)
    presize(t, [], longest=10, settings=DecodeSettings(20, 120, (), use_graph=True, graph_bucket=16), block=16)
    out = DecodeState.of(t).slot.out
    assert out is not None and out.numel() >= t.capacity + 16 + 1


def test_a_generation_counts_its_captures(fake):
    t = tiny_target("qwen3", capacity=128)
    s = DecodeSettings(30, 120, (), use_graph=True, graph_bucket=16)
    first = generate(t, [9, 10, 11], s, CPU32)
    assert first.graph_captures == 2 == fake.captures  # buckets 16 and 32 (positions 3..32)
    assert generate(t, [9, 10, 11], s, CPU32).graph_captures == 0


def test_a_capture_in_a_measured_round_fails_the_run():
    rows = [{"warmup": True, "graph_captures": 3, "round": 1, "arm": "AR", "question_id": 0, "turn": 0},
            {"warmup": False, "graph_captures": 0, "round": 2, "arm": "AR", "question_id": 0, "turn": 0}]
    refuse_captures(rows, "samples.jsonl")  # captures in a warmup round are fine
    rows[1]["graph_captures"] = 1
    with pytest.raises(UsageError, match="measured round 2"):
        refuse_captures(rows, "samples.jsonl")


class RngFakeGraphs(FakeGraphs):
    """FakeGraphs with StepGraphs' randomness: the generation's generator state moves into one graph generator."""

    def __init__(self):
        super().__init__()
        self.rng = torch.Generator()

    adopt_rng, return_rng, _source = StepGraphs.adopt_rng, StepGraphs.return_rng, StepGraphs._source
    supports_rng = staticmethod(lambda: True)


def test_sampled_tokens_with_graphs_equal_eager(monkeypatch):
    """T > 0 with graphs: the prefill's draw and the steps' draws come from one stream (the adopted generator), so
    the tokens and the generator's final state equal the eager run's (the prefill drew from the caller's generator
    while the steps drew from a copy of its earlier state, so the first step repeated the prefill's numbers)."""
    g = RngFakeGraphs()
    monkeypatch.setattr(loop, "_check", lambda settings, backend: None)
    monkeypatch.setattr(state, "StepGraphs", lambda device: g)
    t = tiny_target("qwen3", capacity=128)
    d = tiny_drafter(t, block=4)
    s = DecodeSettings(24, 120, (), temperature=1.0)
    for drafter in (None, d):
        for seed in range(3):
            ge, gg = CPU32.generator(seed), CPU32.generator(seed)
            eager = generate(t, [9, 10, 11], s, CPU32, drafter=drafter, generator=ge)
            graphed = generate(t, [9, 10, 11], DecodeSettings(24, 120, (), temperature=1.0, use_graph=True),
                               CPU32, drafter=drafter, generator=gg)
            assert graphed.graph_steps > 0
            assert graphed.tokens == eager.tokens, (drafter is not None, seed)
            assert torch.equal(ge.get_state(), gg.get_state())
