"""``ckptrun report RUN_DIR``: a picture of the run, and an HTML page with it and the run's summary.

The PNG has three panels: loss over steps, one line per attempt, with each
failure, restart, stop and resume marked, snapshot ticks along the bottom and
the steps a later attempt replayed drawn over the originals (hollow markers:
an exact resume puts them on the line); throughput over wall time with the
recovery gaps shaded and the stops and resumes marked; and one stacked bar
per restart of its measured RTO components. A script without the runtime
logs no loss: its step records (the bootstrap's optimizer-step hook) still
draw throughput, failures and restarts.
The HTML page embeds the PNG (base64) and tables of the run, its restarts and
its replayed steps, so it is one self-contained file to attach or mail.

Everything is read from the run directory's records (contract C3) through
:mod:`ckptrun.runtime.records`. matplotlib is an optional extra
(``pip install 'ckptrun[report]'``) and is imported inside the command, with
the Agg canvas (no display needed). Importable without torch or matplotlib.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from ckptrun.cli.commands.status import check_run_dir, read_spec, run_state, step_budget
from ckptrun.cli.durations import format_duration
from ckptrun.cli.errors import EXIT_OK, CkptrunError, command
from ckptrun.cli.humanize import human_bytes
from ckptrun.cli.supervision.rundir import RunPaths, holder
from ckptrun.runtime import records
from ckptrun.runtime.records import same_float

RTO_SEGMENTS = (("detect_s", "detect"), ("teardown_s", "teardown"), ("verify_s", "verify"), ("backoff_s", "backoff"),
                ("startup_s", "start-up"), ("restore_s", "restore"), ("first_step_s", "first step"))
COLORS = {"detect": "#d62728", "teardown": "#ff7f0e", "verify": "#bcbd22", "backoff": "#7f7f7f",
          "start-up": "#1f77b4", "restore": "#2ca02c", "first step": "#9467bd", "restart": "#17becf"}


@command
def report(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="The run directory (runs/NAME)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE.png", help="The PNG's path; the HTML page goes beside it (same stem). [default: RUN_DIR/report.png]", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (the files and the summary) on stdout."),
) -> int:
    """Draw the run (loss with failures, restarts and replays; throughput; RTO per restart) as PNG + HTML.

    \b
    Needs matplotlib: pip install 'ckptrun[report]'.
    Examples:
      ckptrun report runs/demo
      ckptrun report runs/demo -o demo.png      # also writes demo.html
    """
    check_run_dir(run_dir)
    png = output if output is not None else run_dir / "report.png"
    if png.suffix.lower() != ".png":
        raise CkptrunError(f"-o {png}: the picture is a PNG", "name the file FILE.png (the HTML page becomes FILE.html)")
    figure_module = _matplotlib()
    facts = RunFacts.read(run_dir)
    if not facts.series:
        raise CkptrunError(f"{run_dir} has no step records yet (metrics.jsonl is empty)", "report once the run has trained a step")
    summary = summarize(facts)
    png.parent.mkdir(parents=True, exist_ok=True)
    draw(facts, figure_module, png)
    page = png.with_suffix(".html")
    page.write_text(html_page(summary, png.read_bytes()))
    if as_json:
        sys.stdout.write(json.dumps({"png": str(png), "html": str(page), "summary": summary}, indent=2) + "\n")
    else:
        sys.stdout.write(f"{png}\n{page}\n")
    return EXIT_OK


def _matplotlib() -> Any:
    try:
        from matplotlib import figure
    except ImportError:
        raise CkptrunError("ckptrun report draws with matplotlib, which is not installed",
                           "pip install 'ckptrun[report]'") from None
    return figure


# --- what the records say -------------------------------------------------------------------


@dataclass
class RunFacts:
    """The run's records, and its per-attempt step series: {attempt: {step: metrics record}}."""

    run_dir: Path
    spec: Any
    run_id: str | None
    events: list[dict[str, Any]]
    series: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def read(cls, run_dir: Path) -> RunFacts:
        spec, run_id = read_spec(run_dir)
        facts = cls(run_dir, spec, run_id, records.read_events(run_dir))
        for record in records.read_metrics(run_dir):
            if isinstance(record.get("step"), int) and isinstance(record.get("time"), (int, float)) and not record.get("skipped"):
                facts.series.setdefault(int(record.get("attempt", 1)), {})[record["step"]] = record
        return facts

    @property
    def losses(self) -> dict[int, dict[int, dict[str, Any]]]:
        """The series restricted to records with a loss (a plain script has none)."""
        kept = {a: {s: r for s, r in rows.items() if isinstance(r.get("loss"), (int, float))} for a, rows in self.series.items()}
        return {a: rows for a, rows in kept.items() if rows}

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    @property
    def start_time(self) -> float:
        times = [e["time"] for e in self.events[:1]] + [r["time"] for s in self.series.values() for r in s.values()]
        return min(t for t in times if isinstance(t, (int, float)))


