"""The memory tier (issue #15 item 3): snapshots in /dev/shm that the supervisor owns, restored first after a crash.

Unit tests drive the restart choice over synthetic snapshots (newer and of the lineage → memory; a fork, another
run or a bad digest → disk) and the directory's life. Two end-to-end runs of the embedded default job on one
rank, against one uninterrupted reference: a kill restores from memory (lost work at most the memory cadence)
and a hang whose memory copy the test removes before the restart restores from disk; both end bitwise equal to
the reference, and the memory directory is gone after each run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_helpers import (ONE_RANK_JOB, ONE_RANK_STEPS, Cleanup, assert_losses_equal, ckptrun, one, run_id, start,
                            tail, wait_for)
from snapshot_factory import default_files, flip_byte, make_snapshot
from supervisor_helpers import T0, ScriptedWorld, supervisor, training
from workers import shared_tensors

from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.supervision import memory_tier as tier
from ckptrun.cli.supervision.observation import Snapshot
from ckptrun.cli.supervision.spec import LaunchSpec, build_spec
from ckptrun.runtime.storage import store
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.hashing import hash_file
from ckptrun.runtime.manifest import FileEntry, Manifest
from ckptrun.runtime.checkpoint import snapshot
from ckptrun.runtime.checkpoint.memory_tier import MemoryCadence, MemoryTier, apply_memory_retention, steps_between
from ckptrun.runtime.records import final_losses, read_events

RUN = "test-run"


def memory_snapshot(memory_dir: Path, step: int, lineage: str, run: str = RUN) -> Path:
    """A published snapshot in a memory directory, of the durable dir's ``lineage`` (no lineage.json of its own)."""
    temp = store.new_temp_dir(memory_dir, step)
    entries = []
    for rel, data in default_files(step).items():
        (temp / rel).parent.mkdir(parents=True, exist_ok=True)
        (temp / rel).write_bytes(data)
        size, digest = hash_file(temp / rel, "sha256")
        entries.append(FileEntry(path=rel, size=size, algorithm="sha256", digest=digest, rank=0))
    store.write_manifest(temp, Manifest(run_id=run, lineage=lineage, step=step, world_size=1, files=entries))
    return store.publish(temp, step)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, str]:
    """A durable dir with steps 5 and 10, an empty memory dir, and the current line's id."""
    ckpt, memory = tmp_path / "checkpoints", tmp_path / "shm"
    memory.mkdir()
    for step in (5, 10):
        make_snapshot(ckpt, step)
    return ckpt, memory, store.read_lineage(ckpt).current


def durable(ckpt: Path, step: int) -> Snapshot:
    return Snapshot(ckpt / store.snapshot_name(step), step)


# --- the restart choice -----------------------------------------------------------------


def test_a_newer_memory_snapshot_of_the_lineage_is_chosen(dirs: tuple[Path, Path, str]) -> None:
    ckpt, memory, line = dirs
    for step in (8, 12, 14):
        memory_snapshot(memory, step, line)
    choice = tier.choose(durable(ckpt, 10), memory, ckpt, RUN)
    assert (choice.tier, choice.snapshot.step, choice.skipped) == ("memory", 14, [])
    assert "newer than the newest durable one (step 10)" in choice.reason


def test_memory_no_newer_than_disk_leaves_the_disk_snapshot(dirs: tuple[Path, Path, str]) -> None:
    ckpt, memory, line = dirs
    memory_snapshot(memory, 10, line)
    choice = tier.choose(durable(ckpt, 10), memory, ckpt, RUN)
    assert (choice.tier, choice.snapshot.step) == ("disk", 10)


def test_a_memory_snapshot_across_a_lineage_fork_is_never_used(dirs: tuple[Path, Path, str]) -> None:
    ckpt, memory, line = dirs
    memory_snapshot(memory, 14, line)  # written on the old line, after the fork point
    store.fork(ckpt, ckpt / store.snapshot_name(5))  # `resume --from 5`: step 10 is abandoned
    choice = tier.choose(durable(ckpt, 5), memory, ckpt, RUN)
    assert (choice.tier, choice.snapshot.step) == ("disk", 5)
    assert "never across a fork" in choice.skipped[0]["reason"]


