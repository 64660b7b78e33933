"""Loss curves as a PNG (the demo's `loss_curves.png`): matplotlib is imported only here, when a plot is drawn, with
the Agg backend, which needs no display.
"""

import os
from pathlib import Path


def plot_loss_curves(
    panels: dict[str, dict[str, list[list[float]]]],
    path: str | os.PathLike,
    baselines: dict[str, tuple[float, str]] | None = None,
) -> Path:
    """One panel per run: train loss and held-out loss against step, and the run's baseline (`baselines[title]`: a
    loss and what it is, e.g. a unigram model's) as a dotted line, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, history) in zip(axes[0], panels.items(), strict=True):
        for kind, style, label in (("train", "-", "train loss"), ("eval", "o--", "held-out loss")):
            points = history.get(kind) or []
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        if baselines and title in baselines:
            loss, what = baselines[title]
            ax.axhline(loss, color="0.4", linestyle=":", label=f"{what} ({loss:.2f})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["plot_loss_curves"]
