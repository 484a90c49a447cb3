"""training.compare_tau on hand-made records: the pairing, its refusals, and the CI's power against the smallest
change that matters.

Power: the smallest change that matters here is a drafter's tau rising 3% (the continued drafter's held-out 2.439 ->
2.511, results/perf/NOTES.md) on the 64 held-out prompts. Simulated (200 draws, seed 0, 500 bootstrap resamples,
per-prompt tau uniform in 1.9-3.0, each prompt's ratio the 3% times lognormal noise), the CI excludes 1 in 100% of
draws at 5% per-prompt sd, 91% at 7.5% (the spread of the per-prompt ratios in the 8-prompt CPU check of NOTES) and
82% at 10%. The tests below take the noiseless rise (shown), no change (not shown) and noise with no trend (not
shown).
"""
import json
from pathlib import Path

import numpy as np
import pytest

from core.errors import UsageError
from training import compare_tau


def record(path, taus, steps=40, keys=None, arm="tau_drafter", sets=("heldout",)):
    """An acceptance.json whose prompts each decoded `steps` steps at the given per-prompt tau."""
    pp = {"keys": keys or [f"{i:08x}" for i in range(len(taus))],
          arm: [[int(round(t * steps)), steps] for t in taus]}
    steps_sum = sum(s for _, s in pp[arm])
    tau = sum(t for t, _ in pp[arm]) / steps_sum if steps_sum else float("nan")
    rec = {s: {"set": s, "of": len(taus), "prompts": len(taus), arm: tau, "per_prompt": pp} for s in sets}
    path.write_text(json.dumps({"key": "k", **rec}))
    return path


def spread(n=64, seed=0):
    """Per-prompt tau for n prompts, in the range the held-out set's prompts span."""
    return np.random.default_rng(seed).uniform(1.9, 3.0, n)


def test_a_three_percent_rise_on_every_prompt_is_shown(tmp_path):
    base = spread()
    a, b = record(tmp_path / "a.json", base), record(tmp_path / "b.json", base * 1.03)
    r = compare_tau.compare(str(a), str(b))[0]
    assert r["prompts"] == 64 and r["ratio"] == pytest.approx(1.03, abs=2e-3)
    assert r["ratio_ci95"][0] > 1.0, r
    assert r["base"] == pytest.approx(base.mean(), rel=0.02) and r["new"] == pytest.approx(r["base"] * 1.03, rel=2e-3)
    assert "higher" in compare_tau.line(r)
    down = compare_tau.compare(str(b), str(a))[0]  # the same pair the other way round
    assert down["ratio_ci95"][1] < 1.0 and "lower" in compare_tau.line(down)


def test_no_rise_or_noise_alone_is_not_shown(tmp_path):
    base = spread()
    same = compare_tau.compare(str(record(tmp_path / "a.json", base)), str(record(tmp_path / "b.json", base)))[0]
    assert same["ratio"] == 1.0 and same["ratio_ci95"] == [1.0, 1.0]
    noisy = base * np.exp(np.random.default_rng(1).normal(0.0, 0.2, base.size))  # 20% per prompt, no trend
    r = compare_tau.compare(str(tmp_path / "a.json"), str(record(tmp_path / "c.json", noisy)))[0]
    assert r["ratio_ci95"][0] < 1.0 < r["ratio_ci95"][1], r
    assert "no difference shown" in compare_tau.line(r)


def test_a_capped_record_pairs_on_its_prefix_and_arms_are_named(tmp_path):
    base = spread()
    a = record(tmp_path / "a.json", base)
    b = record(tmp_path / "b.json", base[:37] * 1.1, arm="tau_xpress_K4")
    r = compare_tau.compare(str(a), f"{b}:tau_xpress_K4")[0]
    assert r["prompts"] == 37 and r["ratio"] == pytest.approx(1.1, abs=3e-3)
    assert "(37 prompts, tau_drafter -> tau_xpress_K4)" in compare_tau.line(r)  # the printed line names the arms
    assert "(37 prompts, tau_drafter)" in compare_tau.line({**r, "arms": ["tau_drafter"] * 2})
    with pytest.raises(UsageError, match="no arm 'tau_markov'.*tau_xpress_K4"):
        compare_tau.compare(str(a), f"{b}:tau_markov")


