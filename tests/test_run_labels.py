"""Issue 27, items 4, 6 and 7: both speedups and the break-even tau recompute from the rows by hand; the run's facts
(model, quantization, device, dtype, kernels) come from config.json into summary.json, table.md, table.csv and
every plot title; env.json names the CPU; the merged report groups mixed targets and keeps each folder's flags."""
import csv
import io
import json
import statistics
from types import SimpleNamespace

import pytest

from harness.protocol import facts, report, results_io, tables
from harness.protocol.plan import target_source
from test_report import example, fake_folder

CONFIG = {"model_name_or_path": "/m/SmolLM2.Q4_1.gguf", "seed": 7, "max_new_tokens": 96, "dtype": None,
          "device": None, "compat_reference": False, "draft_temperature": 0.0,
          "resolved": {"device": "cuda:0", "dtype": "bfloat16", "kernels": "triton",
                       "target": {"source": "/m/SmolLM2.Q4_1.gguf", "quantization": "Q4_1"}}}


def test_both_speedups_and_the_break_even_recompute_by_hand():
    """Guards the end-to-end speedup (TTFT + drafter prefill + decode) and the break-even tau (step cost over
    AR's): neither existed before, and they come from the same measured rows (rounds 2 and 3) as the decode one."""
    s = report.summarize(example(), n_boot=50)
    x, ar = s["arms"]["xPress(K=6)"], s["arms"]["AR"]
    # decode only: decode tokens (160 per round for both arms) over decode seconds, per round, median over rounds
    assert x["speedup"]["value"] == pytest.approx(statistics.median([1.7 / 0.8, 3.2 / 0.64]))
    # end to end: new tokens (161 both) over TTFT (0.01 + 0.02 + 0.03) + drafter prefill (3 x 0.002) + decode
    e2e = statistics.median([(0.06 + 1.7) / (0.066 + 0.8), (0.06 + 3.2) / (0.066 + 0.64)])
    assert x["speedup_e2e"]["value"] == pytest.approx(e2e) and x["speedup_e2e"]["ci95"][0] is not None
    assert ar["speedup_e2e"] is None
    # steps: AR 3 per row x 3 prompts x 2 rounds; xPress rounds 2 and 3 have 6 and 5 accept_lengths entries
    assert (ar["steps"], x["steps"]) == (18, 11)
    assert ar["step_s"] == pytest.approx(4.9 / 18) and x["step_s"] == pytest.approx(1.44 / 11)
    assert x["break_even_tau"] == pytest.approx((1.44 / 11) / (4.9 / 18)) and ar["break_even_tau"] == 1.0
    # the pooled decode speedup is exactly tokens-per-step over AR's, over the break-even
    pooled = (320 / 1.44) / (320 / 4.9)
    assert (320 / 11) / (320 / 18) / x["break_even_tau"] == pytest.approx(pooled)
    md = tables.format_markdown_table(s, "toy")
    assert "| E2E Sp. [95% CI] | break-even tau |" in md
    assert f"break-even tau {x['break_even_tau']:.2f}" in md and f"pooled Sp. = {pooled:.3f}" in md
    assert "break_even_tau" in s["conventions"] and "speedup_e2e" in s["conventions"]


def test_tables_and_summary_name_the_model_device_and_dtype(tmp_path, monkeypatch):
    """Guards item 6: before, only the console line named the device and dtype, and config.json stored null."""
    run = facts.run_facts(CONFIG)
    assert run["model"] == "SmolLM2.Q4_1.gguf" and run["quantization"] == "Q4_1"
    assert (run["device"], run["dtype"], run["kernels"], run["seed"]) == ("cuda:0", "bfloat16", "triton", 7)
    s = report.summarize(example(), n_boot=50, run=run)
    assert s["run"] == run
    title = tables.format_markdown_table(s, "toy").splitlines()[0]
    readme = tables.format_conventions(s, "toy").splitlines()  # the folder's README says what ran, too
    assert readme[2].startswith("Run: model=SmolLM2.Q4_1.gguf (Q4_1, de-quantized to bfloat16)  device=cuda:0")
    assert all(x in title for x in ("model=SmolLM2.Q4_1.gguf (Q4_1, de-quantized to bfloat16)", "device=cuda:0",
                                    "dtype=bfloat16", "kernels=triton", "seed=7", "prompts=3"))
    first = next(csv.DictReader(io.StringIO(tables.format_csv(s))))
    assert (first["model"], first["device"], first["dtype"], first["quantization"], first["seed"]) == (
        "SmolLM2.Q4_1.gguf", "cuda:0", "bfloat16", "Q4_1", "7")  # the seed too, as the README says
    titles = []
    from matplotlib.axes import Axes
    monkeypatch.setattr(Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    from harness.protocol.plots import write_plots
    assert write_plots(tmp_path, s, "toy", None)
    assert titles and all("SmolLM2.Q4_1.gguf" in t and "device=cuda:0" in t and "dtype=bfloat16" in t
                          and "quantization=Q4_1" in t for t in titles)
    old = facts.run_facts({"model_name_or_path": "x", "dtype": None})  # a config.json from before "resolved" dtype
    assert old["dtype"] == old["device"] == old["quantization"] == "unknown"


def test_the_target_source_records_the_gguf_quantization(tmp_path):
    """Guards that config.json's resolved section names the GGUF's stored quantization (the run de-quantizes it),
    read from the file's header, not from its name; a non-GGUF target has none."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    path = tmp_path / "model.gguf"  # named without its quantization on purpose
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = SimpleNamespace(random_weights=None, model_name_or_path=str(path))
    assert target_source(cfg) == {"source": str(path), "quantization": "Q4_1"}
    assert target_source(SimpleNamespace(random_weights=None, model_name_or_path="org/model"))["quantization"] is None
    assert target_source(SimpleNamespace(random_weights="tiny", model_name_or_path=None))["source"] == "random tiny"


def test_environment_names_the_cpu_and_its_threads(tmp_path):
    """Guards env.json's CPU model and thread counts (a CPU run's step time rides on them; they were missing)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n")
    assert results_io.cpu_model(str(info)) == "Test CPU 9000"
    env = results_io.environment()
    import torch
    assert env["torch_threads"] == torch.get_num_threads() and env["cpu_count"] >= 1 and "cpu" in env


