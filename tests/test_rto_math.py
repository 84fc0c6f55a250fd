"""The recovery arithmetic with fixed inputs: worked Daly/Young/goodput values, durations, budgets, history tables."""

from __future__ import annotations

import pytest

from ckptrun.cli.durations import DurationError, format_duration, parse_duration
from ckptrun.cli.recovery_budget import rto_history as hist
from ckptrun.cli.recovery_budget.rto_model import (
    Component,
    budget_verdict,
    cost_per_failure,
    daly,
    goodput,
    lost_work,
    total,
    young,
)

# --- the worked values of issue 5 --------------------------------------------------------


@pytest.mark.parametrize(
    "tau, delta, w, rto, mtbf, expected",
    [(600, 6, 60, 120, 10800, 0.94582), (60, 0.5, 2, 10, 3600, 0.98010)],
)
def test_goodput_worked_values(tau, delta, w, rto, mtbf, expected):
    assert goodput(tau, delta, w, rto, mtbf) == pytest.approx(expected, abs=5e-6)


@pytest.mark.parametrize("delta, mtbf, expected", [(6.3, 11160, 370.8), (0.5, 3600, 59.667)])
def test_daly_worked_values(delta, mtbf, expected):
    assert daly(delta, mtbf) == pytest.approx(expected, abs=0.05 if expected > 100 else 5e-4)


@pytest.mark.parametrize("delta, mtbf, expected", [(6.3, 11160, 374.99), (0.5, 3600, 60.0)])
def test_young_worked_values(delta, mtbf, expected):
    assert young(delta, mtbf) == pytest.approx(expected, abs=5e-3)


def test_daly_is_the_mtbf_once_a_save_costs_twice_the_mtbf():
    assert daly(200, 100) == 100
    assert 0 < daly(150, 100) < 100  # below the edge, the formula


def test_daly_interval_maximises_goodput_nearby():
    delta, mtbf = 6.3, 11160
    best = daly(delta, mtbf)
    at_best = goodput(best, delta, 0, 60, mtbf)
    assert all(goodput(best * f, delta, 0, 60, mtbf) <= at_best + 1e-6 for f in (0.5, 0.8, 1.25, 2.0))


def test_cost_and_lost_work():
    assert cost_per_failure(120, 600, 6, 60) == pytest.approx(483)
    assert lost_work(600, 60) == (360, 660)
    assert lost_work(10) == (5, 10)


def test_goodput_floors_at_zero_when_failures_outpace_recovery():
    assert goodput(60, 1, 0, 500, 100) == 0.0
    assert goodput(0, 0, 0, 1, 100) == 0.0


# --- durations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [("90s", 90), ("5m", 300), ("3h", 10800), ("1ms", 0.001), ("90", 90), ("0.5", 0.5), ("2d", 172800),
     ("1h30m", 5400), ("1.5h", 5400), (" 5m ", 300), ("250ms", 0.25), ("1m30s", 90), ("3H", 10800), (".5s", 0.5)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "-5", "m", "1h1h", "1e3", "5 m s", "1,5h", "inf"])
def test_parse_duration_refuses_with_one_line_naming_value_and_forms(text):
    with pytest.raises(DurationError) as caught:
        parse_duration(text)
    message = str(caught.value)
    assert repr(text) in message and "90s" in message and "3h" in message and "1ms" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "seconds, text",
    [(None, "-"), (0.25, "250 ms"), (5.44, "5.4 s"), (750, "12.5 min"), (3 * 3600, "3.0 h"), (3 * 86400, "3.0 d")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# --- budget -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parts, limit, ok, largest",
    [
        ({"detect": 0.2, "teardown": 0.5, "verify": 0.1, "backoff": 1.0, "restart": 4.0}, 10, True, "restart"),
        ({"detect": 0.2, "teardown": 0.5, "verify": 0.1, "backoff": 1.0, "restart": 4.0}, 5, False, "restart"),
        ({"detect": 0.2, "teardown": 0.5, "verify": 30, "backoff": 1.0, "restart": 4.0}, 30, False, "verify"),
        ({"detect": 1, "restart": 2, "lost_work": 300}, 120, False, "lost_work"),
        ({"detect": 1, "restart": 2}, 3, True, "restart"),  # equal to the budget fits
    ],
)
def test_budget_verdict(parts, limit, ok, largest):
    verdict = budget_verdict(parts, limit)
    assert (verdict.ok, verdict.largest) == (ok, largest)
    assert verdict.figure_s == pytest.approx(sum(parts.values()))


