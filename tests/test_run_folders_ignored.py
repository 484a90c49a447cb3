"""Run folders the benchmark names itself under results/ are ignored by git, so a later run's provenance does not
record git_dirty: true because of an earlier run; every committed file under results/ stays tracked (.gitignore).
Before, nothing under results/ was ignored."""
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import harness.protocol.plan as runner

ROOT = Path(__file__).resolve().parents[1]


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


pytestmark = pytest.mark.skipif(git("rev-parse", "--git-dir").returncode != 0, reason="not a git checkout")


def ignored(path: str) -> bool:
    return git("check-ignore", "-q", "--no-index", path).returncode == 0


def default_folder(tmp_path, monkeypatch, taken: int = 0, temperature: float = 0.0) -> str:
    """The folder run_folder names for a run with no --run-id, as a path under results/ (`taken` earlier runs in
    the same second make it add -2, -3, ...)."""
    monkeypatch.setattr(runner.time, "strftime", lambda fmt, *a: "20261201-093015")
    cfg = SimpleNamespace(resume=None, run_id=None, results_dir=str(tmp_path), dataset="gsm8k",
                          temperature=temperature)
    for _ in range(taken):
        folder = Path(runner.run_folder(cfg))
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    return "results/" + Path(runner.run_folder(cfg)).name


@pytest.mark.parametrize("taken,temperature", [(0, 0.0), (1, 0.7), (2, 1e-6)])
def test_a_default_named_run_folder_is_ignored(tmp_path, monkeypatch, taken, temperature):
    folder = default_folder(tmp_path, monkeypatch, taken, temperature)
    for name in ("config.json", "samples.jsonl", "samples.jsonl.gz", "plots/tau_vs_K.png"):
        assert ignored(f"{folder}/{name}"), folder


def test_committed_results_stay_tracked_and_named_folders_are_not_hidden():
    assert git("ls-files", "-ci", "--exclude-standard", "results").stdout == ""
    tracked = git("ls-files", "results").stdout.split()
    assert tracked and not any(ignored(p) for p in tracked[:50])
    assert not ignored("results/my-run/config.json")  # --run-id my-run: the user named it
    assert not ignored("results/smollm2-135m/gsm8k_T0_20261201-093015/config.json")  # only top-level run folders
