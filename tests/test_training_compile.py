"""train.compile (training/compiling.py): speculators 0.9.0 compiles each speculator's whole forward on CUDA, which
cost 248.7 s of a 256.9 s box on the H200. "attention" runs the forward eagerly and compiles flex attention alone;
"none" compiles nothing; "model" keeps speculators' behaviour. These tests use a forward decorated with
torch.compile as speculators' decorator does on CUDA (never called here, so nothing compiles on the CPU)."""
import json

import pytest
import torch

from core.errors import UsageError
from training import compiling


class _Decorated(torch.nn.Module):
    @torch.compile
    def forward(self, x):
        return x + 1


def _orig():
    return _Decorated.forward._torchdynamo_orig_callable


@pytest.mark.parametrize("mode,eager", [("none", True), ("attention", True), ("model", False), ("auto", True)])
def test_compile_modes_on_cuda(mode, eager, monkeypatch):
    import speculators.models.attention as attention
    monkeypatch.setattr(attention, "flex_attention", attention.flex_attention)  # restored after the test
    before = attention.flex_attention
    m = _Decorated()
    resolved = compiling.apply(m, mode, "cuda")
    assert resolved == {"auto": "attention"}.get(mode, mode)
    bound = getattr(m.forward, "__func__", None)
    assert (bound is _orig()) == eager  # the undecorated forward, bound to this instance only
    assert type(m).forward is not _orig()  # the class (every other instance) is untouched
    assert (attention.flex_attention is not before) == (resolved == "attention")


def test_auto_compiles_nothing_on_a_cpu():
    m = _Decorated()
    assert compiling.apply(m, "auto", "cpu") == "none" and m.forward.__func__ is _orig()


def test_an_undecorated_forward_is_left_alone():
    m = torch.nn.Linear(2, 2)
    assert not compiling.eager_forward(m) and "forward" not in m.__dict__


def test_unknown_compile_mode_is_refused(tmp_path):
    from training.config import load_config
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"target": "t", "models": {"d": {}}, "train": {"compile": "max"}}))
    with pytest.raises(UsageError, match="train.compile 'max': use one of auto, model, layers, attention, none"):
        load_config(str(p))


def test_layers_mode_compiles_each_draft_layer_and_leaves_the_rest_eager(monkeypatch):
    import speculators.models.attention as attention
    monkeypatch.setattr(attention, "flex_attention", attention.flex_attention)

    class Drafter(_Decorated):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    m = Drafter()
    assert compiling.apply(m, "layers", "cuda") == "layers"
    assert m.forward.__func__ is _orig()  # the model's own forward eager
    assert all(layer._compiled_call_impl is not None for layer in m.layers)
    assert Drafter().layers[0]._compiled_call_impl is None  # in place, this instance only


def test_dynamo_takes_speculators_draft_layer_whole_and_does_not_recompile(tmp_path):
    """train.compile=layers relies on it: speculators 0.9.0's DFlash decoder layer traced in one graph (no break),
    and a new step's data and block mask reuse it (no recompile); the traced forward gives the eager logits.
    Traced with dynamo's "eager" backend (nothing compiles on this CPU), with flex attention and its block masks as
    on a GPU (forward only: the CPU has no flex backward)."""
    from torch._dynamo.utils import counters
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators_forward import every_anchor_logits
    from tiny import save_tiny_checkpoint
    save_tiny_checkpoint(tmp_path / "target")
    tl = create_transformer_layer_config(str(tmp_path / "target"), 2, "qwen3", None, 4096, [0, 1])
    torch.manual_seed(0)
    m = DFlashDraftModel.from_training_args(
        tl, verifier_name_or_path=str(tmp_path / "target"), target_layer_ids=[1, 3, 5], block_size=4,
        draft_vocab_size=tl.vocab_size, mask_token_id=tl.vocab_size - 1, sample_from_anchor=False,
        draft_attn_impl="simple_flex_attention").eval()  # the GPU's attention: a new block mask each step
    compiling.eager_forward(m)
    h, n = tl.hidden_size, 24

    def logits(seed):
        g = torch.Generator().manual_seed(seed)
        return every_anchor_logits(m, torch.randn(1, n, 3 * h, generator=g), torch.randint(8, 100, (1, n), generator=g),
                                   torch.randn(1, n, h, generator=g), 4, 4)
    want = [logits(s) for s in (1, 2)]
    torch._dynamo.reset()
    counters.clear()
    assert compiling.compile_layers(m, backend="eager") == 2
    got = [logits(1)]
    graphs = counters["stats"]["unique_graphs"]
    got.append(logits(2))
    assert not counters["graph_break"] and 1 <= graphs <= 2  # one graph a layer at most (torch may share it)
    assert counters["stats"]["unique_graphs"] == graphs  # the second step's data and block mask: no new graph
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ops, traced: bit for bit


