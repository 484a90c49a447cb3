"""Divergence measured where it happens (issue 27, item 1): the untimed replay's gaps at each first divergence from
AR, the near-tie bound, the bug reports, and AR against an AR in float32 (--reference-dtype)."""
import json
import statistics

import pytest
import torch

import benchmark_compile_all as cli
import harness.protocol.replays as replays
import harness.protocol.runner as runner
from harness.decode.target import Target
from harness.protocol import comparisons, divergence
from harness.protocol.results_io import read_folder_rows
from tiny import write_run_fixture

# tiny shapes: one intra-op thread (conftest.one_thread), as the other tiny-model modules run
pytestmark = pytest.mark.usefixtures("one_thread", "no_plots_module")


PLANT = 3  # the new token at which the target double plants its divergence


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    rows = [{"turns": ["Add 2 and 3."]}, {"turns": ["Name a colour."]}]
    return write_run_fixture(tmp_path_factory.mktemp("div_runs"), rows, xpress_std=0.02, markov_std=0.02)


def args(files, results, run_id, *extra):
    return ["--model-name-or-path", str(files / "target"), "--draft-name-or-path", str(files / "drafter"),
            "--dataset", "mini", "--data-dir", str(files / "data"), "--max-new-tokens", "6", "--device", "cpu",
            "--results-dir", str(results), "--run-id", run_id, *extra]


def plant(monkeypatch, shift: float | None):
    """A target double: at new token PLANT of every prompt, a one-row step (AR) sees the runner-up one ulp below
    the top logit (AR keeps its token), a verify block (a speculative arm) sees it one ulp above the top (shift
    None: a near-tie) or `shift` above it (a divergence no rounding explains)."""
    real_prefill, real_verify = Target.prefill, Target.verify

    def prefill(self, prompt, want_features):
        self._plant_p0 = prompt.shape[0]
        return real_prefill(self, prompt, want_features)

    def verify(self, block, length, want_features):
        logits, feats = real_verify(self, block, length, want_features)
        i = PLANT - 1 - (int(self.pos) - self._plant_p0)  # row i predicts new token pos + 1 + i - p0
        if 0 <= i < logits.shape[0]:
            logits = logits.clone()
            (v, _), (top, second) = logits[i].topk(2)
            if block.shape[0] == 1:
                logits[i, second] = torch.nextafter(v, torch.tensor(-float("inf")))
            else:
                logits[i, second] = v + shift if shift else torch.nextafter(v, torch.tensor(float("inf")))
        return logits, feats

    monkeypatch.setattr(Target, "prefill", prefill)
    monkeypatch.setattr(Target, "verify", verify)


def run(files, tmp_path, monkeypatch, capsys, shift, run_id):
    plant(monkeypatch, shift)
    assert cli.main(args(files, tmp_path, run_id)) == 0
    folder = tmp_path / run_id
    return (json.loads((folder / "summary.json").read_text()), read_folder_rows(folder),
            (folder / "table.md").read_text(), capsys.readouterr().out)


def test_a_planted_divergence_beyond_the_bound_is_a_bug_report(files, tmp_path, monkeypatch, capsys):
    """A verify block whose logits put another token 5 logits above AR's top at one position: every prompt
    diverges there, the replay measures both gaps, and the divergence is printed as a BUG REPORT on the console
    and in table.md (the old code recorded no gap and flagged nothing)."""
    summary, rows, table, out = run(files, tmp_path, monkeypatch, capsys, 5.0, "bug")
    tm = summary["arms"]["drafter-only"]["token_match"]
    assert [e["position"] for e in tm["first_divergence"]] == [PLANT, PLANT]
    d = tm["divergence"]
    assert d["measured"] == 2 and len(d["not_near_tie"]) == 2 and d["gap_max"] > 4.9
    assert all(e["gap_arm"] == pytest.approx(5.0, abs=1e-4) and e["bound"] < 1e-4 for e in d["not_near_tie"])
    assert out.count("BUG REPORT: drafter-only left AR on prompt") == 2
    assert table.count("BUG REPORT") == 2 and "**2 BUG**" in table


def test_a_near_tie_divergence_is_not_flagged(files, tmp_path, monkeypatch, capsys):
    """The same position, but the verify block's runner-up is one float32 ulp above the top and AR's one ulp
    below: both gaps are an ulp, within the bound (2 (e_A + e_B) = 4 ulps): a divergence, no bug report."""
    summary, rows, table, out = run(files, tmp_path, monkeypatch, capsys, None, "tie")
    d = summary["arms"]["drafter-only"]["token_match"]["divergence"]
    assert d["divergences"] == 2 and d["measured"] == 2 and d["not_near_tie"] == []
    assert 0 < d["gap_max"] < 4e-6
    assert "BUG REPORT" not in out and "BUG" not in table


