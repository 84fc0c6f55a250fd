"""Snapshots the supervisor must not relaunch from: one that verifies but does not load, and those of a diverged resume.

An e2e run plants a pickle (digests updated, so it verifies) in the newest snapshot of a running 2-rank job and
kills a rank: the next attempt refuses to load it, the supervisor quarantines it and relaunches from the previous
one. The store and supervisor parts are checked without processes.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from launch_helpers import Cleanup, assert_no_processes, ckptrun, events, start, tail, wait_for
from snapshot_factory import make_snapshot, plant_pickle
from supervisor_helpers import T0, ScriptedWorld, supervisor, training

from ckptrun.cli.supervision.observation import Observation, RankView, Snapshot
from ckptrun.cli.supervision.recovery import RecoveryOptions
from ckptrun.runtime.storage import store
from ckptrun.runtime.records import read_heartbeats
from ckptrun.runtime.checkpoint.verify import newest_verified


def published(ckpt: Path) -> bool:
    return (ckpt / "step-000000010" / "manifest.json").exists()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_snapshot_that_verifies_but_does_not_load_is_quarantined_and_the_run_completes(tmp_path: Path, cleanup: Cleanup) -> None:
    """Rank 1 hangs after step 10's save (a long heartbeat timeout keeps the supervisor waiting) while the test
    plants the pickle, then the test SIGKILLs it: attempt 2 refuses step 10, attempt 3 resumes from step 5."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "planted")
    ckpt, marker = run_dir / "checkpoints", tmp_path / "marker"
    flags = ["--nproc-per-node", "2", "--save-every-steps", "5", "--heartbeat-timeout", "120", "--startup-timeout", "60",
             "--restart-backoff", "0.1", "--name", "planted", "--inject-fault", "hang:rank=1:step=10"]
    launcher = cleanup.track(start("launch", *flags, "--", "--num-workers", "0", "--steps", "12",
                                   cwd=tmp_path, log=tmp_path / "launch.log"))
    wait_for(lambda: published(ckpt) and 10 in [e.get("step") for e in events(run_dir, "snapshot_saved")],
             timeout=120, what="the snapshot of step 10")
    plant_pickle(ckpt / "step-000000010", "rank-00000.safetensors", marker)
    os.kill(read_heartbeats(run_dir)[1].pid, signal.SIGKILL)
    assert launcher.wait(timeout=240) == 0, tail(tmp_path / "launch.log")
    assert not marker.exists(), "the planted pickle ran"
    assert [e["snapshot_step"] for e in events(run_dir, "restart")] == [10, 5]
    quarantined = events(run_dir, "snapshot_quarantined")
    assert [(Path(e["snapshot"]).name, e["status"]) for e in quarantined] == [("step-000000010", "unloadable")]
    assert Path(quarantined[0]["moved_to"]).is_dir(), "kept, not deleted"
    assert quarantined[0]["cause"] == "load" and "snapshot step 10 passed its checks but does not load" in (
        tmp_path / "launch.log").read_text(errors="replace"), "bytes that match: not worded as a digest failure"
    report = json.loads(ckptrun("verify", str(ckpt), "--json", cwd=tmp_path).stdout)
    statuses = {(Path(s["path"]).name, s["status"]) for s in report["snapshots"]}
    assert ("step-000000010", "unloadable") in statuses, statuses
    assert_no_processes(run_dir)


