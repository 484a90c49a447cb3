"""summary.json's documented, versioned schema (harness.protocol.summary_schema): a written summary matches it, and
--rebuild reads a folder written before schema versions."""
import json
from pathlib import Path

from harness.protocol import report, results_io
from test_report import example, summary  # noqa: F401 (summary: the module-scoped fixture)

ROOT = Path(__file__).resolve().parents[1]


def test_a_written_summary_matches_its_documented_schema(tmp_path, summary):
    """Every key of summary.json (top level and per arm) is documented in summary_schema with its type, and a
    written one carries schema_version: a key added, dropped or retyped without the schema fails here."""
    from harness.protocol import summary_schema
    assert summary["schema_version"] == summary_schema.SCHEMA_VERSION and summary["schema"] == summary_schema.SCHEMA
    report.write_results(tmp_path / "run", {"dataset": "toy"}, {}, example(), summary)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary_schema.problems(written) == []
    assert set(written) == set(summary_schema.TOP) and all(set(a) == set(summary_schema.ARM)
                                                           for a in written["arms"].values())
    real = report.summarize(results_io.read_folder_rows(ROOT / "results/smollm2-135m/gsm8k_t0"))
    assert summary_schema.problems(real) == []  # a real run: every arm kind, nulls where undefined
    broken = dict(written, extra=1, prompts="3")
    del broken["labels"]
    assert summary_schema.problems(broken) == ["summary: missing 'labels'", "summary: undocumented 'extra'",
                                               "summary['prompts']: str is not <class 'int'>"]


def test_rebuild_reads_a_folder_written_before_schema_versions(tmp_path, capsys):
    """--rebuild on a committed folder whose summary.json is version 1 (no schema_version): every number of the old
    summary comes out unchanged, the new summary is the current version (its added fields filled, "unknown" where
    the old config.json does not say) and the old tables' lines are all still there; a newer version is refused."""
    import shutil
    src = ROOT / "results" / "smollm2-135m-v1" / "h200_96tok" / "gsm8k_t0"  # written at schema 1
    folder = tmp_path / "gsm8k_t0"
    shutil.copytree(src, folder)
    assert "schema_version" not in json.loads((folder / "summary.json").read_text())
    assert report.main(["--rebuild", str(folder)]) == 0
    # README.md: the old lines but for the conventions that version 3 changed (scope, tau_source) or added
    changed = ("scope", "tau_source", "tau_gain", "design", "tau_order")
    kept = [x for x in (src / "README.md").read_text().splitlines()
            if not x.lstrip("- *").startswith(changed)]
    assert set(kept) <= set((folder / "README.md").read_text().splitlines())
    new = json.loads((folder / "summary.json").read_text())
    old = json.loads((src / "summary.json").read_text())
    assert new.pop("schema_version") == 3 and new.pop("schema") == "xpress-bench/summary/3"
    assert old.pop("schema") == "xpress-bench/summary/1"
    assert new.pop("design")["imbalance"] is None  # the rows of version 1 do not record their slots
    assert new.pop("run")["dtype"] == "unknown"  # the old config.json stored "dtype": null
    order = new.pop("tau_order")  # added in 3: the run has drafter-only, Markov and xPress at K 1, 2, 4, 6, 8
    assert order["markov"] == "Markov" and [x["K"] for x in order["xpress"]] == [1, 2, 4, 6, 8]
    added = ("speedup_e2e", "steps", "step_s", "break_even_tau")
    for arm in new["arms"].values():  # version 3's keys; T=0: one tau replicate, the first measured round
        assert arm.pop("tau_seeds") == 1 and arm.pop("tau_rounds") == arm["rounds"][:1]
        arm.pop("tau_gain")
        assert all(arm.pop(k, "missing") != "missing" for k in added)
        assert arm.pop("reference_match") is None  # rows written before the replay: no reference pass
        if arm["token_match"]:
            assert arm["token_match"].pop("divergence")["measured"] == 0  # nor gaps measured
    assert new["conventions"].pop("divergence")
    for c in changed:
        new["conventions"].pop(c, None), old["conventions"].pop(c, None)
    assert {k: v for k, v in new.items() if k != "conventions"} == {k: v for k, v in old.items() if k != "conventions"}
    assert old["conventions"].items() <= new["conventions"].items()  # every number as before
    (folder / "summary.json").write_text(json.dumps(dict(new, schema_version=99, optimal=new["optimal"])))
    capsys.readouterr()
    assert report.main([str(folder)]) == 2
    assert "schema_version 99 is newer" in capsys.readouterr().err
