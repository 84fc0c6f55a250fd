"""`ckptrun --help` imports no command module; each command still loads, helps and completes as before.

The command list in ckptrun.cli.main names modules instead of importing them (issue 13: `--help` ≤ 0.2 s);
these tests hold the lazy table to the functions it stands for.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import typer.main

from ckptrun.cli.main import Commands, app

CKPTRUN = [sys.executable, "-m", "ckptrun.cli.main"]


def test_top_level_help_imports_no_command_module():
    modules = sorted({entry.module for entry in Commands.table.values()})
    code = ("import sys\nsys.argv = ['ckptrun', '--help']\nfrom ckptrun.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', [m for m in {modules!r} if m in sys.modules], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "LOADED [] False" in out
    assert all(f"  {name} " in out for name in Commands.table)  # every command is still listed


def test_each_help_row_is_its_commands_own_docstring():
    group = typer.main.get_command(app)
    for name, entry in Commands.table.items():
        command = group.commands[name]  # imports the module, builds the click command
        assert entry.summary == inspect.getdoc(command.callback).split("\n\n")[0].replace("\n", " "), name


def test_help_is_the_same_before_and_after_every_command_is_loaded():
    group = typer.main.get_command(app)
    lazy = group.get_help(typer.Context(group, info_name="ckptrun"))
    for name in list(group.commands):
        group.commands[name]
    assert group.get_help(typer.Context(group, info_name="ckptrun")) == lazy


def test_command_help_and_shell_completion_load_the_command():
    launch = subprocess.run([*CKPTRUN, "launch", "--help"], capture_output=True, text=True)
    assert launch.returncode == 0 and "--nproc-per-node" in launch.stdout and "Exit codes" in launch.stdout
    assert "[OPTIONS] [SCRIPT [ARGS]...]" in launch.stdout
    env = {**os.environ, "_CKPTRUN_COMPLETE": "complete_bash"}
    names = subprocess.run(CKPTRUN, env={**env, "COMP_WORDS": "ckptrun la", "COMP_CWORD": "1"},
                           capture_output=True, text=True)
    options = subprocess.run(CKPTRUN, env={**env, "COMP_WORDS": "ckptrun launch --nproc", "COMP_CWORD": "2"},
                             capture_output=True, text=True)
    assert names.stdout.split() == ["launch"]
    assert options.stdout.split() == ["--nproc-per-node"]