def test_the_divergence_columns_recompute_from_the_rows(files, tmp_path, monkeypatch, capsys):
    """Median and maximum gap of table.md and summary.json come from the rows' replay records (the first
    divergence of each prompt, turn 0), and every row identical to AR counts as such."""
    summary, rows, table, _ = run(files, tmp_path, monkeypatch, capsys, 2.5, "cols")
    mine = [r for r in rows if r["arm"] == "drafter-only" and r["turn"] == 0]
    gaps = [r["divergence"]["gap_arm"] + r["divergence"]["gap_ref"] for r in mine if r["divergence"]]
    d = summary["arms"]["drafter-only"]["token_match"]["divergence"]
    assert d["gap_median"] == pytest.approx(statistics.median(gaps)) and d["gap_max"] == pytest.approx(max(gaps))
    same = sum(r["tokens"] == a["tokens"] for r in mine for a in rows if a["arm"] == "AR" and a["turn"] == 0
               and a["question_id"] == r["question_id"] and a["round"] == r["round"])
    line = next(x for x in table.splitlines() if x.startswith("| drafter-only | AR |"))
    assert f"| {same}/{len(mine)} |" in line and f"{statistics.median(gaps):.3g}" in line
    assert f"{max(gaps):.3g}" in line


def test_the_replay_runs_after_every_timed_decode_and_only_where_rows_diverge(files, tmp_path, monkeypatch,
                                                                               capsys):
    """The timed decodes record no gaps; the replays (gaps on) all come after the last timed decode, and only the
    diverging rows (and AR with them) are replayed, each up to its first divergence."""
    events = []
    real = runner.generate

    def timed(*a, **k):
        events.append(("timed", a[2].record_gaps))
        return real(*a, **k)

    def replay(*a, **k):
        events.append(("replay", a[2].max_new_tokens))
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate", timed)
    monkeypatch.setattr(replays, "generate", replay)
    run(files, tmp_path, monkeypatch, capsys, 5.0, "order")
    kinds = [e[0] for e in events]
    assert kinds.index("replay") > max(i for i, k in enumerate(kinds) if k == "timed")
    assert all(not gaps for kind, gaps in events if kind == "timed")
    assert [n for kind, n in events if kind == "replay"] == [PLANT + 1] * 4  # 2 prompts x (arm, AR)


def test_the_float32_reference_counts_rows(tmp_path):
    """AR rows against an AR decode in float32: compared and identical rows are counted, a divergence carries both
    runs' gaps and the bound, and a run already in float32 is its own reference (the same run, nothing decoded)."""
    rows = [{"arm": "AR", "turn": 0, "round": r, "question_id": q, "dataset_row": q, "tokens": [1, 2, 3, 4]}
            for r in (1, 2) for q in (0, 1, 2)]

    class Fixed:
        replays = 0

        def at(self, arm, row, pos):
            return (0.01, 12.0), True

        def gaps_before(self, arm, row, pos):
            return [1.0, 1.25][:pos]

    class Ref:
        def __init__(self, q):
            self.tokens = [1, 2, 9, 4] if q == 1 else [1, 2, 3, 4]
            self.top2_gaps, self.top_logits = [1.0, 1.0, 0.02, 1.0], [12.0] * 4

    assert replays.mark_reference(rows, "AR", Fixed(), lambda r: Ref(r["question_id"]), "bfloat16", "float32") == 6
    rm = comparisons.reference_match(rows, "AR")
    assert (rm["rows_compared"], rm["rows_identical"], rm["same_run"]) == (6, 4, False)
    (e,) = [e for e in rm["first_divergence"] if e["position"] is not None]
    assert (e["question_id"], e["position"], e["gap"]) == (1, 2, pytest.approx(0.03))
    assert e["bound"] == pytest.approx(2 * (2 ** 3 * 2 ** -7 + 2 ** 3 * 2 ** -23)) and e["near_tie"]
    # the gap error where both chose the same token (positions 0 and 1): |1.0 - 1.0| and |1.25 - 1.0|
    assert (e["gap_err_max"], e["gap_err_n"]) == (0.25, 2)
    assert (rm["divergence"]["gap_err_max"], rm["divergence"]["gap_err_n"]) == (0.25, 2)
    same = [dict(r, reference=None) for r in rows]
    for r in same:
        del r["reference"]
    assert replays.mark_reference(same, "AR", Fixed(), None, "float32", "float32") == 6
    rm = comparisons.reference_match(same, "AR")
    assert rm["same_run"] and rm["rows_identical"] == rm["rows_compared"] == 6


