"""``ckptrun report``'s picture: loss, throughput and RTO panels drawn with matplotlib (Agg, no display).

matplotlib is handed in by the command (it is an optional extra), so this
module imports it only inside :func:`draw`. Importable without torch or matplotlib.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

from ckptrun.cli.commands.report_data import RTO_SEGMENTS, RunFacts, restarts
from ckptrun.cli.durations import format_duration

COLORS = {"detect": "#d62728", "teardown": "#ff7f0e", "verify": "#bcbd22", "backoff": "#7f7f7f",
          "start-up": "#1f77b4", "restore": "#2ca02c", "first step": "#9467bd", "restart": "#17becf"}



def draw(facts: RunFacts, figure_module: Any, png: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure_module.Figure(figsize=(11, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, speed_ax, rto_ax = fig.subplots(3, 1, height_ratios=[3, 2, 1.4])
    fig.suptitle(f"ckptrun run {facts.run_id or facts.run_dir.name}", fontsize=13)
    draw_loss(loss_ax, facts)
    draw_throughput(speed_ax, facts)
    draw_rto(rto_ax, restarts(facts))
    fig.savefig(png, format="png")


def _color(attempt: int) -> str:
    return f"C{(attempt - 1) % 10}"


def draw_loss(ax: Any, facts: RunFacts) -> None:
    series = facts.losses
    if not series:
        ax.text(0.5, 0.5, "no loss curve: the script does not log its loss through ckptrun.runtime",
                ha="center", va="center", transform=ax.transAxes, color="0.4")
    seen: set[int] = set()
    for attempt in sorted(series):
        steps = sorted(series[attempt])
        losses = [series[attempt][s]["loss"] for s in steps]
        ax.plot(steps, losses, color=_color(attempt), lw=2 if attempt == min(series) else 1.3, label=f"attempt {attempt}")
        replayed = [(s, loss) for s, loss in zip(steps, losses) if s in seen]
        if replayed:
            ax.plot(*zip(*replayed), "o", ms=5, mfc="none", color=_color(attempt), label=f"attempt {attempt}: replayed steps")
        seen.update(steps)
    _mark_failures(ax, facts)
    _mark_sessions(ax, facts, lambda event, key: event.get(key))
    _snapshot_ticks(ax, facts)
    ax.set(xlabel="optimizer step", ylabel="loss", title="loss (failures, restarts, stops, resumes, replayed steps)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="upper right", fontsize=8)


def _mark_sessions(ax: Any, facts: RunFacts, where: Callable[[dict[str, Any], str], Any]) -> None:
    """Each stop (at its step, or time) and each resume (at the step it resumed from, or its time)."""
    marks = [(e, "step", "■ stopped", "#8c564b") for e in facts.named("run_stopped")]
    marks += [(e, "snapshot_step", "▶ resumed", "#1f77b4") for e in facts.named("resume")]
    for event, key, label, color in marks:
        x = where(event, key)
        if isinstance(x, (int, float)):
            ax.axvline(x, color=color, ls="-.", lw=1.2)
            ax.annotate(label, (x, 0.03), xycoords=("data", "axes fraction"), color=color, fontsize=8,
                        ha="left", va="bottom", rotation=90)


def _mark_failures(ax: Any, facts: RunFacts) -> None:
    for failure in facts.named("failure"):
        if isinstance(failure.get("step"), int):
            ax.axvline(failure["step"], color="#d62728", ls=":", lw=1.5)
            who = f"rank {failure['rank']}" if failure.get("rank") is not None else "job"
            ax.annotate(f"✕ {failure.get('cause', 'failure')} ({who})", (failure["step"], 0.97), xycoords=("data", "axes fraction"),
                        color="#d62728", fontsize=8, ha="right", va="top", rotation=90)
    for number, event in enumerate(facts.named("restart"), start=1):
        step = event.get("snapshot_step") or 0
        ax.axvline(step, color="#2ca02c", ls="--", lw=1.2)
        ax.annotate(f"restart {number} from step {step}", (step, 0.97), xycoords=("data", "axes fraction"),
                    color="#2ca02c", fontsize=8, ha="left", va="top", rotation=90)


def _snapshot_ticks(ax: Any, facts: RunFacts) -> None:
    steps = [e["step"] for e in facts.named("snapshot_saved") if isinstance(e.get("step"), int)]
    if steps:
        ax.plot(steps, [0.02] * len(steps), "|", ms=12, mew=2, color="0.25", transform=ax.get_xaxis_transform(),
                label="snapshot saved", zorder=5)


def draw_throughput(ax: Any, facts: RunFacts) -> None:
    start = facts.start_time
    for attempt in sorted(facts.series):
        rows = [facts.series[attempt][s] for s in sorted(facts.series[attempt])]
        pairs = [(r["time"] - start, speed) for r, speed in zip(rows, rates(rows)) if speed is not None]
        if not pairs:
            continue
        times, speeds = zip(*pairs)
        window = max(1, len(speeds) // 50)  # a long run: per-step points faint, a rolling median over them
        ax.plot(times, speeds, ".", ms=2 if window > 1 else 4, alpha=0.3 if window > 1 else 1.0, color=_color(attempt))
        ax.plot(times, rolling_median(speeds, window), lw=1.3, color=_color(attempt), label=f"attempt {attempt}")
    for gap_start, gap_end in recovery_gaps(facts):
        ax.axvspan(gap_start - start, gap_end - start, color="#d62728", alpha=0.12, lw=0)
    _mark_sessions(ax, facts, lambda event, key: event["time"] - start if isinstance(event.get("time"), (int, float)) else None)
    unit = "samples/s" if any(isinstance(r.get("samples_per_s"), (int, float)) for s in facts.series.values() for r in s.values()) else "steps/s"
    ax.set(xlabel="wall time since launch (s)", ylabel=unit, title="throughput (shaded: failure to first step after restart)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def rolling_median(values: tuple[float, ...], window: int) -> list[float]:
    return [statistics.median(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def rates(rows: list[dict[str, Any]]) -> list[float | None]:
    """Each record's throughput; without samples/s or a step time (a plain script's step records), the step
    rate since the attempt's previous record."""
    out: list[float | None] = []
    for index, row in enumerate(rows):
        speed = _speed(row)
        if speed is None and index > 0 and row["time"] > rows[index - 1]["time"]:
            speed = (row["step"] - rows[index - 1]["step"]) / (row["time"] - rows[index - 1]["time"])
        out.append(speed)
    return out


