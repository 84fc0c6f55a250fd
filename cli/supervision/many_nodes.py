"""``launch`` and ``resume`` on many nodes: one launcher per node, node rank 0 leads.

The leader hosts the job's store first (a busy port: exit 2 before anything
is written), does what one node does (refuses a used run dir or store prefix,
writes ``run.json``), writes a fresh token into the checkpoint directory and
publishes it — and only then picks (and hashes) the snapshot, so the others
never wait on a large verify to connect. Every other node must read the same
token from *its* checkpoint directory — the directory must be one storage
everywhere — or is refused (exit 2). The others join within the start-up
allowance: they read the leader's ``run.json`` from the shared run dir and
run its spec as node ``k``, with their own ``--memory-dir``, ``--local-cache``
(a cache of the node's own ranks' files: :mod:`ckptrun.runtime.checkpoint.node_cache`)
and ``--local-addr``. torch is imported (for the store) only here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ckptrun.cli.errors import EXIT_REFUSED, EXIT_REQUEUE, CkptrunError
from ckptrun.cli.supervision import spares
from ckptrun.cli.supervision.attempt import NODE_VARIABLE, RUN_ID_VARIABLE
from ckptrun.cli.supervision.job_store import JobStore, StoreUnreachable
from ckptrun.cli.supervision.node_env import NodeSettings
from ckptrun.cli.supervision.node_world import NodePaths
from ckptrun.cli.supervision.observation import Snapshot
from ckptrun.cli.supervision.rundir import RUNS_ROOT, RunLock
from ckptrun.cli.supervision.runner import (_refuse_used, _refuse_used_store, ckpt_dir_of, next_attempt,
                                            resume_snapshot, supervise_run)
from ckptrun.cli.supervision.standby import StandbyKeeper
from ckptrun.cli.supervision.spec import LaunchSpec, RunRecord, build_spec, read_run_record, write_run_record
from ckptrun.cli.supervision.world import Estimator
from ckptrun.runtime import records
from ckptrun.runtime.storage.ckpt_url import merge_options

TOKEN_NAME = ".ckptrun-storage-token"  # in the checkpoint dir: every node must read what the leader wrote
JOIN_POLL_S = 0.5
NODE_CHOICES_FILE = "own.json"  # in a node's dir: the --local-cache and --node-group its launch named, for a resume


def start_nodes(spec: LaunchSpec, settings: NodeSettings, argv: list[str], as_json: bool, estimator: Estimator) -> int:
    """``ckptrun launch --nnodes N``: the leader creates the run, the others join it."""
    run_dir = spec.run_dir or RUNS_ROOT / str(settings.job_id)
    paths = NodePaths(run_dir, node=settings.node_rank)
    if settings.leader:
        _refuse_used(paths, ckpt_dir_of(spec, run_dir))
        _refuse_used_store(spec)
    elif (spare := _spare_holding(settings)) is not None:  # the scheduler relaunched a node a spare replaced
        print(f"ckptrun: node rank {settings.node_rank} is held by spare {spare}, which replaced it: joining as a spare",
              file=sys.stderr, flush=True)
        return start_spare(spec, settings, argv, as_json, estimator)
    return _node_run(paths, settings, argv, as_json, estimator, spec=spec)


def start_spare(spec: LaunchSpec, settings: NodeSettings, argv: list[str], as_json: bool, estimator: Estimator) -> int:
    """``ckptrun launch --spare``: wait in the job's store until the leader gives this launcher a lost node's
    rank, then run that node (:mod:`ckptrun.cli.supervision.spares`); or end with the job."""
    run_dir = spec.run_dir or RUNS_ROOT / str(settings.job_id)
    job, _ = _join(NodePaths(run_dir, node=settings.node_rank), settings, spec.ckpt_dir, spec.startup_timeout)

    def say(line: str) -> None:
        print(f"ckptrun: {line}", file=sys.stderr, flush=True)

    run_id = str(settings.job_id)
    keeper = StandbyKeeper(spec.standby, run_id, run_dir / spares.SPARES_DIR / "standby.log", lambda *_, **__: None,
                           warm=spec.forks_ranks)

    def keep_warm(spare: int) -> None:  # the first attempt's agent, past its imports while the spare waits
        keeper.prepare({RUN_ID_VARIABLE: run_id, NODE_VARIABLE: spares.standby_label(spare)})

    try:
        spare, node, verdict = spares.wait_for_promotion(job, run_dir, say, keep_warm)
    except BaseException:
        keeper.close()
        raise
    if node is None:
        keeper.close()
        if verdict is None:
            raise CkptrunError(f"spare {spare}: lost the job's leader (node 0) while waiting", "nothing ran here: "
                               "start the spare again with the job", EXIT_REQUEUE)
        say(f"spare {spare}: the job ended while this launcher waited ({verdict['message']})")
        return int(verdict["code"])
    say(f"spare {spare}: promoted to node rank {node}")
    settings = dataclasses.replace(settings, node_rank=node, spare=spare)
    return _node_run(NodePaths(run_dir, node=node), settings, argv, as_json, estimator, spec=spec, job=job,
                     standby=keeper)


def _spare_holding(settings: NodeSettings) -> int | None:
    """The spare that holds this launcher's node rank now (it replaced the node), or None (none did, or the
    leader is not up yet: a first launch)."""
    try:
        job = JobStore.connect(str(settings.job_id), settings.host, settings.store_port, timeout_s=2.0)
        return spares.held_by_spare(job, settings.node_rank)
    except StoreUnreachable:
        return None


def resume_nodes(run_dir: Path, settings: NodeSettings, overrides: dict[str, Any], argv: list[str], as_json: bool,
                 estimator: Estimator) -> int:
    """``ckptrun resume --latest`` on every node: the leader applies the overrides (run.json, which the others
    read) and picks the newest verified snapshot."""
    paths = NodePaths(run_dir, node=settings.node_rank)
    return _node_run(paths, settings, argv, as_json, estimator, spec=None, overrides=overrides)


def _node_run(paths: NodePaths, settings: NodeSettings, argv: list[str], as_json: bool, estimator: Estimator,
              spec: LaunchSpec | None, overrides: dict[str, Any] | None = None, job: JobStore | None = None,
              standby: StandbyKeeper | None = None) -> int:
    paths.node_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(paths):
        if settings.leader:
            job = host_job_store(settings)  # first: the others connect while the leader picks the snapshot
            try:
                record = _lead(paths, settings, argv, spec, overrides or {})
                _publish_token(job, record, paths)
                first, resume = (1, None) if spec is not None else _pick_snapshot(paths, settings, record, argv)
            except CkptrunError as exc:  # a bad override, no snapshot to resume: the others end with this verdict
                _tell_others(job, settings, exc, (spec.grace_period if spec is not None else 10.0))
                raise
        else:
            own = spec if spec is not None else read_run_record(paths.root).spec  # a resume: run.json is there
            if job is None:
                job, record = _join(paths, settings, spec.ckpt_dir if spec is not None else None, own.startup_timeout)
            else:  # a promoted spare: joined (and checked) already
                record = read_run_record(paths.root)
            record = with_own_secrets(record, own)
            # --memory-dir names this node's own memory (the leader's run.json holds the leader's): a resume, which
            # takes no --memory-dir, uses the node's default one
            record.spec.node_memory_dir = own.node_memory_dir if spec is not None else None
            record.spec.local_addr = own.local_addr  # this node's address, never the leader's
            first, resume = 1, None
        # this node's own --local-cache and --node-group (a resume: as recorded at its launch)
        unrecorded = {"cache_dir": record.spec.cache_dir if settings.leader else None,
                      "node_group": record.spec.node_group if settings.leader else None}
        mine = _own_choices(paths, spec, unrecorded)
        record.spec.cache_dir, record.spec.node_group = mine["cache_dir"], mine["node_group"]
        record.spec.node_rank = settings.node_rank
        return supervise_run(record, paths, first, resume, as_json, estimator=estimator, settings=settings,
                             store=job, standby=standby)


def _own_choices(paths: NodePaths, spec: LaunchSpec | None, unrecorded: dict[str, Any]) -> dict[str, Any]:
    """This node's ``--local-cache`` and ``--node-group`` (the leader's run.json holds the leader's): those its
    launch named (the group by default from Slurm's topology), recorded in its node dir for a resume, which
    takes neither (``unrecorded`` when the launch recorded nothing)."""
    recorded = paths.node_dir / NODE_CHOICES_FILE
    if spec is None:
        try:
            return {**unrecorded, **json.loads(recorded.read_text())}
        except (OSError, ValueError):
            return unrecorded
    mine = {"cache_dir": str(spec.cache_dir.resolve()) if spec.cache_dir is not None else None,
            "node_group": spec.node_group or topology_group(os.environ)}
    recorded.write_text(json.dumps(mine))
    return mine


def topology_group(environ: Any) -> str | None:
    """The switch above this node in Slurm's topology (``SLURM_TOPOLOGY_ADDR`` ``s0.s3.node17`` → ``s0.s3``):
    nodes under one leaf switch share its failure, so it is their default ``--node-group``."""
    address = str(environ.get("SLURM_TOPOLOGY_ADDR") or "")
    return address.rsplit(".", 1)[0] if "." in address else None


def with_own_secrets(record: RunRecord, own: LaunchSpec) -> RunRecord:
    """A non-leader node runs the leader's ``run.json``, which never holds credentials: its ranks upload with
    the ``--storage-option`` credentials given to this node's own launcher, merged over what the leader wrote."""
    record.spec.store_secrets = merge_options(record.spec.store_secrets or {}, own.store_secrets or {})
    return record


def host_job_store(settings: NodeSettings) -> JobStore:
    """The leader's store at the coordination port; a port it cannot bind is refused (exit 2) with the fix."""
    try:
        return JobStore.host(str(settings.job_id), settings.host, settings.store_port)
    except StoreUnreachable as exc:
        raise CkptrunError(f"node rank 0 cannot host the job's store at {settings.host}:{settings.store_port} ({exc})",
                           "pass a free --coord-port PORT (the same on every node), and run node rank 0 on the host "
                           "--rdzv-endpoint names") from None


def _lead(paths: NodePaths, settings: NodeSettings, argv: list[str], spec: LaunchSpec | None,
          overrides: dict[str, Any]) -> RunRecord:
    """run.json as every node will read it: a new run's, or the resumed run's with the overrides applied."""
    if spec is not None:  # a new run
        spec.run_dir, spec.ckpt_dir = paths.root.resolve(), ckpt_dir_of(spec, paths.root).resolve()
        record = RunRecord(run_id=str(settings.job_id), argv=argv, spec=spec)
        write_run_record(paths.root, record)
        records.log_event(paths.root, "launch", run_id=record.run_id, argv=argv, spec=spec.model_dump(mode="json"),
                          nnodes=settings.nnodes)
        return record
    record = read_run_record(paths.root)
    given = {key: value for key, value in overrides.items() if value is not None}
    if given:  # written before the token: the other nodes read run.json once the leader's token is there
        record.spec = build_spec({**record.spec.model_dump(), **given})
        write_run_record(paths.root, record)
    return record


def _publish_token(job: JobStore, record: RunRecord, paths: NodePaths) -> None:
    token = uuid.uuid4().hex
    ckpt_dir = ckpt_dir_of(record.spec, paths.root)
    if not record.spec.store_url:  # an object-store URL names one storage for every node already
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / TOKEN_NAME).write_text(token)
    job.set_token(token)


