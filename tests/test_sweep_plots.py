"""A sweep's plots (harness/protocol/sweep_plots.py): the plots written, and why any other is not."""
import builtins
import os

from harness.protocol import sweep_plots, sweep_readme


def summary(batches=(1, 2), contexts=(0, 60), arms=("AR", "xPress(K=1)"), reference="AR"):
    return {"arms": list(arms), "reference": reference, "batch_sizes": list(batches), "context_lengths": list(contexts),
            "labels": ["a tiny sweep"],
            "points": [{"batch_size": b, "context_len": c, "arms": {a: {"speedup": 1.1, "speedup_ci": [1.0, 1.2]}
                                                                  for a in arms}} for b in batches for c in contexts]}


def test_a_plot_not_written_says_why(tmp_path, monkeypatch):
    """write_plots returns, beside the plots written, why each other is not (one batch size or one context length
    swept, no AR, no other arm, no matplotlib), which the README and stdout give instead of leaving a plot out
    silently. Power: one reason for every case, or a reason beside a plot written, fails one of these."""
    paths, why = sweep_plots.write_plots(str(tmp_path), summary())
    assert sorted(os.path.basename(p) for p in paths) == ["speedup_vs_batch.png", "speedup_vs_context.png"] and not why
    paths, why = sweep_plots.write_plots(str(tmp_path), summary(batches=(4,)))
    assert [os.path.basename(p) for p in paths] == ["speedup_vs_context.png"]
    assert why == ["no speedup_vs_batch.png: one batch size swept (4); a line needs two"]
    assert sweep_plots.write_plots(str(tmp_path), summary(reference=None)) == ([], [
        "no speedup_vs_batch.png: no AR arm to take the speedup over",
        "no speedup_vs_context.png: no AR arm to take the speedup over"])
    assert sweep_plots.write_plots(str(tmp_path), summary(arms=("AR",)))[1][0].endswith("no arm besides AR")
    text = sweep_readme.readme({**summary(batches=(4,)), "conventions": CONVENTIONS}, ["speedup_vs_context.png"], why)
    assert "Not plotted: no speedup_vs_batch.png: one batch size swept (4); a line needs two." in text
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda n, *a, **k: (_ for _ in ()).throw(ImportError(n))
                        if n.startswith("matplotlib") else real(n, *a, **k))
    assert sweep_plots.write_plots(str(tmp_path), summary())[1] == [
        f"no {n}: matplotlib is not installed (pip install matplotlib)" for n in ("speedup_vs_batch.png",
                                                                                 "speedup_vs_context.png")]


CONVENTIONS = {"speedup": "s", "unit": "u", "total_tok_s": "t", "per_request_tok_s": "p", "crossover": "c"}
