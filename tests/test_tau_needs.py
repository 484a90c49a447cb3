"""harness.lab.tau_needs: the later slots' conditional rate a τ goal asks, from a table's per-position acceptance.

Power: on rates built as a_k = a1 c^(k-1) the solved c must be that c to 1e-9 (a solver off by one slot, or one
that summed from k = 0, misses by far more); the goal's c must give exactly goal x drafter-only's τ with the arm's
a1 (checked by recomputing τ from it); a goal past the first slot's ceiling must say so, not return c = 1."""
import json

import pytest

from harness.lab import tau_needs


def table(arms: dict) -> dict:
    """summary.json's fields that tau_needs reads, for arms of name -> (a1, c) over 15 slots."""
    out = {}
    for name, (a1, c) in arms.items():
        pp = [a1 * c ** k for k in range(15)]
        out[name] = {"per_position": pp, "tau_per_step": 1 + sum(pp)}
    return {"dataset": "toy", "temperature": 0.0, "arms": out}


def test_the_rate_is_recovered_and_the_goal_rate_gives_the_goal():
    s = table({"drafter-only": (0.8, 0.7), "xPress(K=4)": (0.79, 0.76), "AR": (0.0, 0.0)})
    r = tau_needs.needs(s, 1.30, "xPress(K=4)", "t")
    assert r["arms"]["drafter-only"]["c"] == pytest.approx(0.7, abs=1e-9)
    assert r["arms"]["xPress(K=4)"]["c"] == pytest.approx(0.76, abs=1e-9)
    tau_goal = 1 + tau_needs.continued(0.79, r["c_goal"], 15)
    assert tau_goal == pytest.approx(1.30 * s["arms"]["drafter-only"]["tau_per_step"], rel=1e-9)
    assert r["rejection_cut_arm"] == pytest.approx(1 - 0.24 / 0.30, abs=1e-9)
    assert r["rejection_cut_goal"] == pytest.approx(1 - (1 - r["c_goal"]) / 0.30, abs=1e-9)
    assert r["arms"]["AR"]["c"] is None  # no draft slots accepted: no rate


def test_a_goal_past_the_first_slots_ceiling_is_unreachable():
    r = tau_needs.needs(table({"drafter-only": (0.5, 0.5), "xPress(K=4)": (0.5, 0.6)}), 5.0, "xPress(K=4)")
    assert r["reachable"] is False and r["c_goal"] is None and r["ceiling_tau"] == pytest.approx(8.5)
    assert "unreachable (ceiling τ 8.50)" in tau_needs.markdown([r])


def test_a_goal_the_first_slot_alone_exceeds_has_no_rate():
    """τ = 0.3 x drafter-only asks fewer accepted drafts than the arm's first slot alone gives: no c solves it (the
    bisection would otherwise return c = 0 and a negative cut)."""
    r = tau_needs.needs(table({"drafter-only": (0.8, 0.7), "xPress(K=4)": (0.8, 0.75)}), 0.3, "xPress(K=4)")
    assert r["c_goal"] is None and r["rejection_cut_goal"] is None
    assert "n/a (the first slot alone gives more)" in tau_needs.markdown([r])
    assert tau_needs.rate_for(0.8, 0.5, 15) is None and tau_needs.rate_for(0.8, 0.8, 15) == pytest.approx(0, abs=1e-9)


def test_the_command_writes_its_files_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    d = tmp_path / "gsm8k_t0"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(table({"drafter-only": (0.8, 0.7), "xPress(K=4)": (0.8, 0.75)})))
    out = tmp_path / "needs.json"
    assert tau_needs.main([str(d), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["table"] == "gsm8k_t0" and row["goal"] == 1.30 and "| gsm8k_t0 |" in (tmp_path / "needs.md").read_text()
    capsys.readouterr()
    bad, notau = tmp_path / "bad", tmp_path / "notau"
    bad.mkdir()
    (bad / "summary.json").write_text("{not json")
    notau.mkdir()
    t = table({"drafter-only": (0.8, 0.7), "xPress(K=4)": (0.8, 0.75)})
    t["arms"]["drafter-only"]["tau_per_step"] = None
    (notau / "summary.json").write_text(json.dumps(t))
    for args in ([str(tmp_path / "none")], [str(d), "--arm", "Markov"], [str(d), "--goal", "0"], [str(bad)],
                 [str(notau)]):
        assert tau_needs.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
