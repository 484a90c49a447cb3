"""training.ship (which weights ship, within which limits) and training.card (the model card's records), on
hand-made pipeline folders: no speculators, no model."""
import gzip
import json

import pytest

from training import card, ship


def _workdir(root, taus, sizes=None):
    """A pipeline workdir with export/ and train/ for a drafter, an xPress head and Markov heads of given tau."""
    models = {"drafter": {"type": "dflash", "num_layers": 3, "block_size": 16},
              "xpress": {"type": "xpress", "num_layers": 3, "block_size": 16, "xpress_rank": 8, "init_from": "drafter"}}
    models.update({n: {"type": "dspark", "num_layers": 3, "block_size": 16, "markov_rank": 8, "init_from": "drafter",
                       "markov_head_type": n.split("_")[1]} for n in taus})
    files = {}
    for n in models:
        d = root / "export" / n
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"\0" * (sizes or {}).get(n, 100))
        files[n] = {f.name: f.stat().st_size for f in d.iterdir()}
        t = root / "train" / n
        t.mkdir(parents=True)
        evals = [{"global_step": 5, "tau_drafter": 1.5, **({"tau_markov": taus[n]} if n in taus else {})}]
        (t / "manifest.json").write_text(json.dumps({"complete": True, "final": "0", "global_step": 5,
                                                     "planned_steps": 9, "truncated": n == "markov_vanilla",
                                                     "evals": evals}))
    (root / "export" / "manifest.json").write_text(json.dumps({"models": models, "files": files}))
    return root


def test_ship_takes_the_markov_variant_with_the_best_held_out_tau(tmp_path):
    work = _workdir(tmp_path / "w", {"markov_vanilla": 2.10, "markov_gated": 2.15, "markov_rnn": 2.12})
    m = ship.ship(work, tmp_path / "out")
    assert m["shipped"] == {"drafter": "drafter", "xpress": "xpress", "markov": "markov_gated"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["drafter", "manifest.json", "markov", "xpress"]
    written = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert written["models"]["markov_vanilla"]["truncated"] and written["models"]["markov_rnn"]["held_out"][
        "tau_markov"] == 2.12
    assert ship.ship(work, tmp_path / "o2", markov="markov_rnn")["shipped"]["markov"] == "markov_rnn"


def test_ship_refuses_over_budget_and_leaves_nothing(tmp_path, capsys):
    work = _workdir(tmp_path / "w", {"markov_gated": 2.0}, sizes={"drafter": 40_000, "xpress": 30_000})
    assert ship.main(["--workdir", str(work), "--out", str(tmp_path / "out"), "--max-mb", "0.05"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "over --max-mb 0.05" in err[0]
    assert not (tmp_path / "out").exists()
    assert ship.main(["--workdir", str(work), "--out", str(tmp_path / "out"), "--markov", "nope"]) == 2
    assert "not a trained Markov model" in capsys.readouterr().err


def test_card_summarises_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    d = tmp_path / "train" / "drafter"
    d.mkdir(parents=True)
    rows = [{"train": {"loss": 2.0 - 0.01 * s}, "profile": {"step_ms": 9000.0 if s == 0 else 30.0},
             "global_step": s} for s in range(60)]
    rows.insert(30, {"val": {"loss_epoch": 1.5}, "epoch": 0})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "manifest.json").write_text(json.dumps({"planned_steps": 60, "truncated": False,
                                                 "evals": [{"tau_drafter": 1.7}]}))
    out = card.build(tmp_path / "train", tmp_path / "card")["models"][0]
    assert out["steps"] == 60 and out["first_step_s"] == 9.0 and out["median_step_ms"] == 30.0
    assert out["val_loss_per_epoch"] == [1.5] and out["held_out"] == {"tau_drafter": 1.7}
    assert out["last_loss_mean25"] == pytest.approx(2.0 - 0.01 * 47)  # the mean of steps 35..59
    assert (tmp_path / "card" / "loss_curves.png").stat().st_size > 1000
    back = gzip.decompress((tmp_path / "card" / "drafter.metrics.jsonl.gz").read_bytes()).decode().splitlines()
    assert [json.loads(x) for x in back] == rows