def test_refusals_say_what_is_wrong(tmp_path, capsys):
    base = spread(8)
    a = record(tmp_path / "a.json", base)
    other = record(tmp_path / "o.json", base, keys=[f"{i:08x}" for i in range(7)] + ["ffffffff"])
    with pytest.raises(UsageError, match="prompt 7 differs"):
        compare_tau.compare(str(a), str(other))
    old = tmp_path / "old.json"
    rec = json.loads(a.read_text())
    del rec["heldout"]["per_prompt"]
    old.write_text(json.dumps(rec))
    with pytest.raises(UsageError, match="no per-prompt records"):
        compare_tau.compare(str(old), str(a))
    sel = record(tmp_path / "s.json", base, sets=("selection",))
    with pytest.raises(UsageError, match="share no measured set"):
        compare_tau.compare(str(a), str(sel))
    out = tmp_path / "never.json"
    assert compare_tau.main([str(a), str(tmp_path / "missing.json"), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err and not out.exists()
    assert compare_tau.main([str(a), str(a), "--set", "bench:gsm8k"]) == 2
    assert "is not in both files" in capsys.readouterr().err


def test_records_that_cannot_pair_are_refused_in_one_line(tmp_path, capsys):
    base = spread(8)
    a = record(tmp_path / "a.json", base)
    for bad, match in ((lambda p: p.write_text("[1, 2]"), "a JSON object expected, found list"),
                       (lambda p: p.write_bytes(b"\x1f\x8b\x08\xff"), "not a text file"),
                       (lambda p: p.mkdir(), "not a file")):
        p = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.json"
        bad(p)
        with pytest.raises(UsageError, match=match):
            compare_tau.compare(str(a), str(p))
    with pytest.raises(UsageError, match="must be a tau key"):
        compare_tau.compare(str(a), f"{a}:keys")
    empty = record(tmp_path / "e.json", [])
    with pytest.raises(UsageError, match="measured no prompt"):
        compare_tau.compare(str(a), str(empty))
    none = record(tmp_path / "z.json", base, steps=0)
    with pytest.raises(UsageError, match="decoded no step"):
        compare_tau.compare(str(a), str(none))
    fp32 = json.loads(a.read_text())
    (tmp_path / "fp32.json").write_text(json.dumps({**fp32, "dtype": "float32"}))
    (tmp_path / "bf16.json").write_text(json.dumps({**fp32, "dtype": "bfloat16"}))
    with pytest.raises(UsageError, match="different dtype"):
        compare_tau.compare(str(tmp_path / "bf16.json"), str(tmp_path / "fp32.json"))
    assert compare_tau.main([str(a), str(a), "--json", str(tmp_path / "no" / "dir" / "x.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "cannot write it" in err  # nothing printed before the refusal


def test_sets_in_one_file_only_are_named(tmp_path, capsys):
    base = spread(8)
    a = record(tmp_path / "a.json", base, sets=("selection", "heldout"))
    b = record(tmp_path / "b.json", base, sets=("heldout", "bench:gsm8k"))
    rows = compare_tau.compare(str(a), str(b))
    assert [r["set"] for r in rows] == ["heldout"] and rows[0]["skipped"] == ["bench:gsm8k", "selection"]
    assert compare_tau.main([str(a), str(b)]) == 0
    assert "not compared (measured in one file only): bench:gsm8k, selection" in capsys.readouterr().out


def test_file_and_arm_specs_read_as_a_user_means_them(tmp_path):
    """A file whose name holds a colon is taken whole; FILE:ARM splits at the last colon only for a tau key; a
    misspelt arm is named as such, not reported as a missing file (review, 2026-12-04)."""
    odd = record(tmp_path / "x:tau_base.json", spread(4))
    assert compare_tau.parse(str(odd)) == (odd, "tau_drafter")
    assert compare_tau.parse(f"{odd}:tau_markov") == (odd, "tau_markov")
    with pytest.raises(UsageError, match="must be a tau key.*'drafter.tau'"):
        compare_tau.parse(f"{tmp_path}/a.json:drafter.tau")
    assert compare_tau.parse("runs/a:b/acceptance.json") == (Path("runs/a:b/acceptance.json"), "tau_drafter")
