"""The epilogue benchmark as a PNG: per case and shape, a group of bars, one per variant, each the
variant's time relative to the bare cuBLAS GEMM (the dashed line at 1.0; lower is better)."""
from __future__ import annotations

from pathlib import Path

from .harness import FLOOR, Row, progress

PER_ROW = 12  # bar groups per row of the figure; whole cases are packed into rows


def chart(rows: list[Row], path: Path) -> Path | None:
    """Write the chart to `path`; None when no row has a ratio to draw (every case failed), or (with a
    one-line note) when matplotlib is not installed."""
    ratio = {(r.bench, r.shape, r.variant): r.vs_gemm for r in rows if r.variant != FLOOR}
    if not ratio:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on the GPU machines
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        progress("chart: matplotlib is not installed, so no PNG (pip install matplotlib)")
        return None
    variants = list(dict.fromkeys(v for _, _, v in ratio))
    colors = dict(zip(variants, plt.get_cmap("tab10").colors))  # one color per variant throughout
    layout: list[list[tuple[str, str]]] = []  # rows of (case, shape) groups
    for case in dict.fromkeys(b for b, _, _ in ratio):
        groups = list(dict.fromkeys((b, s) for b, s, _ in ratio if b == case))
        if layout and len(layout[-1]) + len(groups) <= PER_ROW:
            layout[-1] += groups
        else:
            layout.append(groups)
    fig, axes = plt.subplots(len(layout), 1, figsize=(1.25 * PER_ROW + 1, 3.2 * len(layout)), squeeze=False)
    width = 0.8 / len(variants)
    for ax, groups in zip(axes[:, 0], layout):
        for j, (case, shape) in enumerate(groups):
            present = [v for v in variants if (case, shape, v) in ratio]  # centered, without gaps
            for i, v in enumerate(present):
                bar = ax.bar(j + (i - (len(present) - 1) / 2) * width, ratio[case, shape, v], width, color=colors[v])
                ax.bar_label(bar, fmt="%.2f", fontsize=6, padding=1)
            if j and groups[j - 1][0] != case:
                ax.axvline(j - 0.5, color="grey", linewidth=0.5)
        values = [ratio[g + (v,)] for g in groups for v in variants if g + (v,) in ratio]
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        # bars from 0 would hide the few-percent differences that matter here
        ax.set_ylim(min(0.8, min(values) - 0.05), max(1.2, max(values) + 0.1))
        ax.set_xlim(-0.5, PER_ROW - 0.5)  # the same bar width in every row
        ax.set_xticks(range(len(groups)), [f"{c}\n{s}" for c, s in groups], fontsize=7)
        ax.set_ylabel("time / cuBLAS GEMM")
    fig.legend([Patch(color=colors[v]) for v in variants], variants, loc="upper center", ncol=len(variants),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # 0.4 inch on top for the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
