"""The first hour at the command line (issue 10, items 1, 3, 7 and the CLI parts of 8): refusals that name
the typo or the real run, the ranks' output on the launcher's terminal, a default snapshot cadence."""

from __future__ import annotations

import io
import json
import re
import threading
import tomllib
from pathlib import Path

import pytest
import typer.main
from launch_helpers import Cleanup, ckptrun, events, last_step, wait_for
from snapshot_factory import make_snapshot
from typer._click.exceptions import NoSuchOption

from ckptrun.cli.commands.launch import split_target
from ckptrun.cli.main import app
from ckptrun.cli.progress import Progress, Status
from ckptrun.cli.supervision.rank_output import RankOutput, selector
from ckptrun.cli.supervision.rundir import RunPaths
from ckptrun.cli.supervision.spec import LaunchSpec, RunRecord, build_spec, read_run_record, write_run_record
from ckptrun.cli.supervision.world import LocalWorld
from ckptrun.runtime.records import log_event, read_events

TEMPLATES = Path(__file__).parent.parent / "templates"
HELLO = """import os, sys
rank = int(os.environ["RANK"])
print(f"hello from rank {rank}")
print(f"a warning from rank {rank}", file=sys.stderr)
"""


@pytest.fixture
def cleanup():
    tracker = Cleanup()
    yield tracker
    tracker.close()


def _launch_args(*argv: str) -> list[str]:
    """What click leaves for the training command after `ckptrun launch ARGV` (the real parser)."""
    command = typer.main.get_command(app).commands["launch"]
    return command.make_context("launch", list(argv)).args


# --- item 1: a typo is refused, everything after SCRIPT is the script's ------------------------------


def test_a_typo_in_a_launch_option_is_refused_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    result = ckptrun("launch", "--nproc-per-nod", "2", "--name", "x", "train.py", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: No such option: --nproc-per-nod",
        "hint: did you mean --nproc-per-node? options go before SCRIPT; see `ckptrun launch --help`"]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("argv, script, rest", [
    (["--", "--steps", "2"], None, ["--steps", "2"]),  # after `--`: the default job's arguments
    (["--nproc-per-node", "2", "train.py", "--nproc-per-nod", "3", "--", "x"], Path("train.py"),
     ["--nproc-per-nod", "3", "--", "x"]),  # after SCRIPT: untouched, typos and `--` included
    (["--name", "x", "train.py"], Path("train.py"), []),
])
def test_options_end_at_script_or_double_dash(argv: list[str], script: Path | None, rest: list[str]) -> None:
    assert split_target(_launch_args(*argv)) == (script, rest)


def test_an_unknown_option_before_script_never_reaches_a_job() -> None:
    with pytest.raises(NoSuchOption) as caught:
        _launch_args("--steps", "2")
    assert caught.value.option_name == "--steps"


# --- item 3: the ranks' output on the launcher's terminal ---------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_ranks_output_reaches_the_launcher_prefixed_and_console_log_keeps_all(tmp_path: Path, cleanup: Cleanup) -> None:
    (tmp_path / "hello.py").write_text(HELLO)
    shown = {}
    for choice in ("all", "0"):
        cleanup.run_dir(tmp_path / "runs" / choice)
        result = ckptrun("launch", "--nproc-per-node", "2", "--startup-timeout", "60", "--name", choice,
                         "--ranks-output", choice, "hello.py", cwd=tmp_path, timeout=200)
        assert result.returncode == 0, result.stderr[-3000:]
        shown[choice] = result.stdout.splitlines()
        console = (tmp_path / "runs" / choice / "logs" / "attempt-1" / "console.log").read_text()
        for rank in (0, 1):
            assert f"[rank{rank}]:hello from rank {rank}" in console
            assert f"[rank{rank}]:a warning from rank {rank}" in console
    assert sorted(shown["all"]) == sorted(f"[rank{r}]:{what} from rank {r}" for r in (0, 1) for what in ("hello", "a warning"))
    assert sorted(shown["0"]) == ["[rank0]:a warning from rank 0", "[rank0]:hello from rank 0"]
    # item 8: resuming the completed run says so, exits 0 and starts nothing
    run_dir = tmp_path / "runs" / "all"
    resumed = ckptrun("resume", "--run-dir", str(run_dir), cwd=tmp_path, timeout=60)
    assert resumed.returncode == 0 and "already completed" in resumed.stderr, resumed.stderr
    assert len(read_events(run_dir, "attempt_start")) == 1 and not read_events(run_dir, "resume")
    assert not (run_dir / "logs" / "attempt-2").exists()