def test_a_memory_snapshot_that_fails_verification_falls_back(dirs: tuple[Path, Path, str]) -> None:
    ckpt, memory, line = dirs
    memory_snapshot(memory, 12, line)
    flip_byte(memory_snapshot(memory, 14, line) / "model.bin")
    choice = tier.choose(durable(ckpt, 10), memory, ckpt, RUN)  # the next newest memory one, still newer than disk
    assert (choice.tier, choice.snapshot.step) == ("memory", 12)
    assert choice.skipped[0]["step"] == 14 and "does not verify" in choice.skipped[0]["reason"]
    flip_byte(memory / store.snapshot_name(12) / "optim.bin")
    choice = tier.choose(durable(ckpt, 10), memory, ckpt, RUN)
    assert (choice.tier, choice.snapshot.step, len(choice.skipped)) == ("disk", 10, 2)


def test_another_runs_memory_snapshot_is_skipped_and_nothing_means_none(dirs: tuple[Path, Path, str]) -> None:
    ckpt, memory, line = dirs
    memory_snapshot(memory, 14, line, run="someone-else")
    assert tier.choose(durable(ckpt, 10), memory, ckpt, RUN).tier == "disk"
    assert tier.choose(None, memory, ckpt, RUN).tier == "none"


def test_the_choice_is_an_event_and_what_it_passed_over_is_deleted(dirs: tuple[Path, Path, str]) -> None:
    ckpt, memory, line = dirs
    memory_snapshot(memory, 12, line)
    flip_byte(memory_snapshot(memory, 14, line) / "model.bin")
    events: list[tuple[str, dict]] = []
    chosen = tier.MemoryDir(memory).choose(durable(ckpt, 10), ckpt, RUN, lambda name, **f: events.append((name, f)),
                                           lambda line: None)
    assert chosen.step == 12 and not (memory / store.snapshot_name(14)).exists()  # never quarantined into ckpt
    assert not (ckpt / store.QUARANTINE_DIR).exists()
    name, fields = events[0]
    assert name == "restore_source" and fields["tier"] == "memory" and fields["skipped"][0]["step"] == 14


def test_a_memory_copy_the_ranks_quarantined_as_poisoned_is_dropped_and_the_next_tier_tried(
        dirs: tuple[Path, Path, str]) -> None:
    """Issue 24 item 3: the ranks blamed memory step 14 (poison right after restoring it) and moved it aside in
    its own directory (store.quarantine, as they do); the restart takes the next tier down (memory 12, then
    disk 10), and the poisoned copy is deleted, never quarantined into the durable directory."""
    ckpt, memory, line = dirs
    memory_snapshot(memory, 12, line)
    store.quarantine(memory_snapshot(memory, 14, line), "poisoned", "loss nan at step 15", step=15, loss="nan")

    def pick() -> Snapshot | None:
        return tier.MemoryDir(memory).choose(durable(ckpt, 10), ckpt, RUN, lambda *a, **k: None, lambda line: None)

    assert pick().step == 12
    assert not any(e.step == 14 for e in store.list_entries(memory, include_abandoned=True)), "dropped"
    store.quarantine(memory / store.snapshot_name(12), "poisoned", "loss nan at step 13")
    chosen = pick()
    assert (chosen.step, chosen.path) == (10, ckpt / store.snapshot_name(10))
    assert not (ckpt / store.QUARANTINE_DIR).exists()


