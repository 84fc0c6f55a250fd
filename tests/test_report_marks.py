"""`ckptrun report` marks stops and resumes, and draws a plain script's run (no loss) from its step records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptrun.cli.commands.report_data import RunFacts, summarize
from ckptrun.cli.commands.report_figure import draw_loss, draw_throughput
from ckptrun.runtime.records import append_jsonl, log_metrics

figure = pytest.importorskip("matplotlib.figure")


def stopped_and_resumed(run_dir: Path, with_loss: bool) -> None:
    """Attempt 1 trains to step 6 and is stopped; a resume from step 6 trains attempt 2 to step 10."""
    run_dir.mkdir(parents=True)
    events = [("launch", 100.0, {}), ("attempt_start", 100.0, {"attempt": 1}),
              ("run_stopped", 107.0, {"attempt": 1, "step": 6, "snapshot_step": 6}),
              ("resume", 120.0, {"attempt": 2, "snapshot_step": 6}), ("attempt_start", 120.0, {"attempt": 2})]
    for name, time, fields in events:
        append_jsonl(run_dir / "events.jsonl", {"event": name, "time": time, **fields})
    for attempt, steps, start in ((1, range(1, 7), 101.0), (2, range(7, 11), 121.0)):
        for step in steps:
            record = {"step": step, "attempt": attempt, "time": start + step}
            log_metrics(run_dir, {**record, "loss": 1.0 / step} if with_loss else {**record, "source": "step-hook"})


def texts(ax: object) -> list[str]:
    return [t.get_text() for t in ax.texts]  # type: ignore[attr-defined]


@pytest.mark.parametrize("with_loss", [True, False])
def test_stops_and_resumes_are_marked_on_both_panels(tmp_path: Path, with_loss: bool) -> None:
    stopped_and_resumed(tmp_path / "run", with_loss)
    facts = RunFacts.read(tmp_path / "run")
    loss_ax, speed_ax = figure.Figure().subplots(2, 1)
    draw_loss(loss_ax, facts)
    draw_throughput(speed_ax, facts)
    for ax in (loss_ax, speed_ax):
        assert sum("stopped" in t for t in texts(ax)) == 1 and sum("resumed" in t for t in texts(ax)) == 1
    assert any("no loss curve" in t for t in texts(loss_ax)) != with_loss
    assert speed_ax.get_ylabel() == "steps/s" and speed_ax.lines  # step rates from the records' times
    summary = summarize(facts)
    assert (summary["stops"], summary["resumes"], summary["step"]) == (1, 1, 10)
    assert (summary["final_loss"] is None) != with_loss


def test_report_of_a_plain_script_run_exits_0(tmp_path: Path) -> None:
    stopped_and_resumed(tmp_path / "run", with_loss=False)
    result = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "report", str(tmp_path / "run"), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert Path(json.loads(result.stdout)["png"]).stat().st_size > 0
