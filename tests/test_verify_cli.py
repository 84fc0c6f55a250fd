"""`ckptrun verify` through the real command line, on synthetic snapshots (no torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from snapshot_factory import (
    flip_byte,
    make_snapshot,
    make_temp_dir,
    manifest_dict,
    truncate,
    write_manifest_dict,
)

import ckptrun.runtime.storage.store as store


def ckptrun(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ckptrun.cli.main", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=60,
    )


def verify_json(path: Path, *flags: str) -> tuple[int, dict]:
    result = ckptrun("verify", path, "--json", *flags)
    return result.returncode, json.loads(result.stdout)


def by_step(document: dict) -> dict[int, dict]:
    return {snap["step"]: snap for snap in document["snapshots"] if not snap["abandoned"]}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint dir with three good snapshots: steps 10, 20, 30."""
    ckpt_dir = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        make_snapshot(ckpt_dir, step)
    return ckpt_dir


def test_all_good_prints_a_table_and_exits_0(ckpt: Path) -> None:
    result = ckptrun("verify", ckpt)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:6] == ["STEP", "LINEAGE", "FILES", "SIZE", "AGE", "STATUS"]
    rows = [line.split() for line in lines[1:4]]
    assert [row[0] for row in rows] == ["10", "20", "30"]
    assert all(row[2] == "3" and "ok" in row for row in rows)
    assert "3 ok" in lines[-1] and "newest verified: step 30" in lines[-1]


def test_flipped_byte_is_corrupt_and_names_file_and_digests(ckpt: Path) -> None:
    flip_byte(ckpt / "step-000000020" / "model.bin")
    result = ckptrun("verify", ckpt)
    assert result.returncode == 1
    row = next(line for line in result.stdout.splitlines() if line.startswith("20 "))
    assert "corrupt" in row
    code, document = verify_json(ckpt)
    assert code == 1 and document["ok"] is False
    bad = by_step(document)[20]
    assert bad["status"] == "corrupt"
    [problem] = bad["problems"]
    expected = manifest_dict(ckpt / "step-000000020")["files"][0]["digest"]
    assert problem.startswith("model.bin: sha256 ") and expected[:16] in problem
    assert by_step(document)[10]["status"] == by_step(document)[30]["status"] == "ok"


def test_truncated_file_is_corrupt(ckpt: Path) -> None:
    truncate(ckpt / "step-000000030" / "optim.bin")
    code, document = verify_json(ckpt)
    assert code == 1
    snap = by_step(document)[30]
    assert snap["status"] == "corrupt"
    assert "optim.bin: size 5 bytes" in snap["problems"][0]


def test_missing_file_is_incomplete(ckpt: Path) -> None:
    (ckpt / "step-000000010" / "rank0" / "rng.json").unlink()
    code, document = verify_json(ckpt)
    assert code == 1
    snap = by_step(document)[10]
    assert snap["status"] == "incomplete"
    assert snap["problems"] == ["rank0/rng.json: missing"]


def test_garbage_manifest_is_corrupt(ckpt: Path) -> None:
    (ckpt / "step-000000020" / "manifest.json").write_bytes(b"\x00{not json")
    code, document = verify_json(ckpt)
    assert code == 1
    snap = by_step(document)[20]
    assert snap["status"] == "corrupt" and "manifest.json" in snap["problems"][0]


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda doc: doc.update(schema_version=99), "schema version 99"),
        (lambda doc: doc.pop("run_id"), "run_id"),
        (lambda doc: doc["files"][0].update(path="../outside"), "leaves the snapshot directory"),
        (lambda doc: doc["files"][0].update(path="/etc/passwd"), "leaves the snapshot directory"),
    ],
    ids=["schema-version", "missing-field", "dotdot-path", "absolute-path"],
)
def test_invalid_manifest_is_corrupt(ckpt: Path, damage, words: str) -> None:
    snapshot = ckpt / "step-000000020"
    (ckpt / "outside").write_bytes(b"not part of any snapshot")
    document = manifest_dict(snapshot)
    damage(document)
    write_manifest_dict(snapshot, document)
    code, report = verify_json(ckpt)
    assert code == 1
    snap = by_step(report)[20]
    assert snap["status"] == "corrupt" and words in snap["problems"][0]


