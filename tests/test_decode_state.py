"""The decode's own state (harness.decode.state) apart from the target: graphs, samplers and buffers live in a
DecodeState and its slots, a change to what a step launches drops its graphs, both target families share their
fields through one code path, and the settings refuse what the runner would divide by. CPU only: graphs through a
fake that counts captures."""
import pytest
import torch

from core.errors import UsageError
from core.ops import TorchOps
from gemma_tiny import gemma_target
from harness.decode import loop, state
from harness.decode.graphs import StepGraphs, check_use_graph
from harness.decode.loop import DecodeSettings, generate
from harness.decode.state import DecodeState, graph_stats
from tiny import CPU32, tiny_drafter, tiny_target


class CountingGraphs:
    """StepGraphs' interface on CPU: every new (arm, shape) key is a capture; steps run eagerly."""
    rng_unsupported = StepGraphs.rng_unsupported
    capacity_for, length = staticmethod(StepGraphs.capacity_for), staticmethod(StepGraphs.length)
    made = 0

    def __init__(self, device):
        CountingGraphs.made += 1
        self.keys, self.captures = set(), 0

    def adopt_rng(self, generator):
        return False

    def run(self, stepper, speculative, width, length):
        key = (id(stepper.drafter), speculative, width, length)
        if key not in self.keys:
            self.keys.add(key)
            self.captures += 1
        return stepper.step(speculative, width, length)

    def stats(self):
        return {"graphs": len(self.keys), "captures": self.captures}


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setattr(loop, "_check", lambda settings, backend: None)  # --use-graph is CUDA-only otherwise
    monkeypatch.setattr(state, "StepGraphs", CountingGraphs)


@pytest.mark.parametrize("change", ["use_ops", "use_fp32_logits", "fuse_projections"])
def test_a_change_to_what_a_step_launches_drops_the_states_graphs(counting, change):
    """Guards the invalidation that `target.step_graphs = None` did: after use_ops / use_fp32_logits /
    fuse_projections a state never replays graphs captured before (they hold the old launches)."""
    t = tiny_target("qwen3", capacity=128)
    st = DecodeState.of(t)
    g = st.step_graphs()
    assert st.step_graphs() is g and st.graphs is g  # kept while nothing changes
    {"use_ops": lambda: t.use_ops(TorchOps()), "use_fp32_logits": t.use_fp32_logits,
     "fuse_projections": t.fuse_projections}[change]()
    assert st.graphs is None and graph_stats(t) == {}
    assert st.step_graphs() is not g


def test_a_generation_after_use_ops_captures_again(counting):
    """The same invalidation through generate(): a warm generation captures nothing, one after use_ops captures
    its shapes again in new graphs."""
    t = tiny_target("qwen3", capacity=128)
    s = DecodeSettings(20, 120, (), use_graph=True, graph_bucket=16)
    assert generate(t, [9, 10, 11], s, CPU32).graph_captures > 0
    assert generate(t, [9, 10, 11], s, CPU32).graph_captures == 0
    t.use_ops(TorchOps())
    again = generate(t, [9, 10, 11], s, CPU32)
    assert again.graph_captures > 0 and again.graph_steps > 0


def test_the_target_holds_no_per_generation_state():
    """Guards item 3 of issue 25: step graphs, samplers and the gap buffer are the decode state's (its slot's),
    not attributes of the target; a generation handed its own state uses that state's slot and leaves the
    target's default one alone, and the slot's request holds the generation's bookkeeping."""
    t = tiny_target("qwen3", capacity=128)
    d = tiny_drafter(t, block=4)
    s = DecodeSettings(12, 120, (3, 5), temperature=1.0, record_gaps=True)
    mine = DecodeState(t)
    g = generate(t, [9, 10, 11], s, CPU32, drafter=d, generator=CPU32.generator(0), state=mine)
    for name in ("step_graphs", "samplers", "gap_buffer"):
        assert not hasattr(t, name), name
    slot = mine.slot
    assert len(slot.samplers) == 1 and slot.gaps is not None and slot.gaps.numel() >= 3 + 12
    r = slot.request
    assert (r.prompt_len, r.max_new_tokens, r.produced, r.stop) == (3, 12, len(g.tokens), g.stop_reason)
    assert r.pos >= 3 + len(g.tokens) - 1 and not r.extra
    default = DecodeState.of(t).slot
    assert default.request is None and default.samplers == {} and default.gaps is None
    assert generate(t, [9, 10, 11], s, CPU32, drafter=d, generator=CPU32.generator(0)).tokens == g.tokens


def test_both_target_families_have_the_same_decode_fields():
    """Guards the drift between Target.__init__ and Gemma4Target.__init__ (which did not call it and repeated the
    fields, without the fp32 head or a version): both set theirs through Target._bind, and what one has that the
    other lacks is only its family's own layer detail."""
    plain, gemma = vars(tiny_target("qwen3")), vars(gemma_target())
    assert set(plain) - set(gemma) == {"groups", "scale", "_act"}
    assert set(gemma) - set(plain) == {"embed_scale", "cap", "kinds", "window", "route_log"}
    for name in ("pos", "kv", "ops", "version", "_lm_fp32", "_fused", "backend", "taps", "vocab_size"):
        assert name in plain and name in gemma, name


def test_graph_bucket_below_one_is_refused_where_the_settings_are_made():
    """Guards the runner's presize, which divides by graph_bucket: 0 (or less) was accepted by the loop's check,
    then divided by; now DecodeSettings refuses it with one line."""
    for bad in (0, -16, True, 2.5):
        with pytest.raises(UsageError, match="graph bucket must be an integer >= 1") as e:
            DecodeSettings(10, 100, (), use_graph=True, graph_bucket=bad)
        assert "\n" not in str(e.value)
    assert DecodeSettings(10, 100, (), graph_bucket=1).graph_bucket == 1


def test_one_cuda_check_for_use_graph():
    """Guards the three copies of "--use-graph needs CUDA" (loop, StepGraphs, the run's preparation) drifting: the
    loop and StepGraphs refuse through graphs.check_use_graph, with its one message."""
    with pytest.raises(UsageError) as want:
        check_use_graph(True, "cpu")
    check_use_graph(False, "cpu")
    check_use_graph(True, "cuda")
    with pytest.raises(UsageError) as by_loop:
        generate(tiny_target("qwen3"), [9, 10], DecodeSettings(4, 100, (), use_graph=True), CPU32)
    with pytest.raises(UsageError) as by_graphs:
        StepGraphs(torch.device("cpu"))
    assert str(by_loop.value) == str(by_graphs.value) == str(want.value)
    assert "--device cuda" in str(want.value) and "cpu" in str(want.value)
