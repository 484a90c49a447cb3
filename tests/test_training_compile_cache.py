"""train.compile_cache (training/compiling.py load_cache, save_cache): torch.compile's artifacts saved by one process
are found by another that starts with empty caches, as a fresh GPU machine does, and a save keeps what was loaded
but not used; a file that does not load, or cannot be written, is reported and the run goes on without it.

Power: the first process compiles in an empty inductor cache and must miss (the control); the second, in another
empty cache, must hit with no miss, which only the loaded file can give. A load_cache that read nothing, or a
save_cache that wrote nothing, fails the second process's counts; a save that dropped the loaded but unused artifact
fails its saved count (each process costs about 15 s on the 2-core machine: two, not three; the first also serves
the "compiled nothing, saves nothing" check by saving once before it compiles, which was a third process).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, sys, torch
from torch._dynamo.utils import counters
from training import compiling
path, names, save_to, also, before = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
rec = compiling.load_cache(path)
before = compiling.save_cache(before, rec) if before else None  # a process that has compiled nothing yet
fns = {"f": lambda x, w: torch.nn.functional.silu(x @ w).sum(-1) * 2, "g": lambda x, w: torch.tanh(x @ w).mean(-1) + 3}
for name in filter(None, names.split(",")):
    torch.compile(fns[name], dynamic=False)(torch.randn(4, 8), torch.randn(8, 8))
also = compiling.save_cache(also, rec) if also else None  # first: the save below starts from the same rec
rec = compiling.save_cache(save_to, rec)
print(json.dumps({**rec, "also": also, "before": before, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def probe(tmp_path: Path, cache_dir: str, path: Path, names: str = "f", save_to: Path | None = None,
          also: Path | None = None, before: Path | None = None) -> dict:
    """A fresh process with an empty inductor cache: load `path`, save to `before` when given (nothing compiled
    yet: its record is the output's "before"), compile the functions `names`, save (to `also` first, when given:
    its record is the output's "also")."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache_dir), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", PROBE, str(path), names, str(save_to or path), str(also or ""), str(before or "")]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """The two processes, shared by the tests below: (first, second, tmp_path). The first saves to none.bin before
    it compiles (test_a_file_that_does_not_load_...), then compiles f and g; the second loads, compiles g alone."""
    tmp_path = tmp_path_factory.mktemp("cc")
    path = tmp_path / "cc" / "compile_cache.bin"
    first = probe(tmp_path, "inductor_a", path, "f,g", before=tmp_path / "none.bin")
    (tmp_path / "afile").write_text("")
    second = probe(tmp_path, "inductor_b", path, "g", also=tmp_path / "afile" / "cc.bin")
    return first, second, tmp_path


def test_a_saved_cache_is_found_by_processes_with_empty_caches_and_keeps_what_they_did_not_use(probes):
    """The first process compiles f and g (misses: the control); the second loads, compiles g alone (hits) and
    saves f too, which it never used. Before the loaded artifacts were recorded again, the second save held g alone
    (review, 2026-12-04). A file that cannot be written is noted, not raised, and leaves no temporary file."""
    first, second, tmp_path = probes
    path = tmp_path / "cc" / "compile_cache.bin"
    assert first["loaded_bytes"] == 0 and "no file yet" in first["note"]
    assert first["miss"] >= 2 and first["hit"] == 0  # an empty cache compiles
    assert first["saved_bytes"] == path.stat().st_size > 0 and first["saved_artifacts"]["inductor"] >= 2
    assert second["loaded_bytes"] == first["saved_bytes"] and second["merged"] and "note" not in second
    assert second["hit"] >= 1 and second["miss"] == 0, second
    assert second["saved_artifacts"]["inductor"] >= first["saved_artifacts"]["inductor"]  # f kept, though unused
    assert all(second["saved_artifacts"].get(k, 0) >= n for k, n in second["artifacts"].items())  # every kind loaded
    assert second["also"]["saved_bytes"] == 0 and second["also"]["note"].startswith("not saved")
    assert not list(path.parent.glob("*.tmp"))


def test_a_file_that_does_not_load_is_reported_and_nothing_is_saved_without_compiling(tmp_path, probes):
    from training import compiling
    bad = tmp_path / "cc.bin"
    bad.write_bytes(b"not an artifact file")
    rec = compiling.load_cache(str(bad))
    assert rec["loaded_bytes"] == 0 and rec["note"].startswith("not loaded")
    from unittest import mock
    with mock.patch("torch.compiler.load_cache_artifacts", side_effect=OSError(28, "No space left on device")):
        rec = compiling.load_cache(str(bad))  # torch raising while it fills its caches: noted, not raised
    assert rec["loaded_bytes"] == 0 and rec["note"].startswith("not loaded (OSError")
    # a process that compiled nothing (a CPU run) saves nothing and writes no file: the first probe's save before it
    # compiled (its own process, an empty inductor cache, no file loaded; its later save wrote f and g)
    first = probes[0]
    assert first["before"]["saved_bytes"] == 0 and not (probes[2] / "none.bin").exists()
    assert "saved_artifacts" not in first["before"] and first["saved_bytes"] > 0
    folder = tmp_path / "adir"
    folder.mkdir()
    rec = compiling.load_cache(str(folder))
    assert rec["note"].startswith("not a file") and compiling.save_cache(str(folder), rec)["saved_bytes"] == 0


def test_the_config_wants_a_path_and_keeps_it_out_of_fingerprints():
    from training.config import load_config, model_fingerprint
    base = load_config("toy", [], "/tmp/w")
    withc = load_config("toy", ["train.compile_cache=/tmp/x.bin"], "/tmp/w")
    assert model_fingerprint(base, "drafter") == model_fingerprint(withc, "drafter")  # run control
    with pytest.raises(UsageError, match="train.compile_cache must be a file path"):
        load_config("toy", ["train.compile_cache=3"], "/tmp/w")


def test_a_loaded_file_with_autotuning_results_is_kept_by_the_next_save():
    """A GPU run's file holds autotune artifacts, whose encode refuses already-encoded content: recording the loaded
    artifacts through record_artifact raised there, keep_loaded returned False and the heads' job of 2026-12-07
    kept the old file, losing what it compiled. Here a file of one autotune and one inductor artifact is loaded into
    a fresh artifact manager: the merge holds, and a save of this process (which compiled nothing) writes both."""
    import torch
    import torch._inductor.codecache  # noqa: F401 (registers the inductor kind)
    import torch._inductor.runtime.autotune_cache  # noqa: F401 (registers the autotune kind)
    from torch.compiler._cache import CacheArtifactManager as manager
    from training import compiling
    with manager.with_fresh_cache():
        manager.record_artifact("autotune", "tune-key", {"num_warps": 4})
        manager.record_artifact("inductor", "graph-key", b"compiled graph")
        data, _ = manager.serialize()
    with manager.with_fresh_cache():
        assert compiling.keep_loaded(data)
        out, info = torch.compiler.save_cache_artifacts()
        assert {k: len(v) for k, v in info.artifacts.items()} == {"autotune": 1, "inductor": 1}
        assert manager.deserialize(out) == manager.deserialize(data)


def test_a_save_with_fewer_artifacts_than_were_loaded_never_replaces_the_file(tmp_path):
    """Even where the merge reported success: a save holding fewer artifacts than the loaded file keeps the file."""
    import torch._inductor.codecache  # noqa: F401 (registers the inductor kind)
    from torch.compiler._cache import CacheArtifactManager as manager
    from training import compiling
    path = tmp_path / "cc.bin"
    path.write_bytes(b"the loaded file")
    with manager.with_fresh_cache():
        manager.record_artifact("inductor", "graph-key", b"compiled graph")
        for merged, why in ((True, "the merge did not hold"), (False, "cannot carry")):
            rec = compiling.save_cache(str(path), {"artifacts": {"inductor": 3}, "merged": merged})
            assert rec["saved_bytes"] == 0 and why in rec["note"] and path.read_bytes() == b"the loaded file"
        assert compiling.save_cache(str(path), {"artifacts": {"inductor": 1}, "merged": True})["saved_bytes"] > 0