def test_save_in_progress_is_listed_but_does_not_fail(ckpt: Path) -> None:
    make_temp_dir(ckpt, 40, suffix="abc123")
    result = ckptrun("verify", ckpt)
    assert result.returncode == 0, result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("40 "))
    assert "in-progress" in row
    code, document = verify_json(ckpt)
    assert code == 0 and document["ok"] is True
    assert by_step(document)[40]["status"] == "in-progress"
    assert by_step(document)[40]["path"].endswith(".step-000000040.tmp-abc123")


def test_quick_checks_sizes_not_digests(ckpt: Path) -> None:
    flip_byte(ckpt / "step-000000020" / "model.bin")
    assert ckptrun("verify", ckpt, "--quick").returncode == 0
    truncate(ckpt / "step-000000030" / "model.bin")
    code, document = verify_json(ckpt, "--quick")
    assert code == 1
    assert by_step(document)[20]["status"] == "ok"
    assert by_step(document)[30]["status"] == "corrupt"


def test_json_is_one_document_with_the_schema(ckpt: Path) -> None:
    result = ckptrun("verify", ckpt, "--json", "--threads", "2")
    assert result.returncode == 0
    document = json.loads(result.stdout)  # the whole of stdout, nothing else
    assert document["ok"] is True
    assert [snap["step"] for snap in document["snapshots"]] == [10, 20, 30]
    for snap in document["snapshots"]:
        assert {"path", "step", "status", "problems", "lineage", "abandoned", "files", "bytes", "created"} <= snap.keys()
        assert snap["status"] == "ok" and snap["problems"] == [] and snap["files"] == 3
        assert Path(snap["path"]).is_absolute()


def test_single_snapshot_dir(ckpt: Path) -> None:
    code, document = verify_json(ckpt / "step-000000020")
    assert code == 0
    [snap] = document["snapshots"]
    assert snap["step"] == 20 and snap["status"] == "ok"
    flip_byte(ckpt / "step-000000020" / "optim.bin")
    result = ckptrun("verify", ckpt / "step-000000020")
    assert result.returncode == 1 and "corrupt" in result.stdout


def test_run_dir_verifies_its_checkpoints(ckpt: Path) -> None:
    result = ckptrun("verify", ckpt.parent)
    assert result.returncode == 0
    assert "3 ok" in result.stdout.splitlines()[-1]


@pytest.mark.parametrize("make_path", [lambda tmp: tmp / "nope", lambda tmp: tmp], ids=["missing", "not-a-ckpt-dir"])
def test_bad_path_is_refused_with_a_hint(tmp_path: Path, make_path) -> None:
    result = ckptrun("verify", make_path(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_abandoned_snapshots_are_listed_and_verified(ckpt: Path) -> None:
    store.fork(ckpt, ckpt / "step-000000010")
    make_snapshot(ckpt, 20)  # the new line's step 20
    code, document = verify_json(ckpt)
    assert code == 0
    abandoned = sorted(snap["step"] for snap in document["snapshots"] if snap["abandoned"])
    assert abandoned == [20, 30]
    assert sorted(by_step(document)) == [10, 20]
    result = ckptrun("verify", ckpt)
    assert sum("abandoned" in line.split() for line in result.stdout.splitlines()[1:]) == 2
    assert "newest verified: step 20" in result.stdout.splitlines()[-1]
    flip_byte(next((ckpt / "abandoned").glob("*/step-000000030")) / "model.bin")
    assert ckptrun("verify", ckpt).returncode == 1  # abandoned ones count


def test_unreadable_lineage_fails_verify_and_says_so(ckpt: Path) -> None:
    (ckpt / "lineage.json").write_text("garbage")
    code, document = verify_json(ckpt)
    assert code == 1 and document["ok"] is False
    assert "lineage.json: unreadable" in document["problems"][0]
    assert all(snap["status"] == "ok" for snap in document["snapshots"])


def test_a_snapshot_retention_deletes_while_it_is_verified_reads_as_vanished_not_corrupt(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race CI met: retention removed the snapshot between the walk's is_dir() and its scandir(), and
    pathlib's rglob raised FileNotFoundError out of verify (a run's own verify, or `ckptrun verify` beside it)."""
    import shutil

    import ckptrun.runtime.checkpoint.verify as verify

    def rglob_as_retention_prunes(self: Path, pattern: str):
        shutil.rmtree(self)
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "rglob", rglob_as_retention_prunes)
    report = verify.verify_snapshot(ckpt / store.snapshot_name(20), quick=True)
    assert report.status == verify.VANISHED, report.problems
