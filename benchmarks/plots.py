"""Plots of benchmark results (matplotlib, imported only when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.models import DTYPE_TAGS


def write_curve_plot(path: Path, curves: dict[str, dict[str, Any]]) -> None:
    """Forward ms against new tokens, one panel per model, one line per (dtype, threads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = sorted({name for info in curves.values() for name in info["curves"]}, reverse=True)
    if not names:
        path.unlink(missing_ok=True)
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for info in curves.values():
            c = info["curves"].get(name)
            if c:
                ax.plot(c["sizes"], [1000 * s for s in c["seconds"]], marker="o", markersize=3,
                        label=f"{DTYPE_TAGS[info['dtype']]}, {info['threads_label']}")
        model = next(info["models"][name] for info in curves.values() if name in info["curves"])
        ax.set_title(f"{name}: {model}", fontsize=9)
        ax.set_xlabel("new tokens in one forward (cached prefix)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
