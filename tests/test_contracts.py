"""The torch-free contracts: C1 environment, fault specs, lineage, manifest paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from snapshot_factory import make_snapshot

import ckptrun.runtime.storage.store as store
from ckptrun.runtime.env import EnvError, RunEnv, known_variables
from ckptrun.runtime.faults import Fault, FaultSpecError, parse_faults
from ckptrun.runtime.manifest import FileEntry, Manifest, read_manifest

# --- C1: the environment ------------------------------------------------------


def test_run_env_round_trips_every_field() -> None:
    env = RunEnv(
        run_id="r1", run_dir=Path("/runs/r1"), ckpt_dir=Path("/ckpt"), attempt=3, supervised=True,
        supervisor_pid=1234, supervisor_start_time=1700000000.125, resume_from=Path("/ckpt/step-000000010"),
        precision="bf16", save_every_steps=50, save_every_seconds=0.1 + 0.2, keep_last=5, keep_every=1000,
        max_failed_saves=2, heartbeat_interval=0.25, seed=7, deterministic=False, threads=4,
        hash_algorithm="sha256", allow_changes=("lr", "batch_size"), fault="kill:rank=1:step=5",
        save_every_auto=True, mtbf_seconds=3600.0, save_interval_cap_seconds=0.1 + 0.7, preflight="resume",
        preflight_steps=10, ckpt_url="s3://bucket/prefix", local_cache=True, node_cache_dir=Path("/scratch/cache"), node_group="rack-7", storage_options='{"anon": false}',
        memory_dir=Path("/dev/shm/ckptrun-r1-host"), memory_every_steps=4, memory_keep=3, node=1,
        memory_replicas=2, memory_fetch={1: 0, 3: 2},
        replica_check_every_steps=25, init_weights=Path("/weights/model.safetensors"), init_weights_sha256="ab" * 32,
    )
    variables = env.to_env()
    assert set(variables) == set(known_variables())
    assert all(isinstance(value, str) for value in variables.values())
    assert RunEnv.from_env(variables) == env


def test_run_env_defaults_without_ckptrun_variables() -> None:
    env = RunEnv.from_env({"PATH": "/usr/bin", "RANK": "0", "WORLD_SIZE": "2"})
    assert env == RunEnv()
    assert env.supervised is False and env.attempt == 1
    assert env.checkpoint_dir == env.run_dir / "checkpoints"
    assert RunEnv.from_env(RunEnv().to_env()) == RunEnv()


def test_unknown_ckptrun_variable_is_refused_by_name() -> None:
    with pytest.raises(EnvError, match="unknown variable CKPTRUN_SAVE_EVERY_STEP;"):
        RunEnv.from_env({"CKPTRUN_SAVE_EVERY_STEP": "10"})


@pytest.mark.parametrize(
    "name, value",
    [("CKPTRUN_ATTEMPT", "zero"), ("CKPTRUN_ATTEMPT", "0"), ("CKPTRUN_PRECISION", "fp12"),
     ("CKPTRUN_KEEP_LAST", "-1"), ("CKPTRUN_DETERMINISTIC", "maybe"), ("CKPTRUN_HEARTBEAT_INTERVAL", "0")],
)
def test_invalid_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(EnvError) as caught:
        RunEnv.from_env({"CKPTRUN_RUN_ID": "r", name: value})
    assert str(caught.value).startswith(f"{name}={value!r}: ")


# --- fault specs -------------------------------------------------------------


def test_fault_specs_parse() -> None:
    spec = (
        "kill:rank=1:step=5; kill:rank=0:step=3:micro=2; hang:rank=1:step=4:attempt=any;"
        "exit:rank=0:step=2:code=7:attempt=2; kill-during-save:rank=0:phase=before-publish:step=4; skip-rng-restore"
    )
    assert parse_faults(spec) == [
        Fault("kill", rank=1, step=5),
        Fault("kill", rank=0, step=3, micro=2),
        Fault("hang", rank=1, step=4, attempt=None),
        Fault("exit", rank=0, step=2, code=7, attempt=2),
        Fault("kill-during-save", rank=0, step=4, phase="before-publish"),
        Fault("skip-rng-restore"),
    ]
    assert parse_faults(None) == parse_faults("") == []


def test_fault_applies_to_rank_and_attempt() -> None:
    [once, always] = parse_faults("kill:rank=1:step=5;hang:step=2:attempt=any")
    assert once.applies(rank=1, attempt=1) and not once.applies(rank=0, attempt=1) and not once.applies(rank=1, attempt=2)
    assert always.applies(rank=3, attempt=9)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("explode:rank=0:step=1", "unknown kind 'explode'; use one of kill, hang"),
        ("kill:rank=0:step", "'step' is not key=value"),
        ("kill-during-save:rank=0:phase=later", "phase must be one of stage, persist, before-manifest, before-publish"),
        ("kill:rank=one:step=1", "rank must be an integer, got 'one'"),
        ("kill:rank=0:step=1:colour=red", "unknown key 'colour'"),
        ("hang:rank=0", "needs step=S"),
    ],
)
def test_fault_spec_errors_name_the_bad_part(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        parse_faults(f"skip-rng-restore;{spec}")
    assert str(caught.value).startswith(f"fault {spec!r}: {message}")


# --- lineage -----------------------------------------------------------------


def test_lineage_contains_across_forks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    old = {step: read_manifest(make_snapshot(ckpt, step)) for step in (10, 20, 30)}
    lineage = store.fork(ckpt, ckpt / "step-000000020")
    assert [lineage.contains(old[s]) for s in (10, 20, 30)] == [True, True, False]
    assert (ckpt / "abandoned" / old[30].lineage / "step-000000030").is_dir()
    assert not (ckpt / "step-000000030").exists()

    second = {step: read_manifest(make_snapshot(ckpt, step)) for step in (30, 40)}
    assert second[30].lineage == lineage.current != old[30].lineage
    lineage = store.fork(ckpt, ckpt / "step-000000030")  # fork the second line too
    assert [lineage.contains(old[s]) for s in (10, 20, 30)] == [True, True, False]
    assert [lineage.contains(second[s]) for s in (30, 40)] == [True, False]
    assert store.read_lineage(ckpt) == lineage
    stranger = old[10].model_copy(update={"lineage": "not-a-line"})
    assert not lineage.contains(stranger)


# --- manifest ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["../outside", "a/../../outside", "/etc/passwd", "", "~/x", "a\\..\\b", "manifest.json"])
def test_manifest_refuses_paths_outside_the_snapshot(path: str) -> None:
    with pytest.raises(ValidationError):
        FileEntry(path=path, size=1, algorithm="sha256", digest="00")


def test_manifest_accepts_nested_relative_paths() -> None:
    entry = FileEntry(path="rank0/rng.json", size=1, algorithm="sha256", digest="00")
    manifest = Manifest(run_id="r", lineage="l", step=1, world_size=2, files=[entry])
    assert Manifest.model_validate_json(manifest.to_json()) == manifest
    assert manifest.total_bytes == 1
