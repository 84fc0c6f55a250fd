"""``ckptrun preflight``: real scratch runs (2 CPU ranks, real kill and relaunch), one verdict per check.

The default job runs once for the whole module (every check passes; ``--json``
is one valid document, also written as ``preflight.json``); char-gpt once
with the table output. Failing cases are scripts derived from the default job:
one whose output is detached from the graph (it cannot learn), run against a
disk too small (``--free-space``) and an RTO budget of 1 ms; one that does not
track its scheduler (the resume check names it). A plain torchrun script gets
the checks that apply and names those skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptrun.cli.commands.preflight import table
from ckptrun.cli.supervision.attempt import default_job
from launch_helpers import FIXTURES, ckptrun

pytestmark = [pytest.mark.e2e]
FAST = ["--nproc-per-node", "2", "--heartbeat-timeout", "5", "--startup-timeout", "60", "--restart-backoff", "0.1"]
CHECKS = ["learns", "resumes", "speed", "snapshot", "budgets", "precision"]
TEMPLATES = Path(default_job()).parent


def preflight(*args: str, cwd: Path, name: str = "job") -> tuple[int, str, str, dict]:
    result = ckptrun("preflight", *FAST, "--run-dir", str(cwd / name), *args, cwd=cwd, timeout=240)
    document = json.loads((cwd / f"{name}-preflight" / "preflight.json").read_text())
    return result.returncode, result.stdout, result.stderr, document


def by_name(document: dict) -> dict[str, dict]:
    return {check["name"]: check for check in document["checks"]}


def derived_job(tmp_path: Path, name: str, *changes: tuple[str, str]) -> Path:
    """The default job with each (old, new) text replaced."""
    text = (TEMPLATES / "default_job.py").read_text()
    for old, new in changes:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str, dict]:
    cwd = tmp_path_factory.mktemp("preflight-default")
    return preflight("--json", "--", "--steps", "200", cwd=cwd)


@pytest.mark.timeout(300)
def test_default_job_passes_every_check(default_run):
    code, stdout, stderr, document = default_run
    assert code == 0, stderr[-3000:]
    assert json.loads(stdout) == document  # --json: one document on stdout, the same as preflight.json
    checks = by_name(document)
    assert list(checks) == CHECKS and document["verdict"] == "pass" and document["skipped"] == []
    assert all(c["verdict"] == "pass" for c in checks.values()), checks
    assert checks["learns"]["facts"]["fall"] >= 0.5
    assert checks["resumes"]["facts"]["verdict"] == "exact" and checks["resumes"]["facts"]["states_lost"] is None
    assert checks["speed"]["facts"]["script_steps"] == 200 and checks["speed"]["facts"]["finish_s"] > 0
    assert checks["snapshot"]["facts"]["bytes"] > 0 and checks["snapshot"]["facts"]["restore_s"] is not None
    assert checks["budgets"]["facts"]["rto_s"] > 0 and checks["budgets"]["facts"]["daly_s"] > 0
    assert checks["precision"]["facts"]["report"]["mode"] in ("fp32", "bf16")


@pytest.mark.timeout(300)
def test_default_job_table_ends_with_the_verdict(default_run):
    lines = table(default_run[3]).splitlines()
    assert lines[0].split()[:4] == ["CHECK", "VERDICT", "FIGURE", "REASON"]
    assert [line.split()[:2] for line in lines[1:7]] == [[name, "PASS"] for name in CHECKS]
    assert lines[-1].startswith("preflight: PASS")


# The char-GPT template passing every check (`--steps 2000`): test_readme.py::test_every_readme_command_runs runs
# the tutorial's preflight of it and asserts each verdict.


@pytest.mark.timeout(300)
def test_detached_output_small_disk_and_1ms_budget_fail(tmp_path):
    script = derived_job(tmp_path, "detached.py", ("forward=lambda batch: model(batch[0])",
                                                   "forward=lambda batch: model(batch[0]).detach().requires_grad_()"))
    code, stdout, _, document = preflight("--free-space", "1K", "--rto-budget", "1ms", str(script), cwd=tmp_path)
    checks = by_name(document)
    assert code == 1 and document["verdict"] == "fail"
    assert checks["learns"]["verdict"] == "fail" and "cannot overfit one batch" in checks["learns"]["reason"]
    assert checks["budgets"]["verdict"] == "fail"
    assert "the disk cannot hold" in checks["budgets"]["reason"] and checks["budgets"]["facts"]["disk_free_bytes"] == 1000
    assert "RTO over --rto-budget 1 ms; the largest part is" in checks["budgets"]["reason"]
    assert stdout.splitlines()[-1].startswith("preflight: FAIL (learns, budgets)")


@pytest.mark.timeout(300)
def test_untracked_scheduler_fails_the_resume_check_naming_it(tmp_path):
    script = derived_job(tmp_path, "untracked.py", ("scheduler=scheduler, ", ""),  # stepped by the script, never saved
                         ("    if run.rank == 0 and run.step % 10 == 0:", "    scheduler.step()\n    if run.rank == 0 and run.step % 10 == 0:"))
    code, _, _, document = preflight(str(script), cwd=tmp_path)
    resumes = by_name(document)["resumes"]
    assert code == 1 and resumes["verdict"] == "fail", resumes
    assert resumes["reason"].startswith("scheduler (learning rate) did not come back"), resumes
    assert by_name(document)["learns"]["verdict"] == "pass"


@pytest.mark.timeout(300)
def test_plain_script_gets_the_checks_that_apply(tmp_path):
    code, stdout, _, document = preflight(str(FIXTURES / "plain_ddp.py"), "--out", str(tmp_path / "own"), "--steps", "40",
                                          "--step-time", "0.1", cwd=tmp_path)
    checks = by_name(document)
    assert code == 0 and document["skipped"] == ["learns", "resumes", "snapshot", "budgets", "precision"]
    assert all("needs ckptrun.runtime" in checks[name]["reason"] for name in document["skipped"])
    assert checks["speed"]["verdict"] in ("pass", "warn") and checks["speed"]["facts"]["step_s"] > 0
    assert "skipped: learns, resumes, snapshot, budgets, precision" in stdout.splitlines()[-1]


def test_bad_input_exits_2(tmp_path):
    result = ckptrun("preflight", "--free-space", "lots", cwd=tmp_path)
    assert result.returncode == 2 and "error: --free-space 'lots' is not a size" in result.stderr
    result = ckptrun("preflight", "--precision", "fp7", cwd=tmp_path)
    assert result.returncode == 2 and "--precision" in result.stderr
    result = ckptrun("preflight", "--run-dir", str(tmp_path / "job"), str(tmp_path / "missing.py"), cwd=tmp_path)
    assert result.returncode == 2 and "missing.py does not exist" in result.stderr