def _folder(tmp_path, name, dataset, model, flagged=False):
    f = fake_folder(tmp_path, name, dataset, (4.0, 6.0), (6.0, 8.0), {6: (7.0, 9.0, 1.7)}, 6)
    cfg = json.loads(json.dumps(CONFIG))
    cfg["resolved"]["target"]["source"] = model
    (tmp_path / name / "config.json").write_text(json.dumps({**cfg, "dataset": dataset}))
    if flagged:
        s = json.loads((tmp_path / name / "summary.json").read_text())
        s["ar_rounds_off_median"] = [{"round": 3, "pooled_tok_s": 50.0, "off_median": 0.4}]
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    return f


def test_merged_report_groups_mixed_targets_and_keeps_the_flags(tmp_path, capsys):
    """Guards item 7: a SmolLM2 folder and a toy-target folder were averaged into one Avg. row with no model
    column, and the folders' FLAGGED AR rounds were dropped. Now each target gets its own table and Avg.; the
    model, device and dtype are columns; a flagged folder's cells carry the mark and its flags column says why."""
    a = _folder(tmp_path, "a", "gsm8k", "/m/SmolLM2.gguf", flagged=True)
    b = _folder(tmp_path, "b", "math500", "/m/SmolLM2.gguf")
    c = _folder(tmp_path, "c", "gsm8k", "random tiny")
    assert report.main([a, b, c]) == 0
    text = capsys.readouterr().out
    assert text.startswith("**2 groups of folders with different targets, protocols or weights")
    sections = text.split("### ")[1:]
    assert len(sections) == 2 and "model=SmolLM2.gguf" in sections[0] and "model=random tiny" in sections[1]
    assert [s.count("| **Avg.** |") for s in sections] == [1, 1]
    rows = [ln for ln in sections[0].splitlines() if ln.startswith("| gsm8k")]
    assert rows[0].count(tables.FLAG) == 3 and "FLAGGED: AR round 3 40% off the median" in rows[0]
    assert "| SmolLM2.gguf | cuda:0 | bfloat16 |" in rows[0]
    assert tables.FLAG not in next(ln for ln in sections[0].splitlines() if ln.startswith("| math500"))
    assert report.main([a, b]) == 0  # one target: one table, as before
    assert not capsys.readouterr().out.startswith("**2 groups")


def test_merged_report_keeps_kernels_apart(tmp_path, capsys):
    """Guards the kernels as part of a folder's protocol: the batch-invariant tiles cost step time (issue 28), so
    a folder decoded on them and one on the fast tiles get a table and an Avg. each, and the header names both."""
    a = _folder(tmp_path, "a", "gsm8k", "/m/SmolLM2.gguf")
    b = _folder(tmp_path, "b", "math500", "/m/SmolLM2.gguf")
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["batch_invariant"], cfg["resolved"]["batch_invariant_verified_on_gpu"] = True, "2026-12-02 abc1234"
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    assert report.main([a, b]) == 0
    text = capsys.readouterr().out
    assert text.startswith("**2 groups of folders with different targets, protocols or weights")
    sections = text.split("### ")[1:]
    assert sorted("kernels=triton batch-invariant" in s.splitlines()[0] for s in sections) == [False, True]


