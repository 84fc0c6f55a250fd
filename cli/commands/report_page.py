"""``ckptrun report``'s HTML page: the PNG embedded (base64) and tables of the run, its restarts and its
replayed steps, so it is one self-contained file to attach or mail."""

from __future__ import annotations

import base64
import html
from typing import Any

from ckptrun.cli.durations import format_duration
from ckptrun.cli.humanize import human_bytes


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