def _pick_snapshot(paths: NodePaths, settings: NodeSettings, record: RunRecord,
                   argv: list[str]) -> tuple[int, Snapshot | None]:
    """A resume's snapshot, as ``resume_run`` picks it (:func:`resume_snapshot`; None for a script that resumes
    from its own files)."""
    snapshot = resume_snapshot(record.spec.node_cache_dir or ckpt_dir_of(record.spec, paths.root), record,
                               paths.root)  # a node's cache: this node's files there, the rest downloaded into it
    first = next_attempt(paths.root)
    records.log_event(paths.root, "resume", attempt=first, snapshot=str(snapshot.path) if snapshot else None,
                      snapshot_step=snapshot.step if snapshot else None, argv=argv, forked=False, nnodes=settings.nnodes)
    return first, snapshot


def _tell_others(job: JobStore, settings: NodeSettings, exc: CkptrunError, wait_s: float) -> None:
    """Publish the leader's refusal as the job's verdict and give the joined nodes a moment to read it."""
    others = [n for n in range(settings.max_nodes) if n != settings.node_rank]
    with contextlib.suppress(StoreUnreachable):  # the store is gone: there is nobody left to tell
        job.set_verdict("gave_up", exc.exit_code, exc.message, hint=exc.hint, restarts=0)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if set(others) <= set(job.teardown_acks("end", others)):  # every other node read it
                return
            time.sleep(JOIN_POLL_S)


