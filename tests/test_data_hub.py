"""Datasets from the hub, offline (a fake hub): the resolved commit recorded, pinned revisions, offline mode, the
LiveCodeBench files, one-line errors; and the provenance hashes."""
import hashlib
import json
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

import harness.protocol.data as data_mod
from harness.protocol.data import (HUB_SOURCES, KNOWN_DATASETS, DatasetSourceError, dataset_provenance, hub_offline,
                                   load_samples, render_prompt, subset_rows)
from core.errors import UsageError

from eval_files import EVAL_DIR, needs_eval
from data_templates import SUFFIX, EXPECTED_ROWS, _lcb_raw, _local_turns, _write  # noqa: F401


# ------------------------------------------------------------------ hub plumbing, offline (fake hub)

class _FakeInfo:
    sha = "ab" * 20


@pytest.fixture
def fake_hub(monkeypatch):
    """HfApi.dataset_info, datasets.load_dataset and hf_hub_download replaced; records the calls."""
    import datasets
    import huggingface_hub
    calls = []

    def dataset_info(self, repo, revision=None, timeout=None, **kw):
        calls.append(("info", repo, revision, timeout))
        return _FakeInfo()

    def load_dataset(repo, config=None, split=None, revision=None, **kw):
        calls.append(("load", repo, config, split, revision))
        return [{"question": "q0", "answer": "a"}, {"question": "q1", "answer": "b"},
                {"question": "q2", "answer": "c"}]

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(data_mod, "_HUB_LOADED", {})
    return calls


def test_hub_load_reads_the_resolved_commit_and_records_it(fake_hub):
    samples = load_samples("gsm8k", None, 2)
    assert fake_hub == [("info", "openai/gsm8k", None, data_mod.HUB_PROBE_TIMEOUT_S),
                        ("load", "openai/gsm8k", "main", "test", "ab" * 20)]
    assert [s.row for s in samples] == subset_rows(3, 2)
    assert [s.turns for s in samples] == [(f"q{r}" + SUFFIX,) for r in subset_rows(3, 2)]
    assert all(s.source == f"hub openai/gsm8k config=main split=test revision=unpinned resolved={'ab' * 20}"
               for s in samples)
    prov = dataset_provenance("gsm8k", None)
    rows_jsonl = "".join(json.dumps({"turns": [f"q{i}" + SUFFIX]}) + "\n" for i in range(3))
    assert prov == {"source": "hub", "repo": "openai/gsm8k", "config": "main", "split": "test",
                    "revision": "unpinned", "resolved_revision": "ab" * 20, "file": None,
                    "sha256": hashlib.sha256(rows_jsonl.encode()).hexdigest()}


def test_hub_load_uses_a_pinned_revision(fake_hub, monkeypatch):
    pin = "cd" * 20
    monkeypatch.setitem(HUB_SOURCES, "gsm8k", HUB_SOURCES["gsm8k"]._replace(revision=pin))
    samples = load_samples("gsm8k", None, None)
    assert fake_hub[0][:3] == ("info", "openai/gsm8k", pin) and fake_hub[1][-1] == "ab" * 20
    assert samples[0].source.endswith(f"revision={pin} resolved={'ab' * 20}")
    assert dataset_provenance("gsm8k", None)["revision"] == pin
    assert dataset_provenance("mbpp", None)["revision"] == "unpinned"


def test_offline_mode_skips_the_probe_and_reads_the_cache(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert hub_offline()
    samples = load_samples("gsm8k", None, None)
    assert [c[0] for c in fake_hub] == ["load"] and fake_hub[0][-1] is None
    assert samples[0].source == "hub openai/gsm8k config=main split=test revision=unpinned"


def test_livecodebench_reads_the_six_files_in_order(fake_hub, monkeypatch, tmp_path):
    import huggingface_hub
    fetched = []

    def hf_hub_download(repo, filename, repo_type=None, revision=None, **kw):
        fetched.append((repo, filename, repo_type, revision))
        path = tmp_path / filename
        rows = [{"question_content": f"{filename}#{k}", "starter_code": "" if k else "def f():",
                 "private_test_cases": "x" * 10} for k in range(2)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    samples = load_samples("livecodebench", None, None)
    files = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]
    assert fetched == [("livecodebench/code_generation_lite", f, "dataset", "ab" * 20) for f in files]
    assert [_lcb_raw(s.turns[0])["question_content"] for s in samples] == [f"{f}#{k}" for f in files
                                                                           for k in range(2)]
    assert _lcb_raw(samples[0].turns[0])["starter_code"] == "def f():"
    prov = dataset_provenance("livecodebench", None)
    assert prov["file"] == files and prov["split"] is None and prov["revision"] == "unpinned"


def test_unreachable_hub_fails_fast_in_one_line(monkeypatch):
    import huggingface_hub

    def dataset_info(self, repo, **kw):
        raise ConnectionError("[Errno -2] Name or service not known\nsecond line")

    def load_dataset(*a, **kw):
        raise AssertionError("no download may start when the probe fails")

    import datasets
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DatasetSourceError) as err:
        load_samples("mt-bench", None, None)
    msg = str(err.value)
    assert isinstance(err.value, UsageError) and "\n" not in msg
    assert "HuggingFaceH4/mt_bench_prompts" in msg and "Name or service not known" in msg and "--data-dir" in msg


