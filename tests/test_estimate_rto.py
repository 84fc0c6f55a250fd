"""`ckptrun estimate-rto` on real run directories and real snapshots, through the real command line.

One single-process run of the default template gives snapshots, events and
metrics. Past restarts are emulated by appending `restart` events with the
fields the supervisor records (through runtime.records, the log's owner).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptrun.cli.recovery_budget.rto_model import cost_per_failure, daly, goodput, young
from ckptrun.cli.supervision.spec import LaunchSpec, RunRecord, write_run_record
from ckptrun.runtime.records import log_event
from snapshot_factory import flip_byte
from workers import run_job

FAST = ("--steps", "12", "--num-workers", "0", "--hidden", "64")
PARTS = ("detect", "teardown", "verify", "backoff", "restart")
NUMBER = (int, float)
SCHEMA = {
    "path": str, "kind": str, "run_id": (str, type(None)),
    "snapshot": {"path": str, "step": int, "bytes": int, "files": int, "world_size": int},
    "components": {name: {"value_s": NUMBER, "source": str, "detail": str} for name in (*PARTS, "lost_work")},
    "totals": {"rto_s": NUMBER, "rto_hang_s": NUMBER, "cost_per_failure_s": NUMBER},
    "mtbf_s": (float, type(None)), "goodput": (float, type(None)),
    "recommendation": (dict, type(None)), "budget": (dict, type(None)),
}
SOURCES = {"measured", "history", "estimated", "configured", "assumed", "unknown"}


def conforms(document: object, schema: object, where: str = "$") -> None:
    if isinstance(schema, dict):
        assert isinstance(document, dict), f"{where} is not an object"
        for key, sub in schema.items():
            assert key in document, f"{where}.{key} is missing"
            conforms(document[key], sub, f"{where}.{key}")
    else:
        assert isinstance(document, schema), f"{where} = {document!r} is not {schema}"  # type: ignore[arg-type]


def ckptrun(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptrun.cli.main", *map(str, args)],
                          capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"}, timeout=120)


def estimate(*args: str | Path) -> tuple[int, dict, str]:
    result = ckptrun("estimate-rto", *args, "--json")
    document = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.returncode, document, result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished single-process run: snapshots at steps 5, 10 and 12, its events and metrics."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run_job(run_dir, args=FAST, save_every_steps=5)
    assert result.returncode == 0, result.stderr
    return run_dir


RESTARTS = [
    {"cause": "crash", "detect_s": 0.1, "teardown_s": 0.4, "verify_s": 0.02, "backoff_s": 1.0,
     "relaunch_to_first_step_s": 3.0, "startup_s": 2.8, "restore_s": 0.1, "first_step_s": 0.1, "lost_steps": 2},
    {"cause": "crash", "detect_s": 0.3, "teardown_s": 0.6, "verify_s": 0.02, "backoff_s": 1.0,
     "relaunch_to_first_step_s": 5.0, "startup_s": 4.8, "restore_s": 0.1, "first_step_s": 0.1, "lost_steps": 4},
]


@pytest.fixture
def with_history(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run with two past restarts in its event log."""
    run_dir = shutil.copytree(trained, tmp_path / "run", symlinks=True)
    for fields in RESTARTS:
        log_event(run_dir, "restart", **fields)
    return run_dir


def test_run_with_history_takes_each_part_from_its_best_source(with_history: Path) -> None:
    code, doc, err = estimate(with_history, "--mtbf", "3h")
    assert code == 0, err
    conforms(doc, SCHEMA)
    parts = doc["components"]
    assert all(part["source"] in SOURCES and part["detail"] for part in parts.values())
    assert (parts["detect"]["source"], parts["detect"]["value_s"]) == ("history", pytest.approx(0.2))
    assert (parts["teardown"]["source"], parts["teardown"]["value_s"]) == ("history", pytest.approx(0.5))
    assert (parts["restart"]["source"], parts["restart"]["value_s"]) == ("history", pytest.approx(4.0))
    assert parts["verify"]["source"] == "measured" and parts["verify"]["value_s"] > 0
    assert "resident" in parts["verify"]["detail"] or "page-cache" in parts["verify"]["detail"]
    assert parts["backoff"]["source"] == "assumed" and "no run.json" in parts["backoff"]["detail"]
    lost = parts["lost_work"]
    assert lost["source"] == "history" and lost["save_mode"] in ("sync", "async")
    assert (lost["persist_s"] == 0) is (lost["save_mode"] == "sync"), "w is the background write, 0 for sync saves"
    assert doc["snapshot"]["step"] == 12 and doc["kind"] == "run"
    assert "timing a no-op" not in err, "history made the no-op launch unnecessary"


