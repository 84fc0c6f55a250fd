"""What a person types after `launch`: `init`, `status`, `report`, `export` — on a real recovered run.

One module-scoped run serves most tests: `ckptrun init` a project, then
`ckptrun launch` its copied template on 2 CPU ranks with rank 1 killed after
step 12, so the run has a failure, a restart from snapshot step 10, replayed
steps and a completion. The char-GPT template runs under plain torchrun.
Cheap commands run in-process through typer's CliRunner; import hygiene and
"no TTY" are checked in real subprocesses.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ckptrun.cli.commands.export import read_weights
from ckptrun.cli.commands.status_facts import StepRates, progress, rank_rows, run_state, step_budget
from ckptrun.cli.main import app
from ckptrun.cli.supervision.policy import Timeouts
from ckptrun.cli.supervision.spec import build_spec
from ckptrun.runtime.records import Heartbeat, read_events, read_metrics
from launch_helpers import Cleanup, ckptrun
from snapshot_factory import flip_byte, make_snapshot
from torch import nn
from typer.testing import CliRunner
from workers import run_job, shared_tensors

TEMPLATES = Path(__file__).parent.parent / "templates"
HIDDEN = "64"  # the minimal template's --hidden for these runs (default 640): a smaller model, the same code


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """init → launch of the copied minimal template, rank 1 killed after step 12: one restart, then done."""
    project = tmp_path_factory.mktemp("project")
    made = cli("init", str(project))
    assert made.exit_code == 0, made.stderr
    cleanup = Cleanup()
    run_dir = cleanup.run_dir(project / "runs" / "demo")
    try:
        launch = ckptrun("launch", "--config", "ckptrun.toml", "--run-dir", "runs/demo", "--save-every-steps", "5",
                         "--inject-fault", "kill:rank=1:step=12", "--restart-backoff", "0",
                         # facts shared every step: the killed attempt's line 11 (and 12, unless rank 0's teardown
                         # came first) exist for the report's replay
                         "--decision-every-steps", "1",
                         "--", "--steps", "20", "--num-workers", "0", "--hidden", HIDDEN, cwd=project, timeout=240)
    finally:
        cleanup.close()
    assert launch.returncode == 0, launch.stderr[-3000:]
    return SimpleNamespace(project=project, run_dir=run_dir, init=made, launch=launch)


# --- init ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_init_then_launch_of_the_copied_template_recovers(recovered: SimpleNamespace) -> None:
    assert recovered.init.stdout.splitlines() == [f"cd {recovered.project}", "ckptrun launch --config ckptrun.toml"]
    assert (recovered.project / "train.py").read_text() == (TEMPLATES / "default_job.py").read_text()
    restart = read_events(recovered.run_dir, "restart")
    assert len(restart) == 1 and restart[0]["snapshot_step"] == 10
    assert max(r["step"] for r in read_metrics(recovered.run_dir)) == 20


def test_init_lists_refuses_to_overwrite_and_forces(tmp_path: Path) -> None:
    listed = cli("init", "--list")
    assert listed.exit_code == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()] == ["minimal", "char-gpt", "fsdp", "slurm"]
    assert cli("init", str(tmp_path), "--template", "char-gpt").exit_code == 0
    assert (tmp_path / "data" / "tiny.txt").stat().st_size > 2000
    again = cli("init", str(tmp_path), "--template", "char-gpt")
    assert again.exit_code == 2 and "already exists" in again.stderr and "--force" in again.stderr
    (tmp_path / "train.py").write_text("# mine\n")
    assert cli("init", str(tmp_path), "--template", "char-gpt", "--force").exit_code == 0
    assert (tmp_path / "train.py").read_text() == (TEMPLATES / "char_gpt.py").read_text()
    unknown = cli("init", str(tmp_path / "x"), "--template", "nope")
    assert unknown.exit_code == 2 and "minimal, char-gpt, fsdp" in unknown.stderr


def test_the_commented_config_uses_only_launch_keys(tmp_path: Path) -> None:
    """The template's config validates as it is, and with every commented-out setting switched on."""
    text = (TEMPLATES / "ckptrun.toml").read_text()
    assert build_spec({}, TEMPLATES / "ckptrun.toml").script == Path("train.py")
    switched = [re.sub(r"^# ([a-z-]+ = .*?)(\s+#.*)?$", r"\1", line) for line in text.splitlines()]
    assert sum(a != b for a, b in zip(switched, text.splitlines())) >= 10
    (tmp_path / "all.toml").write_text("\n".join(switched))
    spec = build_spec({}, tmp_path / "all.toml")
    assert spec.time_limit == 230 * 60 and spec.hash_algorithm == "blake3" and spec.script_args == ["--steps", "200"]


