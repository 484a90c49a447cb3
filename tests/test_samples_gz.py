"""A results folder's rows gzip'd (harness.protocol.results_io: ROWS, LIVE_ROWS): a finished run writes
samples.jsonl.gz (one deterministic gzip stream), a run appends to a plain samples.jsonl while it goes, and every
reader takes either; a gzip stream cut short reads as a plain file with a truncated last line does. Before, every
folder held a plain samples.jsonl (120 MB of the 149 MB committed under results/)."""
import gzip
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.errors import UsageError
from harness.protocol import plan, report, results_io
from test_report import example

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"i": 1, "tokens": [1, 2, 3], "text": "é"}, {"i": 2, "tokens": []}, {"i": 3, "tokens": [9] * 50}]


def plain(rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def test_write_rows_round_trips_as_one_deterministic_gzip_stream(tmp_path):
    (tmp_path / "samples.jsonl").write_bytes(plain(ROWS[:1]))  # what the run appended: replaced by the .gz
    path = results_io.write_rows(tmp_path, ROWS)
    assert path == tmp_path / "samples.jsonl.gz" and not (tmp_path / "samples.jsonl").exists()
    data = path.read_bytes()
    assert data[:2] == b"\x1f\x8b" and data[4:8] == b"\0\0\0\0" and not data[3] & 0x08  # no time, no name
    assert gzip.decompress(data) == plain(ROWS)
    assert results_io.read_rows(path) == ROWS and results_io.read_folder_rows(tmp_path) == ROWS
    results_io.write_rows(tmp_path, ROWS)
    assert path.read_bytes() == data  # the same rows, the same bytes


def test_a_legacy_plain_folder_is_read_and_a_plain_file_beside_the_gz_wins(tmp_path, capsys):
    results_io.append_rows(tmp_path / "samples.jsonl", ROWS)
    assert results_io.rows_file(tmp_path) == tmp_path / "samples.jsonl"
    assert results_io.read_folder_rows(tmp_path) == ROWS
    (tmp_path / "samples.jsonl.gz").write_bytes(gzip.compress(plain(ROWS[:1])))
    assert results_io.read_folder_rows(tmp_path) == ROWS  # the plain one is the run's live file: never older
    (tmp_path / "samples.jsonl").unlink()
    assert results_io.read_folder_rows(tmp_path) == ROWS[:1]
    (tmp_path / "samples.jsonl.gz").unlink()
    assert results_io.rows_file(tmp_path) is None
    with pytest.raises(UsageError, match=r"no samples.jsonl.gz \(nor a plain samples.jsonl, nor a torchrun run's "
                       r"samples.rank\{r\}.jsonl\)"):
        results_io.read_folder_rows(tmp_path)


@pytest.mark.parametrize("cut", [-1, -9, "mid-row", 5])
def test_a_gzip_stream_cut_short_gives_its_rows_before_the_cut(tmp_path, capsys, cut):
    """As a plain file whose last line a crash cut: the rows before it, and a note; a cut through a row drops
    that row only (the trailer, -1 and -9 bytes: every row is there; 5: inside the header, no row)."""
    data = gzip.compress(plain(ROWS), mtime=0)
    path = tmp_path / "samples.jsonl.gz"
    if cut == "mid-row":  # a stream that ends inside the last row: a member flushed mid-line, then cut
        z = gzip.zlib.compressobj(9, gzip.zlib.DEFLATED, 31)
        text = plain(ROWS)
        path.write_bytes(z.compress(text[:-20]) + z.flush(gzip.zlib.Z_SYNC_FLUSH))
        want = ROWS[:2]
    else:
        path.write_bytes(data[:cut])
        want = [] if cut == 5 else ROWS
    assert results_io.read_rows(path) == want
    err = capsys.readouterr().err
    assert "the gzip stream ends early" in err
    if cut == "mid-row":
        assert "ignored a truncated last line" in err


def test_concatenated_members_are_read_and_a_damaged_stream_is_refused(tmp_path):
    path = tmp_path / "samples.jsonl.gz"
    path.write_bytes(gzip.compress(plain(ROWS[:2])) + gzip.compress(plain(ROWS[2:])) + b"\0" * 8)
    assert results_io.read_rows(path) == ROWS  # members appended one after another (cat a.gz b.gz), padding
    data = bytearray(gzip.compress(plain(ROWS)))
    data[-6] ^= 0xFF  # the CRC no longer matches
    path.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="not a readable gzip file"):
        results_io.read_rows(path)
    path.write_bytes(gzip.compress(plain(ROWS)) + b"junk")
    with pytest.raises(UsageError, match="not a readable gzip file"):
        results_io.read_rows(path)


