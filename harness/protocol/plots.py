"""PNG plots of a run summary, drawn so that a reader would rather look at them than at the table.

* `summary_by_arm.png`: tau/step and the paired speedup over AR of every arm, as bars (every run);
* `tau_vs_K.png`, `speedup_vs_K.png`: the xPress K sweep as a line, the other methods as horizontal lines (only
  when the run has xPress arms: a run without a refiner gets no empty K plot);
* `acceptance_per_position.png`: per arm, the rate at which drafts 1..k are all accepted.

One colour per method in every plot (xPress arms in shades of its colour, darker for larger K); a dotted AR = 1
line in the tau and speedup plots, whose range always holds 1; speedup error bars are the 95% bootstrap CIs of the
summary (not the spread of rounds); every title names the model, dataset, T, prompts and measured rounds, and the
run's labels (random weights, scripted acceptance, ...).
"""
from __future__ import annotations

import io
import json
import math
import os
import sys
from pathlib import Path

from harness.protocol.results_io import atomic_write

COLORS = {"ar": "#4d4d4d", "drafter-only": "#1f77b4", "markov": "#2ca02c", "xpress": "#d62728"}
_ORDER = {"ar": 0, "drafter-only": 1, "markov": 2, "xpress": 3}


def _shade(color: str, t: float) -> tuple[float, float, float]:
    """`color` mixed with white: t = 0 is the colour itself, t = 1 white (shades of one method's colour)."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * t for c in rgb)


def arm_colors(arms: dict) -> dict[str, object]:
    """Arm name -> colour: the method's colour; xPress arms from light (smallest K) to the full colour."""
    xs = sorted((s["K"] or 0, a) for a, s in arms.items() if s["method"] == "xpress")
    out = {a: COLORS.get(s["method"], "#7f7f7f") for a, s in arms.items()}
    for i, (_, a) in enumerate(xs):
        out[a] = _shade(COLORS["xpress"], 0.55 * (len(xs) - 1 - i) / max(1, len(xs) - 1))
    return out


def labels(summary: dict) -> list[str]:
    """What a reader must know about the numbers (random weights, scripted acceptance, compat mode, ...)."""
    from harness.protocol.tables import run_labels
    return list(run_labels(summary))


def plot_title(summary: dict, dataset: str, model: str | None) -> str:
    """Model, dataset, T, prompts x measured rounds; then the run's facts (quantization, device, dtype, kernels,
    seed: harness.protocol.facts, "unknown" for a summary older than schema 3) and labels."""
    from harness.protocol import facts
    run = summary.get("run") or {}
    rounds = len((summary.get("rounds") or {}).get("measured") or [])
    name = model or (run.get("model") if run.get("model") not in (None, facts.UNKNOWN) else None)
    head = f"{name or 'model ?'} | {dataset} | T={summary['temperature']:g} | {summary.get('prompts', '?')} " \
           f"prompts x {rounds} measured round{'s' if rounds != 1 else ''}"
    head += "\n" + "  ".join(f"{k}={run.get(k, facts.UNKNOWN)}" for k in ("quantization", "device", "dtype", "kernels",
                                                                         "seed"))
    marks = labels(summary)
    # the AR rounds table.md flags (timing noise): the speedups drawn rest on them too
    from harness.protocol.tables import flagged_rounds
    flags = flagged_rounds(summary)
    return (head + (f"\n[{'; '.join(marks)}]" if marks else "")
            + (f"\nFLAGGED: {'; '.join(flags)} (timing noise; Sp. is a median over rounds)" if flags else ""))


def _model(folder) -> str | None:
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("model_name_or_path") or (f"random {cfg['random_weights']}" if cfg.get("random_weights") else None)
    return os.path.basename(str(name).rstrip("/")) if name and os.path.sep in str(name) else name


def _ci(s: dict) -> tuple[float, float, float] | None:
    """(Sp., below, above): the table's paired speedup (its `value`, the median over rounds), bars from that
    statistic's 95% CI (zero-width when there is none). The mean over rounds is another statistic, which the CI
    does not belong to: the plots drew it with these bars, and it disagreed with the table."""
    sp = s.get("speedup") or {}
    value = sp.get("value", sp.get("ci_point", sp.get("median")))  # older summaries: the point their CI is about
    if value is None or not math.isfinite(value):
        return None
    lo, hi = (sp.get("ci95") or [None, None])
    if lo is None or hi is None:
        return value, 0.0, 0.0
    return value, max(0.0, value - lo), max(0.0, hi - value)