@pytest.mark.parametrize("key, value, shown", [("use_graph", False, "cuda_graphs=False"),
                                               ("compile_all", True, "compiled=all"),
                                               ("xpress_topc", 128, "xpress_topc=128")])
def test_merged_report_keeps_graphs_compiling_and_topc_apart(tmp_path, capsys, key, value, shown):
    """CUDA graphs and compiling change every step's cost, and the top-C shortlist changes xPress's drafts: a
    folder that differs from another only there is averaged apart (they were averaged together before)."""
    a = _folder(tmp_path, "a", "gsm8k", "/m/SmolLM2.gguf")
    b = _folder(tmp_path, "b", "math500", "/m/SmolLM2.gguf")
    for f, v in (("a", None), ("b", value)):
        cfg = json.loads((tmp_path / f / "config.json").read_text())
        cfg.update({"use_graph": True, "compile_all": False, "compile_refiner": False, "xpress_topc": 0})
        cfg["resolved"].pop("xpress_topc", None)
        if v is not None:
            cfg[key] = v
        (tmp_path / f / "config.json").write_text(json.dumps(cfg))
    assert report.main([a, b]) == 0
    text = capsys.readouterr().out
    assert text.startswith("**2 groups of folders")
    assert sorted(shown in s.splitlines()[0] for s in text.split("### ")[1:]) == [False, True]


def test_committed_results_folders_still_merge(capsys):
    """Older folders (summary schema 1, config.json without the resolved dtype) merge, 'unknown' where they do not
    say; the committed files are read, never rewritten."""
    from test_report import ROOT
    folders = sorted(str(p) for p in (ROOT / "results" / "smollm2-135m-v1").glob("*_t0"))
    before = {f: (ROOT / f / "summary.json").read_bytes() for f in folders}
    assert report.main(folders) == 0
    text = capsys.readouterr().out
    assert "| cpu | unknown |" in text and "SmolLM2-135M-Instruct.Q4_1.gguf" in text  # the typed device, no dtype
    assert before == {f: (ROOT / f / "summary.json").read_bytes() for f in folders}


def test_an_untyped_draft_temperature_records_the_one_that_ran(tmp_path, capsys):
    """--draft-temperature left out runs the drafts at --temperature: config.json's resolved section and the rows
    record that value, so the merged report keeps such a folder in one table with a run that typed it (it recorded
    null, the facts said "unknown", and the report split them into two groups)."""
    import benchmark_compile_all as cli
    from harness.protocol.setups import DATA_DIR
    base = ["--random-weights", "tiny", "--max-samples", "1", "--max-new-tokens", "4", "--device", "cpu",
            "--data-dir", str(DATA_DIR), "--results-dir", str(tmp_path)]
    assert cli.main(base + ["--dataset", "gsm8k", "--run-id", "untyped"]) == 0
    assert cli.main(base + ["--dataset", "math500", "--run-id", "typed", "--draft-temperature", "0"]) == 0
    config = json.loads((tmp_path / "untyped" / "config.json").read_text())
    assert config["draft_temperature"] is None and config["resolved"]["draft_temperature"] == 0.0
    rows = results_io.read_folder_rows(tmp_path / "untyped")
    assert {r["draft_temperature"] for r in rows} == {0.0}
    capsys.readouterr()
    assert report.main([str(tmp_path / "untyped"), str(tmp_path / "typed")]) == 0
    assert "groups of folders" not in capsys.readouterr().out
    # a folder written before: null and a known --temperature read as the temperature the drafts ran at
    assert facts.run_facts({"temperature": 1.0, "draft_temperature": None})["draft_temperature"] == 1.0
    old = {"run": {**facts.run_facts({}), "draft_temperature": facts.UNKNOWN}}
    assert facts.of(old, {"temperature": 0.0, "draft_temperature": None})["draft_temperature"] == 0.0