def test_quarantine_keeps_the_snapshot_with_its_reason_and_hides_it_from_restore(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    make_snapshot(ckpt, 5)
    bad = make_snapshot(ckpt, 10)
    moved = store.quarantine(bad, "unloadable", "rank-00000.safetensors holds a pickle that is not tensors")
    assert newest_verified(ckpt).step == 5
    kept = {e.step: e for e in store.list_entries(ckpt)}
    assert kept[10].kind == "quarantined" and kept[10].path == moved
    assert store.quarantine_reason(moved) == {"status": "unloadable", "reason": "rank-00000.safetensors holds a pickle that is not tensors",
                                             "time": pytest.approx(store.quarantine_reason(moved)["time"])}


def _crash(time: float, step: int) -> Observation:
    return Observation(time=time, ranks={0: RankView(False), 1: RankView(False)}, agent_exit=1, last_step=step)


def test_supervisor_quarantines_the_snapshot_an_attempt_could_not_load_and_relaunches_from_the_next() -> None:
    step10, step5 = Snapshot(Path("/c/step-000000010"), 10), Snapshot(Path("/c/step-000000005"), 5)
    world = ScriptedWorld(
        script={1: [training(T0 + 5, 12), _crash(T0 + 6, 12)],
                2: [Observation(time=T0 + 20, ranks={0: RankView(False)}, agent_exit=1)],
                3: [training(T0 + 40, 12, agent_exit=0)]},
        events_by_attempt={2: {"restore_failed": [{"snapshot": str(step10.path), "reason": "not tensors"}]}},
        snapshots=[step10, step5])
    outcome = supervisor(world).supervise()
    assert outcome.code == 0
    assert world.launches == [(1, None), (2, step10.path), (3, step5.path)]
    assert world.quarantined == [(step10.path, "unloadable", "not tensors")]


def test_a_resume_whose_snapshot_does_not_load_falls_back_instead_of_giving_up() -> None:
    """`ckptrun resume`: its first attempt fails before a step because the snapshot does not load; that is not
    "a restart would fail the same way": the snapshot is quarantined and the next attempt starts from step 5."""
    step10, step5 = Snapshot(Path("/c/step-000000010"), 10), Snapshot(Path("/c/step-000000005"), 5)
    world = ScriptedWorld(
        script={4: [Observation(time=T0 + 20, ranks={0: RankView(False)}, agent_exit=1)],
                5: [training(T0 + 40, 12, agent_exit=0)]},
        events_by_attempt={4: {"restore_failed": [{"snapshot": str(step10.path), "reason": "not tensors"}]}},
        snapshots=[step5])
    outcome = supervisor(world, first_attempt=4, resume=step10).supervise()
    assert outcome.code == 0
    assert world.launches == [(4, step10.path), (5, step5.path)]
    assert world.quarantined == [(step10.path, "unloadable", "not tensors")]


def test_a_diverged_resume_abandons_what_its_attempt_saved() -> None:
    """--require-exact-resume: the replayed step 11 differs; whatever attempt 2 published after step 10 is moved
    out of the lineage, and the message says so."""
    step10 = Snapshot(Path("/c/step-000000010"), 10)
    original = [{"step": s, "attempt": 1, "loss": 1.0 / s, "time": T0 + s} for s in (11, 12)]
    replay = [{"step": 11, "attempt": 2, "loss": 0.5, "time": T0 + 31}]
    world = ScriptedWorld(
        script={1: [training(T0 + 5, 12, steps=original), _crash(T0 + 13, 12)],
                2: [training(T0 + 31, 11, first_step=T0 + 31, steps=replay, snapshot_step=15)]},
        snapshots=[step10])
    world.abandoned_paths = [Path("/c/step-000000015")]
    outcome = supervisor(world, recovery=RecoveryOptions(require_exact_resume=True)).supervise()
    assert outcome.code == 4
    assert world.abandoned == [step10.path]
    assert "step-000000015" in (outcome.hint or "") and "nothing after the divergence was saved" not in (outcome.hint or "")


def test_abandon_after_moves_what_followed_the_fork_point_out_of_the_lineage(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    make_snapshot(ckpt, 5)
    exact = make_snapshot(ckpt, 10)
    assert store.abandon_after(ckpt, exact) == []  # nothing later: the lineage stays as it is
    make_snapshot(ckpt, 15)
    moved = store.abandon_after(ckpt, exact)
    assert [p.name for p in moved] == ["step-000000015"] and all(p.parent.parent.name == "abandoned" for p in moved)
    assert [m.step for _, m in store.current_lineage(ckpt)] == [5, 10] and newest_verified(ckpt).step == 10
    make_snapshot(ckpt, 20)
    assert [p.name for p in store.abandon_after(ckpt, None)] == ["step-000000005", "step-000000010", "step-000000020"]
    assert store.current_lineage(ckpt) == [] and newest_verified(ckpt) is None


def test_every_policy_field_of_the_spec_reaches_the_worker_env(tmp_path: Path) -> None:
    """C1 is derived from the spec: a non-default value of each field both models declare arrives unchanged."""
    from ckptrun.cli.supervision.spec import LaunchSpec
    from ckptrun.runtime.env import RunEnv

    changed = dict(precision="bf16", save_every_steps=7, save_every_seconds=30.0, keep_last=5, keep_every=100, paranoid_retention=True,
                   async_save=False, save_overlap="skip", max_failed_saves=9, seed=11, deterministic=False, threads=2,
                   hash_algorithm="blake3", allow_changes=["lr"], on_anomaly="rollback", anomaly_sigma=3.0,
                   anomaly_window=9, max_rollbacks=1, rollback_lr_factor=0.25, inject_fault="kill:rank=0:step=3",
                   mtbf=60.0, heartbeat_timeout=2.0, allow_reshard=True, memory_every_steps=4, memory_keep=3, memory_replicas=2, node_group="rack-2",
                   decision_every_steps=5,
                   on_replica_divergence="stop", replica_check_every_steps=7,
                   init_weights=Path("/weights/hf"), init_weights_sha256="cd" * 32)
    spec = LaunchSpec(**changed)
    env = RunEnv.from_env(RunEnv(**spec.worker_policy()).to_env())
    shared = [n for n in RunEnv.model_fields if n in LaunchSpec.model_fields and n not in ("run_dir", "ckpt_dir")]
    assert set(shared) <= set(changed), f"give these a non-default value here: {set(shared) - set(changed)}"
    assert all(getattr(env, n) == (tuple(v) if isinstance(v, list) else v) for n, v in changed.items() if n in shared)
    assert (env.fault, env.mtbf_seconds, env.heartbeat_interval) == ("kill:rank=0:step=3", 60.0, 0.4)