def write_plots(folder: str | os.PathLike, summary: dict, dataset: str, out=None) -> list[str]:
    out = out or sys.stdout
    try:  # lazily, and without pyplot: the Agg canvas needs no display and leaves global state alone
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("[report] matplotlib is not installed: plots skipped (pip install 'matplotlib>=3.7')", file=out)
        return []
    arms = dict(sorted(summary["arms"].items(), key=lambda kv: (_ORDER.get(kv[1]["method"], 9), kv[1]["K"] or 0)))
    color = arm_colors(arms)
    title = plot_title(summary, dataset, _model(folder))
    has_ar = bool(summary.get("reference_arm"))
    written = []

    def save(fig, name: str) -> None:
        FigureCanvasAgg(fig)
        path = Path(folder) / name
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        atomic_write(path, buf.getvalue())
        written.append(str(path))

    def finish(ax, ylabel: str, one: bool) -> None:
        if one:  # the AR line, and 1 inside the range
            ax.axhline(1.0, color=COLORS["ar"], linestyle=":", linewidth=1.2, label="AR = 1")
            lo, hi = ax.get_ylim()
            ax.set_ylim(min(lo, 0.9), max(hi, 1.1))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    # bars per arm: every run
    fig = Figure(figsize=(max(6.0, 1.1 * len(arms) + 2), 6.5))
    ax_t, ax_s = fig.subplots(2, 1, sharex=True)
    names = list(arms)
    xs = range(len(names))
    ax_t.bar(xs, [arms[a]["tau_per_step"] or math.nan for a in names], color=[color[a] for a in names])
    finish(ax_t, "tau/step (accepted drafts + 1)", True)
    ax_t.set_title(title, fontsize=9)
    if has_ar:
        cis = [_ci(arms[a]) for a in names]
        ax_s.bar(xs, [c[0] if c else math.nan for c in cis], color=[color[a] for a in names],
                 yerr=[[c[1] if c else 0 for c in cis], [c[2] if c else 0 for c in cis]], capsize=4)
        finish(ax_s, f"speedup over {summary['reference_arm']} (paired, 95% CI)", True)
    else:
        ax_s.text(0.5, 0.5, "no AR arm in this run: no speedup", ha="center", va="center", transform=ax_s.transAxes)
        ax_s.set_yticks([])
    ax_s.set_xticks(list(xs), names, rotation=20, ha="right")
    save(fig, "summary_by_arm.png")

    sweep = [a for a in names if arms[a]["method"] == "xpress" and arms[a]["K"] is not None]
    refs = [a for a in names if arms[a]["method"] in ("markov", "drafter-only")]

    def vs_k(name: str, ylabel: str, value, err=None) -> None:
        fig = Figure(figsize=(6.5, 4.2))
        ax = fig.add_subplot()
        pts = [(arms[a]["K"], value(arms[a]), err(arms[a]) if err else None) for a in sweep]
        pts = [p for p in pts if p[1] is not None and math.isfinite(p[1])]
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], capsize=4, marker="o", color=COLORS["xpress"],
                    yerr=[[p[2][0] for p in pts], [p[2][1] for p in pts]] if err else None, label="xPress")
        ax.set_xticks(sorted({p[0] for p in pts}))
        for a in refs:
            v = value(arms[a])
            if v is not None and math.isfinite(v):
                ax.axhline(v, linestyle="--", color=color[a], label=f"{a} ({v:.2f})")
                if err:
                    below, above = err(arms[a])
                    ax.axhspan(v - below, v + above, color=color[a], alpha=0.12)
        finish(ax, ylabel, True)
        ax.set_xlabel("K (Jacobi passes)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        save(fig, name)

    if sweep:
        vs_k("tau_vs_K.png", "tau/step (accepted drafts + 1)", lambda s: s["tau_per_step"])
        if has_ar:
            vs_k("speedup_vs_K.png", f"speedup over {summary['reference_arm']} (paired, 95% CI)",
                 lambda s: (_ci(s) or (None,))[0], lambda s: (_ci(s) or (0, 0.0, 0.0))[1:])
        else:
            print("[report] no AR arm: speedup_vs_K.png skipped", file=out)
    else:
        print("[report] no xPress arm: tau_vs_K.png and speedup_vs_K.png skipped (summary_by_arm.png has every arm)",
              file=out)

    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.add_subplot()
    for a in names:
        pp = [math.nan if x is None else x for x in (arms[a]["per_position"] or [])]
        if pp and arms[a]["method"] != "ar":
            ax.plot(range(1, len(pp) + 1), pp, marker=".", color=color[a], label=a)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("accept rate (drafts 1..k all accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no speculative arm in this run", ha="center", va="center", transform=ax.transAxes)
    save(fig, "acceptance_per_position.png")
    return written
