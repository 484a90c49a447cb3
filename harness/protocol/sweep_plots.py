"""A sweep's plots (harness.protocol.sweep writes them into its folder): its speedup over AR against the batch size
and against the context length, one line per method, with the 95% CIs as bars."""
from __future__ import annotations

import os
import textwrap

import numpy as np


# each plot: its file, the axis it sweeps along (a summary key), the axis of its panels, the unit the axis counts
# and its label
PLOTS = (("speedup_vs_batch.png", "batch_sizes", "context_lengths", "batch size",
          "batch size B (requests decoding together)"),
         ("speedup_vs_context.png", "context_lengths", "batch_sizes", "context length",
          "context length (prompt tokens, at least)"))


def write_plots(folder: str, summary: dict) -> tuple[list[str], list[str]]:
    """speedup_vs_batch.png (a line per method, a panel per context) and speedup_vs_context.png (a panel per batch
    size), each where its axis has two values or more. Returns the paths written and, for each plot not written, a
    line saying why (an axis of one value, no AR arm, no other arm, no matplotlib), for the README and stdout."""
    def missing(why: str, names=tuple(p[0] for p in PLOTS)) -> list[str]:
        return [f"no {n}: {why}" for n in names]
    arms = [a for a in summary["arms"] if a != summary["reference"]]
    if summary["reference"] is None:
        return [], missing("no AR arm to take the speedup over")
    if not arms:
        return [], missing("no arm besides AR")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], missing("matplotlib is not installed (pip install matplotlib)")
    skipped = [m for name, axis, _, unit, _ in PLOTS if len(summary[axis]) < 2
               for m in missing(f"one {unit} swept ({summary[axis][0]}); a line needs two", [name])]
    sp = {(p["batch_size"], p["context_len"], a): (p["arms"][a].get("speedup"), p["arms"][a].get("speedup_ci"))
          for p in summary["points"] for a in arms}
    paths = []
    for name, axis, panel_axis, _, xlabel in PLOTS:
        xs, panels = summary[axis], summary[panel_axis]
        if len(xs) < 2:  # said in `skipped`
            continue
        by_batch = axis == "batch_sizes"
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for a in arms:
                got = [sp.get((x, panel, a) if by_batch else (panel, x, a), (None, None)) for x in xs]
                ys = np.array([np.nan if y is None else y for y, _ in got])
                lo = np.array([np.nan if ci is None else ci[0] for _, ci in got])
                hi = np.array([np.nan if ci is None else ci[1] for _, ci in got])
                ax.errorbar(xs, ys, yerr=[np.maximum(ys - lo, 0), np.maximum(hi - ys, 0)], marker="o", capsize=3,
                            label=a)  # the bars: each point's 95% CI
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            if by_batch:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel(xlabel)
            ax.set_ylabel("speedup over AR (95% CI)")  # longer, it overran the panel's height
            ax.set_title(f"{'context' if by_batch else 'B'} = {panel}", fontsize=9)
            ax.legend(fontsize=7)
        if summary["labels"]:  # once for the figure, wrapped to its width: a panel's title is too narrow for them
            fig.suptitle(textwrap.fill("; ".join(summary["labels"]), 70 * len(panels)), fontsize=8)
        fig.tight_layout()
        fig.savefig(path := os.path.join(folder, name), dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, skipped
