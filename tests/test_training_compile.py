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
    with pytest.raises(UsageError, match="train.compile 'max': use one of auto, model, attention, none"):
        load_config(str(p))
