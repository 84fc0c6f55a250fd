"""``ckptrun preflight [LAUNCH OPTIONS] [SCRIPT [ARGS...]]``: before a long run, prove the job learns, resumes exactly and fits its budgets.

The checklist engineers follow by hand before spending a cluster-week, run on
the real script with the real launch options (the same options as
``launch``, declared once there and reused here) in a scratch run directory,
``RUN_DIR-preflight``. Two short supervised runs do the measuring:

* ``learn`` — the script's first batch served at every step for
  ``--learn-steps`` steps (stopped after a minute): does the loss fall, does it
  stay finite; its step times give the speed, its first step the precision
  report;
* ``resume`` — a snapshot after step 5, a real SIGKILL after step 8, a
  relaunch under the supervisor that restores step 5 and replays steps 6–8:
  the losses and each tracked state's digest must come back; its records give
  the snapshot figures and a measured RTO.

:mod:`ckptrun.cli.commands.preflight_checks` turns the records into six verdicts. The
table goes to stdout (the verdict line last; ``--json``: one document), the
same document to ``RUN_DIR-preflight/preflight.json``; exit 0 when nothing
failed, 1 when something did, 2 for bad input. torch is imported only by the
ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Literal, Optional

import typer

from ckptrun.cli.commands import preflight_checks as checks
from ckptrun.cli.commands.launch import launch, launch_spec
from ckptrun.cli.errors import EXIT_NO, EXIT_OK, EXIT_REFUSED, CkptrunError, command
from ckptrun.cli.supervision.rundir import RUNS_ROOT, RunPaths, default_name
from ckptrun.cli.supervision.spec import LaunchSpec

REPORT = "preflight.json"
# a scratch run is asked to stop (save, exit 3) after this long, whatever its steps: learn's minute; resume's
# allowance covers two start-ups and a restart on a loaded machine (and an epoch loop, whose steps are its own)
PHASE_SECONDS = {"learn": 60.0, "resume": 180.0}
SAVE_STEP, REPLAYED = 5, 3  # resume run: snapshot after step 5, killed after step 8, replays 6..8
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class PreflightSpec(LaunchSpec):
    """A scratch run's spec: the user's, plus the C1 preflight fields (copied by name into the workers' RunEnv)."""

    preflight: Literal["learn", "resume"]
    preflight_steps: int


def _own_options(
    learn_steps: int = typer.Option(100, "--learn-steps", min=2, metavar="K", help="Steps on one repeated batch (stopped after 60 s).", rich_help_panel="Preflight"),
    learn_fall: float = typer.Option(0.5, "--learn-fall", min=0.0, max=1.0, metavar="FRACTION", help="How much of its first value the loss must lose on that batch.", rich_help_panel="Preflight"),
    free_space: Optional[str] = typer.Option(None, "--free-space", metavar="SIZE", help="Judge the disk against this much free space (e.g. 500G, the quota of the real run's storage) instead of this machine's.", rich_help_panel="Preflight"),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as one JSON document on stdout (also written to preflight.json)."),
) -> None:
    """Preflight's own options, declared here; the rest are launch's (its --json is preflight's own)."""


def preflight(ctx: typer.Context, **options: Any) -> int:
    """Before a long run: prove SCRIPT learns, resumes exactly and fits its budgets, with launch's options.

    \b
    Runs the script twice in RUN_DIR-preflight (about a minute on small jobs):
    1 learns (one batch repeated), 2 resumes exactly (save, kill, restore,
    replay), 3 speed, 4 snapshot, 5 budgets (disk, memory, RTO vs --rto-budget,
    Daly's interval at --mtbf), 6 precision. Exit 0 when nothing failed, 1
    when a check failed. Examples:
      ckptrun preflight --nproc-per-node 2 -- --steps 2000
      ckptrun preflight --config ckptrun.toml --rto-budget 2m
    """
    own = {name: options.pop(name) for name in inspect.signature(_own_options).parameters}
    spec = launch_spec(ctx, options.pop("config"), options.pop("standalone"), options)
    free = _size(own["free_space"]) if own["free_space"] is not None else None
    document = run_preflight(spec, own["learn_steps"], own["learn_fall"], free)
    if own["as_json"]:
        sys.stdout.write(json.dumps(document, indent=1) + "\n")
    else:
        sys.stdout.write(table(document))
    return EXIT_NO if document["verdict"] == checks.FAIL else EXIT_OK


def _with_launch_options(fn: Any) -> Any:
    """Give ``fn`` launch's parameters followed by preflight's own: one declaration of every launch option
    (``--spare`` aside: a preflight runs its own one-node trial, never as a job's spare)."""
    launch_params = [p for p in inspect.signature(launch, eval_str=True).parameters.values() if p.name not in ("as_json", "spare")]
    own = list(inspect.signature(_own_options, eval_str=True).parameters.values())
    fn.__signature__ = inspect.Signature([*launch_params, *own], return_annotation=int)
    fn.__annotations__ = {p.name: p.annotation for p in [*launch_params, *own]} | {"return": int}
    return fn


preflight = command(_with_launch_options(preflight))  # typer reads launch's options off the signature


def _size(text: str) -> int:
    match = SIZE.match(text)
    unit = (match.group(2) or "").lower().rstrip("b") if match else ""
    if not match or unit not in UNITS:
        raise CkptrunError(f"--free-space {text!r} is not a size", "for example --free-space 500G, 2TiB or 1000000 (bytes)")
    return int(float(match.group(1)) * UNITS[unit])


# --- the two scratch runs -----------------------------------------------------------------


def scratch_dir(spec: LaunchSpec) -> Path:
    """``RUN_DIR-preflight`` beside where the real run would go; an old preflight's is replaced."""
    run_dir = spec.run_dir or RUNS_ROOT / (spec.name or default_name(spec.script))
    root = run_dir.with_name(run_dir.name + "-preflight").absolute()
    if root.exists() and any(root.iterdir()):
        if not (root / REPORT).exists():
            raise CkptrunError(f"{root} exists and is not a preflight's scratch directory",
                               "pass another --name or --run-dir, or remove it")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / REPORT).write_text("{}")  # marks the directory as preflight's while it runs
    return root


