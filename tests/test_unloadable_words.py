"""What the supervisor says when an attempt could not load its snapshot: a chunk that failed its digest at load
(named: rank, file, byte range, tensor) or a snapshot whose bytes match but that does not load.

The ``restore_failed`` reasons are the runtime's own: a real one-rank snapshot saved in this process, a byte
flipped, loaded with the runtime's loader (the ranks are not the point). The supervisor's reaction is scripted
(supervisor_helpers), with no processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from snapshot_factory import flip_byte
from supervisor_helpers import T0, ScriptedWorld, supervisor, training
from test_chunk_digests import item_ranges, save

from ckptrun.cli.supervision import unloadable
from ckptrun.cli.supervision.observation import Observation, RankView, Snapshot
from ckptrun.runtime.checkpoint import snapshot


def load_failure(path: Path) -> str:
    """The reason the runtime records in ``restore_failed`` when it cannot load ``path``."""
    with pytest.raises(snapshot.LoadError) as caught:
        snapshot.load(path)
    return str(caught.value)


@pytest.fixture(scope="module")
def reasons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, tuple[str, str]]]:
    """Real load failures, by kind: (reason, (how the named place starts, how it ends)). The byte range is the
    failing chunk's, inside the item (a large item may be stored as several chunks)."""
    root = tmp_path_factory.mktemp("unloadable")
    chunk, _ = save(root / "chunk")
    name, offset, length = item_ranges(chunk)["model.b"]
    flip_byte(chunk / "dcp" / name, offset + length // 2)
    small, _ = save(root / "small")
    flip_byte(small / "state.json", 2)
    return {"chunk": (load_failure(chunk), (f"dcp/{name} bytes ", "(tensor 'model.b')")),
            "small file": (load_failure(small), ("state.json", "state.json"))}


def _quarantined_after(reason: str) -> ScriptedWorld:
    """Attempt 2 is handed step 10, its ranks record ``reason``; attempt 3 must start from step 5."""
    step10, step5 = Snapshot(Path("/c/step-000000010"), 10), Snapshot(Path("/c/step-000000005"), 5)
    world = ScriptedWorld(
        script={1: [training(T0 + 5, 12), Observation(time=T0 + 6, ranks={0: RankView(False)}, agent_exit=1, last_step=12)],
                2: [Observation(time=T0 + 20, ranks={0: RankView(False)}, agent_exit=1)],
                3: [training(T0 + 40, 12, agent_exit=0)]},
        events_by_attempt={2: {"restore_failed": [{"snapshot": str(step10.path), "reason": reason}]}},
        snapshots=[step10, step5])
    assert supervisor(world).supervise().code == 0
    assert world.launches == [(1, None), (2, step10.path), (3, step5.path)]
    return world


@pytest.mark.parametrize("kind", ["chunk", "small file"])
def test_a_digest_failed_at_load_is_named_and_the_snapshot_quarantined_as_corrupt(reasons, kind: str) -> None:
    reason, (starts, ends) = reasons[kind]
    world = _quarantined_after(reason)
    [line] = [line for line in world.said if line.startswith("snapshot step 10")]
    assert f"failed its digest at load: rank 0 read {starts}" in line and "quarantined" in line, line
    assert "verifies but does not load" not in line and "passed its checks" not in line
    [(_, event)] = [(name, fields) for name, fields in world.logged if name == "snapshot_quarantined"]
    assert (event["cause"], event["status"]) == ("digest", "corrupt")
    [failure] = event["digest_failures"]
    assert failure["rank"] == 0 and failure["where"].startswith(starts) and failure["where"].endswith(ends), failure
    assert failure["where"] in line
    assert world.quarantined == [(Path("/c/step-000000010"), "corrupt", reason)]


def test_a_snapshot_whose_bytes_match_but_does_not_load_keeps_words_that_say_so() -> None:
    reason = "rank 0: LoadError: rank-00000.safetensors does not hold a dict of tensors"
    world = _quarantined_after(reason)
    [line] = [line for line in world.said if line.startswith("snapshot step 10")]
    assert "passed its checks but does not load" in line and "does not hold a dict of tensors" in line, line
    assert "digest" not in line
    [event] = [fields for name, fields in world.logged if name == "snapshot_quarantined"]
    assert (event["cause"], event["status"], event["digest_failures"]) == ("load", "unloadable", [])


def test_every_failing_rank_is_counted_from_a_dcp_reason() -> None:
    reason = ("DCP load failed: rank 0: DigestMismatch: dcp/__0_0.safetensors bytes 0..8 (tensor 'a'): sha256 12…, "
              "manifest says 34…; rank 1: DigestMismatch: dcp/__1_0.safetensors bytes 8..16 (tensor 'b'): sha256 56…, "
              "manifest says 78…")
    assert [(f.rank, f.where) for f in unloadable.digest_failures(reason)] == [
        (0, "dcp/__0_0.safetensors bytes 0..8 (tensor 'a')"), (1, "dcp/__1_0.safetensors bytes 8..16 (tensor 'b')")]
    assert "(and 1 more)" in unloadable.describe(4, reason, Path("/q"))


# --- end to end: a chunk flipped in the snapshot a supervised restart is handed -------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_supervised_restart_names_the_chunk_that_failed_at_load_and_falls_back(tmp_path: Path) -> None:
    """One rank hangs after step 10's save (a long heartbeat timeout keeps the supervisor waiting) while the test
    flips a byte inside a stored chunk of step 10 (sizes unchanged), then SIGKILLs it: attempt 2 is handed step 10
    (manifest and sizes pass), its rank finds the chunk at load, attempt 3 resumes from step 5 and completes."""
    import json
    import os
    import signal

    from launch_helpers import Cleanup, assert_no_processes, events, start, tail, wait_for

    from ckptrun.runtime.records import read_heartbeats

    cleanup = Cleanup()
    try:
        run_dir = cleanup.run_dir(tmp_path / "runs" / "flipped")
        step10 = run_dir / "checkpoints" / "step-000000010"
        flags = ["--nproc-per-node", "1", "--save-every-steps", "5", "--heartbeat-timeout", "120",
                 "--startup-timeout", "60", "--restart-backoff", "0.1", "--name", "flipped",
                 "--inject-fault", "hang:rank=0:step=10"]
        launcher = cleanup.track(start("launch", *flags, "--", "--num-workers", "0", "--steps", "12",
                                       cwd=tmp_path, log=tmp_path / "launch.log"))
        wait_for(lambda: (step10 / "manifest.json").exists() and 10 in [e.get("step") for e in events(run_dir, "snapshot_saved")],
                 timeout=120, what="the snapshot of step 10")
        entry = next(e for e in json.loads((step10 / "manifest.json").read_text())["files"] if e.get("chunks"))
        chunk = entry["chunks"][0]
        flip_byte(step10 / entry["path"], chunk["offset"] + chunk["length"] // 2)
        os.kill(read_heartbeats(run_dir)[0].pid, signal.SIGKILL)
        assert launcher.wait(timeout=240) == 0, tail(tmp_path / "launch.log")
        assert [e["snapshot_step"] for e in events(run_dir, "restart")] == [10, 5]
        [quarantined] = events(run_dir, "snapshot_quarantined")
        assert (quarantined["cause"], quarantined["status"]) == ("digest", "corrupt"), quarantined
        [failure] = quarantined["digest_failures"]
        assert failure["rank"] == 0 and failure["where"].startswith(f"{entry['path']} bytes "), failure
        said = (tmp_path / "launch.log").read_text(errors="replace")
        assert f"snapshot step 10 failed its digest at load: rank 0 read {failure['where']}" in said, tail(tmp_path / "launch.log")
        assert "verifies but does not load" not in said
        assert_no_processes(run_dir)
    finally:
        cleanup.close()
