"""Refiner checkpoint paths (local, env, hub ids, the serving fallback) and the converter CLI's refusals."""
import os
import subprocess
import sys

import pytest
import torch

import scripts.convert_refiner as convert
from core.errors import UsageError
from refiners.formats import resolve_refiner_path
from refiner_fixtures import ROOT, V, base_dir, drafter, listing, one_line, save_pt, xpress_args, xpress_head


# --- path resolution ---------------------------------------------------------------------------------------------

class FakeHub:
    def __init__(self, missing=(), fail=False):
        self.calls, self.missing, self.fail = [], set(missing), fail

    def hf_hub_download(self, repo_id, filename, **kw):
        self.calls.append(("file", repo_id, filename))
        if self.fail:
            raise ConnectionError("Failed to resolve 'huggingface.co'\nsecond line")
        if filename in self.missing:
            from huggingface_hub.errors import EntryNotFoundError
            raise EntryNotFoundError(f"{filename} not found")
        return f"/cache/{repo_id}/{filename}"

    def snapshot_download(self, repo_id, allow_patterns=None, **kw):
        self.calls.append(("snapshot", repo_id, tuple(allow_patterns)))
        if self.fail:
            raise ConnectionError("offline")
        return f"/cache/{repo_id}/snapshot"


@pytest.fixture()
def hub(monkeypatch):
    import huggingface_hub
    fake = FakeHub()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    return fake


def test_resolve_local_paths_and_never_the_environment(tmp_path, monkeypatch, hub):
    """The library takes the path alone: XPRESS_CKPT / MK_CKPT are read by the command line (harness.protocol.
    flags), so a set variable changes nothing here (the old resolver fell back to it for None or "")."""
    f = tmp_path / "r.pt"
    f.write_bytes(b"x")
    monkeypatch.setenv("MK_CKPT", str(f))
    monkeypatch.setenv("XPRESS_CKPT", str(f))
    assert resolve_refiner_path(None) is None
    assert resolve_refiner_path("") is None
    assert resolve_refiner_path(str(f)) == str(f)
    assert resolve_refiner_path(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert resolve_refiner_path("r.pt") == "r.pt"
    assert hub.calls == []


@pytest.mark.parametrize("bad", ["a/b/c", "justaname", "user/ repo", "user/repo:", "./missing/x.pt", "/no/such.pt",
                                 "user/repo:a b.pt"])
def test_resolve_refuses_bad_strings(bad, hub):
    with pytest.raises(UsageError, match="accepted forms") as e:
        resolve_refiner_path(bad)
    one_line(e)
    assert hub.calls == []


def test_resolve_hub_ids(hub, monkeypatch):
    assert resolve_refiner_path("user/repo") == "/cache/user/repo/refiner_cotrain.pt"
    assert resolve_refiner_path("user/repo:file.pt") == "/cache/user/repo/file.pt"
    assert resolve_refiner_path("org/Markov-b16:sub/x.pt") == "/cache/org/Markov-b16/sub/x.pt"
    assert resolve_refiner_path("user/repo:config.json") == "/cache/user/repo/snapshot"
    assert hub.calls == [("file", "user/repo", "refiner_cotrain.pt"), ("file", "user/repo", "file.pt"),
                         ("file", "org/Markov-b16", "sub/x.pt"),
                         ("snapshot", "user/repo", ("config.json", "*.safetensors"))]


def test_resolve_hub_falls_back_to_serving_layout_only_when_the_file_is_absent(hub):
    hub.missing = {"refiner_cotrain.pt", "other.pt"}
    assert resolve_refiner_path("user/repo") == "/cache/user/repo/snapshot"
    with pytest.raises(UsageError, match="downloading other.pt from the hub repo user/repo failed"):
        resolve_refiner_path("user/repo:other.pt")  # an explicit file never falls back
    hub.fail, hub.calls = True, []
    with pytest.raises(UsageError, match="ConnectionError: Failed to resolve") as e:
        resolve_refiner_path("user/repo")
    one_line(e)
    assert hub.calls == [("file", "user/repo", "refiner_cotrain.pt")]  # a network failure never switches format


# --- converter safety ------------------------------------------------------------------------------------------

def test_converter_refuses_existing_output_and_leaves_nothing_on_failure(tmp_path, drafter, base_dir, capsys,
                                                                         monkeypatch):
    pt = save_pt(tmp_path / "in.pt", drafter)
    (tmp_path / "out").mkdir()
    before = listing(tmp_path)
    assert convert.main(["pt-to-serving", "--ckpt", str(pt), "--base-config", str(base_dir),
                         "--out", str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert convert.main(["serving-to-pt", "--src", str(base_dir), "--out", str(pt)]) == 2
    assert "already exists" in capsys.readouterr().err

    # A validation failure (the head's vocab differs from the base drafter's) writes nothing.
    wrong = save_pt(tmp_path / "wrong.pt", drafter, head=xpress_head(vocab=V + 1))
    before = listing(tmp_path)
    assert convert.main(["pt-to-serving", "--ckpt", str(wrong), "--base-config", str(base_dir),
                         "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "vocab 129" in err and err.count("\n") == 1
    assert listing(tmp_path) == before

    # A failure in the middle of writing removes the partial output.
    import core.checkpoints as hc
    real = hc.write_safetensors_dir

    def half_then_fail(directory, config, tensors):
        real(directory, config, tensors)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hc, "write_safetensors_dir", half_then_fail)
    assert convert.main(["pt-to-serving", "--ckpt", str(pt), "--base-config", str(base_dir),
                         "--out", str(tmp_path / "new")]) == 2
    assert "No space left" in capsys.readouterr().err
    assert listing(tmp_path) == before

    monkeypatch.setattr(hc, "write_safetensors_dir", real)
    convert.pt_to_serving(str(pt), str(base_dir), str(tmp_path / "s"))
    before = listing(tmp_path)
    real_save = torch.save

    def save_half_then_fail(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", save_half_then_fail)
    assert convert.main(["serving-to-pt", "--src", str(tmp_path / "s"), "--out", str(tmp_path / "b.pt")]) == 2
    assert listing(tmp_path) == before


def test_cli_subprocess_exit_code_and_no_traceback(tmp_path, drafter, base_dir):
    pt = save_pt(tmp_path / "in.pt", drafter, args=xpress_args(no_mixer=True))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "scripts.convert_refiner", "pt-to-serving", "--ckpt", str(pt),
                           "--base-config", str(base_dir), "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_mixer=True" in lines[0] and lines[0].startswith("error: ")
    assert not (tmp_path / "out").exists()
