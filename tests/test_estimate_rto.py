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

import psutil
import pytest
from launch_helpers import alive, wait_for

from ckptrun.cli.recovery_budget import rto_components as components
from ckptrun.cli.recovery_budget import rto_launch
from ckptrun.cli.recovery_budget import rto_measure as measure
from ckptrun.cli.recovery_budget import rto_relaunch as relaunch
from ckptrun.cli.recovery_budget.estimate import find_target
from ckptrun.cli.recovery_budget.rto_model import cost_per_failure, daly, goodput, young
from ckptrun.cli.supervision.spec import LaunchSpec, RunRecord, write_run_record
from ckptrun.runtime.hashing import hash_file
from ckptrun.runtime.records import log_event
from ckptrun.runtime.checkpoint.verified_read import HASH_THREADS
from snapshot_factory import flip_byte, manifest_dict, write_manifest_dict
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
    assert parts["verify"]["rule"] == "manifest-and-sizes", "chunk digests: the supervisor checks manifest and sizes"
    assert "manifest and sizes" in parts["verify"]["detail"]
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
    assert "warm standby agent, forked (warm) ranks" in restart["detail"], "relaunched as the run's restart would be"
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
    [skipped] = verify["skipped"]
    assert skipped.startswith("step-000000012 is corrupt") and verify["detail"].startswith("WARNING:")
    assert "pass the pre-relaunch check" in skipped and "quarantines" in skipped, "the load finds it, not the check"


def test_no_snapshot_that_verifies_is_a_no(with_history: Path) -> None:
    for snapshot in (with_history / "checkpoints").glob("step-*"):
        flip_byte(snapshot / "state.json")
    result = ckptrun("estimate-rto", with_history)
    assert result.returncode == 1 and "no snapshot of the current lineage" in result.stderr


# --- the verified-as-read restore (chunk digests, schema 3) against a schema-2 snapshot ---------------


def as_schema_2(snapshot: Path) -> None:
    """The manifest as written before chunk digests: whole-file digests, no chunks (so hashed before a load)."""
    document = manifest_dict(snapshot)
    document["schema_version"] = 2
    for entry in document["files"]:
        if entry.pop("chunks", None) is not None:
            entry["digest"] = hash_file(snapshot / entry["path"], entry["algorithm"])[1]
    write_manifest_dict(snapshot, document)


@pytest.fixture
def schemas(trained: Path, tmp_path: Path) -> dict[int, components.Target]:
    """The run's checkpoint directory as written (schema 3) and rewritten as schema 2, as estimate-rto finds them."""
    targets = {}
    for schema in (3, 2):
        ckpt = shutil.copytree(trained / "checkpoints", tmp_path / f"schema-{schema}", symlinks=True)
        for snapshot in ckpt.glob("step-*") if schema == 2 else []:
            as_schema_2(snapshot)
        targets[schema] = find_target(ckpt)
    assert targets[3].manifest.verified_as_loaded and not targets[2].manifest.verified_as_loaded
    return targets


def test_verify_is_the_supervisors_check_manifest_and_sizes_for_schema_3_whole_digests_for_schema_2(schemas) -> None:
    new, old = components.verify(schemas[3]), components.verify(schemas[2])
    assert new.facts.keys() == old.facts.keys() and new.source == old.source == "measured"
    assert (new.facts["rule"], old.facts["rule"]) == ("manifest-and-sizes", "whole-file-digests")
    assert "schema 3, chunk digests: manifest and sizes" in new.detail and "counted in restart" in new.detail
    assert new.facts["throughput_bytes_per_s"] is None, "no byte is hashed by the check it times"
    assert "schema 2, whole-file digests" in old.detail and old.facts["throughput_bytes_per_s"] > 0
    assert schemas[3].snapshot.name == schemas[2].snapshot.name == "step-000000012"


def test_the_timed_schema_3_check_reads_no_data_byte_but_sees_sizes(schemas) -> None:
    target = schemas[3]
    data = next(entry for entry in target.manifest.files if entry.chunks)
    flip_byte(target.snapshot / data.path)
    timing = measure.time_load_check(target.snapshot, target.manifest)
    assert timing.deferred and timing.status == "ok" and timing.sampled_bytes == 0, "a flipped byte is the load's to find"
    assert measure.scan_digests(target.snapshot, target.manifest) == "corrupt", "found by the untimed scan instead"
    (target.snapshot / data.path).write_bytes(b"short")
    assert measure.time_load_check(target.snapshot, target.manifest).status == "corrupt"