def test_a_stalled_terminal_never_holds_up_the_writers_or_the_launcher(tmp_path: Path) -> None:
    """The ranks write to console.log; only the follower thread waits for the terminal, and stop() gives up on it."""
    console, release, shown = tmp_path / "console.log", threading.Event(), []
    console.write_bytes(b"")
    follower = RankOutput(console, selector("1"), lambda line: (release.wait(30), shown.append(line)))
    with open(console, "ab") as log:
        log.write(b"W torchrun's own line\n[rank0]:not shown\n[rank1]:first\n")
        log.flush()
        wait_for(lambda: follower.offset > 0, timeout=20, what="the follower to read")
        log.write(b"[rank1]:second\n" * 10_000)  # the terminal is stalled: the writer goes on regardless
    follower.stop(timeout=0.2)
    assert follower.thread.is_alive() and shown == []
    release.set()
    follower.thread.join(20)
    assert not follower.thread.is_alive() and shown == ["[rank1]:first"] + ["[rank1]:second"] * 10_000


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_rank_line_wipes_the_status_line_which_is_drawn_again() -> None:
    terminal = _Terminal()
    progress = Progress(stream=terminal, out=terminal, interval=0.0)
    progress.show(Status(attempt=1, restarts=0, step=3))
    progress.echo("[rank0]:hello")
    progress.show(Status(attempt=1, restarts=0, step=3))
    assert terminal.getvalue() == ("\r\033[Kckptrun: attempt 1 | step 3 | snapshot - | restarts 0"
                                   "\r\033[K[rank0]:hello\n"
                                   "\r\033[Kckptrun: attempt 1 | step 3 | snapshot - | restarts 0")


# --- item 7: a periodic snapshot without being asked ------------------------------------------------


