"""The loss curve with the run's failures, rollbacks and skipped steps marked (MLflow image `loss.png`).

Rank 0 re-renders it at every committed checkpoint and at the end (`MlflowRecorder.refresh_loss_plot`),
from MLflow's metric histories of `loss` and `discarded/loss` and the run's events. Uses matplotlib's object API
(`Figure`, Agg), not `pyplot`, so it is safe in a background thread.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from raytrain_ft.resilience.recovery import failures

LOSS_PLOT = "loss.png"


def loss_figure(kept: list[tuple[int, float]], discarded: list[tuple[int, float]], events: list[dict]) -> Figure:
    """Loss against step, with markers.

    Args:
        kept: (step, loss) pairs of the kept timeline (`loss`, one per step), drawn as the curve.
        discarded: (step, loss) pairs a restart or rollback discarded (`discarded/loss`, see
            `raytrain_ft.telemetry.timeline`), drawn as grey dots.
        events: the run's events (`MlflowRecorder.events()`): a vertical line at each failure's last
            completed step (gid `failure`) and each rollback's step (gid `rollback`), a cross at
            each skipped step (gid `skipped_step`).
    """
    curve = dict(kept)
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    steps = sorted(curve)
    ax.plot(steps, [curve[s] for s in steps], color="tab:blue", linewidth=1.2, label="loss", gid="loss")
    if discarded:
        xs, ys = zip(*discarded, strict=True)
        ax.scatter(xs, ys, s=6, color="0.7", label="discarded by a restart or rollback", gid="discarded")
    for i, (_, f) in enumerate(failures(events)):
        ax.axvline(f["last_step"], color="tab:red", linestyle="--", gid="failure", label="failure" if i == 0 else None)
    rollbacks = [e["at_step"] for e in events if e["kind"] == "rollback"]
    for i, step in enumerate(rollbacks):
        ax.axvline(step, color="tab:orange", linestyle=":", gid="rollback", label="rollback" if i == 0 else None)
    skipped = [e["step"] for e in events if e["kind"] == "skipped_step" and e["step"] in curve]
    if skipped:
        ax.scatter(
            skipped, [curve[s] for s in skipped], marker="x", color="tab:red", gid="skipped_step", label="skipped"
        )
    ax.set(xlabel="step", ylabel="loss (mean over ranks)", title="Training loss")
    ax.legend(loc="upper right", fontsize="small")
    return fig
