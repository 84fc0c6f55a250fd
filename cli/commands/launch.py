"""``ckptrun launch``, ``ckptrun resume`` and ``ckptrun stop``: the commands and their options.

Options keep torchrun's names. ``launch`` reads ``--config FILE`` (TOML, keys
as the long option names) and lets the flags a person typed override it; the
spec is validated in :mod:`ckptrun.cli.supervision.spec`. Everything after the options —
``SCRIPT [ARGS...]``, passed on untouched, or ``-- ARGS`` for the embedded
default job — is the training command. Importable without torch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ckptrun.cli.commands.which_run import chosen_run, positional_run_dir, run_dir_argument, run_dir_option
from ckptrun.cli.errors import EXIT_NO, EXIT_OK, EXIT_REFUSED, CkptrunError, command
from ckptrun.cli.recovery_budget import rto_launch
from ckptrun.cli.store_location import redact_argv, resume_options
from ckptrun.cli.supervision.rundir import RunPaths, alive, holder, node_holders
from ckptrun.cli.supervision.runner import next_attempt, resume_run, start_run
from ckptrun.cli.supervision.node_env import node_fields, node_settings, resume_settings
from ckptrun.cli.supervision.memory_tier import refuse_unsupported
from ckptrun.cli.supervision import script_args
from ckptrun.cli.supervision.spec import RENAMED, LaunchSpec, build_spec, read_run_record
from ckptrun.runtime import faults, records

# Options end at the first word that is not one (SCRIPT) or at `--`; an unknown option before that is a typo,
# refused by click with a did-you-mean (rendered by ckptrun.cli.main), never handed to a job.
LAUNCH_CONTEXT = {"allow_extra_args": True, "allow_interspersed_args": False}
TORCHRUN, RUN, POLICY, SUPERVISION = "torchrun", "Run directory", "Checkpoint policy (C1)", "Supervision"
RECOVERY = "Recovery budget and checks"


def _opt(flag: str, help: str, panel: str, **kw: Any) -> Any:
    return typer.Option(None, flag, help=help, rich_help_panel=panel, show_default=False, **kw)


def split_target(args: list[str]) -> tuple[Optional[Path], list[str]]:
    """``SCRIPT ARGS...`` or only ``ARGS`` (for the default job): a first word that is not an option is SCRIPT.

    ``args`` is what click left after launch's own options; a first word that is an option can only have
    come after ``--`` (click refuses unknown options before SCRIPT), so those are the default job's.
    """
    if args and not args[0].startswith("-"):
        return Path(args[0]), args[1:]
    return None, list(args)


@command
def launch(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file of options (keys = long option names); flags override it."),
    nproc_per_node: Optional[str] = _opt("--nproc-per-node", "Ranks on this node (number, auto, cpu, gpu). [default: 1]", TORCHRUN),
    nnodes: Optional[str] = _opt("--nnodes", "Nodes (N or MIN:MAX): one launch per node, node rank 0 leads; also read from PET_* and SLURM_*. [default: 1]", TORCHRUN),
    node_rank: Optional[int] = _opt("--node-rank", "This node's rank (0 hosts the job's store).", TORCHRUN),
    standalone: bool = typer.Option(False, "--standalone", help="Fresh local rendezvous per attempt (the default).", rich_help_panel=TORCHRUN),
    spare: bool = typer.Option(False, "--spare", help="Many nodes: join the job as a hot spare (no rank) that takes a lost node's place at once, with the job's other flags and no --node-rank.", rich_help_panel=TORCHRUN),
    master_addr: Optional[str] = _opt("--master-addr", "Rendezvous address with --master-port.", TORCHRUN),
    master_port: Optional[int] = _opt("--master-port", "Fixed rendezvous port (default: a fresh one per attempt).", TORCHRUN),
    rdzv_backend: Optional[str] = _opt("--rdzv-backend", "torchrun rendezvous backend.", TORCHRUN),
    rdzv_endpoint: Optional[str] = _opt("--rdzv-endpoint", "torchrun rendezvous endpoint (HOST:PORT of node rank 0, the same on every node).", TORCHRUN),
    local_addr: Optional[str] = _opt("--local-addr", "This node's address in the rendezvous, as torchrun takes it (c10d orders the nodes' ranks by it). [default: the host's FQDN]", TORCHRUN),
    coord_port: Optional[int] = _opt("--coord-port", "Port of the job's store on node rank 0 (many nodes). [default: rendezvous port + 1]", TORCHRUN),
    node_join_timeout: Optional[str] = _opt("--node-join-timeout", "How long the leader waits for a lost node's relaunched launcher. [default: 300s]", SUPERVISION),
    name: Optional[str] = _opt("--name", "Run name. [default: SCRIPT-STEM-DATE-TIME]", RUN),
    run_dir: Optional[Path] = _opt("--run-dir", "Run directory. [default: runs/NAME]", RUN),
    ckpt_dir: Optional[str] = _opt("--ckpt-dir", "Checkpoint directory, or an object-store URL (s3://BUCKET/PREFIX, any fsspec URL). [default: RUN_DIR/checkpoints]", RUN),
    local_cache: Optional[Path] = _opt("--local-cache", "With a URL --ckpt-dir: keep each snapshot in DIR too, for fast restores (many nodes: each node its own DIR, holding its ranks' files). [default: staging in RUN_DIR/staging]", RUN, metavar="DIR"),
    storage_option: Optional[list[str]] = _opt("--storage-option", "fsspec option of a URL --ckpt-dir, KEY=VALUE (repeatable), e.g. endpoint_url=http://minio:9000.", RUN, metavar="KEY=VALUE"),
    precision: Optional[str] = _opt("--precision", "auto, fp32, tf32, bf16, fp16 or fp8. [default: auto]", POLICY),
    save_every_steps: Optional[int] = _opt("--save-every-steps", "Save a snapshot every N steps.", POLICY),
    save_every_seconds: Optional[str] = _opt("--save-every-seconds", "Save when this long passed since the last save (90, 15m).", POLICY),
    save_every: Optional[str] = _opt("--save-every", "auto: the interval follows Daly's formula from the measured save cost and --mtbf (first save after the first step).", POLICY, metavar="auto"),
    mtbf: Optional[str] = _opt("--mtbf", "Mean time between failures assumed by --save-every auto (e.g. 6h). [default: 24h]", POLICY, metavar="DURATION"),
    async_save: Optional[bool] = typer.Option(None, "--async-save/--sync-save", help="Persist snapshots in the background (the step waits only for staging). [default: async]", rich_help_panel=POLICY, show_default=False),
    save_overlap: Optional[str] = _opt("--save-overlap", "A save due while one is in flight: wait or skip. [default: wait]", POLICY),
    keep_last: Optional[int] = _opt("--keep-last", "Verified snapshots kept besides milestones. [default: 3]", POLICY),
    keep_every: Optional[int] = _opt("--keep-every", "Snapshots at multiples of M steps are kept forever.", POLICY),
    paranoid_retention: Optional[bool] = _opt("--paranoid-retention", "Before retention deletes, re-hash the newest snapshot read past the page cache (default: manifest + sizes).", POLICY),
    memory_every_steps: Optional[str] = _opt("--memory-every-steps", "Memory tier: a snapshot every N steps into /dev/shm, which a restart on this node restores first (auto: ~1% overhead; 0: off). [default: 0]", POLICY, metavar="N|auto"),
    node_group: Optional[str] = _opt("--node-group", "Many nodes: this node's failure domain (a rack, a switch): memory replicas go to nodes of other groups first. [default: the switch in SLURM_TOPOLOGY_ADDR, else none]", POLICY, metavar="NAME"),
    memory_dir: Optional[Path] = _opt("--memory-dir", "The memory tier's directory on this node (a tmpfs: its RAM), created and deleted by the launch. [default: /dev/shm/ckptrun-RUN-HOST, many nodes: ...-nodeK]", POLICY, metavar="DIR"),
    memory_keep: Optional[int] = _opt("--memory-keep", "Memory-tier snapshots kept in /dev/shm (plus one being written). [default: 2]", POLICY),
    memory_replicas: Optional[int] = _opt("--memory-replicas", "Many nodes: copy each node's memory snapshots to R other nodes, verified on receipt, so a lost node restores from memory (0: off). [default: 1 with several nodes]", POLICY, metavar="R"),
    init_weights: Optional[Path] = _opt("--init-weights", "Start from these weights when there is no snapshot to restore: a .safetensors file or a Hugging Face directory (model.safetensors, or shards + index); hashed here, loaded strictly into the tracked model.", POLICY, metavar="PATH"),
    decision_every_steps: Optional[str] = _opt("--decision-every-steps", "Steps whose losses and stop/save requests the ranks share in one collective; a stop is agreed at most N steps late (auto: ~1 exchange per 250 ms, N <= 32; 1: every step). [default: auto]", POLICY, metavar="N|auto"),
    seed: Optional[int] = _opt("--seed", "Base seed (rank r uses seed + r). [default: 0]", POLICY),
    deterministic: Optional[bool] = typer.Option(None, "--deterministic/--no-deterministic", help="Deterministic algorithms (exact resume). [default: on]", rich_help_panel=POLICY, show_default=False),
    threads: Optional[int] = _opt("--threads", "torch threads per rank.", POLICY),
    allow_change: Optional[str] = _opt("--allow-change", "Comma-separated config keys that may change on resume.", POLICY),
    allow_reshard: Optional[bool] = _opt("--allow-reshard", "Restarts may resume snapshots written at another world size (RNG reseeded: not bitwise exact).", POLICY),
    hash_algorithm: Optional[str] = _opt("--hash-algorithm", "Digest of snapshot files: sha256 or blake3 (pip install blake3). [default: sha256]", POLICY),
    max_failed_saves: Optional[int] = _opt("--max-failed-saves", "Consecutive failed saves that end the run (exit 1). [default: 3]", POLICY),
    on_anomaly: Optional[str] = _opt("--on-anomaly", "A non-finite or spiking loss: warn, stop (exit 4) or rollback. [default: warn]", POLICY),
    on_replica_divergence: Optional[str] = _opt("--on-replica-divergence", "Replicas that differ across ranks at a save: restart, stop (exit 4) or warn. [default: restart]", POLICY),
    replica_check_every_steps: Optional[int] = _opt("--replica-check-every-steps", "Also compare the replicas across ranks every N steps between saves (a mismatch as at a save). [default: at saves]", POLICY),
    anomaly_sigma: Optional[float] = _opt("--anomaly-sigma", "A spike is a loss above mean + sigma·std of the window. [default: 6]", POLICY),
    max_rollbacks: Optional[int] = _opt("--max-rollbacks", "Rollbacks before an anomaly stops the run. [default: 3]", POLICY),
    inject_fault: Optional[str] = _opt("--inject-fault", "Fault spec for tests and demos, e.g. kill:rank=1:step=17 (see README).", POLICY),
    max_restarts: Optional[int] = _opt("--max-restarts", "Restarts before giving up (exit 1). [default: 3]", SUPERVISION),
    restart_args: Optional[str] = _opt("--restart-args", "Arguments appended to the script's on every restart and on resume, e.g. \"--resume\" (CKPTRUN_RESTART=1 is set then too).", SUPERVISION, metavar='"ARGS"'),
    heartbeat_timeout: Optional[str] = _opt("--heartbeat-timeout", "A training rank silent this long is hung. [default: 300s]", SUPERVISION),
    startup_timeout: Optional[str] = _opt("--startup-timeout", "Allowance for start-up and restore. [default: 600s]", SUPERVISION),
    save_timeout: Optional[str] = _opt("--save-timeout", "Allowance for one snapshot save. [default: 900s]", SUPERVISION),
    grace_period: Optional[str] = _opt("--grace-period", "Time to save and exit after a stop; SIGTERM→SIGKILL wait. [default: 60s]", SUPERVISION),
    time_limit: Optional[str] = _opt("--time-limit", "Wall-clock budget (e.g. 3h50m → 13800): stop, saved, before it (exit 3).", SUPERVISION),
    stop_signal: Optional[str] = _opt("--stop-signal", "Extra signal meaning 'save and stop' (e.g. SIGUSR1 for Slurm --signal).", SUPERVISION),
    max_stalled_restarts: Optional[int] = _opt("--max-stalled-restarts", "Restarts in a row without a new snapshot before giving up (exit 4). [default: 2]", SUPERVISION),
    restart_backoff: Optional[float] = _opt("--restart-backoff", "Seconds before the second restart (none before the first); doubles each time. [default: 1]", SUPERVISION),
    standby: Optional[bool] = typer.Option(None, "--standby/--no-standby", help="Keep the next attempt's torchrun agent started and waiting, so that a restart skips its start-up. [default: on]", rich_help_panel=SUPERVISION, show_default=False),
    warm_workers: Optional[bool] = typer.Option(None, "--warm-workers/--no-warm-workers", help="Fork the ranks from the torchrun agent, past `import torch` (off: a new interpreter per rank, for a script that does not tolerate fork). [default: on]", rich_help_panel=SUPERVISION, show_default=False),
    rto_budget: Optional[str] = _opt("--rto-budget", "Estimate the RTO after the first snapshot; warn when it exceeds this (e.g. 2m). Caps --save-every auto.", RECOVERY, metavar="DURATION"),
    strict_budget: Optional[bool] = _opt("--strict-budget", "With --rto-budget: stop the run (saved, exit 1) when the estimate is over it.", RECOVERY),
    require_exact_resume: Optional[bool] = _opt("--require-exact-resume", "End the run (exit 4) when a resume's replayed losses diverge from the originals (ranks then share facts every step unless --decision-every-steps is given).", RECOVERY),
    ranks_output: Optional[str] = _opt("--ranks-output", "Ranks whose output the launcher shows, prefixed [rankN]: all, none, or ranks like 0 or 0,3 (logs/attempt-N/console.log keeps all). [default: all]", SUPERVISION, metavar="all|none|RANKS"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (run id, dir, exit code) on stdout."),
) -> int:
    """Launch SCRIPT [ARGS...] with torchrun under supervision: restart from the newest verified snapshot on a crash or hang.

    \b
    Options end at SCRIPT: what follows goes to it untouched.
    Without SCRIPT the embedded default job runs with the ARGS after `--`.
    An unknown option before SCRIPT is refused (exit 2).
    Examples:
      ckptrun launch --nproc-per-node 2 train.py --lr 3e-4
      ckptrun launch --nproc-per-node 2 --save-every-steps 5 -- --steps 40
    """
    options = {key: value for key, value in locals().items() if key not in ("ctx", "config", "standalone", "as_json", "spare")}
    if spare and node_rank is not None:
        raise CkptrunError("--spare takes no --node-rank: the leader gives a spare the rank of the node it replaces",
                           "leave --node-rank out (pass the job's --nnodes, --rdzv-endpoint and --name)", EXIT_REFUSED)
    settings = node_settings(node_fields(options), os.environ)
    if spare and not settings.multi_node:
        raise CkptrunError("--spare needs a job of several nodes", "pass the job's --nnodes N (N > 1), "
                           "--rdzv-endpoint and --name", EXIT_REFUSED)
    if settings.multi_node:  # one launcher per node: the leader's store coordinates them (imports torch)
        from ckptrun.cli.supervision.many_nodes import start_nodes, start_spare

        options.update(nnodes=settings.nnodes, node_rank=settings.node_rank, rdzv_endpoint=settings.rdzv_endpoint,
                       rdzv_backend=settings.rdzv_backend, name=settings.job_id, coord_port=settings.store_port,
                       master_addr=None, master_port=None)
        start = start_spare if spare else start_nodes
        return start(launch_spec(ctx, config, standalone, options), settings, argv=redact_argv(sys.argv), as_json=as_json,
                     estimator=rto_launch)
    return start_run(launch_spec(ctx, config, standalone, options), argv=redact_argv(sys.argv), as_json=as_json,
                     estimator=rto_launch)


def launch_spec(ctx: typer.Context, config: Optional[Path], standalone: bool, options: dict[str, Any]) -> LaunchSpec:
    """The spec from launch's options (by parameter name) and SCRIPT ARGS; ``ckptrun preflight`` takes the same."""
    script, script_args = split_target(ctx.args)
    flags = {RENAMED.get(key, key): value for key, value in options.items()}  # --allow-change → allow_changes
    if standalone and options.get("master_port") is not None:
        raise CkptrunError("--standalone and --master-port contradict each other", "pass one of them")
    spec = build_spec({**flags, "script": script, "script_args": script_args or None}, config)
    refuse_unsupported(spec)  # the memory tier: a writable tmpfs, a --memory-dir of its own (exit 2 before anything exists)
    return with_init_weights(spec)


