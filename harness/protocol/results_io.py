"""Files of a results folder: sample rows appended as they finish (and read back after a crash), gzip'd when the
run ends, atomic writes, and the environment a run was measured in."""
from __future__ import annotations

import gzip
import json
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path

from core.errors import UsageError
from harness.protocol.rounds import run_order

_REPO = Path(__file__).resolve().parents[2]
COMMIT_FILE = ".xb_commit"  # harness/lab/device_tree.sh stash writes it: the commit of a tree copied without .git

# A folder's rows. While a run goes they are plain JSON lines, appended a decode at a time (LIVE_ROWS: append_rows,
# fsync'd; a crash loses at most the row being written, and --resume appends to the same file); when it ends they
# are written whole as one gzip stream (ROWS: write_rows) and the plain file goes. Why not gzip while running:
# appending a gzip member per decode compressed each row alone (results/sweeps/h100/smollm2-135m_gsm8k_batch_refill:
# 12.4 MB of rows, 1.34 MB as one stream, 4.56 MB as a member per row), and a member cut off by a crash would have to
# be found by decompressing the whole file before the next append. So a folder holds either file: an interrupted
# run's rows (and an older folder's, written before rows were gzip'd) are plain, a finished run's gzip'd, and every
# reader goes through rows_file / read_folder_rows.
ROWS = "samples.jsonl.gz"
LIVE_ROWS = "samples.jsonl"


def rows_file(folder: str | os.PathLike) -> Path | None:
    """The file holding a results folder's rows: LIVE_ROWS where there is one (a run appending, an interrupted
    run, an older folder; never older than a ROWS beside it, which a run killed while finishing may leave with the
    same rows), else ROWS; None where neither is."""
    for name in (LIVE_ROWS, ROWS):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def rank_rows_files(folder: str | os.PathLike) -> list[Path]:
    """A torchrun run's rows, a samples.rank{r}.jsonl a rank (harness.protocol.distributed), by rank: what ranks
    append to and resume from, and all a run stopped before rank 0 merged them into ROWS leaves."""
    ranks = [(p.name[len("samples.rank"):-len(".jsonl")], p) for p in Path(folder).glob("samples.rank*.jsonl")]
    return [p for r, p in sorted((int(r), p) for r, p in ranks if r.isdigit())]


def read_folder_rows(folder: str | os.PathLike) -> list[dict]:
    """Every row of a results folder: its rows_file (samples.jsonl.gz, or a plain samples.jsonl); where it has
    neither, every rank's samples.rank{r}.jsonl, in a single-process run's order (rounds.run_order, of the rotation
    in its config.json), as rank 0 merges them."""
    path = rows_file(folder)
    if path is not None:
        return read_rows(path)
    ranks = rank_rows_files(folder)
    if not ranks:
        raise UsageError(f"{folder}: no {ROWS} (nor a plain {LIVE_ROWS}, nor a torchrun run's samples.rank{{r}}.jsonl);"
                         " a run writes its rows there")
    try:
        order = json.loads((Path(folder) / "config.json").read_text())["resolved"]["rotation"] or []
    except (OSError, ValueError, KeyError, TypeError):
        order = []  # no rotation recorded: by round, question id and turn
    rows = [r for p in ranks for r in read_rows(p)]
    try:
        return run_order(rows, order)
    except TypeError:  # a malformed row (a null or text round, say): as read, for the report's one-line check
        return rows


def rows_text(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_rows(folder: str | os.PathLike, rows: list[dict]) -> Path:
    """A finished run's rows, whole, as folder/samples.jsonl.gz (one gzip stream, level 9, no name or time in its
    header: the same rows give the same bytes), written atomically; then the plain rows the run appended to go."""
    path = Path(folder) / ROWS
    atomic_write(path, gzip.compress(rows_text(rows).encode("utf-8"), compresslevel=9, mtime=0))
    (Path(folder) / LIVE_ROWS).unlink(missing_ok=True)
    return path


def reopen_rows(path: str | os.PathLike) -> bool:
    """Before a resumed run appends to the plain `path` (folder/samples.jsonl): where only the gzip'd rows are
    there (a run stopped after writing them, before its summary), they are unpacked to it. True if it did."""
    packed = Path(f"{os.fspath(path)}.gz")
    if os.path.exists(path) or not packed.is_file():
        return False
    atomic_write(path, rows_text(read_rows(packed)))
    return True


def append_rows(path: str | os.PathLike, rows: list[dict]) -> None:
    """Append rows as JSON lines, then flush and fsync, so a crash loses at most the row being written.

    A partial last line left by an earlier crash is cut off first (or closed, when it is a whole object), so the
    new rows never fuse with it. Only to a plain file (see LIVE_ROWS): gzip'd rows are written whole (write_rows).
    """
    if os.fspath(path).endswith(".gz"):
        raise ValueError(f"{path}: rows are appended to a plain .jsonl; write_rows writes the .gz whole")
    with open(path, "ab+") as f:
        _close_tail(f, path)
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def _close_tail(f, path) -> None:
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    start, pos = 0, end
    while pos > 0:  # the last line may be long (token lists): scan back in chunks for its start
        step = min(1 << 16, pos)
        pos -= step
        f.seek(pos)
        k = f.read(step).rfind(b"\n")
        if k >= 0:
            start = pos + k + 1
            break
    f.seek(start)
    tail = f.read()
    if isinstance(_parse(tail), dict):
        f.write(b"\n")
    else:
        f.truncate(start)
        print(f"[report] {path}: cut a truncated last line ({len(tail)} bytes) before appending", file=sys.stderr)


def _parse(line: bytes):
    try:
        return json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None


def _gunzip(data: bytes, path) -> bytes:
    """A .gz file's bytes, every member of it (concatenated gzip streams read as one). A stream cut off short (a
    copy that stopped; write_rows itself writes atomically) gives what it holds up to the cut, with a note, as a
    plain file's truncated last line does; the line it cut through is then read_rows' truncated last line."""
    out = []
    while any(data):  # what follows the last member may be zero padding (any: stops at the first byte not 0)
        unpack = zlib.decompressobj(wbits=31)
        try:
            out.append(unpack.decompress(data))
        except zlib.error as e:
            raise UsageError(f"{path}: not a readable gzip file ({e})") from None
        if not unpack.eof:
            print(f"[report] {path}: the gzip stream ends early (cut off); read the rows before the cut",
                  file=sys.stderr)
            break
        data = unpack.unused_data
    return b"".join(out)


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a samples.jsonl (or, by its .gz name, a gzip'd one); a truncated last line (an interrupted
    append, or a gzip stream cut off) is ignored with a note."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; a run writes its rows in its results folder ({ROWS}, or a plain "
                         f"{LIVE_ROWS} while it runs)") from None
    if os.fspath(path).endswith(".gz"):
        data = _gunzip(data, path)
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        obj = _parse(line)
        if obj is None and i == len(lines) - 1:
            print(f"[report] {path}: ignored a truncated last line ({len(line)} bytes)", file=sys.stderr)
            break
        if not isinstance(obj, dict):
            raise UsageError(f"{path}:{i + 1}: not a JSON object; only the last line may be truncated")
        rows.append(obj)
    return rows