def test_restarts_that_bring_memory_snapshots_are_progress() -> None:
    """Three crashes, each after new memory snapshots but no durable one: not 'no progress' (exit 4), but restarts."""
    crash = lambda t, step: [training(t, step), training(t + 1, step, agent_exit=1)]  # noqa: E731
    memory = {"memory_saved": [{}]}
    world = ScriptedWorld({1: crash(T0 + 4, 17), 2: crash(T0 + 20, 27), 3: crash(T0 + 40, 37), 4: crash(T0 + 60, 47)},
                          events_by_attempt={1: memory, 2: memory, 3: memory, 4: memory},
                          snapshots=[Snapshot(Path(f"/shm/step-{s:09d}"), s) for s in (16, 26, 36)])
    outcome = supervisor(world, max_restarts=3).supervise()
    assert outcome.code == 1 and len(world.launches) == 4 and "no new snapshot" not in outcome.message


# --- the directory and the options ----------------------------------------------------------


def test_the_memory_directory_is_private_and_removed(tmp_path: Path) -> None:
    spec = LaunchSpec(memory_every_steps=2)
    memory = tier.MemoryDir.open(spec, "r1", root=tmp_path)
    assert memory.path.parent == tmp_path and memory.path.stat().st_mode & 0o777 == 0o700
    assert json.loads((memory.path / tier.OWNER).read_text())["pid"] == os.getpid()
    assert tier.sweep_stale(tmp_path) == []  # its owner is alive
    memory.remove()
    assert not memory.path.exists() and tier.MemoryDir.open(LaunchSpec(), "r1", root=tmp_path).path is None