def with_init_weights(spec: LaunchSpec) -> LaunchSpec:
    """``--init-weights``: readable safetensors (their headers, exit 2 otherwise), absolute, and hashed once here."""
    if spec.init_weights is None:
        return spec
    from ckptrun.runtime.checkpoint import hf_weights

    path = spec.init_weights.expanduser().resolve()
    try:
        hf_weights.tensor_names(path)
        digest = hf_weights.digest(path)
    except ImportError:
        raise CkptrunError("--init-weights needs the safetensors and huggingface_hub packages",
                           "pip install 'ckptrun[export]'", EXIT_REFUSED) from None
    except (hf_weights.WeightsError, OSError) as exc:
        raise CkptrunError(f"--init-weights: {exc}", "pass a .safetensors file or a directory that "
                           "`ckptrun export --format hf` (or save_pretrained) wrote", EXIT_REFUSED) from None
    return spec.model_copy(update={"init_weights": path, "init_weights_sha256": digest})


RESUME_CONTEXT = {"allow_extra_args": True}  # [RUN_DIR] among the options, `-- NEW SCRIPT ARGS` after them


@command
def resume(
    ctx: typer.Context,
    latest: bool = typer.Option(False, "--latest", help="From the newest verified snapshot of the run's lineage (the default)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="The run to continue (or RUN_DIR before `--`). [default: the newest under runs/, by its start time]", show_default=False),
    source: Optional[str] = typer.Option(None, "--from", metavar="STEP_OR_PATH", help="Resume from this snapshot instead; forks the lineage there.", show_default=False),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", help="Override the run's restart budget.", show_default=False),
    time_limit: Optional[str] = typer.Option(None, "--time-limit", help="Wall-clock budget of this resume.", show_default=False),
    allow_change: Optional[str] = typer.Option(None, "--allow-change", help="Config keys that may differ from the snapshot's.", show_default=False),
    nproc_per_node: Optional[str] = typer.Option(None, "--nproc-per-node", help="Ranks on this node, as launch takes it; another world size than the snapshot's needs --allow-reshard.", show_default=False),
    allow_reshard: bool = typer.Option(False, "--allow-reshard", help="Resume a snapshot written at another world size: tensors and the data position reshard, per-rank RNG is reseeded (judged within tolerance, never exact)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="Many nodes: this node's rank (or PET_NODE_RANK, SLURM_NODEID); run resume on every node.", show_default=False),
    storage_option: Optional[list[str]] = typer.Option(None, "--storage-option", metavar="KEY=VALUE", help="fsspec option of the run's object store, over the stored ones (repeatable); credentials are never stored, so pass them again.", show_default=False),
    replace_args: bool = typer.Option(False, "--replace-args", help="The arguments after -- replace all the stored ones (default: each overrides the stored option of its name)."),
    inject_fault: Optional[str] = typer.Option(None, "--inject-fault", help="Fault spec of this resume, over the stored one (a stored fault that can no longer fire is dropped); none drops it.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> int:
    """Continue a stopped, failed or preempted run from its newest verified snapshot, with its run.json spec.

    Arguments after -- override the stored options of the same name and keep the rest (--replace-args:
    replace them all); a config key that changes must be allowed. The effective command line is printed.
    """
    positional, new_args = positional_run_dir(list(ctx.args), sys.argv)
    if latest and source:
        raise CkptrunError("--latest and --from contradict each other", "pass one of them")
    overrides: dict[str, Any] = {"max_restarts": max_restarts, "allow_changes": allow_change,
                                 "script_args": new_args or None, "allow_reshard": allow_reshard or None}
    if nproc_per_node is not None:
        overrides["nproc_per_node"] = build_spec({"nproc_per_node": nproc_per_node}).nproc_per_node
    if time_limit is not None:
        overrides["time_limit"] = build_spec({"time_limit": time_limit}).time_limit
    if allow_change is not None:
        overrides["allow_changes"] = build_spec({"allow_changes": allow_change}).allow_changes
    if max_restarts is not None:
        build_spec({"max_restarts": max_restarts})
    run_dir = chosen_run(positional, run_dir)
    spec = read_run_record(run_dir).spec
    if new_args and not replace_args:
        overrides["script_args"] = script_args.merge(spec.script_args, new_args)
    if inject_fault is not None:  # `none`: the stored fault (a demo's kill) is not fired again
        overrides["inject_fault"] = "" if inject_fault.strip().lower() == "none" else build_spec({"inject_fault": inject_fault}).inject_fault
    elif spec.inject_fault:  # the stored one: what can still fire (a kill demo's attempt-1 kill cannot)
        overrides["inject_fault"] = _pending_faults(spec, overrides.get("nproc_per_node"), next_attempt(run_dir))
    if storage_option:
        overrides["store_options"] = resume_options(spec, storage_option)
    if spec.nnodes.split(":")[-1] != "1":  # a many-node run: resume runs on every node, node rank 0 leads
        from ckptrun.cli.supervision.many_nodes import resume_nodes

        if source:
            raise CkptrunError("--from is not supported for a many-node run yet", "resume with --latest on every node")
        return resume_nodes(run_dir, resume_settings(spec, node_rank, os.environ), overrides, argv=redact_argv(sys.argv),
                            as_json=as_json, estimator=rto_launch)
    return resume_run(run_dir, source, overrides, argv=redact_argv(sys.argv), as_json=as_json, estimator=rto_launch)


def _pending_faults(spec: LaunchSpec, nproc_per_node: str | None, first_attempt: int) -> str:
    """The stored faults a resume from ``first_attempt`` can still fire ("": none); the others are dropped,
    said in one line, so that a kill demo's fault never blocks a resume at another world size."""
    world = spec.model_copy(update={"nproc_per_node": nproc_per_node or spec.nproc_per_node}).world_size
    kept, spent = faults.pending(spec.inject_fault, first_attempt, world)
    if spent:
        why = "; ".join(f"{part} ({reason})" for part, reason in spent.items())
        print(f"ckptrun: dropping the stored --inject-fault that can no longer fire on this resume (attempt "
              f"{first_attempt} on): {why}", file=sys.stderr)
    return kept or ""


@command
def stop(
    run_dir: Optional[Path] = run_dir_argument(),
    run_dir_flag: Optional[Path] = run_dir_option(),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the supervisor has saved and exited."),
    timeout: float = typer.Option(600.0, "--timeout", help="Longest wait in seconds."),
) -> int:
    """Ask a running launch to save a snapshot at the next step boundary and exit 3 (resumable)."""
    run_dir = chosen_run(run_dir, run_dir_flag)
    paths = RunPaths(run_dir)
    if not paths.run_json.exists():
        raise CkptrunError(f"{run_dir} is not a ckptrun run directory", "pass the RUN_DIR that `ckptrun launch` printed")
    # one node: its supervisor; many nodes: the launchers on this host (any node may ask, every node stops)
    here = [who] if (who := holder(paths)) else [h for h in node_holders(paths.root).values() if h["alive"]]
    if not here:
        raise CkptrunError(f"no supervisor is running {run_dir} on this host", _nothing_to_stop(paths), EXIT_REFUSED)
    paths.stop_file.touch()
    what = ("this script does not use ckptrun.runtime, so it cannot be asked to save: its ranks get SIGTERM"
            if records.read_events(paths.root, "plain_script") else "ranks save at the next step boundary")
    print(f"ckptrun: asked supervisor pid {', '.join(str(h['pid']) for h in here)} to stop {run_dir}: {what}", file=sys.stderr)
    if not wait:
        return EXIT_OK
    deadline = time.monotonic() + timeout
    for who in here[1:]:
        _wait_for_exit(int(who["pid"]), float(who["start_time"]), paths, max(0.0, deadline - time.monotonic()), quiet=True)
    return _wait_for_exit(int(here[0]["pid"]), float(here[0]["start_time"]), paths, max(0.0, deadline - time.monotonic()))


def _nothing_to_stop(paths: RunPaths) -> str:
    """The hint for a run no supervisor runs: a completed run has nothing to continue; any other resumes."""
    from ckptrun.cli.commands.status_facts import run_state

    if run_state(records.read_events(paths.root), alive=False) == "completed":
        return f"nothing to stop: the run completed (`ckptrun status {paths.root}` shows it)"
    return f"nothing to stop; `ckptrun resume --latest --run-dir {paths.root}` continues it"


def _wait_for_exit(pid: int, start_time: float, paths: RunPaths, timeout: float, quiet: bool = False) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid, start_time):
            break
        time.sleep(0.2)
    else:
        raise CkptrunError(f"supervisor pid {pid} has not exited after {timeout:g}s", "it is still saving or hung; "
                           f"wait, or signal it twice (kill -TERM {pid}) to kill the ranks", EXIT_NO)
    if quiet:
        return EXIT_OK
    stopped = records.read_events(paths.root, "run_stopped")
    last = stopped[-1] if stopped else {}
    if last.get("plain_script"):
        how = "did not exit cleanly on SIGTERM" if last.get("forced") else "exited cleanly on SIGTERM"
        print(f"ckptrun: stopped; the script {how}", file=sys.stderr)
        return EXIT_OK
    if last.get("framework"):
        print(f"ckptrun: stopped; the script saved its checkpoint at step {last.get('step')}: {last.get('checkpoint')}",
              file=sys.stderr)
        return EXIT_OK
    print(f"ckptrun: stopped; newest verified snapshot: step {last.get('snapshot_step')}", file=sys.stderr)
    return EXIT_OK