def test_no_cadence_given_means_save_every_auto_and_a_typed_one_wins(tmp_path: Path) -> None:
    assert build_spec({}).save_every == "auto"
    config = tmp_path / "run.toml"
    config.write_text('save-every = "auto"\n')
    spec = build_spec({"save_every_steps": 5}, config)  # the flag replaces the file's cadence: no contradiction
    assert (spec.save_every, spec.save_every_steps) == (None, 5)
    with pytest.raises(Exception, match="--save-every auto chooses the interval itself"):
        build_spec({"save_every_steps": 5, "save_every": "auto"})


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_the_default_job_saves_periodically_without_a_save_every_flag(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "auto")
    result = ckptrun("launch", "--startup-timeout", "60", "--name", "auto", "--mtbf", "1m",
                     "--", "--steps", "8", "--num-workers", "0", cwd=tmp_path, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "snapshots: auto: a snapshot after the first step" in result.stderr
    assert read_run_record(run_dir).spec.save_every == "auto"
    final = last_step(run_dir)
    periodic = [e["step"] for e in events(run_dir, "snapshot_saved") if e["step"] < final]
    assert periodic, events(run_dir, "snapshot_saved")  # the first step's save, which measures the save's cost δ
    assert "save cadence: a snapshot every" in result.stderr
    # then the cadence is Daly's interval of that measured δ and --mtbf (8 steps end well before it is due again)
    from ckptrun.cli.recovery_budget.rto_model import daly

    [change, *_] = events(run_dir, "cadence")
    assert change["mtbf_s"] == 60.0 and change["stall_s"] > 0, change
    assert change["daly_s"] == pytest.approx(daly(change["stall_s"], 60.0), rel=1e-12) and change["interval_s"] > 0, change


# --- item 8: smaller untruths ------------------------------------------------------------------------


def test_stop_takes_the_run_dir_its_hint_names(tmp_path: Path) -> None:
    nothing = ckptrun("stop", cwd=tmp_path, timeout=60)
    assert nothing.returncode == 2 and "hint: pass --run-dir RUN_DIR" in nothing.stderr, nothing.stderr
    run_dir = _run(tmp_path, "idle")
    idle = ckptrun("stop", "--run-dir", str(run_dir), cwd=tmp_path, timeout=60)
    assert idle.returncode == 2 and f"no supervisor is running {run_dir}" in idle.stderr, idle.stderr


def test_a_used_checkpoint_dir_is_refused_naming_its_run_and_creating_nothing(tmp_path: Path) -> None:
    owner = _run(tmp_path, "owner")
    make_snapshot(owner / "checkpoints", 1)
    result = ckptrun("launch", "--name", "new", "--ckpt-dir", str(owner / "checkpoints"), cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "already holds snapshots" in result.stderr, result.stderr
    assert f"`ckptrun resume --latest --run-dir {owner}`" in result.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["owner"]


def test_a_name_in_use_is_refused_and_an_auto_name_stays_unique(tmp_path: Path) -> None:
    taken = _run(tmp_path, "x")
    result = ckptrun("launch", "--name", "x", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and f"{Path('runs/x')} already holds a run" in result.stderr, result.stderr
    assert f"ckptrun resume --latest --run-dir runs/x" in result.stderr and "another --name" in result.stderr
    assert sorted(p.name for p in taken.parent.iterdir()) == ["x"]


def test_resume_of_a_completed_run_starts_nothing(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, "done")
    for event in ("launch", "attempt_start", "run_completed"):
        log_event(run_dir, event, attempt=1, step=7)
    result = ckptrun("resume", "--latest", "--json", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["exit_code"] == 0 and "already completed (step 7)" in result.stderr
    assert [e["event"] for e in read_events(run_dir)] == ["launch", "attempt_start", "run_completed"]


def test_the_status_line_after_a_resume_names_the_restored_snapshot(tmp_path: Path) -> None:
    out = io.StringIO()
    world = LocalWorld(LaunchSpec(), "r", RunPaths(tmp_path), tmp_path / "checkpoints", [], Progress(stream=out),
                       restored_step=10)
    world.show_progress(2, 0, None, {})
    assert "snapshot 10 |" in out.getvalue()


def test_config_keys_are_the_long_option_names(tmp_path: Path) -> None:
    options = set(json.loads((Path(__file__).parent / "fixtures" / "frozen_api.json").read_text())["commands"]["launch"])
    text = (TEMPLATES / "ckptrun.toml").read_text()
    keys = {found.group(1) for line in text.splitlines() if (found := re.match(r"^(?:# )?([a-z-]+) = ", line))}
    assert "allow-change" in keys and not [k for k in keys - {"script", "args"} if f"--{k}" not in options], keys
    config = tmp_path / "run.toml"
    for key in ("allow-change", "allow-changes"):  # the old key still reads
        config.write_text(f'{key} = ["lr"]\n')
        assert build_spec({}, config).allow_changes == ["lr"]
    assert text.endswith("\n") and tomllib.loads(text)


def test_init_writes_the_config_with_its_final_newline(tmp_path: Path) -> None:
    result = ckptrun("init", str(tmp_path / "p"), cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "p" / "ckptrun.toml").read_bytes() == (TEMPLATES / "ckptrun.toml").read_bytes()
    assert (tmp_path / "p" / "ckptrun.toml").read_bytes().endswith(b"\n") and result.stdout.endswith("\n")


def _run(tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    write_run_record(run_dir, RunRecord(run_id=name, spec=LaunchSpec(run_dir=run_dir)))
    return run_dir
