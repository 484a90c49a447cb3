"""Summary arithmetic on hand-made sample rows, the results folder, the rows file, and the multi-dataset table."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.protocol import report, results_io, tables
from core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [100, 10, 50]  # decode tokens of prompts q0, q1, q2 (greedy: the same for both arms)
# decode seconds per (arm, round) for q0..q2; round 1 is warmup and absurdly slow, so leaking it would show
SECONDS = {
    ("AR", 1): [10.0, 10.0, 10.0], ("AR", 2): [1.0, 0.2, 0.5], ("AR", 3): [2.0, 0.2, 1.0],
    ("xPress(K=6)", 1): [10.0, 10.0, 10.0], ("xPress(K=6)", 2): [0.5, 0.05, 0.25], ("xPress(K=6)", 3): [0.4, 0.04, 0.2],
}
# xPress acceptance lengths per round and prompt; the measured rounds differ on purpose (T=0 must take round 2)
ACCEPT = {1: [[4, 4], [4], [4]], 2: [[4, 1, 3], [2, 2], [4]], 3: [[1, 1], [1], [1, 1]]}
INFO = {"AR": ("ar", None, 1), "xPress(K=6)": ("xpress", 6, 4), "drafter-only": ("drafter-only", None, 4),
        "Markov": ("markov", None, 4), "xPress(K=4)": ("xpress", 4, 4)}


def row(arm, q, rnd, seconds, *, turn=0, warmup=None, temperature=0.0, accept=None, tokens=None, dtok=None):
    method, k, block = INFO[arm]
    dtok = TOKENS[q] if dtok is None else dtok
    return {"run_id": "t", "dataset": "toy", "question_id": q, "dataset_row": 10 + q, "turn": turn, "round": rnd,
            "warmup": rnd == 1 if warmup is None else warmup, "arm": arm, "method": method, "K": k,
            "block_size": block, "temperature": temperature, "prompt_tokens": 20, "new_tokens": dtok + 1,
            "decode_tokens": dtok, "ttft_s": 0.01 * (q + 1), "drafter_prefill_s": 0.0 if block == 1 else 0.002,
            "decode_s": seconds, "accept_lengths": accept if accept is not None else [1] * 3,
            "stop_reason": "eos", "tokens": tokens if tokens is not None else [q, 1, 2, 3, 4]}


def example(temperature=0.0):
    """2 arms x (1 warmup + 2 measured rounds) x 3 prompts, plus turn-1 rows of q1 that must not count."""
    rows = []
    for rnd in (1, 2, 3):
        for arm in ("AR", "xPress(K=6)"):
            xp = arm != "AR"
            for q in range(3):
                toks = [1, 1, 2, 9, 4] if (xp and q == 1 and rnd == 3) else None  # diverges at position 3
                rows.append(row(arm, q, rnd, SECONDS[arm, rnd][q], temperature=temperature,
                                accept=ACCEPT[rnd][q] if xp else None, tokens=toks))
            rows.append(row(arm, 1, rnd, 99.0, turn=1, temperature=temperature, accept=[4, 4, 4, 4] if xp else None))
    return rows


@pytest.fixture(scope="module")
def summary():
    return report.summarize(example())


def test_pooled_and_per_sample_tok_s_per_round(summary):
    ar, xp = summary["arms"]["AR"], summary["arms"]["xPress(K=6)"]
    assert ar["rounds"] == xp["rounds"] == [2, 3]
    assert summary["rounds"] == {"all": [1, 2, 3], "warmup": [1], "measured": [2, 3]}
    assert ar["pooled_tok_s"]["values"] == pytest.approx([160 / 1.7, 160 / 3.2])  # sum tokens / sum seconds
    assert ar["per_sample_tok_s"]["values"] == pytest.approx([1 / ((0.01 + 0.02 + 0.01) / 3), 50.0])  # 75, 50
    assert ar["pooled_tok_s"]["mean"] == pytest.approx((160 / 1.7 + 50) / 2)
    assert ar["per_sample_tok_s"]["mean"] == pytest.approx(62.5)
    assert ar["per_sample_tok_s"]["std"] == pytest.approx(math.sqrt(2 * 12.5 ** 2))  # n-1 = 1
    assert xp["pooled_tok_s"]["values"] == pytest.approx([200.0, 250.0])
    assert xp["samples"] == 6 and xp["decode_tokens"] == 320 and xp["new_tokens"] == 326
    assert xp["ttft_s"] == pytest.approx(0.02) and xp["drafter_prefill_s"] == pytest.approx(0.002)
    assert xp["stop_reasons"] == {"eos": 6}


def test_speedup_is_the_mean_of_per_round_ratios(summary):
    sp = summary["arms"]["xPress(K=6)"]["speedup"]
    r2, r3 = 200 / (160 / 1.7), 250 / 50  # 2.125, 5.0
    mean_of_ratios = (r2 + r3) / 2
    ratio_of_means = ((200 + 250) / 2) / ((160 / 1.7 + 50) / 2)
    assert abs(mean_of_ratios - ratio_of_means) > 0.4  # the two statistics really differ here ...
    assert sp["mean"] == pytest.approx(mean_of_ratios)  # ... and the paired one is reported
    assert sp["values"] == pytest.approx([r2, r3]) and sp["n"] == 2 and sp["ref"] == "AR"
    assert sp["median"] == pytest.approx(mean_of_ratios)
    assert sp["std"] == pytest.approx(abs(r3 - r2) / math.sqrt(2))
    # the primary statistic is the median of the per-round ratios, and its CI brackets it
    assert sp["value"] == pytest.approx(sp["median"]) and sp["ci_prompts"] == 3
    lo, hi = sp["ci95"]
    assert lo <= sp["value"] <= hi
    # kept beside it: the speedup pooled over rounds, (320 / 1.44) / (320 / 4.9), with its CI over prompts
    assert sp["pooled"]["value"] == pytest.approx(4.9 / 1.44)
    assert sp["pooled"]["ci95"][0] <= sp["pooled"]["value"] <= sp["pooled"]["ci95"][1]
    assert summary["arms"]["AR"]["speedup"] is None
    assert summary["arms"]["xPress(K=6)"]["speedup_per_sample"]["values"] == pytest.approx([200 / 75, 250 / 50])
    assert summary["arms"]["xPress(K=6)"]["gain"] is None and summary["drafter_only_arm"] is None


def test_greedy_tau_comes_from_the_first_measured_round(summary):
    xp = summary["arms"]["xPress(K=6)"]
    assert xp["tau_per_step"] == pytest.approx(16 / 6)  # round 2: 4+1+3+2+2+4 over 6 steps
    assert xp["tau_per_sample"] == pytest.approx((8 / 3 + 2 + 4) / 3)
    assert xp["histogram"] == pytest.approx([0, 1 / 6, 2 / 6, 1 / 6, 2 / 6])
    assert xp["per_position"] == pytest.approx([5 / 6, 3 / 6, 2 / 6])
    assert xp["tau_per_step_by_round"] == pytest.approx([16 / 6, 1.0])
    assert xp["tau_rounds_agree"] is False and "round 2" in xp["tau_source"] and "NOT" in xp["tau_source"]
    assert summary["arms"]["AR"]["tau_per_step"] == 1.0 and summary["arms"]["AR"]["per_position"] == []
    assert summary["greedy"] and summary["block_size"] == 4


def test_sampled_tau_is_the_mean_over_every_round_warmup_included():
    """Issue 27: at T>0 each round is a sampling replicate, the warmup's too (it was the 2 measured rounds only)."""
    xp = report.summarize(example(temperature=1.0), n_boot=50)["arms"]["xPress(K=6)"]
    assert xp["tau_per_step"] == pytest.approx((16 / 4 + 16 / 6 + 1.0) / 3)  # round 1: 4+4+4+4 over 4 steps
    assert xp["per_position"] == pytest.approx([(1 + 5 / 6) / 3, (1 + 3 / 6) / 3, (1 + 2 / 6) / 3])
    assert xp["tau_rounds_agree"] is None and "mean over 3 sampling replicates" in xp["tau_source"]
    assert xp["tau_rounds"] == [1, 2, 3] and xp["tau_seeds"] == 3 and "FEWER THAN 5 SEEDS" in xp["tau_source"]