def test_reference_dtype_float32_end_to_end_on_a_bfloat16_run(files, tmp_path, capsys):
    """--dtype bfloat16 --reference-dtype float32 on the CPU, 3 rounds: every AR row (warmup included) is compared
    with the float32 reference of its prompt, scored once per prompt (counted against a float32 run's own AR
    tokens); table.md has the reference row."""
    assert cli.main(args(files, tmp_path, "fp32", "--ar-only")) == 0
    fp32 = {r["question_id"]: r["tokens"] for r in read_folder_rows(tmp_path / "fp32")}
    capsys.readouterr()
    assert cli.main(args(files, tmp_path, "bf16", "--dtype", "bfloat16", "--fair-interleave", "3",
                         "--reference-dtype", "float32")) == 0
    assert "replay(s) up to a first divergence, 2 float32 scoring(s) of AR's text" in capsys.readouterr().out
    rows = [r for r in read_folder_rows(tmp_path / "bf16") if r["arm"] == "AR"]
    rm = json.loads((tmp_path / "bf16" / "summary.json").read_text())["arms"]["AR"]["reference_match"]
    assert rm["rows_compared"] == len(rows) == 6 and rm["dtype"] == "float32" and not rm["same_run"]
    assert rm["rows_identical"] == sum(r["tokens"] == fp32[r["question_id"]] for r in rows)
    assert "| AR | AR in float32 |" in (tmp_path / "bf16" / "table.md").read_text()
    assert cli.main(args(files, tmp_path, "same", "--ar-only", "--reference-dtype", "float32")) == 0
    assert "AR is its own float32 reference (the same run)" in capsys.readouterr().out
    assert "| AR | AR in float32 (the same run) | 2/2 |" in (tmp_path / "same" / "table.md").read_text()


def test_reference_dtype_needs_greedy_decoding(files, tmp_path, capsys):
    """--reference-dtype float32 at T>0 is refused with one line, before anything loads (no greedy text)."""
    assert cli.main(args(files, tmp_path, "t1", "--ar-only", "--temperature", "1", "--reference-dtype", "float32")) == 2
    assert "needs --temperature 0" in capsys.readouterr().err and not (tmp_path / "t1").exists()


def test_the_bound_is_k_ulps_at_the_top_logit():
    """bf16 at a top logit of 20 has an ulp of 2^4 * 2^-7 = 0.125: the near-tie bound of two bf16 runs is
    2 (e_A + e_B) = 4 ulps = 0.5, float32 beside bf16 about 2 bf16 ulps."""
    assert divergence.ulp(20.0, "bfloat16") == 0.125 and divergence.ulp(-20.0, "bfloat16") == 0.125
    assert divergence.bound(20.0, "bfloat16", 20.0, "bfloat16") == 0.5
    assert divergence.record(5, (0.25, 20.0), (0.25, 20.0), "bfloat16", "bfloat16")["near_tie"]
    assert not divergence.record(5, (0.375, 20.0), (0.25, 20.0), "bfloat16", "bfloat16")["near_tie"]
    assert divergence.record(5, None, (0.1, 20.0), "bfloat16", "bfloat16")["near_tie"] is None


def test_reference_dtype_auto_is_float32_for_the_embedded_default_only():
    """auto: float32 for the embedded default at T=0; off for a named target and at T>0; none is off."""
    from types import SimpleNamespace as C
    from harness.protocol.setups import EMBEDDED
    assert replays.reference_dtype(C(temperature=0.0, reference_dtype="auto", preset=EMBEDDED)) == "float32"
    assert replays.reference_dtype(C(temperature=0.0, reference_dtype="auto", preset=None)) is None
    assert replays.reference_dtype(C(temperature=1.0, reference_dtype="auto", preset=EMBEDDED)) is None
    assert replays.reference_dtype(C(temperature=0.0, reference_dtype="none", preset=EMBEDDED)) is None
    assert replays.reference_dtype(C(temperature=0.0, reference_dtype="float32", preset=None)) == "float32"


@pytest.mark.parametrize("plant", [None, 0, 5, 29])
def test_the_teacher_forced_reference_finds_what_a_full_reference_decode_finds(plant):
    """replays.teacher_forced scores AR's text in forward passes of CHUNK rows instead of decoding it a step at a
    time: against a full float32 greedy decode (record_gaps) of the same tiny target, it must give the same first
    divergence from a text planted to differ at `plant` (None: the decode's own text, no divergence), with the same
    gaps there. The prompt and 40 tokens span two chunks (CHUNK 16 here), so a pass that lost the KV of the one
    before would choose other tokens. Gap tolerance: float32 passes that sum in another order than one-row steps
    differ by a few ulps at these logits (|top| < 8): 1e-4 is some 100 ulps, far below any divergence gap."""
    from harness.decode.loop import DecodeSettings, generate
    from harness.protocol import metrics
    from tiny import CPU32, tiny_target
    target = tiny_target(capacity=128)
    prompt = [3, 17, 42, 8, 99, 5, 61, 23, 7, 11, 2, 19]
    g = generate(target, prompt, DecodeSettings(40, 128, (), record_gaps=True), CPU32)
    text = list(g.tokens)
    if plant is not None:
        text[plant] = (text[plant] + 1) % target.vocab_size
    old = replays.CHUNK
    replays.CHUNK = 16
    try:
        got = replays.teacher_forced(target, prompt, text, CPU32)
    finally:
        replays.CHUNK = old
    assert metrics.first_divergence(text, got.tokens) == metrics.first_divergence(text, g.tokens) == plant
    if plant is None:
        assert got.tokens == text and len(got.top2_gaps) == len(text)
    else:
        assert len(got.tokens) == plant + 1 and got.tokens[plant] == g.tokens[plant]
    for i in range(len(got.tokens)):
        assert got.top2_gaps[i] == pytest.approx(g.top2_gaps[i], abs=1e-4)
        assert got.top_logits[i] == pytest.approx(g.top_logits[i], abs=1e-4)