def test_totals_goodput_and_recommendation_follow_the_formulas(with_history: Path) -> None:
    code, doc, err = estimate(with_history, "--mtbf", "3h")
    assert code == 0, err
    parts, totals = doc["components"], doc["totals"]
    assert totals["rto_s"] == pytest.approx(sum(parts[name]["value_s"] for name in PARTS))
    lost = parts["lost_work"]
    tau, delta, w = lost["interval_s"], lost["stall_s"], lost["persist_s"]
    assert lost["value_s"] == pytest.approx(tau / 2 + w) and lost["worst_s"] == pytest.approx(tau + w)
    assert totals["cost_per_failure_s"] == pytest.approx(cost_per_failure(totals["rto_s"], tau, delta, w))
    assert doc["mtbf_s"] == 10800 and doc["goodput"] == pytest.approx(goodput(tau, delta, w, totals["rto_s"], 10800))
    advice = doc["recommendation"]
    assert advice["interval_s"] == pytest.approx(daly(delta, 10800)) and advice["young_s"] == pytest.approx(young(delta, 10800))
    assert totals["rto_hang_s"] > 300, "a hang waits for the heartbeat timeout (launch default 300 s)"


def test_text_report_names_every_part_and_the_totals(with_history: Path) -> None:
    result = ckptrun("estimate-rto", with_history, "--mtbf", "90m")
    assert result.returncode == 0, result.stderr
    for word in (*PARTS, "lost_work", "RTO", "cost per failure", "goodput", "Daly", "Young"):
        assert word in result.stdout, word


@pytest.mark.parametrize("flags, code, figure", [
    (("--budget", "1h"), 0, "rto"),
    (("--budget", "1h", "--budget-includes-lost-work"), 0, "cost"),
    (("--budget", "2s"), 1, "rto"),
    (("--budget", "2s", "--budget-includes-lost-work"), 1, "cost"),
])
def test_budget_exit_codes(with_history: Path, flags: tuple[str, ...], code: int, figure: str) -> None:
    got, doc, err = estimate(with_history, *flags)
    assert got == code, err
    budget = doc["budget"]
    expected = doc["totals"]["rto_s"] if figure == "rto" else doc["totals"]["cost_per_failure_s"]
    assert budget["ok"] is (code == 0) and budget["figure_s"] == pytest.approx(expected)
    assert budget["largest"] == "restart"
    if code == 1:
        assert err.startswith("error: ") and "exceeds the budget 2.0 s" in err and "largest part is restart" in err
        assert "hint: " in err and "Traceback" not in err


@pytest.mark.parametrize("args, words", [
    (("--budget", "5x"), "'5x' is not a duration"),
    (("--mtbf", "0"), "must be longer than zero"),
    (("--budget-includes-lost-work",), "needs --budget"),
])
def test_bad_flags_are_refused_with_one_line(with_history: Path, args: tuple[str, ...], words: str) -> None:
    result = ckptrun("estimate-rto", with_history, *args)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr


def test_paths_without_snapshots_are_refused(tmp_path: Path) -> None:
    assert "no such directory" in ckptrun("estimate-rto", tmp_path / "nope").stderr
    empty = ckptrun("estimate-rto", tmp_path)
    assert empty.returncode == 2 and "neither a run directory nor a checkpoint directory" in empty.stderr
    (tmp_path / "events.jsonl").write_text("")
    fresh = ckptrun("estimate-rto", tmp_path)
    assert fresh.returncode == 2 and "no published snapshot" in fresh.stderr