def test_token_match_and_first_divergence(summary):
    tm = summary["arms"]["xPress(K=6)"]["token_match"]
    # 3 rounds x (3 turn-0 rows + 1 turn-1 row) compared; one output diverges at position 3 of 5
    assert (tm["rows_compared"], tm["rows_identical"]) == (12, 11)
    assert tm["token_match_rate"] == pytest.approx(58 / 60)
    assert tm["first_divergence"] == [{"question_id": 0, "position": None},
                                      {"question_id": 1, "position": 3, "round": 3},
                                      {"question_id": 2, "position": None}]
    assert summary["arms"]["AR"]["token_match"] is None
    text = report.format_console_table(summary, "toy")
    assert "token match 0.9667" in text and "q1:3" in text and "11/12" in text


def test_gain_over_drafter_only_and_throughput_optimal_k():
    rows = []
    speed = {"AR": 1.0, "drafter-only": 3.0, "Markov": 4.0, "xPress(K=4)": 4.5, "xPress(K=6)": 5.0}
    for rnd in (1, 2, 3):
        for arm, f in speed.items():
            f = f * (1.2 if rnd == 3 and arm == "xPress(K=6)" else 1.0)  # round 3: K=6 is 20 % faster again
            rows += [row(arm, q, rnd, TOKENS[q] / (100 * f), accept=[2] if arm != "AR" else None) for q in range(3)]
    s = report.summarize(rows, n_boot=50)
    assert list(s["arms"]) == ["AR", "drafter-only", "Markov", "xPress(K=4)", "xPress(K=6)"]
    assert s["arms"]["xPress(K=6)"]["gain"]["values"] == pytest.approx([5 / 3, 6 / 3])
    assert s["arms"]["xPress(K=6)"]["gain"]["ref"] == "drafter-only"
    assert s["arms"]["Markov"]["gain"]["mean"] == pytest.approx(4 / 3)
    assert s["arms"]["drafter-only"]["speedup"]["mean"] == pytest.approx(3.0)
    o = s["optimal"]["xpress"]
    assert (o["arm"], o["K"], o["pooled_tok_s"]) == ("xPress(K=6)", 6, pytest.approx(550.0))
    assert o["selected_on"].startswith("warmup rounds") and o["selection_tok_s"] == pytest.approx(500.0)
    assert s["optimal"]["markov"]["arm"] == "Markov" and s["optimal"]["ar"]["arm"] == "AR"
    text = report.format_console_table(s, "toy", explain=True)
    for column in tables._HEADER:
        assert column in text
    assert "1.000 (ref)" in text and "throughput-optimal xpress: xPress(K=6) at" in text
    assert "throughput-optimal ar" not in text
    for key in ("tau_per_step", "pooled_tok_per_s", "per_sample_tok_per_s", "speedup", "tau_source"):
        assert s["conventions"][key] in text