def write_record(path: str | os.PathLike, record: dict, markdown: str) -> None:
    """A bench's record as JSON at `path` and its table as markdown beside it (the same name, .md), each written
    atomically, the folder made if missing."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(record, indent=2))
    atomic_write(os.path.splitext(path)[0] + ".md", markdown)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Temp file in the same folder, fsync, rename: a reader never sees a half-written file."""
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:  # plain open, so the file gets the umask's mode (mkstemp would make it 0600)
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _cmd(args: list[str], cwd=None) -> str | None:
    try:
        p = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _version(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _pathspec(repo: Path, exclude) -> list[str]:
    """git pathspecs that leave out each excluded folder lying inside the repository (the run's own output)."""
    specs = []
    for folder in exclude:
        try:
            rel = Path(folder).resolve().relative_to(repo.resolve())
        except ValueError:  # outside the source tree: git does not see it anyway
            continue
        if rel.parts:
            specs.append(f":(exclude){rel.as_posix()}")
    return ["--", "."] + specs if specs else []


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's model name (Linux: /proc/cpuinfo's "model name"), else platform.processor(), else None."""
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


GIT_DIRTY_COUNTS = ("tracked files changed against HEAD, staged or not (git status --porcelain --untracked-files=no); "
                    "untracked files are counted apart in git_untracked_files, the run's own folder left out")


def environment(exclude=(), repo: Path | None = None) -> dict:
    """Where the numbers came from: GPUs and driver, the CPU's model and thread counts, library versions, the repo's git SHA and dirty flag.

    `exclude`: folders left out of git_untracked_files (the run's own results folder, new and untracked while the
    run writes it). git_dirty counts tracked files only (GIT_DIRTY_COUNTS): an earlier run's folder under results/
    (--run-id X writes results/X/, which .gitignore does not cover) left every later run dirty."""
    repo = repo or _REPO
    env = {"python": platform.python_version(), "platform": platform.platform(), "hostname": socket.gethostname(),
           "time_unix": time.time(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": _version("torch"), "transformers": _version("transformers"), "numpy": _version("numpy"),
           "triton": _version("triton"),
           "cuda": None, "gpus": [], "driver": None, "cpu": cpu_model(), "cpu_count": os.cpu_count(),
           "torch_threads": None}
    if env["torch"]:
        try:
            import torch
            env["torch_threads"] = torch.get_num_threads()  # intra-op threads: what a CPU run's step time rides on
            env["cuda"] = torch.version.cuda
            if torch.cuda.is_available():
                env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception as e:  # a broken CUDA install must not lose the run's results
            env["torch_error"] = f"{type(e).__name__}: {e}"
    if env["gpus"]:
        smi = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = smi.splitlines()[0].strip() if smi else None
    sha = _cmd(["git", "rev-parse", "HEAD"], cwd=repo)
    # dirty: a tracked file differs from HEAD; an untracked file (an earlier run's --run-id folder) does not make
    # the code dirty, and is counted apart (the run's own output left out)
    status = _cmd(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo) if sha else None
    untracked = _cmd(["git", "status", "--porcelain", "--untracked-files=all", *_pathspec(repo, exclude)],
                     cwd=repo) if sha else None
    env["git_sha"] = sha
    env["git_dirty"] = None if status is None else bool(status)
    if sha is None and (repo / COMMIT_FILE).is_file():  # a copy of the tree without .git (a lent GPU machine)
        recorded, _, when = (repo / COMMIT_FILE).read_text().strip().partition(" ")
        env["git_sha"], env["git_dirty"] = recorded.removesuffix("+dirty"), recorded.endswith("+dirty")
        env["git_sha_from"] = (f"{COMMIT_FILE}: the commit harness/lab/device_tree.sh stash (or mark) recorded at "
                               f"{when or 'an unrecorded time'} where the tree was copied from (this copy had no .git)")
    env["git_dirty_counts"] = GIT_DIRTY_COUNTS
    env["git_untracked_files"] = None if untracked is None else sum(
        line.startswith("??") for line in untracked.splitlines())
    return env
