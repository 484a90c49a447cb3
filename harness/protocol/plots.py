"""PNG plots of a run summary: tau and speedup vs K per method, per-position acceptance per arm."""
from __future__ import annotations

import io
import math
import os
import sys
from pathlib import Path

from harness.protocol.results_io import atomic_write


def write_plots(folder: str | os.PathLike, summary: dict, dataset: str, out=None) -> list[str]:
    """tau vs K, speedup vs K (xPress sweep as a line, other methods as horizontal lines), per-position curves."""
    out = out or sys.stdout
    try:  # lazily, and without pyplot: the Agg canvas needs no display and leaves global state alone
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("[report] matplotlib is not installed: plots skipped (pip install 'matplotlib>=3.7')", file=out)
        return []
    arms = summary["arms"]
    sweep = sorted((s for s in arms.values() if s["method"] == "xpress" and s["K"] is not None),
                   key=lambda s: s["K"])
    refs = [s for s in arms.values() if s["method"] in ("markov", "drafter-only")]
    from harness.protocol.tables import run_labels
    labels = run_labels(summary)
    title = f"{dataset}, T={summary['temperature']:g}" + (f"\n[{'; '.join(labels)}]" if labels else "")
    written = []

    def save(fig, name: str) -> None:
        FigureCanvasAgg(fig)
        path = Path(folder) / name
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
        atomic_write(path, buf.getvalue())
        written.append(str(path))

    def vs_k(name: str, ylabel: str, value, err=None) -> None:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        pts = [(s["K"], value(s), err(s) if err else None) for s in sweep if value(s) is not None]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] or 0 for p in pts] if err else None,
                        marker="o", capsize=3, label="xPress")
            ax.set_xticks(sorted({p[0] for p in pts}))
        for i, s in enumerate(refs):
            if value(s) is not None:
                ax.axhline(value(s), linestyle="--", color=f"C{i + 1}", label=f"{s['arm']} ({value(s):.2f})")
        ax.set_xlabel("K (Jacobi passes)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, name)

    vs_k("tau_vs_K.png", "tau/step (accepted drafts + 1)", lambda s: s["tau_per_step"])
    if summary.get("reference_arm"):
        vs_k("speedup_vs_K.png", f"speedup over {summary['reference_arm']} (paired POOLED, mean +- std)",
             lambda s: (s.get("speedup") or {}).get("mean"), lambda s: (s.get("speedup") or {}).get("std"))
    else:
        print("[report] no AR arm: speedup_vs_K.png skipped", file=out)
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for s in arms.values():
        pp = [math.nan if x is None else x for x in (s["per_position"] or [])]
        if pp:
            ax.plot(range(1, len(pp) + 1), pp, marker=".", label=s["arm"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("accept rate (drafts 1..k all accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    save(fig, "acceptance_per_position.png")
    return written