def test_incomplete_rounds_and_duplicates_are_left_out_and_listed():
    rows = example()
    rows = [r for r in rows if not (r["arm"] == "AR" and r["round"] == 3 and r["question_id"] == 2)]
    rows.append(dict(rows[0]))
    s = report.summarize(rows, n_boot=50)
    assert s["incomplete_rounds"] == [["AR", 3, 2, 3]] and s["duplicate_rows_dropped"] == 1
    assert s["arms"]["AR"]["rounds"] == [2]
    assert s["arms"]["xPress(K=6)"]["speedup"]["values"] == pytest.approx([200 / (160 / 1.7)])
    assert "AR round 3 has 2 of 3 prompts" in report.format_console_table(s, "toy")


def test_summarize_refuses_unusable_rows():
    with pytest.raises(UsageError, match="no sample rows"):
        report.summarize([])
    with pytest.raises(UsageError, match="warmup"):
        report.summarize([r for r in example() if r["warmup"]])
    mixed = example() + [row("AR", 0, 4, 1.0, temperature=0.7)]
    with pytest.raises(UsageError, match="temperatures"):
        report.summarize(mixed)


def test_summary_is_strict_json(summary):
    text = json.dumps(summary, allow_nan=False)
    assert json.loads(text) == summary
    assert summary["schema"] == report.SCHEMA


# ----------------------------------------------------------------------------------------------- files and rows

