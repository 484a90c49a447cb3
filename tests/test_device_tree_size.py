"""The tracked files (the shipped weights and the results: `device_tree.sh size`) exceed the 64 MiB working tree the GPU
machine accepts; harness/lab/device_tree.sh moves weights/ and results/ aside for device sessions. This guards the
rest: the code, data and docs, with one carried 50 MB GGUF part beside them, must still fit."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CAP = 64 * 2**20
GGUF_PART = 50_000_000  # the SmolLM2 GGUF travels in two parts, the larger this size


def tracked_bytes(leave_out: tuple = ()) -> int:
    """The bytes of the tracked files, less those under the folders `leave_out`; skips outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / f for f in out.decode().split("\0") if f and not f.startswith(leave_out)]
    return sum(f.stat().st_size for f in files if f.is_file())


def test_the_tree_without_weights_and_results_fits_the_device_with_a_gguf_part():
    size = tracked_bytes(("weights/", "results/"))
    assert size + GGUF_PART < CAP, f"{size / 2**20:.1f} MiB of tracked files outside weights/ and results/"


def test_size_reports_every_tracked_file():
    """`device_tree.sh size` sums every tracked file: its du ran through xargs, which split the list into batches,
    and the last batch's total was reported (99 MiB of 160 on 2026-12-07)."""
    size = tracked_bytes()
    said = subprocess.run(["bash", str(ROOT / "harness" / "lab" / "device_tree.sh"), "size"], capture_output=True,
                          text=True, check=True).stdout
    assert said.startswith(f"tracked: {size // 2**20} MiB;"), said


def test_size_counts_what_is_in_the_tree_while_stashed(tmp_path):
    """`device_tree.sh size` while weights/ and results/ are stashed (tracked files missing): du skipped them and
    exited 1, and set -e with pipefail ended the script with no output and a failing status. It now reports the
    bytes present, which is what travels."""
    import shutil
    repo = tmp_path / "repo"
    (repo / "harness" / "lab").mkdir(parents=True)
    shutil.copy(ROOT / "harness" / "lab" / "device_tree.sh", repo / "harness" / "lab" / "device_tree.sh")
    for rel, size in (("code.py", 3 * 2**20), ("weights/w.bin", 5 * 2**20), ("results/r.json", 2 * 2**20)):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(b"x" * size)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "t"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    size = ["bash", str(repo / "harness" / "lab" / "device_tree.sh"), "size"]
    said = subprocess.run(size, capture_output=True, text=True, check=True).stdout
    assert said.startswith("tracked: 10 MiB; without weights/ and results/: 3 MiB"), said
    shutil.rmtree(repo / "weights")
    shutil.rmtree(repo / "results")
    said = subprocess.run(size, capture_output=True, text=True)
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith("tracked: 3 MiB; without weights/ and results/: 3 MiB"), said.stdout