def test_rows_are_appended_plain_and_reopened_from_the_gz_for_a_resume(tmp_path):
    with pytest.raises(ValueError, match="appended to a plain .jsonl"):
        results_io.append_rows(tmp_path / "samples.jsonl.gz", ROWS)
    live = tmp_path / "samples.jsonl"
    assert results_io.reopen_rows(live) is False and not live.exists()  # nothing to reopen
    results_io.write_rows(tmp_path, ROWS[:2])
    assert results_io.reopen_rows(live) is True and live.read_bytes() == plain(ROWS[:2])
    results_io.append_rows(live, ROWS[2:])
    assert results_io.reopen_rows(live) is False  # the live file is kept as it is
    assert results_io.read_folder_rows(tmp_path) == ROWS


def test_a_folder_holding_only_gzipd_rows_is_taken(tmp_path):
    cfg = SimpleNamespace(run_id="r", results_dir=str(tmp_path), batch_sizes=None, context_lengths=None)
    (tmp_path / "r").mkdir()
    assert plan.run_folder(cfg) == str(tmp_path / "r")
    results_io.write_rows(tmp_path / "r", ROWS)
    with pytest.raises(UsageError, match="already holds a run"):
        plan.run_folder(cfg)


def test_rebuild_reads_a_legacy_plain_folder_as_a_gzipd_one(tmp_path):
    """--rebuild of a folder written before rows were gzip'd (plain samples.jsonl): the same summary as from the
    .gz, and its rows are left as they are."""
    rows = example()
    new, old = tmp_path / "new", tmp_path / "old"
    report.write_results(new, {"dataset": "toy"}, {}, rows, report.summarize(rows, n_boot=50))
    shutil.copytree(new, old)
    (old / "samples.jsonl.gz").unlink()
    (old / "samples.jsonl").write_bytes(plain(rows))
    for folder in (new, old):
        assert report.main(["--rebuild", str(folder)]) == 0
    assert json.loads((old / "summary.json").read_text()) == json.loads((new / "summary.json").read_text())
    assert (old / "samples.jsonl").read_bytes() == plain(rows) and not (old / "samples.jsonl.gz").exists()


def test_sweep_steps_reads_a_gzipd_or_a_plain_sweep_folder(tmp_path, capsys):
    from harness.protocol import sweep_steps
    src = ROOT / "results" / "sweeps" / "h100" / "qwen3-8b_tau7_batch"
    folder = tmp_path / "s"
    folder.mkdir()
    for name in ("sweep.json", "samples.jsonl.gz"):
        shutil.copy(src / name, folder / name)
    assert sweep_steps.main([str(folder)]) == 0
    steps = (folder / "steps.md").read_text()
    assert steps == (src / "steps.md").read_text()  # the committed table, from the committed gzip'd rows
    (folder / "samples.jsonl").write_bytes(gzip.decompress((folder / "samples.jsonl.gz").read_bytes()))
    (folder / "samples.jsonl.gz").unlink()
    (folder / "steps.md").unlink()
    assert sweep_steps.main([str(folder)]) == 0 and (folder / "steps.md").read_text() == steps
    (folder / "samples.jsonl").unlink()
    capsys.readouterr()
    assert sweep_steps.main([str(folder)]) == 2
    assert "it needs sweep.json and samples.jsonl.gz" in capsys.readouterr().err
