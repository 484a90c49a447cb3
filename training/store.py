"""Stage outputs: each stage writes into `<dir>.tmp` and renames it to `<dir>` at the end, with a manifest.json
that records what made it (its inputs' fingerprint). A stage whose manifest matches is skipped; a failure leaves
the previous output as it was and nothing half-written under the final name."""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_path(p: str) -> Path:
    """A config path: absolute as given, else relative to the repository."""
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path

MANIFEST = "manifest.json"


def ids_digest(ids, size: int) -> bytes:
    """A BLAKE2b digest of SIZE bytes of token ids as int64: the same in every process (Python's own hash of bytes
    is salted per process, and the loaders' workers are spawned). The online target's cache keys its sequences by
    it (training/online.py), the acceptance records their prompts (training/acceptance.py)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=size).digest()


def read_manifest(d: Path) -> dict | None:
    f = d / MANIFEST
    return json.loads(f.read_text()) if f.is_file() else None


def is_done(d: Path, key: str) -> bool:
    m = read_manifest(d)
    return m is not None and m.get("key") == key


@contextlib.contextmanager
def staged(d: Path):
    """Yields a fresh temporary directory; on success it replaces `d` (the manifest must be written inside)."""
    tmp = d.with_name(d.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if d.exists():
        shutil.rmtree(d)
    tmp.rename(d)


def write_json(path: Path, obj) -> None:
    """The folder made if it is missing (a record written in a `finally` must not hide the error that left it so)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def write_jsonl(path: Path, rows) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def resumable(d: Path, key: str, force: bool, label: str) -> str:
    """A stage that fills its directory in parts: 'done' (complete with this key: skip), 'resume' (same key,
    unfinished: keep the parts) or 'fresh' (anything else: emptied)."""
    m = read_manifest(d)
    if m is not None and m.get("key") == key and not force:
        if m.get("complete"):
            print(f"{label}: up to date ({d})")
            return "done"
        return "resume"
    shutil.rmtree(d, ignore_errors=True)
    return "fresh"


_DIGESTS: dict = {}


def export_digest(d: Path) -> str:
    """The bytes of an exported folder's config and shards, hashed (cached per file size and mtime): a head's
    fingerprint carries its init_from folder's and a warm-started model's its warm-start folder's (training/warm.py
    identity), so another export at the same path is not resumed; a warm start's acceptance record is keyed by it."""
    files = sorted(p for p in d.iterdir() if p.suffix in (".json", ".safetensors") and p.name != "train_state.json")
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if _DIGESTS.get(d, (None,))[0] != stamp:
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode())
            with open(p, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
        _DIGESTS[d] = (stamp, h.hexdigest()[:16])
    return _DIGESTS[d][1]