def _ask_stop(run_dir: Path) -> None:
    """The phase's time is up: ask its ranks to stop (nothing to ask if the run never started)."""
    with contextlib.suppress(OSError):
        RunPaths(run_dir).stop_file.touch()


def run_phase(spec: LaunchSpec, root: Path, mode: str, steps: int, **updates: Any) -> tuple[Path, int, str]:
    """One supervised run of the script in ``root/mode``; its run dir, exit code and last message."""
    run_dir = root / mode
    phase = PreflightSpec.model_validate({
        **spec.model_dump(), "save_every": None, "save_every_seconds": None, "name": f"{root.name}-{mode}",
        "run_dir": run_dir, "ckpt_dir": run_dir / "checkpoints", "ranks_output": "none", "inject_fault": None,
        "rto_budget": None, "strict_budget": False, "time_limit": None, "memory_every_steps": 0,  # resume: from disk
        **updates, "preflight": mode,
        "preflight_steps": steps})
    from ckptrun.cli.recovery_budget import rto_launch
    from ckptrun.cli.supervision.runner import start_run

    print(f"ckptrun preflight: {mode} run in {run_dir}", file=sys.stderr, flush=True)
    timer = threading.Timer(PHASE_SECONDS[mode], _ask_stop, (run_dir,))
    timer.start()
    try:
        with open(root / f"{mode}.out", "w") as out, contextlib.redirect_stdout(out):
            return run_dir, start_run(phase, argv=["ckptrun", "preflight", mode], estimator=rto_launch), ""
    except CkptrunError as exc:
        if exc.exit_code == EXIT_REFUSED:  # refused before anything ran (no such script, fp8): bad input, exit 2
            shutil.rmtree(root, ignore_errors=True)  # and leave nothing behind
            with contextlib.suppress(OSError):
                root.parent.rmdir()  # runs/, if preflight made it
            raise
        return run_dir, exc.exit_code, exc.message
    finally:
        timer.cancel()


