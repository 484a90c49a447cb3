"""python -m training.travel pack|unpack: finished (or resumable) stage folders carried between machines.

    python -m training.travel pack --workdir W --out DIR [--stages prompts,responses] [--max-mib 15.5]
    python -m training.travel unpack DIR --workdir W [--name stages] [--force]

pack writes one gzip'd tar of the stage folders (paths relative to W, each stage's manifest.json included; a
part still being written, *.tmp, is left out), split into DIR/<name>.part000, part001, ... of at most --max-mib
MiB each, and DIR/<name>.json: the pieces in order with their sizes and sha256, the whole archive's sha256, each
stage's manifest key and counts, the config name and the time. The archive is deterministic (sorted members,
fixed mtime, uid and mode, a gzip header without time or name): the same folders pack to the same bytes.

unpack checks every piece and the whole archive, and every member's path, before it writes anything; it refuses a
stage that W already holds with another manifest key unless --force. It extracts into a temporary folder next to
W and renames each stage folder into place. `python -m training all` then skips the unpacked stages whose keys
match its config and resumes an unfinished responses stage from the parts it holds.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

from core.errors import Parser, UsageError, cli_exit
from training import stages as clock
from training.store import MANIFEST, read_manifest

STAGES = ("prompts", "responses", "hidden", "export")  # the train stage does not travel (stage_list)
DEFAULT_STAGES = ("prompts", "responses")
FORMAT = "xpress-bench training stages 1"
CHUNK = 1 << 20
LEVEL = 6  # gzip: level 9 took 3x as long on token-id JSONL for 2% less
DEVICE_FILES = 8  # what one call of the lent GPU machine gives back (files of < 16 MiB each)


def stage_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if "train" in names:  # per-model checkpoints with their optimizer state, and no stage manifest of its own
        raise UsageError("--stages train: the train stage's checkpoints do not travel; export them (python -m "
                         "training export) and pack export, or carry the export folder as a warm start")
    bad = [s for s in names if s not in STAGES]
    if bad or not names:
        raise UsageError(f"--stages {text!r}: name stages among {', '.join(STAGES)}, comma-separated")
    return sorted(set(names), key=STAGES.index)


def check_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UsageError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (no path)")
    return name


def piece_name(name: str, i: int) -> str:
    return f"{name}.part{i:03d}"


def stage_files(work: Path, stage: str) -> list[Path]:
    d = work / stage
    if not (d / MANIFEST).is_file():
        raise UsageError(f"{d}: no {MANIFEST} (the {stage} stage has not run there); run it or leave it out of "
                         "--stages")
    links = [p for p in d.rglob("*") if p.is_symlink()]
    if links:
        raise UsageError(f"{links[0]}: a symbolic link; a packed stage holds plain files only")
    return sorted((p for p in d.rglob("*") if p.is_file() and p.suffix != ".tmp"),
                  key=lambda p: p.relative_to(work).as_posix())


def counts(manifest: dict, members: list[str], stage: str) -> dict:
    """What a manifest says of its size (its numbers and flags), and the part files packed."""
    out = {k: v for k, v in manifest.items() if k != "key" and isinstance(v, (int, float, bool))}
    parts = sum(1 for m in members if re.fullmatch(rf"{stage}/parts/part_\d+\.jsonl", m))
    if parts:
        out["parts_done"] = parts
    return out


class PieceWriter(io.RawIOBase):
    """A write-only stream cut into files of at most `limit` bytes, hashing each piece and the whole."""

    def __init__(self, out: Path, name: str, limit: int):
        self.out, self.name, self.limit = out, name, limit
        self.pieces: list[dict] = []
        self.whole, self.size = hashlib.sha256(), 0
        self._f = self._h = None
        self._n = 0

    def writable(self) -> bool:
        return True

    def _next(self) -> None:
        self._close_piece()
        self._f = (self.out / piece_name(self.name, len(self.pieces))).open("wb")
        self._h, self._n = hashlib.sha256(), 0

    def _close_piece(self) -> None:
        if self._f is not None:
            self._f.close()
            self.pieces.append({"file": Path(self._f.name).name, "bytes": self._n, "sha256": self._h.hexdigest()})
            self._f = None

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        at = 0
        while at < len(view):
            if self._f is None or self._n == self.limit:
                self._next()
            take = view[at:at + self.limit - self._n]
            self._f.write(take)
            self._h.update(take)
            self.whole.update(take)
            self._n += len(take)
            at += len(take)
        self.size += len(view)
        return len(view)

    def finish(self) -> list[dict]:
        self._close_piece()
        return self.pieces


def write_archive(work: Path, files: list[Path], sink) -> None:
    """A deterministic tar.gz of `files` (paths relative to `work`) into the binary stream `sink`."""
    with gzip.GzipFile(filename="", mode="wb", fileobj=sink, mtime=0, compresslevel=LEVEL) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for f in files:
            info = tarfile.TarInfo(f.relative_to(work).as_posix())
            info.size, info.mtime, info.mode = f.stat().st_size, 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with f.open("rb") as src:
                tar.addfile(info, src)


def pack(work: Path, out: Path, stages: list[str], max_mib: float, name: str, config: str | None) -> dict:
    if not max_mib > 0:
        raise UsageError(f"--max-mib {max_mib}: give a size in MiB above 0")
    limit = int(max_mib * 2 ** 20)
    if limit < 1:
        raise UsageError(f"--max-mib {max_mib}: a piece must hold at least one byte")
    if not work.is_dir():
        raise UsageError(f"--workdir {work}: no such folder")
    files = {s: stage_files(work, s) for s in stages}
    manifests = {s: read_manifest(work / s) for s in stages}
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / f"{name}.json"
    index_path.unlink(missing_ok=True)  # a half-written pack must not pass for a whole one
    writer = PieceWriter(out, name, limit)
    write_archive(work, [f for s in stages for f in files[s]], writer)
    pieces = writer.finish()
    kept = {p["file"] for p in pieces}
    for stale in out.glob(f"{name}.part*"):
        if stale.name not in kept and re.fullmatch(rf"{re.escape(name)}\.part\d+", stale.name):
            stale.unlink()
    index = {"format": FORMAT, "name": name, "config": config or work.name, "workdir": str(work),
             "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "archive": {"bytes": writer.size, "sha256": writer.whole.hexdigest()}, "max_mib": max_mib,
             "pieces": pieces, "stages": {}, "seconds": {s: t for s, t in clock.read(work).items() if s in stages}}
    for s in stages:
        members = [f.relative_to(work).as_posix() for f in files[s]]
        index["stages"][s] = {"key": manifests[s].get("key"), "files": len(members),
                              "bytes": sum(f.stat().st_size for f in files[s]),
                              "counts": counts(manifests[s], members, s)}
    tmp = index_path.with_name(index_path.name + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.rename(index_path)
    return index


class PieceReader(io.RawIOBase):
    """The pieces read back in order as one stream."""

    def __init__(self, paths: list[Path]):
        self.paths, self._i, self._f = list(paths), 0, None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._i < len(self.paths):
            if self._f is None:
                self._f = self.paths[self._i].open("rb")
            n = self._f.readinto(b)
            if n:
                return n
            self._f.close()
            self._f, self._i = None, self._i + 1
        return 0

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        super().close()


def read_index(src: Path, name: str) -> dict:
    path = src / f"{name}.json"
    if not path.is_file():
        raise UsageError(f"{path}: no such file; pass the folder `pack --out` wrote (and --name if not 'stages')")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: invalid JSON ({e.msg}); pack again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not index.get("pieces") \
            or not isinstance(index.get("archive"), dict) or not isinstance(index.get("stages"), dict):
        raise UsageError(f"{path}: not an index written by python -m training.travel pack")
    bad = [s for s in index["stages"] if s not in STAGES]
    if bad or not index["stages"]:
        raise UsageError(f"{path}: stages {bad or 'none'}; an index lists stages among {', '.join(STAGES)}")
    return index


def verify_pieces(src: Path, index: dict) -> list[Path]:
    """Every piece present with its size and sha256, and the whole archive's sha256; the paths in order."""
    whole, paths = hashlib.sha256(), []
    for p in index["pieces"]:
        path = src / p["file"]
        if PurePosixPath(p["file"]).name != p["file"] or not path.is_file():
            raise UsageError(f"{path}: piece missing; copy every {index['name']}.part* file `pack` wrote")
        if path.stat().st_size != p["bytes"]:
            raise UsageError(f"{path}: {path.stat().st_size} bytes, the index says {p['bytes']}; the piece is "
                             "truncated or corrupt, copy it again")
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                h.update(chunk)
                whole.update(chunk)
        if h.hexdigest() != p["sha256"]:
            raise UsageError(f"{path}: sha256 differs from the index; the piece is corrupt, copy it again")
        paths.append(path)
    if whole.hexdigest() != index["archive"]["sha256"]:
        raise UsageError(f"{src}: the pieces joined do not give the archive's sha256; copy them again")
    return paths


