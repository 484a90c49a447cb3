"""A GGUF target is converted once into an HF directory (harness.decode.gguf_cache); later loads read only that
directory and give the same weights, tokenizer and config as transformers' GGUF loader."""
import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from harness.decode import gguf_cache
from core.devices import Backend
from harness.decode.accounting import STANDARD, model_stop_ids
from harness.decode.loading import load_target, load_target_config, load_tokenizer
from harness.protocol.data import render_prompt
from harness.protocol.setups import REPO
from tiny import CPU32
from tiny_gguf import EOS, write_tiny_gguf

CPU16 = Backend(torch.device("cpu"), torch.bfloat16)


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


def _tiny(tmp_path, monkeypatch):
    """The tiny GGUF (tests/tiny_gguf.py) in its own folder, with an empty cache."""
    gguf = tmp_path / "m" / "Tiny-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    write_tiny_gguf(gguf)
    monkeypatch.setenv("XPRESS_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.ENV, raising=False)
    return gguf


def test_a_converted_gguf_loads_without_the_gguf_and_gives_the_same_model(tmp_path, monkeypatch):
    """On a tiny Q4_1 GGUF shaped like SmolLM2's (tests/tiny_gguf.py): the converted directory, read through the
    harness's loaders with any parse of the GGUF refused, gives what transformers' GGUF loader gives: the config,
    the tokenizer (vocabulary, template, special ids, the eval prompts' renderings) and the weights bit for bit at
    float32 and bfloat16. The real 98 MB file is checked the same way by every conversion (gguf_cache.verify, run
    by the main job on its first use; this test converted it in ~45 s on the 2-core machine before)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = _tiny(tmp_path, monkeypatch)
    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    assert gguf_cache.cached(str(gguf)) is None  # the config check never converts
    load_tokenizer(str(gguf))  # the first load converts
    folder = gguf_cache.cached(str(gguf))
    assert folder and folder.startswith(str(tmp_path / "cache"))
    assert not [p for p in os.listdir(os.path.dirname(folder)) if p.endswith(".part")]
    ref_tok = AutoTokenizer.from_pretrained(**where)
    # transformers' GGUF reader dequantizes to fp32 and casts to the dtype asked for
    ref = {dtype: AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
           for dtype in (torch.float32, torch.bfloat16)}
    ref_config = copy.deepcopy(ref[torch.float32].config)
    del ref_config.quantization_config  # the quantizer's mark, which the load adds
    _no_gguf_reads(monkeypatch)  # from here on, any parse of the GGUF itself fails

    config = load_target_config(str(gguf)).to_dict()
    want = ref_config.to_dict()
    assert {k: v for k, v in config.items() if k not in gguf_cache.CONFIG_BOOKKEEPING} == \
        {k: v for k, v in want.items() if k not in gguf_cache.CONFIG_BOOKKEEPING}
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
        assert model_stop_ids(target.model, tok, STANDARD) == model_stop_ids(ref[backend.dtype], ref_tok, STANDARD) \
            == (EOS,)


def _bump_a_tensor(folder):
    from safetensors.torch import load_file, save_file
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = torch.nextafter(tensors[name].view(-1)[0], torch.tensor(1.0))  # one ulp
    save_file(tensors, str(f), metadata={"format": "pt"})


def _drop_a_merge(folder):
    f = folder / "tokenizer.json"
    d = json.loads(f.read_text())
    d["model"]["merges"] = d["model"]["merges"][1:]
    f.write_text(json.dumps(d))


def _change_the_config(folder):
    f = folder / "config.json"
    d = json.loads(f.read_text())
    d["rms_norm_eps"] = d["rms_norm_eps"] * 2
    f.write_text(json.dumps(d))


@pytest.mark.parametrize("spoil, names", [(_bump_a_tensor, "tensor"), (_drop_a_merge, "tokenizer pipeline"),
                                          (_change_the_config, "config rms_norm_eps")])
def test_a_conversion_that_saved_something_else_is_refused_and_leaves_nothing(tmp_path, monkeypatch, capsys,
                                                                                 spoil, names):
    """gguf_cache.verify: a save that changed one weight by one ulp, dropped one BPE merge or changed a config
    value fails the conversion; the run reads the GGUF itself (ensure gives None) and no directory is left. Without
    verify, each of these would be put in place and read by every later run."""
    gguf = _tiny(tmp_path, monkeypatch)
    save = gguf_cache.save_plain

    def lossy(model, tokenizer, folder):
        save(model, tokenizer, folder)
        spoil(Path(folder))
    monkeypatch.setattr(gguf_cache, "save_plain", lossy)
    assert gguf_cache.ensure(str(gguf)) is None
    err = capsys.readouterr().err
    assert "differs from the GGUF's load: " + names in err and "reading the GGUF itself" in err
    assert not [p for p in (tmp_path / "cache" / "hf").iterdir()]


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