def test_write_results_writes_every_file(tmp_path, summary, capsys):
    rows = example()
    env = {"python": "3.11", "git_sha": None}
    written = report.write_results(tmp_path / "run", {"dataset": "toy", "temperature": 0.0}, env, rows, summary)
    folder = tmp_path / "run"
    for name in ("config.json", "env.json", "samples.jsonl.gz", "summary.json", "table.md", "table.csv"):
        assert (folder / name).stat().st_size > 0 and str(folder / name) in written
    assert json.loads((folder / "summary.json").read_text()) == summary
    assert json.loads((folder / "env.json").read_text()) == env
    assert results_io.read_rows(folder / "samples.jsonl.gz") == rows and not (folder / "samples.jsonl").exists()
    csv_lines = (folder / "table.csv").read_text().splitlines()
    assert csv_lines[0].startswith("arm,method,K") and len(csv_lines) == 3
    assert "| xPress(K=6) |" in (folder / "table.md").read_text()
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped" in capsys.readouterr().out
        return
    for name in ("tau_vs_K.png", "speedup_vs_K.png", "acceptance_per_position.png"):
        data = (folder / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plots_are_skipped_with_a_note_without_matplotlib(tmp_path, summary, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    written = report.write_results(tmp_path, {}, {}, example(), summary)
    assert "plots skipped" in capsys.readouterr().out
    assert not [p for p in written if p.endswith(".png")] and not list(tmp_path.glob("*.png"))


def test_read_rows_ignores_a_truncated_last_line_and_append_repairs_it(tmp_path, capsys):
    path = tmp_path / "samples.jsonl"
    a, b, c = {"i": 1}, {"i": 2, "tokens": [1, 2]}, {"i": 3}
    results_io.append_rows(path, [a, b])
    with open(path, "ab") as f:
        f.write(b'{"i": 3, "tok')  # a crash mid-write
    assert results_io.read_rows(path) == [a, b]
    assert "truncated last line" in capsys.readouterr().err
    results_io.append_rows(path, [c])  # cuts the fragment instead of fusing the new row onto it
    assert results_io.read_rows(path) == [a, b, c]
    with open(path, "ab") as f:
        f.write(b'{"i": 4}')  # a whole object whose newline was lost: kept, and closed before the next append
    results_io.append_rows(path, [c])
    assert results_io.read_rows(path) == [a, b, c, {"i": 4}, c]
    path.write_text('{"i": 1}\n{"i": \n{"i": 3}\n')
    with pytest.raises(UsageError, match=":2: not a JSON object"):
        results_io.read_rows(path)
    with pytest.raises(UsageError, match="no such file"):
        results_io.read_rows(tmp_path / "missing.jsonl")


def test_environment_has_the_provenance_fields():
    env = results_io.environment()
    for key in ("gpus", "driver", "torch", "transformers", "python", "platform", "git_sha", "git_dirty", "hostname",
                "time_utc"):
        assert key in env
    assert env["git_sha"] is None or len(env["git_sha"]) == 40
    json.dumps(env)


# ------------------------------------------------------------------------------------------ multi-dataset table

def arm(name, method, k, sp, tau, pooled, gain=None):
    return {"arm": name, "method": method, "K": k, "tau_per_step": tau,
            "speedup": {"value": sp, "ci95": [sp - 0.5, sp + 0.5]},
            "gain": None if gain is None else {"value": gain}, "pooled_tok_s": {"mean": pooled}}


def fake_folder(root, name, dataset, d, m, xs, best, labels=(), temperature=0.0):
    """d, m = (Sp., tau) of drafter-only and Markov; xs = {K: (Sp., tau, gain)}; best = the optimal K."""
    arms = [arm("drafter-only", "drafter-only", None, *d, 100.0), arm("Markov", "markov", None, *m, 150.0)]
    arms += [arm(f"xPress(K={k})", "xpress", k, sp, tau, 200.0 if k == best else 180.0, gain)
             for k, (sp, tau, gain) in xs.items()]
    optimal = {"drafter-only": {"arm": "drafter-only", "K": None}, "markov": {"arm": "Markov", "K": None},
               "xpress": {"arm": f"xPress(K={best})", "K": best}}
    folder = root / name
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"dataset": dataset, "temperature": temperature, "prompts": 12,
                                                     "rounds": {"measured": [2, 3, 4]}, "labels": labels,
                                                     "arms": {a["arm"]: a for a in arms}, "optimal": optimal}))
    (folder / "config.json").write_text(json.dumps({"dataset": dataset}))
    return str(folder)


def table_lines(text: str) -> list[str]:
    """The merged report's lines after its one group's header (which names the target, protocol and weights)."""
    lines = text.splitlines()
    assert lines[0].startswith("### model=") and "weights=" in lines[0] and lines[1] == "", lines[:2]
    return lines[2:]