def member_path(m: tarfile.TarInfo, stages: set[str]) -> PurePosixPath:
    """A member's path, refused unless it is a plain file or folder strictly inside one of the packed stages."""
    p = PurePosixPath(m.name)
    if p.is_absolute() or "\\" in m.name or any(x in ("..", ".", "") for x in m.name.split("/")):
        raise UsageError(f"archive member {m.name!r}: an absolute path or one with '..'; refusing the archive")
    if not (m.isfile() or m.isdir()):
        raise UsageError(f"archive member {m.name!r}: not a plain file or folder; refusing the archive")
    if p.parts[0] not in stages or len(p.parts) < 2:
        raise UsageError(f"archive member {m.name!r}: outside the stages the index lists "
                         f"({', '.join(sorted(stages))}); refusing the archive")
    return p


def scan(paths: list[Path], stages: set[str]) -> dict[str, dict]:
    """Every member checked (no writes); each stage's manifest read from the archive itself."""
    try:
        return _scan(paths, stages)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise UsageError(f"{paths[0].parent}: the pieces are not a readable tar.gz ({e}); pack again") from None


def _scan(paths: list[Path], stages: set[str]) -> dict[str, dict]:
    manifests, seen = {}, set()
    with PieceReader(paths) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
        for m in tar:
            p = member_path(m, stages)
            if m.name in seen:
                raise UsageError(f"archive member {m.name!r} appears twice; refusing the archive")
            seen.add(m.name)
            if m.isfile() and len(p.parts) == 2 and p.parts[1] == MANIFEST:
                try:
                    manifests[p.parts[0]] = json.loads(tar.extractfile(m).read())
                except json.JSONDecodeError:
                    raise UsageError(f"archive member {m.name}: invalid JSON; pack again") from None
    missing = sorted(stages - set(manifests))
    if missing:
        raise UsageError(f"the archive has no {MANIFEST} for {', '.join(missing)}; pack again")
    return manifests


