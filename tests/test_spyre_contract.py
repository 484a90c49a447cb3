"""The Spyre serving contract fails before any model loads, with the reason; --device spyre needs torch-spyre."""
from types import SimpleNamespace

import pytest
import torch

import benchmark_compile_all as cli
from core.errors import UsageError
from harness.protocol import spyre_contract as sc
from harness.protocol.flags import parse_args
from refiners.formats import RefinerCheckpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tiny import write_run_fixture
    return write_run_fixture(tmp_path_factory.mktemp("spyre"), [{"turns": ["Add 2 and 3."]}])


def argv(files, *extra):
    return ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
            "--dataset", "mini", "--data-dir", str(files / "data"), "--results-dir", str(files / "results"),
            "--device", "spyre", *extra]


REFUSED = {  # the flags, and what the one-line error says
    "FP16 weights only, not --dtype float32": ["--dtype", "float32"],
    "FP16 weights only": ["--dtype", "bfloat16"],
    "--xpress-topc 0 (full-vocabulary scoring every pass) is not served": ["--xpress-topc", "0"],
    "above the largest Spyre shortlist (1024)": ["--xpress-topc", "1025"],
    "at least 31 token slots": ["--max-num-batched-tokens", "30"],
    "block = anchor + 15 = 16": ["--block-size", "8"],
    "CUDA graphs": ["--use-graph"],
}


@pytest.mark.parametrize("reason, extra", REFUSED.items())
def test_unsupported_configuration_fails_before_loading(files, reason, extra, capsys, monkeypatch):
    import harness.protocol.runner as runner
    import harness.protocol.build as build
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(build, "load_target_config", lambda *a, **k: pytest.fail("a config was read"))
    assert cli.main(argv(files, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and reason in err and "\n" not in err


def test_budget_of_31_is_enough_and_gguf_is_quantized():
    ok = parse_args(["--model-name-or-path", "t", "--draft-name-or-path", "d", "--dataset", "x", "--device",
                     "spyre", "--max-num-batched-tokens", "31"])
    assert sc.budget_of(ok) == 31 and sc.per_request_budget(16) == 31
    with pytest.raises(UsageError, match="quantized"):
        parse_args(["--model-name-or-path", "m.Q4_K_M.gguf", "--ar-only", "--dataset", "x", "--device", "spyre"])


def hide_torch_spyre(monkeypatch):
    """Make `import torch_spyre` fail as it does where the package is absent (also where it is installed)."""
    import builtins
    real = builtins.__import__

    def no_spyre(name, *a, **k):
        if name == "torch_spyre":
            raise ImportError("No module named 'torch_spyre'", name="torch_spyre")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_spyre)


def test_missing_torch_spyre_names_the_package_and_its_source(files, capsys, monkeypatch):
    hide_torch_spyre(monkeypatch)
    assert cli.main(argv(files)) == 2
    err = capsys.readouterr().err
    for part in ("torch-spyre", "not on PyPI", "github.com/torch-spyre/torch-spyre", "vllm-spyre-next",
                 "'ibm-spyre' 0.0.1 is an empty placeholder"):
        assert part in err, part


def test_torch_spyre_is_imported_only_for_spyre():
    from core.devices import resolve_backend
    from core.spyre import spyre_backend
    asked = []
    with pytest.raises(UsageError, match="did not register"):
        spyre_backend("spyre", None, importer=lambda name: asked.append(name))  # imports, but no device type
    assert asked == ["torch_spyre"]
    assert resolve_backend("cpu", None).dtype == torch.float32  # and nothing else imports it
    with pytest.raises(UsageError, match="FP16"):
        spyre_backend("spyre", "bfloat16", importer=lambda name: pytest.fail("imported before the dtype check"))


def cfg(*extra):
    return parse_args(["--model-name-or-path", "t", "--draft-name-or-path", "d", "--dataset", "x", "--device",
                       "spyre", *extra])


def ckpt(block=16, passes=None, topc=None):
    return RefinerCheckpoint("xpress", None, {}, rank=8, block_size=block, num_passes=passes, topc=topc,
                             source="UIUC-SSAIL/Qwen3-8B-XPress-b16")


TCFG = SimpleNamespace(vocab_size=151936)


def test_k_and_c_precedence_flag_then_checkpoint_then_default():
    assert (sc.check_models(cfg(), TCFG, 16).passes, sc.check_models(cfg(), TCFG, 16).topc) == (6, 512)
    p = sc.check_models(cfg(), TCFG, 16, ckpt(passes=4, topc=128))
    assert (p.passes, p.topc, p.shortlist) == (4, 128, 128)
    p = sc.check_models(cfg("--xpress-refine-passes", "3", "--xpress-topc", "256"), TCFG, 16, ckpt(passes=4, topc=128))
    assert (p.passes, p.topc) == (3, 256)
    small = sc.check_models(cfg("--xpress-topc", "1000"), SimpleNamespace(vocab_size=300), 16)
    assert small.shortlist == 300  # C = min(topc, V)
    assert p.compile_sizes == (1, 16, 64) and "K=3" in p.describe()


@pytest.mark.parametrize("kw, reason", [
    (dict(block=8), "block 8 (the xPress checkpoint"),
    (dict(topc=0), "asks for xpress_topc 0"),
])
def test_checkpoint_contract(kw, reason):
    with pytest.raises(UsageError, match=reason.replace("(", r"\(")):
        sc.check_models(cfg(), TCFG, 16, ckpt(**kw))


def test_block_other_than_16_and_quantized_targets_are_refused():
    with pytest.raises(UsageError, match="got block 8"):
        sc.check_models(cfg(), TCFG, 8)
    quant = SimpleNamespace(vocab_size=10, quantization_config={"quant_method": "awq"})
    with pytest.raises(UsageError, match="quantized \\(awq\\)"):
        sc.check_models(cfg(), quant, 16)
    nested = SimpleNamespace(text_config=SimpleNamespace(vocab_size=10, quantization_config={"quant_method": "fp8"}))
    with pytest.raises(UsageError, match="fp8"):
        sc.check_models(cfg(), nested, 16)


def test_given_flags_are_the_explicit_ones():
    c = parse_args(["--model-name-or-path", "t", "--draft-name-or-path", "d", "--dataset", "x", "--xpress-topc", "0"])
    assert "xpress_topc" in c.given and "xpress_refine_passes" not in c.given and "dataset" in c.given
