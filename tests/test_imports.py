"""Import hygiene: the CLI and the contract modules load without torch (style habit 11)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from snapshot_factory import make_snapshot

CONTRACTS = ["env", "manifest", "hashing", "records", "faults", "storage.store", "storage.ckpt_url", "checkpoint.verify",
             "checkpoint.policies", "step.preflight", "worker.bootstrap"]


def torch_loaded_after(statement: str) -> bool:
    code = f"import sys\n{statement}\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip() == "True"


@pytest.mark.parametrize(
    "module", ["ckptrun.cli.main", "ckptrun.cli.commands.verify", *(f"ckptrun.runtime.{name}" for name in CONTRACTS)]
)
def test_module_imports_without_torch(module: str) -> None:
    assert not torch_loaded_after(f"import {module}"), f"importing {module} pulled in torch"


def run_main(*argv: str) -> subprocess.CompletedProcess:
    """Run the CLI's main() in a fresh interpreter and report whether torch got loaded."""
    code = (
        "import sys\n"
        "from ckptrun.cli.main import main\n"
        f"sys.argv = ['ckptrun', *{list(argv)!r}]\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code or 0\n"
        "print('TORCH', 'torch' in sys.modules, 'EXIT', code)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_verify_runs_without_torch(tmp_path: Path) -> None:
    make_snapshot(tmp_path / "ckpt", 1)
    result = run_main("verify", str(tmp_path / "ckpt"))
    assert result.stdout.splitlines()[-1] == "TORCH False EXIT 0", result.stderr


def test_help_shows_exit_codes_without_torch() -> None:
    result = run_main("--help")
    assert result.stdout.splitlines()[-1] == "TORCH False EXIT 0", result.stderr
    assert "Exit codes" in result.stdout
    for number in ("0", "1", "2", "3", "4", "101"):
        assert any(line.split()[:1] == [number] for line in result.stdout.splitlines()), number
    assert "verify" in result.stdout


def test_console_script_help_and_version() -> None:
    script = Path(sys.executable).parent / "ckptrun"
    if not script.exists():
        pytest.skip("console script not installed next to this python")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "Exit codes" in result.stdout
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("ckptrun ")