def conflicts(work: Path, manifests: dict[str, dict], force: bool) -> list[str]:
    """Refuses a stage W holds with another key (unless force); returns the stages W already has, done, with
    the same key (kept as they are unless force)."""
    keep = []
    for s, m in manifests.items():
        have = read_manifest(work / s) if (work / s).is_dir() else None
        if have is None or force:
            continue
        if have.get("key") != m.get("key"):
            raise UsageError(f"{work / s} holds the {s} stage with key {have.get('key')}, the archive's has "
                             f"{m.get('key')}; pass --force to replace it")
        if have.get("complete", True):  # a finished stage (prompts has no "complete": it is only written done)
            keep.append(s)
    return keep


def extract(paths: list[Path], tmp: Path, stages: set[str]) -> None:
    with PieceReader(paths) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
        for m in tar:
            dest = tmp.joinpath(*member_path(m, stages).parts)
            if m.isdir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, dest.open("wb") as f:
                shutil.copyfileobj(src, f, CHUNK)


def unpack(src: Path, work: Path, name: str, force: bool) -> dict[str, dict]:
    index = read_index(src, name)
    stages = set(index["stages"])
    paths = verify_pieces(src, index)
    manifests = scan(paths, stages)
    keep = set(conflicts(work, manifests, force))
    work.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{work.name}.unpack-", dir=work.parent))
    try:
        extract(paths, tmp, stages)
        work.mkdir(exist_ok=True)
        for s in sorted(stages - keep, key=STAGES.index):
            dest, old = work / s, None
            if dest.exists():
                old = tmp / f"{s}.old"
                dest.rename(old)
            try:
                (tmp / s).rename(dest)
            except OSError:
                if old is not None:
                    old.rename(dest)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    carry_seconds(work, sorted(stages - keep, key=STAGES.index), index.get("seconds", {}))
    return {s: {"key": m.get("key"), "kept": s in keep, "counts": index["stages"][s].get("counts", {})}
            for s, m in sorted(manifests.items(), key=lambda kv: STAGES.index(kv[0]))}