def test_merge_cli_builds_the_table_and_recomputes_the_average(tmp_path, capsys):
    a = fake_folder(tmp_path, "a", "gsm8k", (4.0, 6.0), (6.0, 8.0), {4: (6.5, 8.5, 1.6), 6: (7.0, 9.0, 1.7)}, 6)
    b = fake_folder(tmp_path, "b", "math500", (5.0, 7.0), (5.5, 8.5), {7: (6.0, 9.5, 1.2)}, 7)
    out = tmp_path / "merged.md"
    assert report.main([a, b, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == out.read_text(encoding="utf-8")
    lines = table_lines(text)
    assert lines[0] == ("| benchmark | T | drafter-only Sp. [95% CI] (E2E) / τ (b-e) | Markov Sp. [95% CI] (E2E) / τ "
                        "(b-e) | xPress Sp. [95% CI] (E2E) / τ (b-e) | xPress K | × Gain | prompts | rounds | model | "
                        "device | dtype | flags | labels |")
    unknown = "unknown | unknown | unknown | - | - |"  # schema-1 summaries, config.json without the run's facts
    assert lines[2] == ("| gsm8k | 0 | 4.00× [3.50, 4.50] / 6.00 | 6.00× [5.50, 6.50] / 8.00 | 7.00× [6.50, 7.50] "
                        "/ 9.00 | 6 | 1.70× | 12 | 3 | " + unknown)
    assert lines[3] == ("| math500 | 0 | 5.00× [4.50, 5.50] / 7.00 | 5.50× [5.00, 6.00] / 8.50 | 6.00× [5.50, 6.50] "
                        "/ 9.50 | 7 | 1.20× | 12 | 3 | " + unknown)
    assert lines[4] == "| **Avg.** |  | 4.50× / 6.50 | 5.75× / 8.25 | 6.50× / 9.25 |  | 1.45× |" + "  |" * 7
    assert "recomputed" in text and "throughput-optimal K" in text


def test_merge_cli_averages_each_temperature_on_its_own(tmp_path, capsys):
    """T=0 and T=1 folders in one table: one Avg. row per temperature, never a mean over both."""
    a0 = fake_folder(tmp_path, "a0", "gsm8k", (4.0, 6.0), (6.0, 8.0), {6: (7.0, 9.0, 1.7)}, 6)
    b0 = fake_folder(tmp_path, "b0", "math500", (5.0, 7.0), (5.5, 8.5), {7: (6.0, 9.5, 1.2)}, 7)
    a1 = fake_folder(tmp_path, "a1", "gsm8k", (2.0, 3.0), (3.0, 4.0), {6: (3.0, 5.0, 1.1)}, 6, temperature=1.0)
    assert report.main([a0, a1, b0]) == 0
    lines = table_lines(capsys.readouterr().out)
    assert [ln.split(" | ")[1] for ln in lines[2:5]] == ["0", "1", "0"]  # rows in the order given
    assert lines[5] == "| **Avg. T=0** | 0 | 4.50× / 6.50 | 5.75× / 8.25 | 6.50× / 9.25 |  | 1.45× |" + "  |" * 7
    assert lines[6] == "| **Avg. T=1** | 1 | 2.00× / 3.00 | 3.00× / 4.00 | 3.00× / 5.00 |  | 1.10× |" + "  |" * 7
    assert not any(ln.startswith("| **Avg.** |") for ln in lines)


def test_merge_cli_on_a_real_results_folder(tmp_path, summary, capsys):
    report.write_results(tmp_path / "toy", {"dataset": "toy"}, {}, example(), summary)
    capsys.readouterr()
    assert report.main([str(tmp_path / "toy")]) == 0
    line = table_lines(capsys.readouterr().out)[2]
    sp = summary["arms"]["xPress(K=6)"]["speedup"]
    lo, hi = sp["ci95"]
    x = summary["arms"]["xPress(K=6)"]
    e2e, be = x["speedup_e2e"]["value"], x["break_even_tau"]
    flags = "; ".join(tables.flagged_rounds(summary))
    assert flags  # the toy rows time AR unevenly: the merged row keeps the flags and marks the cell
    assert line == (f"| toy | 0 | - | - | ⚑ {sp['value']:.2f}× [{lo:.2f}, {hi:.2f}; 6 units] (E2E {e2e:.2f}×) / {16 / 6:.2f} "
                    f"(b-e {be:.2f}) | 6 | - | 3 | 2 | unknown | unknown | unknown | FLAGGED: {flags} | - |")


def test_merge_cli_error_exits_on_a_folder_without_summary(tmp_path, capsys):
    good = fake_folder(tmp_path, "a", "gsm8k", (4.0, 6.0), (6.0, 8.0), {6: (7.0, 9.0, 1.7)}, 6)
    (tmp_path / "empty").mkdir()
    assert report.main([good, str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "summary.json" in err and err.count("\n") == 1
    assert report.main([str(tmp_path / "nope")]) == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text("{not json")
    (tmp_path / "bad" / "config.json").write_text("{}")
    assert report.main([str(tmp_path / "bad")]) == 2
    p = subprocess.run([sys.executable, "-m", "harness.protocol.report", str(tmp_path / "empty")], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stdout == ""


def test_merge_cli_refuses_a_summary_whose_optimal_arm_is_missing(tmp_path, capsys):
    folder = Path(fake_folder(tmp_path, "a", "gsm8k", (4.0, 6.0), (6.0, 8.0), {6: (7.0, 9.0, 1.7)}, 6))
    s = json.loads((folder / "summary.json").read_text())
    s["optimal"]["xpress"]["arm"] = "xPress(K=9)"
    (folder / "summary.json").write_text(json.dumps(s))
    assert report.main([str(folder)]) == 2
    assert "optimal['xpress']" in capsys.readouterr().err


def test_summarize_names_a_missing_field():
    rows = example()
    del rows[4]["decode_s"]
    with pytest.raises(UsageError, match=r"row 4 lacks \['decode_s'\]"):
        report.summarize(rows)


def test_compat_greedy_tau_comes_from_the_warmup_round():
    s = report.summarize(example(), tau_from_warmup=True)
    xp = s["arms"]["xPress(K=6)"]
    warm = [r for r in example() if r["arm"] == "xPress(K=6)" and r["round"] == 1 and r["turn"] == 0]
    steps = [x for r in warm for x in r["accept_lengths"]]
    assert xp["tau_per_step"] == pytest.approx(sum(steps) / len(steps)) and "warmup round 1" in xp["tau_source"]
    assert xp["pooled_tok_s"] == report.summarize(example())["arms"]["xPress(K=6)"]["pooled_tok_s"]  # only tau moves


# ---------------------------------------------------------------------------------------------- summary schema


def test_the_console_notes_say_which_rounds_each_count_covers(summary):
    """A run with a warmup round: stop reasons count the measured rounds' first turns (6 rows here), outputs
    identical every round both arms ran, warmup and later turns included (12): each count says so (they stood side
    by side unlabelled, "stop reasons {...: 6}" next to "11/12 outputs identical")."""
    out = tables.format_console_table(summary, "toy")
    xp = summary["arms"]["xPress(K=6)"]
    assert sum(xp["stop_reasons"].values()) == 6 and xp["token_match"]["rows_compared"] == 12
    assert f"stop reasons (measured rounds, first turns) {xp['stop_reasons']}" in out
    assert "11/12 outputs identical (every round both ran, warmup included, every turn)" in out


def test_a_speedup_ci_from_one_prompt_of_one_round_prints_as_n_a(tmp_path):
    """One prompt, one measured round: the run table (and table.md) printed '0.380 (1 round) [0.38, 0.38]'."""
    rows = [r for r in example() if r["question_id"] == 0 and r["round"] in (1, 2) and r["turn"] == 0]
    s = report.summarize(rows)
    table = tables.format_markdown_table(s, "toy")
    line = next(ln for ln in table.splitlines() if ln.startswith("| xPress(K=6)"))
    assert "(1 round) [CI n/a: 1 unit]" in line and line.count("n/a: 1 unit") == 2, line  # Sp. and E2E Sp.
    assert s["arms"]["xPress(K=6)"]["speedup"]["ci95"] == [None, None] or all(
        math.isnan(x) for x in s["arms"]["xPress(K=6)"]["speedup"]["ci95"])
    merged = tables.format_multi_dataset_table([{"summary": s, "dataset": "toy", "temperature": 0.0, "folder": "f"}])
    assert "× [CI n/a: 1 unit]" in merged, merged


def test_a_sampled_runs_token_match_says_it_is_no_identity_check(summary):
    """At T > 0 (or with scripted acceptance) the arms' texts differ from AR's by design: the token-match line
    says so where it prints, not only in a note after it."""
    from harness.protocol import tables
    lines = [x for x in tables._notes(summary) if " vs AR" in x and "token match" in x]
    assert lines and not any("by design" in x for x in lines)
    sampled = [x for x in tables._notes({**summary, "temperature": 1.0}) if " vs AR" in x and "token match" in x]
    assert sampled and all("(differ by design, sampled: no identity check)" in x for x in sampled)
