"""training.compare_tau on hand-made records: the pairing, its refusals, and the CI's power against the smallest
change that matters.

Power: a drafter whose tau rises 3% (the continued drafter's held-out 2.439 -> 2.511, results/perf/NOTES.md) on
64 prompts whose per-prompt tau spreads as the held-out set's sources do (about 1.9 to 3.0): with the rise on
every prompt the CI excludes 1; with none, or with per-prompt noise much larger than the rise, it includes 1.
"""
import json

import numpy as np
import pytest

from core.errors import UsageError
from training import compare_tau


def record(path, taus, steps=40, keys=None, arm="tau_drafter", sets=("heldout",)):
    """An acceptance.json whose prompts each decoded `steps` steps at the given per-prompt tau."""
    pp = {"keys": keys or [f"{i:08x}" for i in range(len(taus))],
          arm: [[int(round(t * steps)), steps] for t in taus]}
    tau = sum(t for t, _ in pp[arm]) / sum(s for _, s in pp[arm])
    rec = {s: {"set": s, "of": len(taus), "prompts": len(taus), arm: tau, "per_prompt": pp} for s in sets}
    path.write_text(json.dumps({"key": "k", **rec}))
    return path


def spread(n=64, seed=0):
    return np.random.default_rng(seed).uniform(1.9, 3.0, n)


def test_a_three_percent_rise_on_every_prompt_is_shown(tmp_path):
    base = spread()
    a, b = record(tmp_path / "a.json", base), record(tmp_path / "b.json", base * 1.03)
    r = compare_tau.compare(str(a), str(b))[0]
    assert r["prompts"] == 64 and r["ratio"] == pytest.approx(1.03, abs=2e-3)
    assert r["ratio_ci95"][0] > 1.0, r
    assert "higher" in compare_tau.line(r)


def test_no_rise_or_noise_alone_is_not_shown(tmp_path):
    base = spread()
    same = compare_tau.compare(str(record(tmp_path / "a.json", base)), str(record(tmp_path / "b.json", base)))[0]
    assert same["ratio"] == 1.0 and same["ratio_ci95"] == [1.0, 1.0]
    noisy = base * np.random.default_rng(1).choice([0.8, 1.25], base.size)  # +-20-25% per prompt, no trend
    r = compare_tau.compare(str(tmp_path / "a.json"), str(record(tmp_path / "c.json", noisy)))[0]
    assert r["ratio_ci95"][0] < 1.0 < r["ratio_ci95"][1], r
    assert "no difference shown" in compare_tau.line(r)


def test_a_capped_record_pairs_on_its_prefix_and_arms_are_named(tmp_path):
    base = spread()
    a = record(tmp_path / "a.json", base)
    b = record(tmp_path / "b.json", base[:37] * 1.1, arm="tau_xpress_K4")
    r = compare_tau.compare(str(a), f"{b}:tau_xpress_K4")[0]
    assert r["prompts"] == 37 and r["ratio"] == pytest.approx(1.1, abs=3e-3)
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