def carry_seconds(work: Path, unpacked: list[str], seconds: dict) -> None:
    """The unpacked stages' wall times (stages.json, for the model card) are those of the run that did the work;
    a time the workdir had for a stage now replaced goes."""
    rec = clock.read(work)
    for s in unpacked:
        rec.pop(s, None)
        if s in seconds:
            rec[s] = seconds[s]
    if rec or (work / clock.FILE).exists():
        (work / clock.FILE).write_text(json.dumps(rec, indent=1) + "\n")


def describe(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items())


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m training.travel", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="stage folders of a workdir -> DIR/<name>.partNNN + DIR/<name>.json")
    pk.add_argument("--workdir", required=True, type=Path)
    pk.add_argument("--out", required=True, type=Path, help="where the pieces and the index go")
    pk.add_argument("--stages", default=",".join(DEFAULT_STAGES), help="comma-separated, among prompts, responses, hidden and export (default: prompts,responses)")
    pk.add_argument("--max-mib", type=float, default=15.5, help="the largest piece, in MiB (default 15.5)")
    pk.add_argument("--name", default="stages", help="the pieces' and index's file name (default: stages)")
    pk.add_argument("--config", default=None, help="the config name recorded in the index (default: the workdir's "
                    "folder name, as runs/<config>/ is)")
    up = sub.add_parser("unpack", help="DIR/<name>.* -> the stage folders of a workdir")
    up.add_argument("src", type=Path, help="the folder `pack --out` wrote")
    up.add_argument("--workdir", required=True, type=Path)
    up.add_argument("--name", default="stages")
    up.add_argument("--force", action="store_true", help="replace stages the workdir holds, whatever their key")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def work():
        name = check_name(args.name)
        if args.cmd == "pack":
            index = pack(args.workdir, args.out, stage_list(args.stages), args.max_mib, name, args.config)
            for s, v in index["stages"].items():
                print(f"packed {s}: key {v['key']}, {v['files']} files, {describe(v['counts'])}")
            mib = index["archive"]["bytes"] / 2 ** 20
            print(f"-> {args.out}/{name}.json + {len(index['pieces'])} piece(s), {mib:.2f} MiB")
            if len(index["pieces"]) + 1 > DEVICE_FILES:
                print(f"note: {len(index['pieces']) + 1} files; a lent GPU machine gives back at most {DEVICE_FILES} "
                      "per call, so bring them back over several calls (or pack fewer --stages per --name)")
        else:
            for s, v in unpack(args.src, args.workdir, name, args.force).items():
                what = "kept (the workdir's is done with the same key)" if v["kept"] else "unpacked"
                print(f"{what} {s}: key {v['key']}, {describe(v['counts'])} -> {args.workdir / s}")
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