def _speed(record: dict[str, Any]) -> float | None:
    if isinstance(record.get("samples_per_s"), (int, float)):
        return float(record["samples_per_s"])
    step_time = record.get("step_time_s")
    return 1.0 / step_time if isinstance(step_time, (int, float)) and step_time > 0 else None


def recovery_gaps(facts: RunFacts) -> list[tuple[float, float]]:
    """(last sign of life, first step of the next attempt) per failure that was followed by one."""
    gaps = []
    for failure in facts.named("failure"):
        begin = failure.get("last_sign_of_life") or failure.get("detected_at") or failure.get("time")
        following = facts.series.get(int(failure.get("attempt", 0)) + 1)
        if isinstance(begin, (int, float)) and following:
            gaps.append((float(begin), following[min(following)]["time"]))
    return gaps


def draw_rto(ax: Any, details: list[dict[str, Any]]) -> None:
    ax.set_title("recovery time (RTO) per restart, measured")
    if not details:
        ax.text(0.5, 0.5, "no restarts in this run", ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_axis_off()
        return
    used: set[str] = set()
    widest = 0.0
    for row, detail in enumerate(details):
        left = 0.0
        for name, seconds in rto_segments(detail):
            ax.barh(row, seconds, left=left, height=0.5, color=COLORS[name], label=None if name in used else name)
            used.add(name)
            left += seconds
        total = detail.get("rto_s") or left
        ax.text(left, row, f"  {format_duration(total)}", va="center", fontsize=8)
        widest = max(widest, left)
    ax.set_xlim(0, widest * 1.15 or 1.0)  # room for the totals
    ax.set_yticks(range(len(details)), [f"restart {d['number']} ({d['cause'] or '?'})" for d in details])
    ax.set_xlabel("seconds")
    ax.set_ylim(len(details) - 0.4, -0.6)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def rto_segments(detail: dict[str, Any]) -> list[tuple[str, float]]:
    """The restart's components in order; the relaunch as one segment when its parts are unknown."""
    segments = [(label, float(detail[key])) for key, label in RTO_SEGMENTS if isinstance(detail.get(key), (int, float))]
    relaunch = detail.get("relaunch_to_first_step_s")
    if isinstance(relaunch, (int, float)) and not any(label in ("start-up", "restore", "first step") for label, _ in segments):
        segments.append(("restart", float(relaunch)))
    return [(label, max(0.0, seconds)) for label, seconds in segments]