def test_a_flag_beyond_the_bound_says_whether_the_measured_gap_error_covers_it():
    """Two flagged divergences of AR from float32 (summed gaps 0.3 and 0.9 over a bound of 0.25) in a comparison
    whose largest measured gap error before its divergences is 0.5: the bug reports stay (the flag is the bound's),
    one says within the measured error and one beyond it, and table.md's line counts the one beyond."""
    def entry(q, gap, err, n):
        return {"question_id": q, "round": 1, "position": 3, "gap_arm": gap / 2, "gap_ref": gap / 2, "top_arm": 20.0,
                "top_ref": 20.0, "gap": gap, "bound": 0.25, "near_tie": gap <= 0.25, "dtype": "bfloat16",
                "dtype_ref": "float32", "gap_err_max": err, "gap_err_n": n}
    entries = [entry(0, 0.3, 0.5, 10), entry(1, 0.9, 0.125, 4), entry(2, 0.1, None, 0)]
    d = divergence.stats(entries)
    assert (d["gap_err_max"], d["gap_err_n"], d["beyond_measured"], len(d["not_near_tie"])) == (0.5, 14, 1, 2)
    rm = {"dtype": "float32", "same_run": False, "rows_compared": 3, "rows_identical": 0, "first_divergence": entries,
          "divergence": d}
    summary = {"arms": {"AR": {"reference_match": rm}}}
    reports = divergence.bug_reports(summary)
    assert len(reports) == 2 and "within the largest gap error" in reports[0] and "beyond the largest" in reports[1]
    assert any("of the 2 divergence(s) beyond the near-tie bound, 1 exceed it too" in line
               for line in divergence.markdown(summary))
    assert divergence.stats([entry(0, 0.3, None, 0)])["beyond_measured"] is None  # nothing measured: no claim


def test_scripted_acceptance_reports_no_bug_and_says_once_that_identity_is_not_checked(files, tmp_path, monkeypatch,
                                                                                        capsys):
    """--scripted-accept forces drafts through, so the arms leave AR's text by design: the planted divergence beyond
    the bound is no BUG REPORT there (console or table.md), no replay runs for it, and one line says identity to
    AR is not checked."""
    plant(monkeypatch, 5.0)
    replayed = []
    real = replays.generate
    monkeypatch.setattr(replays, "generate", lambda *a, **k: replayed.append(1) or real(*a, **k))
    assert cli.main(args(files, tmp_path, "scripted", "--scripted-accept", "2")) == 0
    out, table = capsys.readouterr().out, (tmp_path / "scripted" / "table.md").read_text()
    assert "BUG" not in out and "BUG" not in table and not replayed
    assert out.count(divergence.SCRIPTED_NOTE) == 1 and table.count(divergence.SCRIPTED_NOTE) == 1
    summary = json.loads((tmp_path / "scripted" / "summary.json").read_text())
    assert summary["run"]["scripted_accept"] == 2 and divergence.bug_reports(summary) == [
        f"[divergence] {divergence.SCRIPTED_NOTE}"]


def test_at_t_above_zero_identity_to_ar_is_not_reported_as_a_check():
    """Sampled runs: lossless speculative sampling gives AR's distribution, not its text, so table.md says so in one
    line instead of a T=0 section of 'rows identical 0/9'; the same comparison at T=0 is kept."""
    tm = {"ref": "AR", "rows_compared": 9, "rows_identical": 0, "divergence": {"divergences": 9, "measured": 0}}
    summary = {"temperature": 1.0, "run": {}, "arms": {"xPress(K=1)": {"token_match": tm}}}
    lines = divergence.markdown(summary)
    assert lines == ["", f"Divergence from AR: {divergence.SAMPLED_NOTE}."] and not divergence.bug_reports(summary)
    assert any("| xPress(K=1) | AR | 0/9 |" in line for line in divergence.markdown({**summary, "temperature": 0.0}))