@pytest.mark.parametrize("world", [1, 2])
def test_restore_is_the_slower_of_read_and_hash_for_schema_3_and_the_read_for_schema_2(schemas, world: int) -> None:
    # the model's arithmetic, not a speed: the estimate is the larger of its two measured parts
    modelled, words, facts = components.restore_estimate(schemas[3], world)
    assert facts["restore_rule"] == "slower-of-read-and-hash"
    assert modelled == facts["restore_s"] == max(facts["read_s"], facts["hash_s"]) > 0
    assert facts["hash_threads_per_rank"] == pytest.approx(min(os.cpu_count() or 1, world * HASH_THREADS) / world)
    assert facts["hash_bytes_per_s_per_thread"] > 0 and facts["read_bytes_per_s"] > 0
    assert "the slower" in words and "hashing as read" in words and f"{world} rank(s)" in words
    modelled, words, facts = components.restore_estimate(schemas[2], world)
    assert facts["restore_rule"] == "read" and modelled == facts["restore_s"] > 0 and "hash_s" not in facts
    assert "schema 2: hashed whole before the relaunch" in words


def test_the_in_launch_estimate_uses_the_same_restore_rule(trained: Path) -> None:
    restart = rto_launch.restart(find_target(trained))
    assert restart.source == "estimated" and "hashing as read" in restart.detail, restart.detail


# --- the relaunch a restart runs: warm (standby agent, forked ranks) or cold ---------------


@pytest.mark.parametrize("options, standby, path", [
    ({}, True, "warm"),
    ({"warm_workers": False}, True, "cold"),
    ({"standby": False, "warm_workers": False}, False, "cold"),
    ({"nproc_per_node": "gpu"}, True, "cold"),  # the supervisor forks only for a numeric --nproc-per-node
])
def test_the_modelled_relaunch_follows_the_supervisors_rule(options: dict, standby: bool, path: str) -> None:
    found = relaunch.relaunch_path(LaunchSpec(**options))
    assert (found.standby, found.name) == (standby, path)
    assert relaunch.relaunch_path(None).name == "warm", "no run.json: the launch defaults, warm workers on"


@pytest.mark.parametrize("options, path, words", [
    (None, "warm", "forked (warm) ranks"),
    ({"warm_workers": True}, "warm", "forked (warm) ranks"),
    ({"warm_workers": False}, "cold", "spawned (cold) ranks"),
])
def test_the_restart_names_the_path_it_models_with_and_without_history(with_history: Path, options, path, words) -> None:
    if options is not None:
        write_run_record(with_history, RunRecord(run_id="path-test", spec=LaunchSpec(**options)))
    target = find_target(with_history)
    past = components.restart(target, False, 1, None)
    assert past.source == "history" and past.value_s == pytest.approx(4.0), "past restarts are measured: they win"
    assert past.facts["relaunch_path"] == path and words in past.detail
    assert ("run.json" if options else "launch default") in past.detail
    target.events = [e for e in target.events if e.get("event") != "restart"]  # no history: the model
    modelled = components.restart(target, False, 1, None)
    assert modelled.source == "estimated" and modelled.facts["relaunch_path"] == path
    assert "modelled relaunch: warm standby agent" in modelled.detail, "standby is on by default"
    assert words in modelled.detail


@pytest.mark.timeout(180)
def test_a_warm_no_op_relaunch_goes_through_a_standby_and_forked_ranks(trained: Path) -> None:
    noop = measure.noop_attempt(1, None)  # one real standby, handed a no-op attempt whose rank is forked
    assert (noop.path.name, noop.path.standby, noop.world) == ("warm", True, 1)
    assert noop.launch_s > 0 and noop.teardown_s >= 0
    target = find_target(trained)
    restart = components.restart(target, False, 1, noop)
    assert restart.facts["launch_s"] == noop.launch_s and "no-op 1-rank relaunch" in restart.detail
    assert "forked (warm) ranks" in restart.detail
    assert "forked (warm) ranks" in components.teardown(target, noop).detail