def replays(series: dict[int, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per later attempt: the steps it repeated from earlier attempts, and whether the losses are identical."""
    out = []
    for attempt in sorted(series)[1:]:
        earlier: dict[int, float] = {}
        for previous in sorted(a for a in series if a < attempt):
            earlier.update({s: r["loss"] for s, r in series[previous].items()})
        common = sorted(set(series[attempt]) & set(earlier))
        if not common:
            continue
        diffs = [abs(series[attempt][s]["loss"] - earlier[s]) for s in common]
        identical = all(same_float(series[attempt][s]["loss"], earlier[s]) for s in common)
        out.append({"attempt": attempt, "first_step": common[0], "last_step": common[-1], "steps": len(common),
                    "identical": identical, "max_abs_diff": max(diffs)})
    return out


def restarts(facts: RunFacts) -> list[dict[str, Any]]:
    """Each restart event joined with the failure that caused it (the failure of the attempt before)."""
    failures = {int(f.get("attempt", 0)): f for f in facts.named("failure")}
    out = []
    for number, event in enumerate(facts.named("restart"), start=1):
        failure = failures.get(int(event.get("attempt", 0)) - 1, {})
        out.append({"number": number, "attempt": event.get("attempt"), "cause": event.get("cause") or failure.get("cause"),
                    "rank": failure.get("rank"), "failed_step": failure.get("step"), "signal": failure.get("signal"),
                    "exception": failure.get("exception"), "snapshot_step": event.get("snapshot_step"),
                    "lost_steps": event.get("lost_steps"), "rto_s": event.get("rto_s"),
                    **{key: event.get(key) for key, _ in RTO_SEGMENTS},
                    "relaunch_to_first_step_s": event.get("relaunch_to_first_step_s")})
    return out


def summarize(facts: RunFacts) -> dict[str, Any]:
    """The run in one JSON-ready table (also what the HTML page shows)."""
    last_attempt = max(facts.series)
    final = facts.series[last_attempt][max(facts.series[last_attempt])]
    losses = facts.losses
    first_loss = losses[min(losses)][min(losses[min(losses)])]["loss"] if losses else None
    final_loss = losses[max(losses)][max(losses[max(losses)])]["loss"] if losses else None
    saves = facts.named("snapshot_saved")
    throughput = [r["samples_per_s"] for s in facts.series.values() for r in s.values() if isinstance(r.get("samples_per_s"), (int, float))]
    precision = facts.named("precision")
    spec = facts.spec
    alive = holder(RunPaths(facts.run_dir)) is not None
    return {
        "run_dir": str(facts.run_dir), "run_id": facts.run_id, "state": run_state(facts.events, alive),
        "script": str(spec.script) if spec is not None and spec.script else "the embedded default job",
        "script_args": list(spec.script_args) if spec is not None else [],
        "ranks": spec.nproc_per_node if spec is not None else None,
        "precision": precision[-1].get("mode") if precision else final.get("precision"),
        "attempts": len(facts.named("attempt_start")) or len(facts.series),
        "restarts": len(facts.named("restart")), "failures": len(facts.named("failure")),
        "step": final["step"], "total_steps": step_budget(spec, None), "first_loss": first_loss, "final_loss": final_loss,
        "wall_s": final["time"] - facts.start_time,
        "median_samples_per_s": statistics.median(throughput) if throughput else None,
        "snapshots_saved": len(saves), "last_snapshot_step": saves[-1].get("step") if saves else None,
        "last_snapshot_bytes": saves[-1].get("bytes") if saves else None,
        "median_save_stall_s": statistics.median(s["stall_s"] for s in saves) if saves and all(isinstance(s.get("stall_s"), (int, float)) for s in saves) else None,
        "stops": len(facts.named("run_stopped")), "resumes": len(facts.named("resume")),
        "restart_details": restarts(facts), "replays": replays(losses),
    }


# --- the picture --------------------------------------------------------------------------------


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


# --- the page -------------------------------------------------------------------------------------


def html_page(summary: dict[str, Any], png: bytes) -> str:
    title = f"ckptrun report: {summary['run_id'] or summary['run_dir']}"
    image = base64.b64encode(png).decode()
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{_e(title)}</title>\n<style>{STYLE}</style></head><body>",
             f"<h1>{_e(title)}</h1>", f"<img src='data:image/png;base64,{image}' alt='loss, throughput and RTO of the run'>",
             "<h2>Run</h2>", _table(["", ""], _run_rows(summary)), "<h2>Restarts</h2>", _restart_table(summary["restart_details"]),
             "<h2>Replayed steps</h2>", _replay_table(summary["replays"]), "</body></html>\n"]
    return "\n".join(parts)


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}"
         "img{max-width:100%}table{border-collapse:collapse;margin:.5em 0 1.5em}"
         "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}")


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "" if not any(header) else "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _num(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _run_rows(s: dict[str, Any]) -> list[list[Any]]:
    steps = f"{s['step']}" + (f" of {s['total_steps']}" if s["total_steps"] else "")
    size = "" if s["last_snapshot_bytes"] is None else f", {human_bytes(s['last_snapshot_bytes'])}"
    snapshot = "none" if s["last_snapshot_step"] is None else f"step {s['last_snapshot_step']}{size}"
    return [["run directory", s["run_dir"]], ["run id", s["run_id"] or "-"], ["state", s["state"]],
            ["script", " ".join([s["script"], *s["script_args"]])], ["ranks", s["ranks"] or "-"], ["precision", s["precision"] or "-"],
            ["attempts", s["attempts"]], ["restarts", s["restarts"]], ["failures", s["failures"]],
            ["stops, resumes", f"{s['stops']}, {s['resumes']}"], ["steps", steps],
            ["loss, first → last", f"{_num(s['first_loss'])} → {_num(s['final_loss'])}"], ["wall time", format_duration(s["wall_s"])],
            ["median throughput", "-" if s["median_samples_per_s"] is None else f"{s['median_samples_per_s']:,.0f} samples/s"],
            ["snapshots saved", s["snapshots_saved"]], ["last snapshot", snapshot],
            ["median save stall", format_duration(s["median_save_stall_s"])]]


def _restart_table(details: list[dict[str, Any]]) -> str:
    if not details:
        return "<p>No restarts: the run never failed.</p>"
    header = ["restart", "cause", "rank", "failed at step", "resumed from step", "steps lost", "detect", "teardown",
              "verify", "backoff", "relaunch to first step", "RTO"]
    rows = [[f"restart {d['number']} (attempt {d['attempt']})", _cause(d), _num(d["rank"]), _num(d["failed_step"]),
             _num(d["snapshot_step"]), _num(d["lost_steps"]), *(format_duration(d.get(k)) for k in
             ("detect_s", "teardown_s", "verify_s", "backoff_s", "relaunch_to_first_step_s", "rto_s"))] for d in details]
    return _table(header, rows)


def _cause(detail: dict[str, Any]) -> str:
    why = detail.get("signal") or (str(detail["exception"]).splitlines()[0][:80] if detail.get("exception") else None)
    return (detail["cause"] or "-") + (f" ({why})" if why else "")


def _replay_table(replayed: list[dict[str, Any]]) -> str:
    if not replayed:
        return "<p>No step was run twice.</p>"
    rows = [[f"attempt {r['attempt']}", f"{r['first_step']}–{r['last_step']} ({r['steps']} steps)",
             "identical (bitwise): an exact resume" if r["identical"] else f"differ: max |Δloss| {r['max_abs_diff']:.3g}"]
            for r in replayed]
    return _table(["attempt", "replayed steps", "losses vs. the first run of those steps"], rows)
