"""``curves.png``: training loss, and validation AUC (with the final test AUC), against samples
seen."""

from __future__ import annotations

from pathlib import Path


def plot_curves(
    history: list[dict], path: Path, title: str, bayes_auc: float | None = None
) -> None:
    """Plot ``history`` entries: ``{"samples", "train_loss"}``, ``{"samples", "valid_auc"}``,
    ``{"samples", "test_auc"}``.

    matplotlib is imported here, at the end of a run: importing it costs every rank a third of a
    second at start-up otherwise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = [(h["samples"], h["train_loss"]) for h in history if "train_loss" in h]
    auc = [(h["samples"], h["valid_auc"]) for h in history if h.get("valid_auc") is not None]
    test = [(h["samples"], h["test_auc"]) for h in history if h.get("test_auc") is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    if loss:
        ax1.plot(*zip(*loss, strict=True), color="tab:blue")
    ax1.set_xlabel("samples seen")
    ax1.set_ylabel("train log loss (running mean)")
    ax1.grid(alpha=0.3)
    if auc:
        ax2.plot(*zip(*auc, strict=True), marker="o", color="tab:orange", label="validation AUC")
    if test:
        ax2.plot(
            *zip(*test, strict=True),
            marker="*",
            markersize=12,
            linestyle="none",
            color="tab:red",
            label="test AUC (the model kept)",
        )
    if bayes_auc is not None:
        ax2.axhline(bayes_auc, color="gray", linestyle="--", label=f"Bayes-optimal {bayes_auc:.4f}")
    ax2.set_xlabel("samples seen")
    ax2.set_ylabel("AUC")
    ax2.grid(alpha=0.3)
    if auc or test or bayes_auc is not None:
        ax2.legend(loc="lower right")
    right = max([s for s, _ in loss] + [s for s, _ in auc] + [1])
    ax1.set_xlim(0, right * 1.02)
    for ax in (ax1, ax2):
        ax.ticklabel_format(axis="x", style="sci", scilimits=(3, 3))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
