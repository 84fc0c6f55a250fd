"""``init()``: turn a plain process into a ckptrun worker — policy from C1, process group, precision, seeds.

Everything that must happen once, before the training script builds its model:
parse the environment contract, refuse what cannot run (exit 2, a fatal record
so the supervisor does not retry), start the process group, apply the
precision policy, make the run deterministic, start heartbeats and the
supervisor watch, and create the lineage on rank 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from ckptrun.runtime import collectives, records
from ckptrun.runtime.step import rng
from ckptrun.runtime.storage import store
from ckptrun.runtime.worker import timeline
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.worker.liveness import enable_stack_dumps, watch_supervisor
from ckptrun.runtime.step.precision import Policy, PrecisionUnavailable, ScalerConfig, resolve
from ckptrun.runtime.step.session import Run


def init(config: dict[str, Any] | None = None, precision: str | None = None) -> Run:
    """Start this worker under ckptrun's policy (C1), or with defaults under plain torchrun/python.

    ``precision`` is what the script asks for; when the launcher set one too and
    they differ, the worker stops with an error naming both (one source of truth).
    """
    timeline.mark("init")
    env = RunEnv.from_env()
    if "run_dir" not in env.model_fields_set:
        env = env.model_copy(update={"run_dir": Path("runs") / Path(sys.argv[0]).stem})
    if precision is not None:
        if "precision" in env.model_fields_set and env.precision != precision:
            _refuse_early(env, f"the script asks for precision {precision!r} but the run was launched with "
                               f"{env.precision!r}; drop one of them", 2)
        env = env.model_copy(update={"precision": precision})
    creates_group = "RANK" in os.environ and not collectives.active()
    if creates_group:
        collectives.start(collectives.worker_device())
        timeline.mark("process_group")
    try:
        collectives.ensure_cpu_group()  # the script's own group (e.g. NCCL only): decisions ride gloo beside it
    except collectives.NoCpuBackend as exc:
        _refuse_early(env, str(exc), 2)
    try:
        decision = resolve(env.precision)
    except PrecisionUnavailable as exc:
        _refuse_early(env, f"precision {env.precision} cannot run here: {exc}", 2)
    policy = Policy(decision, ScalerConfig(init_scale=env.loss_scale_init, growth_interval=env.loss_scale_growth_interval))
    policy.apply_matmul_flags()
    if env.threads:
        torch.set_num_threads(env.threads)
    if env.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    rng.seed_everything(env.seed + collectives.rank())
    env.run_dir.mkdir(parents=True, exist_ok=True)
    enable_stack_dumps()
    watch_supervisor(env.supervisor_pid, env.supervisor_start_time)
    run = Run(env, config or {}, policy)
    run.owns_group = creates_group  # a group the script created is the script's to destroy
    run.heart.beat(0, "init")
    if run.rank == 0:
        run.lineage = store.ensure_lineage(run.ckpt_dir, env.run_id).current
        store.clean_temp_dirs(run.ckpt_dir)
        if env.attempt == 1:
            records.log_event(run.run_dir, "precision", requested=decision.requested, mode=decision.mode,
                              reason=decision.reason, device=decision.device)
            print(f"ckptrun: precision {decision.mode} ({decision.reason})", file=sys.stderr, flush=True)
    run.lineage = collectives.broadcast_object(run.lineage)
    return run


def _refuse_early(env: RunEnv, message: str, code: int) -> None:
    """Refuse before a Run exists: fatal record (rank 0), one line, exit ``code``; a restart cannot help."""
    if int(os.environ.get("RANK", "0")) == 0:
        env.run_dir.mkdir(parents=True, exist_ok=True)
        records.write_fatal(env.run_dir, 0, message, code)
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
