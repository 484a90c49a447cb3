"""python -m training.travel (training/travel.py): stage folders packed into verified pieces and unpacked on another
machine. Guards: the round trip gives the same bytes; packing is deterministic; pieces keep under --max-mib; a
missing, truncated or corrupt piece, another key in the workdir, and an archive member outside the stages are each
refused with one line and nothing written; after unpack the pipeline skips the stages and resumes the responses."""
import io
import json
import os
import random
import tarfile

import pytest

from training import travel


def make_work(root, big=40_000):
    """A workdir as the prompts and an unfinished responses stage leave it (a part still being written included)."""
    w = root / "W"
    (w / "prompts").mkdir(parents=True)
    (w / "responses" / "parts").mkdir(parents=True)
    (w / "prompts" / "manifest.json").write_text(json.dumps({"key": "kp", "train": 3, "heldout": 1}))
    (w / "prompts" / "train.jsonl").write_text(random.Random(0).randbytes(big // 2).hex())  # gzip keeps its size
    (w / "responses" / "manifest.json").write_text(json.dumps({"key": "kr", "complete": False}))
    for i in range(2):
        (w / "responses" / "parts" / f"part_{i:04d}.jsonl").write_text(json.dumps({"response": [i] * 50}) + "\n")
    (w / "responses" / "parts" / "part_0002.tmp").write_text("half")
    return w


def cli(*args):
    return travel.main([str(a) for a in args])


def files_of(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_round_trip_gives_the_same_bytes(tmp_path, capsys):
    w = make_work(tmp_path)
    assert cli("pack", "--workdir", w, "--out", tmp_path / "P", "--max-mib", 0.01) == 0
    index = json.loads((tmp_path / "P" / "stages.json").read_text())
    assert index["stages"]["responses"]["key"] == "kr" and index["stages"]["prompts"]["key"] == "kp"
    assert index["stages"]["responses"]["counts"] == {"complete": False, "parts_done": 2}
    assert index["config"] == "W" and index["created"]
    assert cli("unpack", tmp_path / "P", "--workdir", tmp_path / "W2") == 0
    want = {k: v for k, v in files_of(w).items() if not k.endswith(".tmp")}  # a half-written part stays behind
    assert files_of(tmp_path / "W2") == want
    out = capsys.readouterr().out
    assert "unpacked responses: key kr, complete False, parts_done 2" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P", "W", "W2"]  # the temporary folder is gone


def test_packing_twice_gives_the_same_bytes(tmp_path):
    w = make_work(tmp_path)
    assert cli("pack", "--workdir", w, "--out", tmp_path / "A", "--max-mib", 0.01) == 0
    for f in w.rglob("*"):
        os.utime(f, (1_000_000, 1_000_000))  # other mtimes: the archive must not record them
    assert cli("pack", "--workdir", w, "--out", tmp_path / "B", "--max-mib", 0.01) == 0
    a, b = files_of(tmp_path / "A"), files_of(tmp_path / "B")
    assert {k: v for k, v in a.items() if k.endswith(tuple(f"part{i:03d}" for i in range(100)))} == \
        {k: v for k, v in b.items() if k != "stages.json"}
    ia, ib = (json.loads(x["stages.json"]) for x in (a, b))
    assert ia["archive"] == ib["archive"] and ia["pieces"] == ib["pieces"]


def test_pieces_keep_under_max_mib_and_stale_pieces_go(tmp_path, capsys):
    """Also: more files than one device call gives back (8) is said."""
    w = make_work(tmp_path)
    out = tmp_path / "P"
    out.mkdir()
    (out / "stages.part099").write_text("from an older, larger pack")
    assert cli("pack", "--workdir", w, "--out", out, "--max-mib", 0.002) == 0
    index = json.loads((out / "stages.json").read_text())
    limit = int(0.002 * 2 ** 20)
    names = [p["file"] for p in index["pieces"]]
    assert len(names) > 8 and names == [f"stages.part{i:03d}" for i in range(len(names))]
    assert f"note: {len(names) + 1} files" in capsys.readouterr().out
    for p in index["pieces"]:
        assert (out / p["file"]).stat().st_size == p["bytes"] <= limit
    assert sum(p["bytes"] for p in index["pieces"]) == index["archive"]["bytes"]
    assert sorted(x.name for x in out.iterdir()) == sorted(names + ["stages.json"])


def refused(capsys, *args) -> str:
    assert cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_a_bad_piece_is_refused_before_anything_is_written(tmp_path, capsys, damage):
    w = make_work(tmp_path)
    assert cli("pack", "--workdir", w, "--out", tmp_path / "P", "--max-mib", 0.01) == 0
    piece = tmp_path / "P" / "stages.part001"
    data = piece.read_bytes()
    if damage == "missing":
        piece.unlink()
    elif damage == "truncated":
        piece.write_bytes(data[:-1])
    else:
        piece.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    err = refused(capsys, "unpack", tmp_path / "P", "--workdir", tmp_path / "new" / "W2")
    assert "stages.part001" in err and {"missing": "missing", "truncated": "bytes", "flipped": "sha256"}[damage] in err
    assert not (tmp_path / "new").exists()


def test_another_key_in_the_workdir_is_refused_and_force_replaces_it(tmp_path, capsys):
    w = make_work(tmp_path)
    assert cli("pack", "--workdir", w, "--out", tmp_path / "P") == 0
    w2 = tmp_path / "W2"
    (w2 / "responses").mkdir(parents=True)
    mine = json.dumps({"key": "other", "complete": True})
    (w2 / "responses" / "manifest.json").write_text(mine)
    err = refused(capsys, "unpack", tmp_path / "P", "--workdir", w2)
    assert str(w2 / "responses") in err and "other" in err and "--force" in err
    assert files_of(w2) == {"responses/manifest.json": mine.encode()}  # prompts not written either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P", "W", "W2"]
    assert cli("unpack", tmp_path / "P", "--workdir", w2, "--force") == 0
    assert json.loads((w2 / "responses" / "manifest.json").read_text())["key"] == "kr"
    assert (w2 / "prompts" / "train.jsonl").read_bytes() == (w / "prompts" / "train.jsonl").read_bytes()


def test_a_finished_stage_with_the_same_key_is_kept_and_an_unfinished_one_replaced(tmp_path, capsys):
    w = make_work(tmp_path)
    assert cli("pack", "--workdir", w, "--out", tmp_path / "P") == 0
    w2 = tmp_path / "W2"
    for stage, manifest in (("prompts", {"key": "kp", "train": 7}), ("responses", {"key": "kr", "complete": False})):
        (w2 / stage).mkdir(parents=True)
        (w2 / stage / "manifest.json").write_text(json.dumps(manifest))
    assert cli("unpack", tmp_path / "P", "--workdir", w2) == 0
    assert json.loads((w2 / "prompts" / "manifest.json").read_text())["train"] == 7  # kept
    assert not (w2 / "prompts" / "train.jsonl").exists()
    assert len(list((w2 / "responses" / "parts").glob("part_*.jsonl"))) == 2  # the archive's parts replaced it
    assert "kept (the workdir's is done with the same key) prompts" in capsys.readouterr().out


def forged(out, members):
    """Pieces and an index, hashes right, of a tar.gz holding `members` (TarInfo, bytes) as given."""
    writer = travel.PieceWriter(out, "stages", 1 << 20)
    with tarfile.open(fileobj=writer, mode="w|gz") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index = {"format": travel.FORMAT, "name": "stages", "pieces": writer.finish(),
             "archive": {"bytes": writer.size, "sha256": writer.whole.hexdigest()},
             "stages": {"prompts": {"key": "kp", "counts": {}}}}
    (out / "stages.json").write_text(json.dumps(index))


@pytest.mark.parametrize("bad", ["../evil.txt", "/tmp/evil.txt", "prompts/../../evil.txt", "link", "other/x.txt"])
def test_members_outside_the_stages_are_refused(tmp_path, capsys, bad):
    out = tmp_path / "P"
    out.mkdir()
    manifest = (tarfile.TarInfo("prompts/manifest.json"), json.dumps({"key": "kp"}).encode())
    evil = tarfile.TarInfo(bad)
    if bad == "link":
        evil = tarfile.TarInfo("prompts/link")
        evil.type, evil.linkname = tarfile.SYMTYPE, "/etc/passwd"
    forged(out, [manifest, (evil, b"owned")])
    err = refused(capsys, "unpack", out, "--workdir", tmp_path / "W")
    assert "refusing the archive" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P"]  # no workdir, no temporary folder, no evil.txt


def test_bad_pack_arguments_are_refused_before_anything_is_written(tmp_path, capsys):
    w = make_work(tmp_path)
    assert "--stages" in refused(capsys, "pack", "--workdir", w, "--out", tmp_path / "P", "--stages", "responsez")
    assert "hidden stage has not run" in refused(capsys, "pack", "--workdir", w, "--out", tmp_path / "P",
                                                 "--stages", "hidden")
    assert "the train stage's checkpoints do not travel" in refused(capsys, "pack", "--workdir", w, "--out",
                                                                   tmp_path / "P", "--stages", "prompts,train")
    assert "--max-mib" in refused(capsys, "pack", "--workdir", w, "--out", tmp_path / "P", "--max-mib", 0)
    assert "--name" in refused(capsys, "pack", "--workdir", w, "--out", tmp_path / "P", "--name", "../x")
    assert not (tmp_path / "P").exists()
    assert "no such file" in refused(capsys, "unpack", tmp_path / "P", "--workdir", tmp_path / "W2")


@pytest.mark.usefixtures("one_thread")
def test_after_unpack_the_pipeline_skips_the_stages_and_resumes_the_responses(tmp_path, monkeypatch, capsys):
    """A tiny run interrupted after its first responses part is packed and unpacked into a fresh workdir: there the
    pipeline redoes neither the prompts nor the part it carried, writes the rest, and ends with the files of an
    uninterrupted run; packed again when done and unpacked once more, both stages are up to date."""
    from training_fixtures import run_cli, tiny_models, write_config
    import training.responses as responses
    monkeypatch.setattr(responses, "PART_PROMPTS", 4)  # several parts from the tiny prompt set
    cfg = write_config(tmp_path, tiny_models(heads=False), responses={"engine": "hf"})

    def stages(work):
        for stage in ("prompts", "responses"):
            assert run_cli(stage, "--config", cfg, "--workdir", work) == 0

    stages(tmp_path / "ref")  # uninterrupted
    real, calls = responses.write_jsonl, []

    def interrupted(path, rows):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(path, rows)
    monkeypatch.setattr(responses, "write_jsonl", interrupted)
    assert run_cli("prompts", "--config", cfg, "--workdir", tmp_path / "A") == 0
    assert run_cli("responses", "--config", cfg, "--workdir", tmp_path / "A") == 130
    monkeypatch.setattr(responses, "write_jsonl", real)
    assert [p.name for p in (tmp_path / "A" / "responses" / "parts").iterdir()] == ["part_0000.jsonl"]

    assert cli("pack", "--workdir", tmp_path / "A", "--out", tmp_path / "P") == 0
    assert cli("unpack", tmp_path / "P", "--workdir", tmp_path / "B") == 0
    b = tmp_path / "B"
    carried = [*(b / "prompts").iterdir(), b / "responses" / "parts" / "part_0000.jsonl"]
    carried = {f: f.stat().st_mtime_ns for f in carried}
    capsys.readouterr()
    stages(b)
    assert "prompts: up to date" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in carried} == carried  # nothing carried was rewritten
    timed = json.loads((b / "stages.json").read_text())  # the prompts' time is the run's that wrote them
    assert timed["prompts"] == json.loads((tmp_path / "A" / "stages.json").read_text())["prompts"]
    assert len(list((b / "responses" / "parts").iterdir())) > 1
    assert files_of(b / "prompts") == files_of(tmp_path / "ref" / "prompts")
    assert files_of(b / "responses") == files_of(tmp_path / "ref" / "responses")

    assert cli("pack", "--workdir", b, "--out", tmp_path / "P2") == 0
    assert cli("unpack", tmp_path / "P2", "--workdir", tmp_path / "C") == 0
    unpacked = {f: f.stat().st_mtime_ns for f in (tmp_path / "C").rglob("*") if f.is_file()}
    capsys.readouterr()
    stages(tmp_path / "C")
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / "C").rglob("*") if f.is_file()} == unpacked
    out = capsys.readouterr().out
    assert "prompts: up to date" in out and "responses: up to date" in out
    assert files_of(tmp_path / "C") == files_of(b)  # stages.json too: neither stage did any work in C


def test_an_index_that_is_not_travels_or_names_another_folder_is_refused(tmp_path, capsys):
    w = make_work(tmp_path)
    assert cli("pack", "--workdir", w, "--out", tmp_path / "P") == 0
    index_file = tmp_path / "P" / "stages.json"
    index = json.loads(index_file.read_text())
    index_file.write_text(json.dumps({**index, "stages": {"../up": {}}}))
    assert "../up" in refused(capsys, "unpack", tmp_path / "P", "--workdir", tmp_path / "W2")
    index_file.write_text(json.dumps({"pieces": index["pieces"]}))
    assert "not an index" in refused(capsys, "unpack", tmp_path / "P", "--workdir", tmp_path / "W2")
    assert not (tmp_path / "W2").exists()