@pytest.mark.e2e
def test_char_gpt_template_trains_on_two_ranks_under_plain_torchrun(tmp_path: Path) -> None:
    assert cli("init", str(tmp_path), "--template", "char-gpt").exit_code == 0
    run_dir = tmp_path / "runs" / "gpt"
    result = run_job(run_dir, nproc=2, script=tmp_path / "train.py", args=("--steps", "6", "--sample-chars", "40"),
                     save_every_steps=3, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert "sample (EMA weights)" in result.stdout
    snapshot = run_dir / "checkpoints" / "step-000000006"
    weights = read_weights(snapshot, "ema")  # tied embedding/head weights export as two equal tensors
    assert torch.equal(weights["wte.weight"], weights["lm_head.weight"])
    assert not any(key.startswith("module.") for key in weights) and "n_averaged" not in weights


# --- status ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_status_json_on_a_recovered_run_without_torch(recovered: SimpleNamespace) -> None:
    code = ("import sys\nfrom ckptrun.cli.main import main\n"
            f"sys.argv = ['ckptrun', 'status', {str(recovered.run_dir)!r}, '--json']\n"
            "try:\n    main()\nexcept SystemExit as exit:\n    sys.stderr.write(f'EXIT {exit.code}')\n"
            "sys.stderr.write(f' TORCH {\"torch\" in sys.modules}')\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.stderr.endswith("TORCH False"), result.stderr
    doc = json.loads(result.stdout)
    assert (doc["state"], doc["attempt"], doc["restarts"], doc["failures"]) == ("completed", 2, 1, 1)
    assert doc["progress"]["step"] == 20 and doc["progress"]["total_steps"] == 20 and doc["progress"]["eta_s"] is None
    assert doc["snapshot"]["step"] == 20 and doc["snapshot"]["verified"] and doc["snapshot"]["bytes"] > 0
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(not r["alive"] and r["phase"] == "done" and r["steps_per_s"] is None and not r["flags"] for r in doc["ranks"])
    assert doc["rto"]["restarts_measured"] == 1 and doc["rto"]["rto_s"] > 0
    assert set(doc["rto"]["components_s"]) == {"detect", "teardown", "verify", "backoff", "restart"}


@pytest.mark.e2e
def test_status_watch_without_a_tty_prints_once(recovered: SimpleNamespace) -> None:
    """No RUN_DIR: the most recent run under runs/; stdout is a pipe, so --watch prints once and exits 0."""
    result = ckptrun("status", "--watch", cwd=recovered.project, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "\033[" not in result.stdout and result.stdout.count("RANK") == 1
    assert "attempt 2" in result.stdout and "1 restart(s)" in result.stdout and "step 20/20" in result.stdout
    over = cli("status", str(recovered.run_dir), "--rto-budget", "1ms")
    assert over.exit_code == 1 and "OVER" in over.stdout


def test_status_flags_stale_ranks_and_stragglers_from_heartbeat_samples() -> None:
    import os

    now = time.time() + 100  # beats "written" after this process started, so it counts as their live writer
    rates = StepRates()

    def beats(at: float, steps: tuple[int, int, int]) -> dict[int, Heartbeat]:
        return {r: Heartbeat(rank=r, pid=os.getpid(), attempt=1, step=s, phase="train", time=at) for r, s in enumerate(steps)}

    rates.add(beats(now - 40, (0, 0, 0)))
    first = rank_rows(beats(now - 40, (0, 0, 0)), rates, Timeouts(heartbeat=30), now)
    assert all(row["steps_per_s"] is None and row["flags"] == ["stale"] for row in first)  # one look: no rate yet
    later = beats(now, (100, 96, 50))
    rates.add(later)
    rows = rank_rows(later, rates, Timeouts(heartbeat=30), now)
    assert [row["flags"] for row in rows] == [[], [], ["straggler"]]
    assert rows[0]["steps_per_s"] == pytest.approx(2.5)


def test_status_progress_rate_and_eta_come_from_the_latest_attempt() -> None:
    metrics = [{"step": s, "attempt": 1, "loss": 1.0, "time": 100.0 + s} for s in range(1, 13)]
    metrics += [{"step": s, "attempt": 2, "loss": 0.5, "time": 200.0 + 2 * s, "samples_per_s": 64.0} for s in range(11, 21)]
    running = progress(metrics, total=100, state="running")
    assert (running["step"], running["steps_per_s"], running["eta_s"], running["samples_per_s"]) == (20, 0.5, 160.0, 64.0)
    assert progress(metrics, total=100, state="recovering")["eta_s"] is None
    assert step_budget(build_spec({"script_args": ["--lr", "1", "--steps=300"]}), None) == 300


@pytest.mark.parametrize(("events", "alive", "state"), [
    ([], True, "running"),
    (["launch", "attempt_start", "failure"], True, "recovering"),
    (["launch", "attempt_start", "failure", "attempt_start"], True, "running"),
    (["launch", "attempt_start", "run_completed"], False, "completed"),
    (["launch", "attempt_start", "run_stopped", "resume", "attempt_start"], False, "not running"),
    (["launch", "attempt_start", "failure", "gave_up"], False, "failed"),
])
def test_status_run_state_follows_the_event_log(events: list[str], alive: bool, state: str) -> None:
    assert run_state([{"event": name} for name in events], alive) == state


def test_status_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    result = cli("status", str(tmp_path))
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "hint: " in result.stderr


# --- report ------------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.e2e
def test_report_draws_the_restart_and_names_it(recovered: SimpleNamespace, tmp_path: Path) -> None:
    result = cli("report", str(recovered.run_dir), "-o", str(tmp_path / "demo.png"), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    width, height = png_size(tmp_path / "demo.png")
    assert width >= 400 and height >= 300
    page = (tmp_path / "demo.html").read_text()
    assert "data:image/png;base64," in page and "restart 1 (attempt 2)" in page and "crash (SIGKILL)" in page
    (replay,) = doc["summary"]["replays"]  # step 12's shared line exists if rank 0 wrote it before its teardown
    assert (replay["attempt"], replay["first_step"], replay["identical"], replay["max_abs_diff"]) == (2, 11, True, 0.0)
    assert replay["last_step"] in (11, 12) and replay["steps"] == replay["last_step"] - 10
    assert doc["summary"]["restart_details"][0]["rank"] == 1


def test_report_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text("")
    code = ("import sys\nsys.modules['matplotlib'] = None\nfrom ckptrun.cli.main import main\n"
            f"sys.argv = ['ckptrun', 'report', {str(tmp_path)!r}]\nmain()\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "hint: pip install 'ckptrun[report]'" in result.stderr


# --- export ------------------------------------------------------------------------------------


def minimal_template_model(hidden: int) -> nn.Module:
    """The architecture of templates/default_job.py (the minimal template)."""
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Dropout(), nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(),
                         nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(), nn.Linear(hidden, 10))


@pytest.mark.e2e
def test_export_round_trips_into_a_fresh_model(recovered: SimpleNamespace, tmp_path: Path) -> None:
    stored = shared_tensors(recovered.run_dir / "checkpoints" / "step-000000020")
    out = cli("export", str(recovered.run_dir), "-o", str(tmp_path / "model.pt"))  # the run dir: its newest verified
    assert out.exit_code == 0, out.stderr
    assert "step-000000020" in out.stderr
    model = minimal_template_model(int(HIDDEN))
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, stored[f"model.{name}"]), name
    ema = cli("export", str(recovered.run_dir / "checkpoints" / "step-000000020"), "--ema", "-o", str(tmp_path / "ema.safetensors"))
    assert ema.exit_code == 0, ema.stderr
    from safetensors.torch import load_file

    model.load_state_dict(load_file(tmp_path / "ema.safetensors"), strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, stored[f"ema.module.{name}"]), name


def test_export_refuses_unverified_snapshots_missing_ema_and_unknown_formats(tmp_path: Path) -> None:
    snapshot = make_snapshot(tmp_path / "ckpt", 1, files={"state.json": b'{"objects": {"model": {}}}', "blob.bin": b"x" * 64})
    no_ema = cli("export", str(snapshot), "--ema", "-o", str(tmp_path / "w.pt"))
    assert no_ema.exit_code == 2 and "no `ema`" in no_ema.stderr and "drop --ema" in no_ema.stderr
    suffix = cli("export", str(snapshot), "-o", str(tmp_path / "w.bin"))
    assert suffix.exit_code == 2 and ".safetensors" in suffix.stderr
    flip_byte(snapshot / "blob.bin")
    bad = cli("export", str(snapshot), "-o", str(tmp_path / "w.pt"))
    assert bad.exit_code == 1 and "does not verify" in bad.stderr and "blob.bin" in bad.stderr
    assert not (tmp_path / "w.pt").exists()
    code = ("import sys\nsys.modules['safetensors'] = None\nfrom ckptrun.cli.main import main\n"
            f"sys.argv = ['ckptrun', 'export', {str(snapshot)!r}, '-o', {str(tmp_path / 'w.safetensors')!r}]\nmain()\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "pip install 'ckptrun[export]'" in result.stderr