def run_preflight(spec: LaunchSpec, learn_steps: int, learn_fall: float, free: int | None) -> dict[str, Any]:
    """Both scratch runs, then the six checks, written to ``preflight.json``."""
    root = scratch_dir(spec)
    learn_dir, code, message = run_phase(spec, root, "learn", learn_steps, save_every_steps=learn_steps, max_restarts=0)
    script_steps = _script_steps(learn_dir)
    results = [checks.learns(learn_dir, learn_fall)]
    if code not in (0, 3) and results[0].verdict != checks.FAIL:
        results[0] = checks.Check("learns", checks.FAIL, f"exit {code}", f"the learn run failed: {message}")
    if checks.plain(learn_dir) or code not in (0, 3):
        why = checks.NEEDS_RUNTIME if checks.plain(learn_dir) else "the learn run failed"
        skip = {name: checks.Check(name, checks.SKIPPED, "-", why) for name in checks.NAMES[1:]}
        if code in (0, 3):  # a plain script that ran: its optimizer steps have times
            skip["speed"] = checks.speed(learn_dir, script_steps)
        results += list(skip.values())
    else:
        kill = SAVE_STEP + REPLAYED
        resume_dir, _, _ = run_phase(spec, root, "resume", kill + 2, save_every_steps=SAVE_STEP, max_restarts=1,
                                     inject_fault=f"kill:rank=0:step={kill}")
        snap = checks.snapshot(resume_dir, resume_dir / "checkpoints")
        results += [checks.resumes(resume_dir, spec.deterministic), checks.speed(learn_dir, script_steps), snap,
                    checks.budgets(spec, snap, resume_dir, script_steps, free), checks.precision(learn_dir)]
    document = _document(spec, root, results)
    (root / REPORT).write_text(json.dumps(document, indent=1))
    return document


def _script_steps(run_dir: Path) -> int | None:
    from ckptrun.runtime import records

    asked = [e.get("script_steps") for e in records.read_events(run_dir, "preflight")]
    return asked[0] if asked else None


def _document(spec: LaunchSpec, root: Path, results: list[checks.Check]) -> dict[str, Any]:
    verdicts = [r.verdict for r in results]
    verdict = checks.FAIL if checks.FAIL in verdicts else checks.WARN if checks.WARN in verdicts else checks.PASS
    return {"schema_version": 1, "verdict": verdict, "scratch_dir": str(root),
            "script": str(spec.script) if spec.script else None, "world_size": spec.world_size,
            "checks": [r.to_json() for r in results],
            "skipped": [r.name for r in results if r.verdict == checks.SKIPPED]}


def table(document: dict[str, Any]) -> str:
    """One row per check (CHECK, VERDICT, FIGURE, REASON), then the verdict line."""
    rows = [("CHECK", "VERDICT", "FIGURE", "REASON")]
    rows += [(c["name"], c["verdict"].upper(), c["figure"], c["reason"]) for c in document["checks"]]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3] for row in rows]
    failed = [c["name"] for c in document["checks"] if c["verdict"] == checks.FAIL]
    skipped = f"; skipped: {', '.join(document['skipped'])}" if document["skipped"] else ""
    if failed:
        verdict = f"preflight: FAIL ({', '.join(failed)}){skipped} — details in {document['scratch_dir']}/{REPORT}"
    else:
        verdict = f"preflight: {document['verdict'].upper()}{skipped}: launch it with the same options"
    return "\n".join(lines + ["", verdict]) + "\n"