def test_download_errors_become_one_line_usage_errors(fake_hub, monkeypatch):
    import datasets

    def load_dataset(*a, **kw):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DatasetSourceError, match="could not load 'gsm8k' .*--data-dir"):
        load_samples("gsm8k", None, None)


# ------------------------------------------------------------------ provenance

def test_local_provenance_hashes_the_file(tmp_path):
    _write(tmp_path / "p.jsonl", [json.dumps({"turns": ["a"]})])
    prov = dataset_provenance("p", str(tmp_path))
    assert prov["source"] == "local" and prov["file"] == str((tmp_path / "p.jsonl").resolve())
    assert prov["sha256"] == hashlib.sha256((tmp_path / "p.jsonl").read_bytes()).hexdigest()
    assert prov["repo"] is None and prov["revision"] is None
    assert load_samples("p", str(tmp_path), None)[0].source == f"local {tmp_path / 'p.jsonl'}"
    with pytest.raises(UsageError, match="not found"):
        dataset_provenance("q", str(tmp_path))
    with pytest.raises(UsageError, match="unknown dataset"):
        dataset_provenance("alpaca", None)


@needs_eval
def test_hub_prompt_hash_equals_the_local_file_hash_for_equal_prompts():
    """The sha256 recorded for a hub load is comparable with the local file's: same bytes, same hash."""
    for name in KNOWN_DATASETS:
        rows = _local_turns(name)
        assert data_mod._prompts_sha256(rows) == dataset_provenance(name, str(EVAL_DIR))["sha256"], name


# ------------------------------------------------------------------ the real hub (skips when unreachable)

@pytest.fixture(scope="module")
def hub_reachable():
    """One quick metadata request; any failure skips every hub test at once (no retries, no hang)."""
    if hub_offline():
        pytest.skip("HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set: hub equivalence test skipped")
    pytest.importorskip("datasets", reason="datasets is in requirements.txt: pip install 'datasets>=3'")
    from huggingface_hub import HfApi
    start = time.monotonic()
    try:
        HfApi().dataset_info("openai/gsm8k", timeout=5)
    except Exception as e:
        pytest.skip(f"HF hub not reachable ({type(e).__name__}: {' '.join(str(e).split())[:120]}; "
                    f"{time.monotonic() - start:.1f}s): hub-vs-local prompt test skipped, the offline template "
                    f"tests above cover the prompt strings")


@pytest.mark.network
@needs_eval
@pytest.mark.parametrize("name", KNOWN_DATASETS)
def test_hub_prompts_equal_local_files(hub_reachable, name):
    samples = load_samples(name, None, None)
    local = _local_turns(name)
    assert len(samples) == len(local) == EXPECTED_ROWS[name]
    for s, turns in zip(samples, local):
        assert s.turns == turns, f"{name} row {s.row}"
    assert dataset_provenance(name, None)["sha256"] == dataset_provenance(name, str(EVAL_DIR))["sha256"]


# ------------------------------------------------------------------------------------------- chat rendering

# Qwen3's shape: the empty think block appears only when the caller turns thinking off.
QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
PLAIN = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built offline: every string encodes, so a wrong rendering cannot hide behind <unk>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<|im_start|>", "<|im_end|>"])
    # a BOS-adding post-processor shows whether special tokens were added on top of the template
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>")


def test_render_single_turn_disables_thinking_and_adds_no_bos():
    tok = _byte_tokenizer()
    tok.chat_template = QWEN_LIKE
    ids = render_prompt(tok, [{"role": "user", "content": "Hi, é?"}])
    expected = "<|im_start|>user\nHi, é?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert tok.decode(ids) == expected
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.bos_token_id not in ids
    assert all(type(i) is int for i in ids)


def test_render_multi_turn_history():
    tok = _byte_tokenizer()
    tok.chat_template = QWEN_LIKE
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "reply"},
                {"role": "user", "content": "two"}]
    expected = ("<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\nreply<|im_end|>\n"
                "<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(render_prompt(tok, messages)) == expected


def test_render_template_without_enable_thinking_ignores_it():
    tok = _byte_tokenizer()
    tok.chat_template = PLAIN
    ids = render_prompt(tok, [{"role": "user", "content": "Hi"}])
    assert ids == tok.encode("[user] Hi\n[assistant] ", add_special_tokens=False)


def test_render_without_template_falls_back_to_plain_text():
    tok = _byte_tokenizer()
    assert not getattr(tok, "chat_template", None)
    ids = render_prompt(tok, [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}])
    assert ids == tok.encode("one\n\ntwo", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id