def _probe_processes(estimator: psutil.Process) -> list[psutil.Process]:
    """Processes of this estimator's relaunch (standby agent, torchrun, ranks): its descendants whose run id says
    so (never another test's estimate running alongside)."""
    found = []
    for process in estimator.children(recursive=True):
        try:
            run_id = process.environ().get("CKPTRUN_RUN_ID", "")
            if ("-rto-probe-" in run_id or run_id.startswith("rto-noop-")) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(180)
def test_a_sigkilled_estimator_leaves_no_relaunch_process(trained: Path, tmp_path: Path) -> None:
    """The estimator's relaunches are supervised by it (its pid in C1): SIGKILL it while its no-op relaunch
    (measured for a run without restart history; its ranks wait to be torn down) runs, and the agent and ranks
    exit within 20 s (issue 24; before: 3 processes left 20 s later)."""
    run_dir = shutil.copytree(trained, tmp_path / "run", symlinks=True)
    spec = LaunchSpec(script_args=list(FAST), nproc_per_node="1", threads=1, save_every_steps=5)
    write_run_record(run_dir, RunRecord(run_id="probe-orphan", spec=spec))
    log = open(tmp_path / "estimate.log", "wb")
    estimator = subprocess.Popen([sys.executable, "-m", "ckptrun.cli.main", "estimate-rto", str(run_dir), "--probe"],
                                 stdout=log, stderr=subprocess.STDOUT)
    relaunch: list[psutil.Process] = []  # taken before the kill: orphans are no one's descendants
    try:
        watched = psutil.Process(estimator.pid)
        wait_for(lambda: len(_probe_processes(watched)) >= 2 or estimator.poll() is not None, timeout=120,
                 what="the no-op relaunch's agent and rank")
        relaunch = _probe_processes(watched)
        assert estimator.poll() is None and relaunch, (tmp_path / "estimate.log").read_text()[-2000:]
        estimator.kill()
        estimator.wait()
        wait_for(lambda: not any(alive(p) for p in relaunch), timeout=20, what="the probe's processes to exit")
    finally:
        estimator.kill()
        for process in filter(alive, relaunch):
            process.kill()


def test_before_any_restart_a_crash_teardown_follows_the_device_and_the_hand_over_attempt_1s_fork(with_history: Path) -> None:
    """Issue 26: before a restart measured them, a crash's teardown on CPU ranks is modelled (they leave a broken
    gloo collective and take SIGTERM), also over a no-op relaunch's quicker idle tree; on a GPU it is the SIGKILL
    bound, or the no-op's; the standby's hand-over is its dispatch
    plus what attempt 1's forked ranks took to their process group."""
    from ckptrun.cli.recovery_budget import rto_history as hist
    from ckptrun.cli.recovery_budget import rto_launch

    target = find_target(with_history)  # its events are replaced: no restart in them
    started = {"event": "started", "attempt": 1, "startup": {"process": 100.0, "bootstrap": 100.01, "process_group": 100.25}}
    idle = measure.NoopTimes(launch_s=0.5, teardown_s=0.1, world=2, path=relaunch.RelaunchPath(standby=True, warm=True))
    for device, expected, over_noop in (("cpu", (components.CPU_CRASH_TEARDOWN_S, "estimated"), (0.4, "estimated")),
                                        ("cuda", (1.0, "configured"), (0.1, "measured"))):
        target.events = [{"event": "precision", "device": device, "time": 99.0}, started]
        teardown = components.teardown(target, None)
        assert (teardown.value_s, teardown.source) == expected and "bound: SIGKILL" in teardown.detail
        teardown = components.teardown(target, idle)  # the no-op's idle ranks: on CPU the model is the floor
        assert (teardown.value_s, teardown.source) == over_noop and "no-op 2-rank" in teardown.detail
    assert hist.forked_to_process_group(target.events) == (pytest.approx(0.25), 1)
    handover, words = rto_launch._handover(target)
    assert handover == pytest.approx(rto_launch.STANDBY_DISPATCH_S + 0.25) and "(attempt 1, 1 start(s))" in words
    target.events = [{"event": "started", "attempt": 1, "startup": {"bootstrap": 100.0, "process_group": 100.2}}]
    assert hist.forked_to_process_group(target.events) == (None, 0), "spawned ranks note no fork"
    assert rto_launch._handover(target)[0] == pytest.approx(rto_launch.STANDBY_DISPATCH_S + rto_launch.FORKED_TO_GROUP_S)
