"""What a new user meets before a long run: the install lines, --help, setups, input checks and scripts."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import benchmark_compile_all as cli
import harness.protocol.runner as runner
from core.errors import UsageError
from harness.protocol import flags, report, setups
from tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def readme_first_command() -> list[str]:
    """The README's first command (the CPU installs and the main job), split at its `&&`."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A fresh machine"):]
    block = section[section.index("```\n") + 4:]
    first = block[:block.index("```")].strip().splitlines()[0]
    return [part.strip() for part in first.split("&&")]


def test_ci_runs_the_readme_main_job_as_written_before_any_test_extra():
    first = readme_first_command()
    assert first == ["pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                     "pip install -r requirements.txt", "python benchmark_compile_all.py"]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    steps = [ln for ln in ci if ln and not ln.startswith(("#", "echo", "if ", "fi", "then")) and "set -" not in ln
             and not ln.startswith("cd ") and not ln.startswith('"')]
    assert steps[:3] == first, steps  # the main job, exactly as a new user runs it, comes first
    assert steps[-2:] == ["python -m pytest -q", "python -m harness.lab.readme_numbers --check"]  # then the README numbers
    extras = [i for i, ln in enumerate(steps) if "triton" in ln or "requirements-speculators" in ln
              or "requirements-training" in ln]
    assert extras and min(extras) > 2  # nothing test-only (Triton, speculators) is installed before the main job


def test_requirements_hold_the_tested_versions():
    from packaging.specifiers import SpecifierSet
    reqs = dict(re.match(r"([a-z]+)(.*)", ln).groups() for ln in (ROOT / "requirements.txt").read_text().splitlines()
                if ln and not ln.startswith("#") and ln.split("#")[0].strip() and ln[0].isalpha())
    assert "2.13.0" in SpecifierSet(reqs["torch"].split("#")[0].strip())
    tf = SpecifierSet(reqs["transformers"].split("#")[0].strip())
    assert "5.17.0" in tf and "5.19.0" in tf and "5.20.0" not in tf