def test_total_is_unknown_when_a_part_is():
    parts = {name: Component(name, 1.0, "measured", "") for name in ("detect", "teardown", "verify", "backoff", "restart")}
    assert total(parts) == 5.0
    parts["verify"] = Component("verify", None, "unknown", "")
    assert total(parts) is None


# --- history tables -------------------------------------------------------------------------


def saved(time, step, total_s=0.5, **extra):
    return {"event": "snapshot_saved", "time": time, "step": step, "stall_s": 0.1, "write_s": total_s - 0.1,
            "total_s": total_s, **extra}


def test_sync_saves_interval_excludes_save_cost_and_the_final_save():
    events = [{"event": "attempt_start", "time": 0, "attempt": 1},
              saved(10.5, 10), saved(21.0, 20), saved(31.5, 30), saved(33.5, 34), {"event": "completed", "time": 34, "step": 34}]
    facts = hist.save_facts(events)
    assert facts.interval_s == pytest.approx(10.0)  # 10.5 s between saves minus the 0.5 s save
    assert facts.interval_steps == 10 and facts.intervals == 2
    assert facts.stall_s == pytest.approx(0.5) and facts.persist_s == 0.0 and facts.mode == "sync"


def test_async_saves_stall_only_for_staging_and_persist_in_the_background():
    events = [saved(10.1, 10, asynchronous=True), saved(20.2, 20, asynchronous=True), saved(30.3, 30, asynchronous=True)]
    facts = hist.save_facts(events)
    assert facts.mode == "async"
    assert facts.stall_s == pytest.approx(0.1) and facts.persist_s == pytest.approx(0.4)
    assert facts.interval_s == pytest.approx(10.0)


def test_intervals_never_span_a_failure():
    events = [saved(10.5, 10), saved(21.0, 20), {"event": "failure", "time": 25}, {"event": "attempt_start", "time": 26},
              {"event": "restored", "time": 30, "attempt": 2}, saved(100.5, 30), saved(111.0, 40)]
    facts = hist.save_facts(events)
    assert facts.intervals == 2 and facts.interval_s == pytest.approx(10.0)


def test_no_saves_means_unknown():
    facts = hist.save_facts([{"event": "launch", "time": 0}])
    assert (facts.interval_s, facts.stall_s, facts.saves) == (None, None, 0)


def test_step_time_leaves_out_each_attempts_first_step():
    metrics = [{"attempt": 1, "step": 1, "time": 5.0, "step_time_s": 4.0}, {"attempt": 1, "step": 2, "time": 5.2, "step_time_s": 0.2},
               {"attempt": 1, "step": 3, "time": 5.4, "step_time_s": 0.2}, {"attempt": 2, "step": 3, "time": 20.0, "step_time_s": 9.0},
               {"attempt": 2, "step": 4, "time": 20.3}]
    assert hist.step_time(metrics) == pytest.approx(0.2)


def test_first_step_after_restore_and_setup():
    events = [{"event": "restored", "time": 19.5, "attempt": 2}, {"event": "probe_restored", "time": 50.0, "attempt": 3}]
    metrics = [{"attempt": 1, "step": 1, "time": 5.0, "step_time_s": 4.0}, {"attempt": 2, "step": 3, "time": 20.0}]
    assert hist.first_step_after_restore(events, metrics) == (pytest.approx(0.5), 1)
    assert hist.setup_and_first_step(events, metrics) == (4.0, 1)


def test_restart_figure_is_a_median_over_restarts_that_have_it():
    restarts = [{"teardown_s": 0.4}, {"teardown_s": 0.6}, {"teardown_s": None}, {}]
    assert hist.restart_figure(restarts, "teardown_s") == (pytest.approx(0.5), 2)
    assert hist.restart_figure([], "teardown_s") == (None, 0)


def test_manifest_cadence():
    assert hist.manifest_cadence([(20, 130.0), (10, 100.0), (30, 160.0)]) == (30.0, 10)
    assert hist.manifest_cadence([(10, 100.0)]) == (None, None)