def _join(paths: NodePaths, settings: NodeSettings, own_ckpt_dir: Path | None,
          startup_s: float) -> tuple[JobStore, RunRecord]:
    """Connect to the leader's store (it may start later: up to the start-up allowance), check the storage."""
    deadline = time.monotonic() + startup_s
    job: JobStore | None = None
    while job is None:
        try:
            job = JobStore.connect(str(settings.job_id), settings.host, settings.store_port, timeout_s=5.0)
        except StoreUnreachable:
            if time.monotonic() > deadline:
                raise CkptrunError(f"node rank 0's launcher did not answer at {settings.host}:{settings.store_port} "
                                   f"within {startup_s:g}s (--startup-timeout)",
                                   "start `ckptrun launch` on node rank 0 with the same --rdzv-endpoint") from None
    token = None
    try:
        while token is None and time.monotonic() < deadline:
            token, verdict = job.token(), job.verdict()
            if verdict is not None:  # the leader refused the job before it started
                job.ack_teardown("end", settings.node_rank, code=int(verdict["code"]))
                raise CkptrunError(f"node rank 0: {verdict['message']}", verdict.get("hint"), int(verdict["code"]))
            time.sleep(0 if token else JOIN_POLL_S)
    except StoreUnreachable:
        raise CkptrunError(f"node rank 0's launcher went away at {settings.host}:{settings.store_port} before the "
                           "job started", "the job is resumable: start it again on every node (or let the scheduler "
                           "requeue it)", EXIT_REQUEUE) from None
    if token is None:
        raise CkptrunError(f"node rank 0's launcher at {settings.host}:{settings.store_port} did not publish its "
                           f"checkpoint token within {startup_s:g}s (--startup-timeout)",
                           "check node rank 0's output; start every node with the same --rdzv-endpoint and --name")
    record = read_run_record(paths.root)
    ckpt_dir = own_ckpt_dir or ckpt_dir_of(record.spec, paths.root)  # what this node was told, checked against node 0's
    try:
        mine = (ckpt_dir / TOKEN_NAME).read_text()
    except OSError:
        mine = None
    if mine != token and not record.spec.store_url:
        raise CkptrunError(f"checkpoint directory {ckpt_dir} on node {settings.node_rank} is not the storage node 0 "
                           "writes to (its token is missing or different)",
                           "put the run dir and --ckpt-dir on storage every node mounts at the same path", EXIT_REFUSED)
    return job, record