def test_help_is_grouped_shows_defaults_and_imports_no_torch():
    code = ("import sys; sys.argv = ['benchmark_compile_all.py', '--help']\n"
            "import benchmark_compile_all as b\n"
            "try:\n    b.main()\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert out.strip().endswith("NO-TORCH"), out[-300:]
    heads = [m.group(1) for m in re.finditer(r"^(\w[\w ]*):$", out, re.M)]
    groups = ["models", "data", "decoding", "arms", "protocol", "outputs", "CUDA", "timing"]
    assert [h for h in heads if h in groups] == groups
    flat = " ".join(out.split())
    assert "generation budget per turn (default: 16384)" in flat
    assert "drafter-only (default: 3)" in flat  # --xpress-refine-passes
    assert "hub datasets (--dataset without --data-dir): " + ", ".join(flags.HUB_DATASETS) in flat
    examples = out[out.index("examples:"):].strip().splitlines()[1:]
    assert sum(line.lstrip().startswith("python benchmark_compile_all.py") for line in examples) == 2


def test_help_lists_exactly_the_hub_datasets():
    from harness.protocol.data import KNOWN_DATASETS
    assert flags.HUB_DATASETS == KNOWN_DATASETS


def test_untyped_settings_come_from_the_setup_and_typed_ones_win(monkeypatch, tmp_path):
    monkeypatch.setattr(setups, "embedded_target", lambda: "/fetched/SmolLM2.gguf")
    weights = tmp_path / "w"
    for sub in ("drafter", "xpress", "markov"):
        (weights / sub).mkdir(parents=True)
        (weights / sub / "config.json").write_text("{}")
    monkeypatch.setenv(setups.WEIGHTS_ENV, str(weights))
    monkeypatch.delenv("XPRESS_CKPT", raising=False)
    monkeypatch.delenv("MK_CKPT", raising=False)
    values, typed, _ = flags.typed_values(["--device", "cpu", "--max-samples", "2"])
    got = setups.apply(values, typed)
    assert got["preset"] == "smollm2-135m" and got["model_name_or_path"] == "/fetched/SmolLM2.gguf"
    assert got["draft_name_or_path"] == str(weights / "drafter") and got["markov_refiner_path"] == str(weights / "markov")
    assert got["data_dir"] == str(ROOT / "data" / "eval") and got["dataset"] == "gsm8k"
    assert got["max_samples"] == 2  # typed
    assert got["max_new_tokens"] == setups.EMBEDDED_CPU["max_new_tokens"] and got["use_graph"] is False
    assert got["fair_interleave"] == setups.EMBEDDED_CPU["fair_interleave"]
    cuda = setups.apply(*flags.typed_values(["--device", "cuda"])[:2])
    assert cuda["use_graph"] is True and cuda["fair_k_list"] == setups.EMBEDDED_CUDA["fair_k_list"]
    monkeypatch.setenv("XPRESS_CKPT", "")  # set but empty: the xPress arm is dropped
    assert setups.apply(*flags.typed_values([])[:2])["xpress_refiner_path"] is None
    paper = setups.apply(*flags.typed_values(["--preset", "paper", "--device", "cpu", "--temperature", "1"])[:2])
    assert paper["model_name_or_path"] == "Qwen/Qwen3-8B" and paper["fair_k_list"] == "6,7,8"
    assert paper["data_dir"] is None and paper["max_new_tokens"] == 2048 and paper["use_graph"] is False
    named = setups.apply(*flags.typed_values(["--model-name-or-path", "x/y"])[:2])
    assert named.get("preset") is None and named["draft_name_or_path"] is None and named["dataset"] == "gsm8k"


def test_embedded_sizes_measure_two_rounds_and_help_says_so(capsys):
    # the tables' spreads need >= 2 measured rounds; fair_interleave counts the warmup round too (the CUDA size was
    # once 2 rounds with 1 warmup: one measured round while the help said two)
    for setup in (setups.EMBEDDED_CPU, setups.EMBEDDED_CUDA):
        assert setup["fair_interleave"] - setup["fair_warmup_rounds"] >= 2
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    gpu = setups.EMBEDDED_CUDA
    assert f"{gpu['fair_interleave'] - gpu['fair_warmup_rounds']} measured rounds after 1 warmup round" in text


def test_missing_shipped_weights_give_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(setups.WEIGHTS_ENV, str(tmp_path / "none"))
    monkeypatch.setattr(setups, "embedded_target", lambda: pytest.fail("fetched before the weights were checked"))
    assert cli.main(["--device", "cpu", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the embedded default needs the shipped weights")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fh")
    save_tiny_checkpoint(root / "target")
    return root


def test_missing_local_model_path_says_no_such_path(tmp_path, capsys):
    for flag in ("--model-name-or-path", "--draft-name-or-path"):
        argv = ["--model-name-or-path", str(tmp_path / "t"), "--draft-name-or-path", str(tmp_path / "d"),
                "--results-dir", str(tmp_path)]
        if flag == "--draft-name-or-path":
            argv[1] = str(ROOT)  # an existing folder, so the drafter's path is the one checked
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {tmp_path}" in err and "no such path" in err and "Repo id" not in err


def test_hf_overrides_with_random_weights_is_refused_not_ignored(tmp_path, capsys):
    """--random-weights builds every model from its preset, so --hf-overrides would change nothing (it was
    silently dropped): one line, exit 2, no results folder."""
    argv = ["--random-weights", "tiny", "--hf-overrides", '{"num_hidden_layers": 1}', "--results-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: --hf-overrides" in err and "drop --hf-overrides" in err
    assert list(tmp_path.iterdir()) == []


def test_unwritable_results_dir_is_found_before_loading(target_dir, monkeypatch, capsys):
    # /proc refuses new files even for root, whom os.access lets through everywhere
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(runner, "prepare", lambda *a, **k: pytest.fail("configs were read"))
    argv = ["--model-name-or-path", str(target_dir / "target"), "--ar-only", "--device", "cpu",
            "--results-dir", "/proc/xpress-bench-results"]
    assert cli.main(argv) == 2
    assert "is not a writable directory" in capsys.readouterr().err


def test_block_larger_than_trained_is_refused_smaller_is_noted(target_dir, tmp_path, capsys):
    from scripts import make_random_drafter
    drafter = tmp_path / "drafter"
    assert make_random_drafter.main(["--target", str(target_dir / "target"), "--out", str(drafter),
                                     "--block-size", "8"]) == 0
    base = ["--model-name-or-path", str(target_dir / "target"), "--draft-name-or-path", str(drafter),
            "--max-new-tokens", "4", "--device", "cpu", "--results-dir", str(tmp_path / "r"),
            "--dataset", "mini", "--data-dir", str(tmp_path)]
    (tmp_path / "mini.jsonl").write_text('{"turns": ["Add 2 and 3."]}\n')
    assert cli.main(base + ["--block-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "--block-size 16" in err and "trained with block 8" in err
    assert not (tmp_path / "r").exists()
    assert cli.main(base + ["--block-size", "4", "--skip-ar"]) == 0
    assert "[note] block 4 is smaller than the drafter's trained block 8" in capsys.readouterr().out


def test_random_scripts_refuse_to_overwrite_without_force(target_dir, tmp_path, capsys):
    from harness.protocol.build import prepare
    from harness.protocol.config import RunConfig
    from scripts import make_random_drafter, make_random_refiners
    t, d = str(target_dir / "target"), str(tmp_path / "drafter")
    assert make_random_drafter.main(["--target", t, "--out", d, "--block-size", "4"]) == 0
    assert make_random_drafter.main(["--target", t, "--out", d]) == 2
    assert "--force" in capsys.readouterr().err
    assert make_random_drafter.main(["--target", t, "--out", d, "--block-size", "4", "--force", "--seed", "3"]) == 0
    (tmp_path / "afile").write_text("")  # --out a file, and a --drafter that is no drafter: one line each
    assert make_random_drafter.main(["--target", t, "--out", str(tmp_path / "afile")]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert make_random_refiners.main(["--target", t, "--drafter", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "--drafter " + str(tmp_path / "nope") + ": no config.json there" in capsys.readouterr().err
    assert make_random_refiners.main(["--target", t, "--drafter", d, "--out", str(tmp_path), "--rank", "8"]) == 0
    assert make_random_refiners.main(["--target", t, "--drafter", d, "--out", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert make_random_refiners.main(["--target", t, "--drafter", d, "--out", str(tmp_path), "--rank", "8",
                                      "--force"]) == 0
    (tmp_path / "mini.jsonl").write_text('{"turns": ["hi"]}\n')
    cfg = RunConfig(t, d, "mini", data_dir=str(tmp_path), xpress_refiner_path=str(tmp_path / "xpress"),
                    markov_refiner_path=str(tmp_path / "markov"), device="cpu", fair_interleave=0, fair_k_list="1,2")
    prep = prepare(cfg)  # every compatibility check of the harness against the target and the drafter
    assert [a.name for a in prep.arms] == ["AR", "drafter-only", "Markov", "xPress(K=1)", "xPress(K=2)"]
    assert prep.refiners["xpress"].rank == prep.refiners["markov"].rank == 8
    assert prep.refiners["xpress"].draft_state is None  # heads only: the arms run with the drafter's own weights
    from scripts.random_mark import NAME
    assert NAME == report.RANDOM_MARK and all((Path(p) / NAME).is_file() for p in (d, tmp_path / "xpress"))


def test_shipped_prompts_are_whole_small_and_licensed():
    from harness.protocol.data import load_samples
    folder = ROOT / "data" / "eval"
    assert (folder / "DEEPSPEC_LICENSE").is_file() and (folder / "README.md").is_file()
    rows = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 257, "mt-bench": 80}
    for name, n in rows.items():
        path = folder / f"{name}.jsonl"
        assert path.stat().st_size < 500_000
        assert sum(1 for line in path.read_text().splitlines() if line.strip()) == n
        json.loads(path.read_text().splitlines()[0])["turns"]
    assert len(load_samples("gsm8k", str(folder), 128)) == 128
    assert all(p.stat().st_size < 500_000 for p in folder.iterdir())
    assert os.access(folder / "gsm8k.jsonl", os.R_OK)


def make_weights(target: str, out: Path, block: int = 4, rank: int = 8) -> Path:
    from scripts import make_random_drafter, make_random_refiners
    assert make_random_drafter.main(["--target", target, "--out", str(out / "drafter"), "--block-size",
                                     str(block)]) == 0
    assert make_random_refiners.main(["--target", target, "--drafter", str(out / "drafter"), "--out", str(out),
                                      "--rank", str(rank)]) == 0
    return out


def test_no_model_flags_run_the_embedded_default_with_script_made_weights(target_dir, tmp_path, monkeypatch,
                                                                           capsys):
    weights = make_weights(str(target_dir / "target"), tmp_path / "w")
    monkeypatch.setenv(setups.WEIGHTS_ENV, str(weights))
    monkeypatch.setattr(setups, "embedded_target", lambda: str(target_dir / "target"))  # instead of the GGUF
    for var in ("XPRESS_CKPT", "MK_CKPT"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "mini.jsonl").write_text('{"turns": ["Add 2 and 3."]}\n{"turns": ["Count to 4."]}\n')
    assert cli.main(["--dataset", "mini", "--data-dir", str(tmp_path), "--max-new-tokens", "5",
                     "--results-dir", str(tmp_path / "r"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "tau/step" in out and "POOLED tok/s" in out and "Sp. (" in out
    assert "[random drafter/heads (scripts/make_random_*)]" in out  # script-made weights are labelled
    (folder,) = (tmp_path / "r").iterdir()
    assert "random drafter/heads (scripts/make_random_*)" in json.loads((folder / "summary.json").read_text())["labels"]
    config = json.loads((folder / "config.json").read_text())
    assert config["preset"] == "smollm2-135m" and config["fair_k_list"] == setups.EMBEDDED_CPU["fair_k_list"]
    assert config["resolved"]["arms"] == ["AR", "drafter-only", "Markov", "xPress(K=2)"]
    assert config["resolved"]["rounds"] == setups.EMBEDDED_CPU["fair_interleave"]



def test_every_setting_has_a_flag():
    dests = {a.dest for a in flags.build_parser()._actions} - {"help"}
    assert set(flags.FIELDS) - dests == {"given"} and dests <= set(flags.FIELDS)