def test_estimate_from_history_does_not_import_torch(with_history: Path) -> None:
    code = ("import sys\nfrom ckptrun.cli.main import main\n"
            f"sys.argv = ['ckptrun', 'estimate-rto', {str(with_history)!r}, '--json']\n"
            "try:\n    main()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines()[-1] == "TORCH False", result.stderr


# --- probes: real processes restoring real snapshots --------------------------------------


@pytest.mark.timeout(180)
def test_bare_checkpoint_dir_probe_loads_the_snapshot_without_user_code(trained: Path) -> None:
    code, doc, err = estimate(trained / "checkpoints", "--probe")
    assert code == 0, err
    conforms(doc, {**SCHEMA, "components": {**SCHEMA["components"], "lost_work": dict}})
    parts = doc["components"]
    assert doc["kind"] == "checkpoint" and doc["snapshot"]["step"] == 12
    assert parts["restart"]["source"] == "measured" and parts["restart"]["world_size"] == 1
    assert 0 < parts["restart"]["restore_s"] <= parts["restart"]["probe_s"] <= parts["restart"]["value_s"]
    assert "no user code" in parts["restart"]["detail"]
    assert parts["teardown"]["source"] == "measured" and "no-op 1-rank torchrun" in parts["teardown"]["detail"]
    assert parts["lost_work"]["source"] == "history" and "creation times" in parts["lost_work"]["detail"]


@pytest.mark.timeout(180)
def test_run_dir_probe_reruns_the_script_and_leaves_the_run_untouched(with_history: Path) -> None:
    spec = LaunchSpec(script_args=list(FAST), nproc_per_node="1", threads=1, save_every_steps=5)
    write_run_record(with_history, RunRecord(run_id="probe-test", spec=spec))
    before = {p: p.read_bytes() for p in (with_history / "events.jsonl", with_history / "metrics.jsonl")}
    snapshots = sorted(p.name for p in (with_history / "checkpoints").iterdir())
    code, doc, err = estimate(with_history, "--probe")
    assert code == 0, err
    restart = doc["components"]["restart"]
    assert restart["source"] == "measured" and "the run's script on 1 rank" in restart["detail"]
    assert "past restarts: median 4.0 s" in restart["detail"]
    assert doc["components"]["backoff"]["source"] == "configured"
    assert {p: p.read_bytes() for p in before} == before, "the probe wrote into the real run's records"
    assert sorted(p.name for p in (with_history / "checkpoints").iterdir()) == snapshots


@pytest.mark.timeout(180)
def test_run_dir_probe_at_another_world_size_reshards(with_history: Path) -> None:
    spec = LaunchSpec(script_args=list(FAST), threads=1, save_every_steps=5)
    write_run_record(with_history, RunRecord(run_id="probe-test", spec=spec))
    code, doc, err = estimate(with_history, "--probe", "--nproc-per-node", "2")
    assert code == 0, err
    restart = doc["components"]["restart"]
    assert restart["source"] == "measured" and restart["world_size"] == 2, restart


# --- measurements on the snapshot's own files --------------------------------------------


def test_verify_timing_whole_and_sampled(trained: Path) -> None:
    from ckptrun.cli.recovery_budget.rto_measure import read_bandwidth, resident_fraction, time_verify
    from ckptrun.runtime.manifest import read_manifest

    snapshot = trained / "checkpoints" / "step-000000012"
    manifest = read_manifest(snapshot)
    whole = time_verify(snapshot, manifest)
    assert whole.status == "ok" and whole.sampled_bytes == whole.bytes == manifest.total_bytes and whole.seconds > 0
    sampled = time_verify(snapshot, manifest, sample_bytes=1)  # one chunk of each of the largest files
    assert sampled.status is None and 0 < sampled.sampled_bytes <= manifest.total_bytes and sampled.seconds > 0
    resident = resident_fraction([(snapshot / e.path, e.size) for e in manifest.files])
    assert resident is None or resident > 0.5, "just hashed, so it sits in the page cache"
    bandwidth, read, _ = read_bandwidth(snapshot, manifest)
    assert bandwidth > 0 and read == manifest.total_bytes


def test_a_corrupt_newest_snapshot_is_timed_and_skipped_as_the_supervisor_would(with_history: Path) -> None:
    flip_byte(with_history / "checkpoints" / "step-000000012" / "state.json")
    code, doc, err = estimate(with_history)
    assert code == 0, err
    assert doc["snapshot"]["step"] == 10, "a restart falls back to the newest snapshot that verifies"
    verify = doc["components"]["verify"]
    assert verify["skipped"] == ["step-000000012 is corrupt"] and verify["detail"].startswith("WARNING:")


def test_no_snapshot_that_verifies_is_a_no(with_history: Path) -> None:
    for snapshot in (with_history / "checkpoints").glob("step-*"):
        flip_byte(snapshot / "state.json")
    result = ckptrun("estimate-rto", with_history)
    assert result.returncode == 1 and "no snapshot of the current lineage" in result.stderr
