"""Shared test setup. Others add fixtures here; keep each one small.

``tests/`` has no ``__init__.py`` (pytest runs with ``--import-mode=importlib``),
so helper modules such as ``snapshot_factory`` are made importable by putting
this directory on ``sys.path``.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def default_job_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted `ckptrun launch` of the embedded default job (2 ranks, 30 steps, a snapshot every 5): its
    run dir. The reference of test_launch_e2e's recoveries and test_exactness's accumulate-1 kills (plain torchrun
    with the same C1 fields computes the same bits: losses, tensors, RNG and data position)."""
    from launch_helpers import COMMON, ckptrun

    from ckptrun.runtime.records import read_events

    cwd = tmp_path_factory.mktemp("default-job")
    result = ckptrun("launch", *COMMON, "--name", "ref", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = cwd / "runs" / "ref"
    assert len(read_events(run_dir, "attempt_start")) == 1
    return run_dir


@pytest.fixture(scope="session")
def one_rank_job_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted `ckptrun launch` of the embedded default job on one rank (24 steps, hidden 128, no loader
    workers, a snapshot every 2 steps, every rank a new interpreter: ``--no-warm-workers``): its run dir. A cold
    start's bits, the reference of test_standby's warm restarts and test_memory_tier's restores from memory (the
    save cadence never touches the losses or the state, so each test may save at its own)."""
    from launch_helpers import ONE_RANK_JOB, Cleanup, ckptrun

    from ckptrun.runtime.records import read_events

    cwd = tmp_path_factory.mktemp("one-rank-job")
    tracker = Cleanup()
    try:
        run_dir = tracker.run_dir(cwd / "runs" / "reference")
        result = ckptrun("launch", "--nproc-per-node", "1", "--save-every-steps", "2", "--heartbeat-timeout", "5",
                         "--startup-timeout", "60", "--no-warm-workers", "--name", "reference", *ONE_RANK_JOB,
                         cwd=cwd, timeout=170)
    finally:
        tracker.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_events(run_dir, "attempt_start")) == 1
    return run_dir


@pytest.fixture
def cleanup():
    """A tracker of the run dirs a test launches into: whatever they left running is killed at the end, whatever
    the outcome (``launch_helpers.Cleanup``). Shared by every e2e test file; a file may define its own."""
    from launch_helpers import Cleanup

    tracker = Cleanup()
    yield tracker
    tracker.close()