def test_a_drafter_trained_for_another_architecture_is_noted(tmp_path):
    """The shapes of a Llama-trained drafter fit a Mistral target of the same size, so no check refuses it; the
    console says whose drafter it is (speculators' verifier record), and nothing when the architectures agree."""
    import json
    from types import SimpleNamespace
    from harness.protocol.console import verifier_mismatch
    (tmp_path / "config.json").write_text(json.dumps(
        {"speculators_config": {"verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "/tmp/x"}}}))
    note = verifier_mismatch(str(tmp_path), SimpleNamespace(architectures=["MistralForCausalLM"]))
    assert "trained for a LlamaForCausalLM verifier and this target is MistralForCausalLM" in note
    assert verifier_mismatch(str(tmp_path), SimpleNamespace(architectures=["LlamaForCausalLM"])) is None
    assert verifier_mismatch(str(tmp_path / "none"), SimpleNamespace(architectures=["X"])) is None


def test_the_plots_draw_the_tables_speedup_with_its_own_ci():
    """The bars and the K plot's markers are Sp. (the median over rounds, the table's number), with the CI computed
    for that statistic; the mean over rounds, which the plots drew beside the median's CI, is another number."""
    from harness.protocol.plots import _ci
    s = {"speedup": {"value": 0.929, "median": 0.929, "mean": 0.820, "ci95": [0.45, 1.48]}}
    value, below, above = _ci(s)
    assert value == 0.929 and abs(below - 0.479) < 1e-9 and abs(above - 0.551) < 1e-9


def test_spyre_numerics_are_labelled():
    from harness.protocol.labels import config_labels
    assert "xPress on Spyre's numerics (--refine-numerics spyre)" in config_labels({"refine_numerics": "spyre"})
    assert config_labels({"refine_numerics": "standard"}) == []


def test_random_drafter_heads_on_the_real_target_are_never_averaged_with_trained_weights(tmp_path):
    """The same target and protocol, one run on make_random_* weights: two groups (the merged report averaged them
    together, its labels column the only trace)."""
    from harness.protocol import merge
    random_dir = tmp_path / "random"
    random_dir.mkdir()
    (random_dir / "RANDOM_WEIGHTS.txt").write_text("made by scripts/make_random_drafter.py\n")
    a = {"summary": {}, "config": {"draft_name_or_path": str(random_dir)}, "folder": "a"}
    b = {"summary": {}, "config": {"draft_name_or_path": str(tmp_path / "trained")}, "folder": "b"}
    assert len(merge.groups([a, b])) == 2 and len(merge.groups([b, dict(b, folder="c")])) == 1
    assert dict(merge.group_key(a))["weights"] == "random drafter/heads (scripts/make_random_*)"
    # what the run recorded decides, not the disk at report time (the random folder deleted, or another machine)
    recorded = dict(a, summary={"labels": ["random drafter/heads (scripts/make_random_*)"]})
    (random_dir / "RANDOM_WEIGHTS.txt").unlink()
    assert len(merge.groups([recorded, dict(b, summary={"labels": []})])) == 2


def test_an_old_config_still_names_its_typed_device_and_dtype():
    """A config.json written before "resolved" recorded the device and dtype: a rebuild said device=unknown where
    the config holds the typed --device; what the run resolved still wins, and nothing typed stays unknown."""
    from harness.protocol import facts
    assert facts.run_facts({"device": "cpu", "dtype": "float32"})["device"] == "cpu"
    assert facts.run_facts({"device": "cpu", "dtype": "float32"})["dtype"] == "float32"
    assert facts.run_facts({"device": "cuda", "resolved": {"device": "cuda:1"}})["device"] == "cuda:1"
    assert facts.run_facts({"device": None})["device"] == facts.UNKNOWN
    assert facts.run_facts({"dtype": "bf16"})["dtype"] == "bfloat16"  # as a resolved run records it: one group


def test_a_resume_that_reused_every_decode_is_no_resumed_run(tmp_path):
    """A run stopped while it wrote its report resumes without decoding anything: no round spans two processes,
    so its tables are not labelled resumed; a resume that reused part of the decodes is."""
    import json
    from harness.protocol.plan import resume_count
    entry = {"time_utc": "t", "time_unix": 0, "reused_decodes": 90, "total_decodes": 90}
    (tmp_path / "resumes.json").write_text(json.dumps([entry]))
    assert resume_count(str(tmp_path)) == 0
    (tmp_path / "resumes.json").write_text(json.dumps([entry, dict(entry, reused_decodes=40)]))
    assert resume_count(str(tmp_path)) == 1


def test_runs_of_other_drafters_or_blocks_are_two_groups():
    """Two trained drafters (their digests differ) or blocks are never averaged together; the same tensors carried
    to another path are one group; a config.json without digests groups as 'unrecorded'. (A new-user trial merged
    a block-4 tiny-cpu export with the shipped block-16 drafter into one Avg. row.)"""
    from harness.protocol import merge

    def entry(folder, drafter, block=16):
        weights = {"drafter": {"digest": drafter, "files": 1, "bytes": 1, "scheme": 1}} if drafter else None
        return {"summary": {}, "config": {"resolved": {"block_size": block, "weights": weights}}, "folder": folder}
    shipped, other = entry("a", "43b9b84b6c4ccdea"), entry("b", "4dedd87f00000000", block=4)
    assert len(merge.groups([shipped, other])) == 2
    assert len(merge.groups([shipped, entry("c", "43b9b84b6c4ccdea")])) == 1
    assert len(merge.groups([shipped, entry("d", "43b9b84b6c4ccdea", block=8)])) == 2
    key = dict(merge.group_key(shipped))
    assert key["digests"] == "drafter 43b9b84b" and key["block"] == 16
    assert dict(merge.group_key(entry("e", None)))["digests"] == "unrecorded"