def test_flex_kernel_options_reach_flex_attention(monkeypatch):
    """train.flex_kernel_options: "auto" makes our compiled flex attention pass 64 x 64 forward tiles (the default
    forward spilled and took 4x its backward on an H100: results/perf/flex_h100/), {} passes none (torch's choice), a
    dict passes itself, a caller's own kernel_options win; the mode's record says what was put in place (None where
    ours is not). torch.compile and flex_attention are stand-ins here (nothing compiles on the CPU)."""
    import speculators.models.attention as attention
    import torch.nn.attention.flex_attention as fa
    monkeypatch.setattr(attention, "flex_attention", attention.flex_attention)
    monkeypatch.setattr(compiling, "_COMPILED_FLEX", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    seen = []
    monkeypatch.setattr(fa, "flex_attention", lambda q, k, v, **kw: seen.append(kw.get("kernel_options")))
    for value, passed in [("auto", {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}), ({}, None),
                          ({"fwd_num_warps": 8}, {"fwd_num_warps": 8})]:
        m = _Decorated()
        assert compiling.apply(m, "attention", "cuda", value) == "attention"
        attention.flex_attention(1, 2, 3, block_mask=None)
        assert seen.pop() == passed and m.xb_flex_kernel_options == (passed or {})
    attention.flex_attention(1, 2, 3, kernel_options={"fwd_num_warps": 4, "fwd_num_stages": 2})
    assert seen.pop() == {"fwd_num_warps": 4, "fwd_num_stages": 2}  # the caller's key wins, its others added
    m = _Decorated()
    compiling.apply(m, "model", "cuda", "auto")
    assert m.xb_flex_kernel_options is None


@pytest.mark.parametrize("value", [5, "fast", ["fwd_num_warps", 8], {"fwd_num_warps": "8"}])
def test_bad_flex_kernel_options_are_refused(tmp_path, value):
    from training.config import load_config
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"target": "t", "models": {"d": {}}, "train": {"flex_kernel_options": value}}))
    with pytest.raises(UsageError, match="train.flex_kernel_options .*: use auto"):
        load_config(str(p))


def test_flex_with_kernel_options_traces_alone_and_inside_a_compiled_layer(monkeypatch):
    """The flex attention compile_attention_only installs (a partial carrying the kernel options) computes flex
    attention's output, called directly and from inside a compiled caller, as a draft layer compiled by
    train.compile=layers calls it (dynamo traces through the partial). Dynamo only (backend "eager"): the options
    pick GPU tiles, which a CPU has none of."""
    import speculators.models.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    real_compile = torch.compile
    monkeypatch.setattr(attention, "flex_attention", attention.flex_attention)
    monkeypatch.setattr(compiling, "_COMPILED_FLEX", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{"backend": "eager", **kw}))
    torch._dynamo.reset()
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu")
    q, k, v = (torch.randn(1, 3, 256, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        want = flex_attention(q, k, v, block_mask=bm)
        compiling.compile_attention_only(compiling.flex_options("auto"))
        assert torch.allclose(attention.flex_attention(q, k, v, block_mask=bm), want, rtol=0, atol=1e-6)
        layer = real_compile(lambda q, k, v: attention.flex_attention(q, k, v, block_mask=bm) * 2, backend="eager")
        assert torch.allclose(layer(q, k, v) / 2, want, rtol=0, atol=1e-6)
    torch._dynamo.reset()
