"""A simulated pipeline schedule as a Gantt chart: one row per device, forwards and backwards by micro-batch."""
from __future__ import annotations

from pathlib import Path

from tapestry.pipeline.schedule import Timeline

LABELLED = 32  # micro-batches up to which each bar is numbered


def draw_timeline(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Write the chart to `path` (PNG or SVG by suffix): forwards blue, backwards orange, darker for later
    chunks of an interleaved schedule; idle time is the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedule = timeline.schedule
    devices, v = schedule.stages, schedule.chunks
    fig, ax = plt.subplots(figsize=(11, 0.45 * devices + 1.4))
    colors = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges")}
    for slot in timeline.slots:
        local = slot.task.chunk // devices
        shade = 0.45 + 0.4 * (local / max(1, v - 1) if v > 1 else 0.0)
        ax.barh(slot.device, slot.end - slot.start, left=slot.start, height=0.8,
                color=colors[slot.task.kind](shade), edgecolor="white", linewidth=0.3)
        if schedule.micro_batches <= LABELLED:
            ax.text((slot.start + slot.end) / 2, slot.device, str(slot.task.micro_batch), ha="center",
                    va="center", fontsize=6)
    ax.set_yticks(range(devices), [f"stage {d}" for d in range(devices)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"{schedule.name}: {devices} stages, {schedule.micro_batches} micro-batches",
                 fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k](0.6)) for k in "FB"]
    ax.legend(handles, ["forward", "backward"], loc="upper right", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
