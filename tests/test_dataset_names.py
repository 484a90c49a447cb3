"""A dataset name that does not exist lists the names that do and says which need the hub (harness.protocol.data),
and in the embedded default a typed hub dataset that data/eval/ does not ship is read from the hub
(harness.protocol.setups). `--dataset gsm9k` used to say only that data/eval/gsm9k.jsonl was missing, and
`--dataset livecodebench` (listed in --help as a hub dataset) failed as a missing file in data/eval/."""
import pytest

import benchmark_compile_all as cli
import harness.protocol.data as data
from core.errors import UsageError
from embedded_weights import fake_embedded
from harness.protocol import flags, setups

SHIPPED = ["aime24", "aime25", "gsm8k", "humaneval", "math500", "mbpp", "mt-bench"]


@pytest.fixture()
def embedded(monkeypatch, tmp_path):
    (tmp_path / "SmolLM2.gguf").write_bytes(b"")
    fake_embedded(monkeypatch, tmp_path, str(tmp_path / "SmolLM2.gguf"))


def test_the_shipped_names_are_the_files_of_data_eval():
    assert setups.jsonl_names(setups.DATA_DIR) == SHIPPED


def test_an_unknown_name_lists_the_shipped_and_the_hub_only_names():
    with pytest.raises(UsageError) as e:
        data.validate_dataset_args("gsm9k", None, 4)
    msg = str(e.value)
    assert f"shipped in data/eval/ (no hub needed): {', '.join(SHIPPED)}" in msg
    assert "from the HF hub only: livecodebench;" in msg and "\n" not in msg


def test_a_missing_file_lists_what_the_folder_holds(tmp_path):
    for name in ("b", "a"):
        (tmp_path / f"{name}.jsonl").write_text('{"turns": ["x"]}\n')
    with pytest.raises(UsageError, match=f"; {tmp_path} holds a, b$"):
        data.validate_dataset_args("c", str(tmp_path), 4)
    with pytest.raises(UsageError, match=f"{tmp_path} holds a, b; it is a hub dataset: omit --data-dir"):
        data.validate_dataset_args("livecodebench", str(tmp_path), 4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no .jsonl file"):
        data.validate_dataset_args("c", str(tmp_path / "empty"), 4)


def test_the_embedded_default_reads_an_unshipped_hub_dataset_from_the_hub(embedded):
    got = setups.apply(*flags.typed_values(["--device", "cpu", "--dataset", "livecodebench"])[:2])
    assert got["preset"] == setups.EMBEDDED and got["data_dir"] is None
    data.validate_dataset_args(got["dataset"], got["data_dir"], 4)  # a hub dataset: no file needed
    shipped = setups.apply(*flags.typed_values(["--device", "cpu", "--dataset", "mbpp"])[:2])
    assert shipped["data_dir"] == str(setups.DATA_DIR)


def test_a_hub_failure_does_not_point_at_data_eval_for_a_dataset_it_lacks(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def offline(*a, **k):
        raise OSError("not in the local cache")
    monkeypatch.setattr(data, "_hub_raw_rows", offline)
    with pytest.raises(UsageError) as e:
        data.load_samples("livecodebench", None, 4)
    assert "(data/eval/ does not ship livecodebench)" in str(e.value)
    with pytest.raises(UsageError, match=r"pass --data-dir data/eval \(shipped with the repository\)"):
        data.load_samples("gsm8k", None, 4)


def test_the_cli_says_it_in_one_line_before_loading(embedded, tmp_path, capsys):
    assert cli.main(["--device", "cpu", "--dataset", "gsm9k", "--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown dataset 'gsm9k'" in err[0] and "gsm8k" in err[0] and "livecodebench" in err[0]