def test_a_killed_supervisors_memory_directory_is_swept(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "ckptrun-old-host"
    stale.mkdir()
    (stale / tier.OWNER).write_text(json.dumps({"pid": dead.pid, "start_time": 0.0}))
    assert tier.sweep_stale(tmp_path) == [stale] and not stale.exists()


def test_every_launch_and_verify_sweep_a_killed_supervisors_directory(tmp_path: Path) -> None:
    """Not only a later launch that uses the memory tier (issue 24): any launch's world, and `ckptrun verify`."""
    dead = subprocess.Popen(["true"])
    dead.wait()

    def plant(root: Path) -> Path:
        stale = root / f"ckptrun-sweep-test-{os.getpid()}-{dead.pid}"
        stale.mkdir()
        (stale / tier.OWNER).write_text(json.dumps({"pid": dead.pid, "start_time": 0.0}))
        return stale

    stale = plant(tmp_path)
    assert tier.MemoryDir.open(LaunchSpec(), "r2", root=tmp_path).path is None and not stale.exists()
    # verify, in a root of this test's own: in /dev/shm another test's launch (the other pytest worker) might
    # sweep the planted directory first, and the test would pass whatever verify did
    own_root = tmp_path / "shm"
    own_root.mkdir()
    stale = plant(own_root)
    verify_here = (f"import functools, sys; from pathlib import Path; import ckptrun.cli.commands.verify as v; "
                   f"v.sweep_stale = functools.partial(v.sweep_stale, Path({str(own_root)!r})); "
                   f"sys.argv = ['ckptrun', 'verify', {str(tmp_path / 'nothing')!r}]; "
                   f"from ckptrun.cli.main import main; main()")
    (tmp_path / "nothing").mkdir()
    result = subprocess.run([sys.executable, "-c", verify_here], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr and not stale.exists(), result.stderr


def test_the_tier_is_refused_without_shared_memory_or_a_directory_of_its_own(tmp_path: Path) -> None:
    """No tmpfs, a --memory-dir holding someone else's files or under a missing parent: exit 2. Many nodes are
    accepted (each node keeps its own ranks' shards), with a --memory-dir each."""
    with pytest.raises(CkptrunError) as missing:
        tier.refuse_unsupported(LaunchSpec(memory_every_steps=2), root=tmp_path / "no-shm")
    assert missing.value.exit_code == 2 and str(tmp_path / "no-shm") in missing.value.message
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep me")
    for given, words in ((tmp_path / "theirs", "not a ckptrun memory tier's"), (tmp_path / "no" / "dir", "not a writable")):
        with pytest.raises(CkptrunError) as refused:
            tier.refuse_unsupported(LaunchSpec(memory_every_steps=2, node_memory_dir=given), root=tmp_path)
        assert refused.value.exit_code == 2 and words in refused.value.message
    assert (tmp_path / "theirs" / "notes.txt").exists()
    tier.refuse_unsupported(LaunchSpec(memory_every_steps="auto", nnodes="2", node_memory_dir=tmp_path / "n1"), root=tmp_path)
    tier.refuse_unsupported(LaunchSpec(memory_every_steps=2, nnodes="2"), root=tmp_path)  # /dev/shm/...-node<k>
    tier.refuse_unsupported(LaunchSpec(nnodes="2"), root=tmp_path / "no-shm")  # off: nothing to refuse


def test_the_options_reach_the_workers_and_a_bad_value_is_one_line() -> None:
    spec = build_spec({"memory_every_steps": "auto", "memory_keep": 3})
    env = RunEnv.from_env(RunEnv(**spec.worker_policy(), memory_dir=Path("/dev/shm/x")).to_env())
    assert (env.memory_every_steps, env.memory_keep, env.memory_dir) == ("auto", 3, Path("/dev/shm/x"))
    assert RunEnv.from_env({"CKPTRUN_MEMORY_EVERY_STEPS": "4"}).memory_every_steps == 4
    with pytest.raises(CkptrunError) as bad:
        build_spec({"memory_every_steps": "often"})
    assert bad.value.message == "--memory-every-steps often: must be a number of steps >= 0 (0: off) or auto"


def test_preflight_fails_a_memory_tier_that_does_not_fit(tmp_path: Path) -> None:
    from ckptrun.cli.commands.preflight_checks import FAIL, PASS, _memory_tier

    spec = LaunchSpec(memory_every_steps=2, memory_keep=3)
    verdict, _, reason, facts = _memory_tier(spec, 10**15, root=tmp_path)  # 4 PB: keep 3 + 1 in flight
    assert verdict == FAIL and "--memory-keep 3" in reason and facts["memory_tier_need_bytes"] == 4 * 10**15
    assert _memory_tier(spec, 1000, root=tmp_path)[0] == PASS


@pytest.mark.parametrize("cadence,steps,due", [
    (MemoryCadence(2), [1, 2, 3, 4], [False, True, False, True]),
    (MemoryCadence(0), [1, 2], [False, False]),
    (MemoryCadence(3, auto=True), [5, 6, 7], [True, True, True]),  # nothing saved yet: the first boundary
    (MemoryCadence(3, auto=True, last_step=5), [6, 7, 8], [False, False, True]),
])
def test_memory_cadence(cadence: MemoryCadence, steps: list[int], due: list[bool]) -> None:
    assert [cadence.due(s) for s in steps] == due


@pytest.mark.parametrize("stall,step,every", [(0.01, 1.0, 1), (0.05, 1.0, 5), (0.2, 0.1, 200), (0.0, 1.0, 1), (0.1, 0.0, 1)])
def test_auto_keeps_a_memory_save_near_one_percent(stall: float, step: float, every: int) -> None:
    assert steps_between(stall, step) == every


def test_memory_retention_keeps_the_newest_of_the_lineage(dirs: tuple[Path, Path, str]) -> None:
    ckpt, memory, line = dirs
    for step in (2, 4, 6):
        memory_snapshot(memory, step, line)
    memory_snapshot(memory, 8, "an-abandoned-line")
    deleted = apply_memory_retention(memory, ckpt, keep=2)
    assert sorted(p.name for p in deleted) == ["step-000000002", "step-000000008"]
    assert [e.step for e, _ in store.published(memory)] == [4, 6]


def test_the_worker_writes_verified_snapshots_keeps_k_and_auto_paces_itself(tmp_path: Path) -> None:
    """In this process (no process group): real memory saves through the tier, its retention and its auto pace."""
    ckpt, memory, run_dir = tmp_path / "checkpoints", tmp_path / "shm", tmp_path / "run"
    memory.mkdir()
    run_dir.mkdir()
    line = store.ensure_lineage(ckpt, RUN).current
    env = RunEnv(run_id=RUN, run_dir=run_dir, ckpt_dir=ckpt, memory_dir=memory, memory_every_steps=2, memory_keep=2)
    memory_tier = MemoryTier(env, run_dir)
    for step in (2, 4, 6):
        assert memory_tier.due(step) and not memory_tier.due(step + 1)
        state = snapshot.State({"objects": {}, "counters": {"step": step}}, {"model.w": torch.full((64,), float(step))},
                               {"rng": {}}, {})
        memory_tier.save(state, snapshot.SnapshotInfo(RUN, line, "step-000000000", step, 0, 0, "fp32", {}, ""))
    memory_tier.close()
    kept = store.published(memory)
    assert [e.step for e, _ in kept] == [4, 6] and all(m.parent == "step-000000000" for _, m in kept)
    assert memory_tier.holds(kept[-1][0].path) and not memory_tier.holds(ckpt / "step-000000006")
    assert [e["step"] for e in read_events(run_dir, "memory_saved")] == [2, 4, 6]
    assert tier.choose(None, memory, ckpt, RUN).snapshot.step == 6  # and they verify
    auto = MemoryTier(env.model_copy(update={"memory_every_steps": "auto"}), run_dir)
    auto.stalls, auto.step_s = [0.05], 1.0  # 50 ms per save, 1 s per step: every 5 steps keeps it at 1%
    assert auto.cadence.every == 1 and auto._advice(7) == 5 and read_events(run_dir, "memory_cadence")[0]["every_steps"] == 5
    auto.cadence.every = 5
    auto.stalls = [0.055]  # 6 steps now: within the jitter band of 5 → keep 5
    assert auto._advice(8) == 5
    auto.close()


# --- end to end: one rank, the embedded default job -------------------------------------------

STEPS, DURABLE, MEMORY, KILL = ONE_RANK_STEPS, 10, 2, 15  # conftest's one-rank job (24 steps) is the reference
JOB = ONE_RANK_JOB
QUICK = ["--nproc-per-node", "1", "--heartbeat-timeout", "5", "--startup-timeout", "60", "--restart-backoff", "0.1",
         "--save-every-steps", str(DURABLE), "--ranks-output", "none"]


@pytest.fixture(scope="module")
def reference(one_rank_job_run: Path) -> Path:
    """The uninterrupted run, without the memory tier (conftest's, shared with test_standby)."""
    return one_rank_job_run


def assert_exact(run_dir: Path, reference: Path) -> None:
    """Per-step losses and the final snapshot's tensors, counters and RNG, bitwise."""
    assert_losses_equal(run_dir, final_losses(reference))
    final = store.snapshot_name(STEPS)
    ours, theirs = shared_tensors(run_dir / "checkpoints" / final), shared_tensors(reference / "checkpoints" / final)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("state.json", "rank-00000.json"):
        assert (run_dir / "checkpoints" / final / name).read_text() == (reference / "checkpoints" / final / name).read_text()


def memory_dir_of(run_dir: Path) -> Path:
    return tier.SHM_ROOT / tier.directory_name(run_id(run_dir))


@pytest.mark.e2e
@pytest.mark.timeout(360)
def test_a_kill_restores_from_memory_exactly(reference: Path, tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "kill")
    result = ckptrun("launch", *QUICK, "--name", "kill", "--memory-every-steps", str(MEMORY),
                     "--inject-fault", f"kill:rank=0:step={KILL}", *JOB, cwd=tmp_path, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    source = one(run_dir, "restore_source")
    assert source["tier"] == "memory" and source["step"] == KILL - 1, source  # memory 14 beats disk 10
    restart = one(run_dir, "restart")
    assert restart["snapshot_step"] == KILL - 1 and 0 < restart["lost_steps"] <= MEMORY, restart
    restored = [e for e in read_events(run_dir, "restored") if e["attempt"] == 2]
    assert restored[0]["tier"] == "memory" and restored[0]["step"] == KILL - 1
    assert "restore from memory" in result.stdout + result.stderr
    assert_exact(run_dir, reference)
    assert not memory_dir_of(run_dir).exists()  # the run ended: its memory is released


@pytest.mark.e2e
@pytest.mark.timeout(360)
def test_without_its_memory_copy_a_restart_restores_the_newest_disk_snapshot(reference: Path, tmp_path: Path,
                                                                             cleanup: Cleanup) -> None:
    """A hang (alive, silent) gives the test the heartbeat timeout (10 s here, twice the usual, so a loaded machine
    cannot starve the test past it) to remove the memory copy before the supervisor chooses: the hang fires after the memory
    save of step 14 settled and step 15's line is written."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "hang")
    log = tmp_path / "hang.log"
    # one exchange per step: step 15's line is written before its hang (a batch of steps would hold it back)
    process = cleanup.track(start("launch", *QUICK, "--name", "hang", "--memory-every-steps", str(MEMORY),
                                  "--decision-every-steps", "1", "--heartbeat-timeout", "10", "--inject-fault", f"hang:rank=0:step={KILL}", *JOB, cwd=tmp_path, log=log))
    memory = wait_for(lambda: (run_dir / "run.json").exists() and memory_dir_of(run_dir), 60, "the run to start")
    wait_for(lambda: KILL in final_losses(run_dir) and (memory / store.snapshot_name(KILL - 1)).exists(), 120,
             f"step {KILL} and memory step {KILL - 1}")
    for entry in store.list_entries(memory):  # the writer's retention may delete an older one meanwhile
        shutil.rmtree(entry.path, ignore_errors=True)
    assert not [e for e in store.list_entries(memory) if e.kind == "published"], "nothing left to restore from memory"
    assert process.wait(timeout=170) == 0, tail(log)
    source = one(run_dir, "restore_source")
    assert (source["tier"], source["step"]) == ("disk", DURABLE), source
    assert one(run_dir, "restart")["snapshot_step"] == DURABLE
    assert_exact(run_dir, reference)
    assert not memory.exists()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_memory_tier_that_turns_off_is_named_in_the_last_line_and_in_status_its_error_once(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """Issue 38: every memory save failed (two ranks per node on many nodes), the tier turned itself off after 3,
    and the launch ended "run completed", exit 0, with three copies of a 600-character error in between. A tier
    the user asked for either works or the run says so: here both ranks' memory writes fail (ENOSPC from step
    2), durable snapshots go on, the run completes exit 0, and its last line and `status` name the tier that
    was lost; each failure is one line that says the ranks' common cause once."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "off")
    result = ckptrun("launch", *QUICK, "--nproc-per-node", "2", "--name", "off", "--memory-every-steps", str(MEMORY),
                     "--inject-fault", "memory-enospc:step=2", *JOB, cwd=tmp_path, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ckptrun: run completed at step {STEPS} after 0 restart(s), but without the memory tier "
                           "since step 6: 3 memory saves failed in a row"), last
    failed = read_events(run_dir, "memory_save_failed")
    assert [e["step"] for e in failed] == [2, 4, 6], failed
    assert all(e["error"].startswith("ranks 0, 1: ") and e["error"].count("No space left") == 1 for e in failed), failed
    assert [e["step"] for e in read_events(run_dir, "snapshot_saved")] == [10, 20, STEPS]
    status = ckptrun("status", str(run_dir), cwd=tmp_path)
    assert "tiers     memory: OFF since step 6 of attempt 1 (3 memory saves failed in a row" in status.stdout, status.stdout
    facts = json.loads(ckptrun("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert [(t["tier"], t["step"]) for t in facts["tiers_off"]] == [("memory", 6)]
