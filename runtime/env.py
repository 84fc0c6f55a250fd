"""Contract C1: everything the supervisor hands a worker, as ``CKPTRUN_*`` variables.

This is the only module that spells a ``CKPTRUN_`` name. The supervisor builds a
:class:`RunEnv` and calls :meth:`RunEnv.to_env`; the worker calls
:meth:`RunEnv.from_env` in ``init()``. A worker started without ckptrun (plain
``torchrun`` or ``python``) gets the field defaults, so the same script runs
either way. Importable without torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

PREFIX = "CKPTRUN_"
PrecisionMode = Literal["auto", "fp32", "tf32", "bf16", "fp16", "fp8"]
# Modes named in the contract that nothing implements yet: refused on every machine, never run as another.
NOT_IMPLEMENTED = {
    "fp8": ("fp8 training is not implemented yet (float8 linear layers via torchao, compute capability ≥ 8.9); "
            "ckptrun will not run bf16 under the fp8 label", "use --precision bf16"),
}
HashAlgorithm = Literal["sha256", "blake3"]


def _memory_cadence(value: Any) -> Any:
    """``--memory-every-steps``: a number of steps (0: off) or ``auto``; the message says which."""
    text = str(value).strip().lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text == "auto":
        return "auto"
    if text is None or not text.isdigit():
        raise ValueError("must be a number of steps >= 0 (0: off) or auto")
    return int(text)


MemoryCadence = Annotated[int | Literal["auto"], BeforeValidator(_memory_cadence)]


def _decision_cadence(value: Any) -> Any:
    """``--decision-every-steps``: a number of steps >= 1 or ``auto``; the message says which."""
    text = str(value).strip().lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text == "auto":
        return "auto"
    if text is None or not text.isdigit() or int(text) < 1:
        raise ValueError("must be a number of steps >= 1 (1: every step) or auto")
    return int(text)


DecisionCadence = Annotated[int | Literal["auto"], BeforeValidator(_decision_cadence)]


class EnvError(ValueError):
    """A ``CKPTRUN_*`` variable is malformed; the message names it and the fix."""


class RunEnv(BaseModel):
    """The worker's view of its run. Field docs say what the supervisor promises."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field("local", description="Names the run; every manifest carries it.")
    run_dir: Path = Field(Path("runs/local"), description="Run directory (contract C3).")
    ckpt_dir: Path | None = Field(None, description="Snapshot directory; default RUN_DIR/checkpoints.")
    ckpt_url: str | None = Field(None, description="Object-store URL (s3://…, any fsspec URL) every snapshot is uploaded to and committed in; ckpt_dir is then its local copy.")
    local_cache: bool = Field(False, description="With ckpt_url: ckpt_dir is a restore tier kept by its own retention; else staging, emptied after each upload.")
    node_cache_dir: Path | None = Field(None, description="With ckpt_url on many nodes (--local-cache): this node's own cache, which keeps the files its ranks wrote of each committed snapshot (a restore tier); the snapshot stages in ckpt_dir.")
    storage_options: str | None = Field(None, description="fsspec options for ckpt_url, a JSON object (--storage-option); credentials come from the environment.")
    attempt: int = Field(1, ge=1, description="1 for the first attempt, +1 per restart.")
    restart: bool = Field(False, description="True on every attempt after the first (a restart, or a resume): a script that keeps its own checkpoints continues from them (see CKPTRUN_ATTEMPT).")
    supervised: bool = Field(False, description="True under `ckptrun launch`: the supervisor picks and verifies the snapshot.")
    supervisor_pid: int | None = Field(None, description="Workers exit when this process is gone.")
    supervisor_start_time: float | None = Field(None, description="psutil create_time of the supervisor, guards against pid reuse.")
    resume_from: Path | None = Field(None, description="Snapshot verified by the supervisor; load exactly this one.")
    init_weights: Path | None = Field(None, description="Weights a run starts from when it has no snapshot to restore: a .safetensors file, or a Hugging Face directory (model.safetensors, or shards and model.safetensors.index.json); loaded into the tracked model strictly (runtime.checkpoint.hf_weights).")
    init_weights_sha256: str | None = Field(None, description="Their digest taken at launch: a rank refuses the weights if they changed since.")
    node: int | None = Field(None, ge=0, description="Many nodes: the node rank whose supervisor started this worker; its teardown sweep matches (run_id, node).")
    precision: PrecisionMode = Field("auto", description="Precision policy (issue: precision).")
    save_every_steps: int | None = Field(None, ge=1, description="Save every N optimizer steps.")
    save_every_seconds: float | None = Field(None, gt=0, description="Save when T seconds passed since the last save (rank 0 decides).")
    save_every_auto: bool = Field(False, description="Rank 0 sets the time between saves to Daly(measured save cost, mtbf_seconds); replaces save_every_seconds.")
    mtbf_seconds: float = Field(86400.0, gt=0, description="Mean time between failures the auto cadence assumes (--mtbf).")
    save_interval_cap_seconds: float | None = Field(None, gt=0, description="Longest auto interval: keeps the cost per failure within --rto-budget.")
    keep_last: int = Field(3, ge=1, description="Verified snapshots of the lineage kept besides milestones.")
    keep_every: int | None = Field(None, ge=1, description="Snapshots at multiples of M steps are milestones, never deleted.")
    paranoid_retention: bool = Field(False, description="Before retention deletes, re-hash the newest snapshot read past the page cache (default: manifest + sizes).")
    memory_dir: Path | None = Field(None, description="Node-local tmpfs directory (/dev/shm) the supervisor owns and deletes: memory-tier snapshots; None: no memory tier.")
    memory_every_steps: MemoryCadence = Field(0, description="A memory-tier snapshot every N steps (0: off; auto: the cadence that keeps its cost near 1% of training).")
    memory_keep: int = Field(2, ge=1, description="Memory-tier snapshots kept (each a full copy of the node's state in RAM, plus one being written).")
    memory_replicas: int | None = Field(None, ge=0, description="Many nodes: each node's memory snapshots are copied to this many other nodes (a ring), verified on receipt, so that a lost node restores from another node's memory (default: 1 with several nodes; 0: off).")
    node_group: str | None = Field(None, description="Many nodes: this node's failure domain (a rack, a switch; --node-group, default from SLURM_TOPOLOGY_ADDR): memory replicas go to nodes of other groups first.")
    memory_fetch: dict[int, int] = Field(default_factory=dict, description="Many nodes, a restore from memory after a lost node: the nodes that fetch their shards of the resume step from a replica, and the node holding it (node -> holder).")
    async_save: bool = Field(True, description="Persist and publish in the background; the step waits only for staging.")
    save_overlap: Literal["wait", "skip"] = Field("wait", description="A save due while one is in flight waits for it, or is skipped.")
    max_failed_saves: int = Field(3, ge=1, description="Consecutive failed saves that stop the run (exit 1).")
    decision_every_steps: DecisionCadence = Field("auto", description="Steps whose facts (mean losses, stop, time-based save, anomalies) the ranks share in one collective; a stop or such a save is agreed at most this many steps late (auto: about one exchange per 250 ms of training, at most 32 steps).")
    heartbeat_interval: float = Field(1.0, gt=0, description="Seconds between heartbeat writes of a rank.")
    seed: int = Field(0, description="Base seed; rank r seeds python, numpy and torch with seed + r.")
    deterministic: bool = Field(True, description="torch.use_deterministic_algorithms and fixed seeds.")
    threads: int | None = Field(None, ge=1, description="torch.set_num_threads in each worker (default: torch's).")
    hash_algorithm: HashAlgorithm = Field("sha256", description="Digest recorded for every snapshot file.")
    allow_changes: tuple[str, ...] = Field((), description="Config keys that may differ from the snapshot's on resume.")
    allow_reshard: bool = Field(False, description="A snapshot written at another world size may be resumed: tensors and the data position reshard, per-rank RNG is reseeded (not bitwise exact).")
    on_anomaly: Literal["warn", "stop", "rollback"] = Field("warn", description="What a loss anomaly triggers.")
    on_replica_divergence: Literal["restart", "stop", "warn"] = Field("restart", description="Replicated tensors that differ across ranks at a save (silent data corruption): restart from the last snapshot whose replicas agreed, stop (exit 4) or warn; the snapshot is never published.")
    replica_check_every_steps: int | None = Field(None, ge=1, description="Also compare the replicated tensors across ranks every N steps between saves, so a drifting replica is caught within N steps (default: at saves only).")
    anomaly_window: int = Field(50, ge=2, description="Steps of loss history an anomaly is judged against.")
    anomaly_sigma: float = Field(6.0, gt=0, description="A spike is a loss above mean + sigma * std of the window.")
    rollback_lr_factor: float = Field(0.5, gt=0, le=1, description="LR multiplier after each rollback.")
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks allowed before an anomaly stops the run (exit 4).")
    loss_scale_init: float = Field(2.0**16, gt=0, description="fp16 GradScaler initial scale.")
    loss_scale_growth_interval: int = Field(2000, ge=1, description="fp16 GradScaler growth interval (steps).")
    fault: str | None = Field(None, description="Fault injection spec for tests (see runtime.faults).")
    exit_after_restore: bool = Field(False, description="Probe mode (estimate-rto --probe): log the restore timings, exit 0.")
    preflight: Literal["learn", "resume"] | None = Field(None, description="`ckptrun preflight`: learn serves the first batch at every step; resume logs each state's digest per step (runtime.preflight).")
    preflight_steps: int | None = Field(None, ge=1, description="`ckptrun preflight`: run.batches runs exactly this many steps, whatever the script asks.")
    debug: bool = Field(False, description="`ckptrun --debug`: a script's traceback keeps ckptrun's own frames (bootstrap, runpy) above the script's.")

    @field_validator("memory_fetch", mode="before")
    @classmethod
    def _node_pairs(cls, value: Any) -> Any:
        """``CKPTRUN_MEMORY_FETCH=1:0,3:2``: node 1 fetches from node 0, node 3 from node 2."""
        if isinstance(value, str):
            try:
                return {int(node): int(holder) for node, holder in (pair.split(":") for pair in value.split(",") if pair)}
            except ValueError:
                raise ValueError("expected NODE:HOLDER pairs separated by commas, e.g. 1:0") from None
        return value

    @field_validator("allow_changes", mode="before")
    @classmethod
    def _split_csv(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @property
    def checkpoint_dir(self) -> Path:
        return self.ckpt_dir if self.ckpt_dir is not None else self.run_dir / "checkpoints"

    def to_env(self) -> dict[str, str]:
        """Serialise to ``CKPTRUN_*`` variables (unset fields are left out)."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None or value == {}:
                continue
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, (tuple, list)):
                text = ",".join(value)
            elif isinstance(value, dict):
                text = ",".join(f"{key}:{item}" for key, item in value.items())
            else:
                text = str(value)
            env[PREFIX + name.upper()] = text
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RunEnv":
        """Parse and validate ``CKPTRUN_*`` variables; unknown ones are an error."""
        environ = os.environ if environ is None else environ
        fields = {}
        for key, text in environ.items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX):].lower()
            if name not in cls.model_fields:
                raise EnvError(f"unknown variable {key}; unset it (known: {', '.join(known_variables())})")
            fields[name] = text
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            first = exc.errors()[0]
            var = PREFIX + str(first["loc"][0]).upper() if first["loc"] else PREFIX
            raise EnvError(f"{var}={fields.get(str(first['loc'][0]) if first['loc'] else '', '')!r}: {first['msg']}") from None


def known_variables() -> list[str]:
    """Every ``CKPTRUN_*`` name of the contract, for docs and the frozen-API test."""
    return [PREFIX + name.upper() for name in RunEnv.model_fields]


def variable(field: str) -> str:
    """The ``CKPTRUN_*`` name of one field, for code that looks for it in another process's environment."""
    if field not in RunEnv.model_fields:
        raise KeyError(f"RunEnv has no field {field!r}")
    return PREFIX + field.upper()
