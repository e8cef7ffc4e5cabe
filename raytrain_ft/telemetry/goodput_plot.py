"""Goodput against GPU count for both recovery modes (`raytrain-ft plan-goodput --plot FILE`).

Each mode at its interval (`raytrain_ft.resilience.planner.plan`: `restart` at its simulated best, `replica`
at Daly's) from 64 to 100,000 GPUs on a log axis, with the 95 % range of a month shaded, the
README's reference point (1,000 GPUs, 10,000 h per GPU, a 5-minute checkpoint: docs/fault-tolerance.md;
the other costs as plotted) and two published anchors marked:

* Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4): 466 job interruptions
  in 54 days on 16,384 GPUs, more than 90 % effective training time;
* ByteDance's ByteRobust (Wan et al., "Robust LLM Training Infrastructure at ByteDance", arXiv
  2509.16293, 2025): 97 % effective training time ratio (ETTR) for a three-month job on 9,600 GPUs.

The anchors come from other clusters, MTBFs and costs: they place the curves, they do not test them.
Uses matplotlib's object API (`Figure`, Agg), as `raytrain_ft.telemetry.plots` does.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from matplotlib.figure import Figure

from raytrain_ft.resilience.planner import MODES, Cluster, Costs, plan

GPU_COUNTS = np.unique(np.geomspace(64, 100_000, 16).round().astype(int))
REFERENCE_GPUS, REFERENCE_MTBF_HOURS, REFERENCE_CHECKPOINT_S = 1_000, 10_000.0, 300.0  # the README's example
# (label, GPUs, effective training time, more-than?)
ANCHORS = [
    ("Llama 3: > 90 %, 16,384 GPUs", 16_384, 0.90, True),
    ("ByteDance: 97 % ETTR, 9,600 GPUs", 9_600, 0.97, False),
]
COLORS = {"restart": "tab:blue", "replica": "tab:green"}
INTERVAL = {"restart": "its best interval", "replica": "Daly's interval (checkpoint.interval: auto)"}


def goodput_figure(cluster: Cluster, costs: Costs, repetitions: int = 40, seed: int = 0) -> Figure:
    """Goodput (mean and 95 % range of a month) against `GPU_COUNTS` for `cluster`'s per-GPU MTBF,
    days, replica size and clustered fraction at `costs`; lines have gid `restart` and `replica`,
    the reference point gid `reference_point`, the anchors gid `anchor`."""
    curves: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    for gpus in GPU_COUNTS:
        modes = MODES if gpus // cluster.gpus_per_replica >= 2 else ("restart",)
        result = plan(replace(cluster, gpus=int(gpus)), costs, modes, repetitions=repetitions, seed=seed)
        for mode, p in result["modes"].items():
            curves[mode].append((gpus, p["goodput"], *p["goodput_ci95"]))
    fig = Figure(figsize=(9, 5), layout="constrained")
    ax = fig.add_subplot()
    for mode, rows in curves.items():
        x, y, lo, hi = np.array(rows).T
        ax.plot(x, y, color=COLORS[mode], marker=".", label=f"{mode} mode at {INTERVAL[mode]}", gid=mode)
        ax.fill_between(x, lo, hi, color=COLORS[mode], alpha=0.2, linewidth=0)
    reference = plan(
        replace(cluster, gpus=REFERENCE_GPUS, mtbf_hours=REFERENCE_MTBF_HOURS),
        replace(costs, checkpoint_s=REFERENCE_CHECKPOINT_S, save_s=max(costs.save_s, REFERENCE_CHECKPOINT_S)),
        ("restart",),
        repetitions=repetitions,
        seed=seed,
    )["modes"]["restart"]
    ax.scatter(
        [REFERENCE_GPUS],
        [reference["goodput"]],
        marker="*",
        s=160,
        color="tab:red",
        zorder=3,
        gid="reference_point",
        label=f"1,000 GPUs, 10,000 h, 5-min checkpoint (restart): {reference['goodput']:.3f}",
    )
    for (label, gpus, value, at_least), (dx, ha) in zip(ANCHORS, ((9, "left"), (-9, "right")), strict=True):
        ax.scatter([gpus], [value], marker="^" if at_least else "D", s=60, color="black", zorder=3, gid="anchor")
        ax.annotate(label, (gpus, value), textcoords="offset points", xytext=(dx, 4), ha=ha, fontsize="small")
    ax.set_xscale("log")
    ax.set(
        xlabel="GPUs",
        ylabel="goodput (useful compute / wall time)",
        ylim=(0, 1.02),
        title=f"Goodput of a {cluster.days:g}-day run, {cluster.mtbf_hours:,.0f} h MTBF per GPU, "
        f"checkpoint stall {costs.checkpoint_s:g} s, restart {costs.restart_s:g} s, rejoin {costs.rejoin_s:g} s",
    )
    ax.title.set_fontsize("medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    return fig
