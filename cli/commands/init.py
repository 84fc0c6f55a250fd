"""``ckptrun init [DIR]``: start a new project from a template — a training script and a commented config.

Templates ship inside the package (``ckptrun.templates``) and are read with
:mod:`importlib.resources`, so ``init`` works from a wheel as well as from a
checkout. Nothing is overwritten without ``--force``; every file is checked
before the first one is written. Importable without torch.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import typer
from ckptrun.cli.errors import EXIT_OK, CkptrunError, command

CONFIG = "ckptrun.toml"
DEFAULT_TEMPLATE = "minimal"


@dataclass(frozen=True)
class Template:
    """What a template is for, and which packaged files it copies where (source → destination)."""

    summary: str
    files: tuple[tuple[str, str], ...]
    run: str = f"ckptrun launch --config {CONFIG}"  # the command to type next


TEMPLATES = {
    "minimal": Template("an MLP on data it generates: the smallest complete script (the embedded default job)",
                        (("default_job.py", "train.py"),)),
    "char-gpt": Template("a character-level GPT on a bundled text: DDP, accumulation, clipping, EMA, LR schedule",
                         (("char_gpt.py", "train.py"), ("data/tiny.txt", "data/tiny.txt"))),
    "fsdp": Template("a small GPT sharded with FSDP2 (fully_shard) on data it generates: CPU ranks or GPUs, unchanged",
                     (("fsdp.py", "train.py"),)),
    "slurm": Template("the minimal script plus an sbatch file: one `ckptrun launch` per node, saved and requeued "
                      "on preemption", (("default_job.py", "train.py"), ("slurm.sbatch", "slurm.sbatch")),
                      run="sbatch slurm.sbatch"),
}


@command
def init(
    directory: Path = typer.Argument(Path("."), metavar="DIR", help="Where to put the files (created if missing). [default: .]", show_default=False),
    template: str = typer.Option(DEFAULT_TEMPLATE, "--template", "-t", metavar="NAME", help="Which template (--list names them)."),
    list_templates: bool = typer.Option(False, "--list", help="Name the templates, one line each, and exit."),
    force: bool = typer.Option(False, "--force", help="Overwrite files that already exist."),
) -> int:
    """Copy a training script template and a commented ckptrun.toml into DIR, then print the next commands.

    \b
    Examples:
      ckptrun init my-run
      ckptrun init my-gpt --template char-gpt
      ckptrun init my-fsdp --template fsdp
      ckptrun init my-job --template slurm
      ckptrun init --list
    """
    if list_templates:
        width = max(map(len, TEMPLATES))
        sys.stdout.write("".join(f"{name:<{width}}  {t.summary}\n" for name, t in TEMPLATES.items()))
        return EXIT_OK
    chosen = _template(template)
    copies = [(source, directory / dest) for source, dest in (*chosen.files, (CONFIG, CONFIG))]
    existing = [dest for _, dest in copies if dest.exists()]
    if existing and not force:
        raise CkptrunError(f"{existing[0]} already exists" + (f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""),
                           "pass --force to overwrite, or choose another DIR")
    for source, dest in copies:
        _copy(source, dest)
    print(f"ckptrun: wrote {', '.join(str(dest) for _, dest in copies)} (template {template})", file=sys.stderr)
    sys.stdout.write("".join(f"{line}\n" for line in next_commands(directory, chosen.run)))
    return EXIT_OK


def _template(name: str) -> Template:
    if name not in TEMPLATES:
        raise CkptrunError(f"no template named {name!r}", f"choose one of: {', '.join(TEMPLATES)} (`ckptrun init --list`)")
    return TEMPLATES[name]


def _copy(source: str, dest: Path) -> None:
    data = files("ckptrun.templates").joinpath(source).read_bytes()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)


def next_commands(directory: Path, launch: str = f"ckptrun launch --config {CONFIG}") -> list[str]:
    """What to type next: go there (unless already there), then launch with the config (or submit the job)."""
    if directory.resolve() == Path.cwd().resolve():
        return [launch]
    return [f"cd {shlex.quote(str(directory))}", launch]
