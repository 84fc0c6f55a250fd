"""The launch spec: everything ``ckptrun launch`` was asked to run, saved as ``RUN_DIR/run.json``.

One pydantic model, one docstring per field, validation in one place. It is
built from ``--config FILE`` (TOML) overlaid by the flags a person actually
typed, and ``ckptrun resume`` re-runs exactly what ``run.json`` holds. A bad
value becomes one line that names the flag, the value and the fix
(:func:`build_spec` raises :class:`~ckptrun.cli.errors.CkptrunError`, exit 2).
Importable without torch.
"""

from __future__ import annotations

import copy
import difflib
import json
import shlex
import signal
import time
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ckptrun.cli import durations, store_location
from ckptrun.cli.errors import EXIT_REFUSED, CkptrunError
from ckptrun.runtime.storage.ckpt_url import merge_options
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.faults import FaultSpecError, parse_faults

RUN_JSON = "run.json"
DEFAULT_MTBF_S = 86400.0  # --mtbf: one failure a day, a common figure for a multi-node job
CADENCE = ("save_every_steps", "save_every_seconds", "save_every")  # one choice: a flag replaces the config's
CONFIG_INTERNAL = {"store_url": "ckpt-dir", "store_secrets": "storage-option"}  # fields no config sets → the key that does
RENAMED = {"allow_change": "allow_changes", "args": "script_args",  # TOML key (= long option) → field
           "local_cache": "cache_dir", "storage_option": "store_options", "memory_dir": "node_memory_dir"}


def parse_duration(value: Any) -> Any:
    """``90``, ``"90s"``, ``"1ms"``, ``"15m"``, ``"3h50m"`` → seconds (other types pass through to validation)."""
    if isinstance(value, str):
        try:
            return durations.parse_duration(value)
        except durations.DurationError as exc:
            raise ValueError(str(exc)) from None
    return value


# RunEnv fields that are not launch options: the world sets them per attempt, they derive from options
# of another name (``worker_policy``), or only ckptrun's own tools set them. Every other RunEnv field IS a
# launch option (a ``--config`` key, and a flag where ``launch`` declares one): declared once, in RunEnv.
NOT_OPTIONS = frozenset({
    "run_id", "run_dir", "ckpt_dir", "attempt", "supervised", "supervisor_pid", "supervisor_start_time",
    "resume_from", "save_interval_cap_seconds", "memory_dir", "memory_fetch", "node", "restart",  # the world's, per attempt
    "save_every_auto", "mtbf_seconds", "heartbeat_interval", "fault",  # from save_every, mtbf, heartbeat_timeout, inject_fault
    "loss_scale_init", "loss_scale_growth_interval", "exit_after_restore", "preflight", "preflight_steps",  # tools, tests
    "ckpt_url", "local_cache", "node_cache_dir", "storage_options",  # from --ckpt-dir URL, --local-cache, --storage-option
    "debug",  # the global --debug of the launcher
    "init_weights_sha256",  # the launch hashes --init-weights (LaunchSpec's own field, kept in run.json)
})
WorkerPolicy: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "WorkerPolicy", __doc__="The contract-C1 fields a launch decides for every worker: RunEnv's own fields.",
    **{name: (info.annotation, copy.copy(info)) for name, info in RunEnv.model_fields.items() if name not in NOT_OPTIONS},
)


class LaunchSpec(WorkerPolicy):  # type: ignore[misc,valid-type]
    """What to run, on how many ranks, under which checkpoint and supervision policy.

    The worker-policy fields (precision, save cadence, retention, seeds, anomaly handling…) come from
    :class:`~ckptrun.runtime.env.RunEnv` through :data:`WorkerPolicy`; the fields below are the launch's own.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- what runs ---
    script: Path | None = Field(None, description="Training script; None runs the embedded default job.")
    script_args: list[str] = Field(default_factory=list, description="Arguments passed to the script.")
    restart_args: list[str] = Field(default_factory=list, description="Arguments appended to the script's on every restart and on resume, never on the first attempt (e.g. --resume): a script that needs a flag to continue from its own checkpoint.")
    init_weights_sha256: str | None = Field(None, description="The digest of --init-weights, taken by the launch (ranks refuse weights that changed since).")
    # --- torchrun (same names as torchrun's flags) ---
    nproc_per_node: str = Field("1", description="Ranks on this node: a number, or auto/cpu/gpu as torchrun takes it.")
    nnodes: str = Field("1", description="Nodes (N or MIN:MAX): one `ckptrun launch` per node, node rank 0 leads.")
    node_rank: int = Field(0, ge=0, description="This node's rank (0 on one node).")
    master_addr: str | None = Field(None, description="Rendezvous address (default: a fresh local one per attempt).")
    master_port: int | None = Field(None, ge=1, le=65535, description="Fixed rendezvous port (default: a fresh free port per attempt).")
    rdzv_backend: str | None = Field(None, description="torchrun rendezvous backend (c10d across nodes).")
    rdzv_endpoint: str | None = Field(None, description="torchrun rendezvous endpoint.")
    local_addr: str | None = Field(None, description="torchrun --local-addr: this node's address in the rendezvous (default: its FQDN); c10d numbers the nodes' ranks in the order of these addresses, so distinct, stable ones keep every node's ranks across attempts.")
    coord_port: int | None = Field(None, ge=1, le=65535, description="Port of the job's coordination store on node rank 0 (many nodes); default: the rendezvous port + 1.")
    node_join_timeout: float = Field(300.0, gt=0, description="How long the leader waits for a lost node's relaunched launcher to join (many nodes).")
    # --- the run directory ---
    name: str | None = Field(None, description="Run name; default SCRIPT-STEM-YYYYmmdd-HHMMSS.")
    run_dir: Path | None = Field(None, description="Run directory; default runs/NAME.")
    ckpt_dir: Path | None = Field(None, description="Checkpoint directory; default RUN_DIR/checkpoints. A URL (s3://…) sets store_url.")
    node_memory_dir: Path | None = Field(None, description="--memory-dir: this node's memory-tier directory (a tmpfs: its RAM); default /dev/shm/ckptrun-<run>-<host>, on many nodes /dev/shm/ckptrun-<run>-node<k>.")
    store_url: str | None = Field(None, description="Object-store URL every snapshot is committed to (--ckpt-dir s3://…, any fsspec URL).")
    cache_dir: Path | None = Field(None, description="--local-cache: with a store URL, each snapshot stays here too (a restore tier); default: RUN_DIR/staging, emptied after each upload.")
    store_options: dict[str, Any] = Field(default_factory=dict, description="--storage-option KEY=VALUE: fsspec options of the store (credentials kept out of run.json).")
    store_secrets: dict[str, Any] = Field(default_factory=dict, exclude=True, description="The --storage-option values that look like credentials: for the workers, never written.")
    # --- what every worker is told (contract C1): WorkerPolicy's fields, and these that map to RunEnv's ---
    save_every: Literal["auto"] | None = Field(None, description="auto: the time between saves follows Daly's formula from the measured save cost and --mtbf; the default when no --save-every* is given.")
    mtbf: float = Field(DEFAULT_MTBF_S, gt=0, description="Mean time between failures of the job, for --save-every auto.")
    allow_changes: list[str] = Field(default_factory=list, description="Config keys allowed to differ on resume.")  # RunEnv's tuple, as a list
    inject_fault: str | None = Field(None, description="Fault injection spec (tests, demos): see README.")
    ranks_output: str = Field("all", description="Whose output the launcher shows, prefixed [rankN]: all, none or ranks like 0 or 0,3 (console.log keeps all).")
    # --- supervision ---
    max_restarts: int = Field(3, ge=0, description="Restarts after failures before giving up (exit 1).")
    max_stalled_restarts: int = Field(2, ge=1, description="Restarts in a row that bring no new snapshot before giving up (exit 4).")
    restart_backoff: float = Field(1.0, ge=0, description="Seconds before the second restart (none before the first); doubles per restart.")
    restart_backoff_cap: float = Field(60.0, ge=0, description="Longest wait between restarts.")
    standby: bool = Field(True, description="Pre-start the next attempt's torchrun agent while this one trains (a warm standby): a restart skips its start-up.")
    warm_workers: bool = Field(True, description="Fork the ranks from the torchrun agent, past `import torch` (torchrun --start-method fork); off: a new interpreter per rank, for a script that does not tolerate fork.")
    heartbeat_timeout: float = Field(300.0, gt=0, description="A training rank silent this long is hung.")
    startup_timeout: float = Field(600.0, gt=0, description="Allowance for start-up and restore (phases init/restore).")
    save_timeout: float = Field(900.0, gt=0, description="Allowance for one snapshot save (phase save).")
    grace_period: float = Field(60.0, gt=0, description="Time to save and exit after a stop request, and SIGTERM→SIGKILL wait.")
    time_limit: float | None = Field(None, gt=0, description="Wall-clock budget: a stop is asked grace-period seconds before it.")
    stop_signal: str | None = Field(None, description="Extra signal that means 'save and stop' (e.g. SIGUSR1 for Slurm).")
    # --- recovery checks ---
    rto_budget: float | None = Field(None, gt=0, description="Recovery-time budget: the RTO is estimated after the first snapshot; over it, a warning.")
    strict_budget: bool = Field(False, description="Stop the run (exit 1) when the RTO estimate exceeds --rto-budget.")
    require_exact_resume: bool = Field(False, description="End the run (exit 4) when a resume's replayed losses diverge from the originals.")

    @field_validator("restart_args", mode="before")
    @classmethod
    def _split_words(cls, value: Any) -> Any:
        """``--restart-args "--resume --from ckpt.pt"``: one string, split as a shell would."""
        if isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as exc:
                raise ValueError(f"cannot split {value!r} into arguments: {exc}") from None
        return value

    _durations = field_validator("time_limit", "grace_period", "heartbeat_timeout", "startup_timeout",
                                 "save_timeout", "save_every_seconds", "mtbf", "rto_budget", "node_join_timeout",
                                 mode="before")(parse_duration)

    @field_validator("nproc_per_node", "nnodes", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) else value

    @field_validator("nproc_per_node")
    @classmethod
    def _nproc(cls, value: str) -> str:
        if value in ("auto", "cpu", "gpu") or (value.isdigit() and int(value) >= 1):
            return value
        raise ValueError("must be a number of ranks >= 1, or auto, cpu or gpu")

    @field_validator("nnodes")
    @classmethod
    def _one_node(cls, value: str) -> str:
        parts = value.split(":")
        if not all(p.isdigit() for p in parts) or len(parts) > 2:
            raise ValueError("must be N or MIN:MAX")
        if int(parts[0]) < 1 or int(parts[0]) > int(parts[-1]):
            raise ValueError("must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX")
        return value

    @field_validator("stop_signal")
    @classmethod
    def _signal(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP", "SIGUSR2"):
            raise ValueError("must be a catchable signal name such as SIGUSR1 (SIGUSR2 is reserved for stack dumps)")
        return name

    @field_validator("inject_fault")
    @classmethod
    def _fault(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            return None  # `resume --inject-fault none`: no fault
        try:
            parse_faults(value)
        except FaultSpecError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("allow_changes", mode="before")
    @classmethod
    def _csv(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("ranks_output")
    @classmethod
    def _ranks(cls, value: str) -> str:
        if value in ("all", "none") or all(part.strip().isdigit() for part in value.split(",")):
            return value
        raise ValueError("must be all, none, or comma-separated ranks such as 0 or 0,3")

    @model_validator(mode="before")
    @classmethod
    def _object_store(cls, data: Any) -> Any:
        """``--ckpt-dir URL`` → store_url (an unusable URL: exit 2); --storage-option items → options."""
        return store_location.split_spec(data) if isinstance(data, dict) else data

    @model_validator(mode="before")
    @classmethod
    def _default_cadence(cls, data: Any) -> Any:
        """No --save-every* given: --save-every auto, so a run never goes without a periodic snapshot."""
        if isinstance(data, dict) and all(data.get(key) is None for key in CADENCE):
            return {**data, "save_every": "auto"}
        return data

    @model_validator(mode="after")
    def _combinations(self) -> "LaunchSpec":
        if self.cache_dir is not None and self.store_url is None:
            raise ValueError("--local-cache needs an object-store --ckpt-dir (s3://BUCKET/PREFIX); a local --ckpt-dir "
                             "is already local")
        if self.strict_budget and self.rto_budget is None:
            raise ValueError("--strict-budget needs --rto-budget DURATION (e.g. --rto-budget 5m)")
        if self.save_every == "auto" and (self.save_every_seconds is not None or self.save_every_steps is not None):
            raise ValueError("--save-every auto chooses the interval itself; drop --save-every-seconds and "
                             "--save-every-steps (or --save-every auto)")
        world = self.world_size
        beyond = [f.rank for f in parse_faults(self.inject_fault) if world and f.rank is not None and f.rank >= world]
        if beyond:
            raise ValueError(f"--inject-fault names rank {beyond[0]}, but the world has ranks 0..{world - 1}: "
                             "it could never fire")
        return self

    # --- derived ---

    @property
    def world_size(self) -> int | None:
        """Ranks in the job when the flags say (``--nproc-per-node N`` times the most nodes); None for auto/cpu/gpu."""
        return int(self.nproc_per_node) * int(self.nnodes.split(":")[-1]) if self.nproc_per_node.isdigit() else None

    @property
    def node_cache_dir(self) -> Path | None:
        """``--local-cache`` on many nodes: each node's own cache of its ranks' files of every snapshot, which
        stages in the shared ``RUN_DIR/staging``; None on one node, where it is the local snapshot dir itself."""
        return self.cache_dir if self.store_url and int(self.nnodes.split(":")[-1]) > 1 else None

    @property
    def local_cache_dir(self) -> Path | None:
        """``--local-cache`` as the run's local snapshot dir (one node)."""
        return self.cache_dir if self.node_cache_dir is None else None

    @property
    def forks_ranks(self) -> bool:
        """Whether an attempt's ranks are forked from the agent (warm): ``--warm-workers`` and a numeric
        ``--nproc-per-node`` (for gpu/auto, torchrun probes devices first)."""
        return bool(self.warm_workers) and self.nproc_per_node.isdigit()

    @property
    def heartbeat_interval(self) -> float:
        """How often workers beat: often enough that a few missed beats are not yet a hang."""
        return min(1.0, self.heartbeat_timeout / 5)

    def worker_policy(self) -> dict[str, Any]:
        """The contract-C1 fields this spec decides, for :class:`RunEnv`: every field both models
        declare is copied by name (declared once, never copied by hand), the few renamed ones mapped.
        The run's location, attempt and supervisor facts are the world's to add."""
        same = {name: getattr(self, name) for name in RunEnv.model_fields
                if name in type(self).model_fields and name not in ("run_dir", "ckpt_dir")}
        if self.require_exact_resume and same.get("decision_every_steps") == "auto":
            # the check compares every replayed step with the original's line, and a crash takes the lines the
            # ranks had not shared yet: an exact-resume run shares every step (N given explicitly is kept)
            same["decision_every_steps"] = 1
        return {**same, **store_location.worker_fields(self.store_url, self.local_cache_dir, merge_options(self.store_options, self.store_secrets)),
                "node_cache_dir": self.node_cache_dir,
                "fault": self.inject_fault, "mtbf_seconds": self.mtbf,
                "save_every_auto": self.save_every == "auto", "heartbeat_interval": self.heartbeat_interval}


def flag_name(field: str) -> str:
    option = {field: key for key, field in RENAMED.items()}.get(field, field)
    return "--" + option.replace("_", "-")


def _one_line(exc: ValidationError, source: dict[str, Any], config: Path | None, from_file: set[str]) -> CkptrunError:
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a combination of options
        return CkptrunError(message, "see `ckptrun launch --help`")
    if first["type"] == "extra_forbidden":
        return unknown_key(field, config)
    value = source.get(field)
    where = f"{config}: {field} = {value!r}" if field in from_file and config else f"{flag_name(field)} {value}"
    return CkptrunError(f"{where}: {message}", f"fix {flag_name(field)} (see `ckptrun launch --help`)")


def config_keys() -> list[str]:
    """The keys a ``--config`` file may set: launch's long options (``script`` and ``args`` too), never an
    internal field (the store URL comes from ``ckpt-dir``, its secrets from ``storage-option``)."""
    return [flag_name(name)[2:] for name in LaunchSpec.model_fields if name not in CONFIG_INTERNAL]


def unknown_key(field: str, config: Path | None) -> CkptrunError:
    """``x.toml: unknown key 'nproc_per_nod'`` + the nearest option name (difflib), never a dump of them all."""
    typed = field.replace("_", "-")
    internal = CONFIG_INTERNAL.get(field.replace("-", "_"))
    guess = [internal] if internal else difflib.get_close_matches(typed, config_keys(), n=1)
    where = f"{config}: unknown key {field!r}" if config else f"unknown option --{typed}"
    hint = (f"did you mean {guess[0]}? " if guess else "") + \
        "the keys are launch's long options, `-` or `_` alike (see `ckptrun launch --help`)"
    return CkptrunError(where, hint)


def read_config(path: Path) -> dict[str, Any]:
    """A TOML config's keys, with ``-`` spelled as ``_`` (``heartbeat-timeout`` = ``heartbeat_timeout``)."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CkptrunError(f"config file {path} does not exist", "pass an existing TOML file to --config") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CkptrunError(f"config file {path} is not valid TOML: {exc}", "fix the file's syntax") from None
    known = {key.replace("-", "_") for key in config_keys()} | set(RENAMED.values()) - set(CONFIG_INTERNAL)
    for key in data:
        if key.replace("-", "_") not in known:
            raise unknown_key(key, path)
    data = {key.replace("-", "_"): value for key, value in data.items()}
    for key, field in RENAMED.items():  # allow-changes, the old key, is the field's own name: still read
        if key in data and field not in data:
            data[field] = data.pop(key)
    return data


def build_spec(flags: dict[str, Any], config: Path | None = None) -> LaunchSpec:
    """The spec from a config file overlaid by the flags that were given (``None`` means not given)."""
    from_file = read_config(config) if config else {}
    given = {key: value for key, value in flags.items() if value is not None}
    if any(key in given for key in CADENCE):  # a cadence typed on the command line replaces the file's
        from_file = {key: value for key, value in from_file.items() if key not in CADENCE}
    merged = {**from_file, **given}
    try:
        return LaunchSpec.model_validate(merged)
    except ValidationError as exc:
        raise _one_line(exc, merged, config, set(from_file) - set(given)) from None


# --- run.json -------------------------------------------------------------------


class RunRecord(BaseModel):
    """``run.json``: the run's identity and the spec that ``resume`` re-runs."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = 1
    run_id: str
    created: float = Field(default_factory=time.time)
    argv: list[str] = Field(default_factory=list, description="The command line that created the run.")
    spec: LaunchSpec

    @field_validator("argv")
    @classmethod
    def _no_credentials(cls, value: list[str]) -> list[str]:
        """--storage-option values may be credentials: never written (whoever built the record)."""
        return store_location.redact_argv(value)


def write_run_record(run_dir: Path, record: RunRecord) -> None:
    tmp = run_dir / f".{RUN_JSON}.tmp"
    tmp.write_text(record.model_dump_json(indent=1))
    tmp.replace(run_dir / RUN_JSON)


def read_run_record(run_dir: Path) -> RunRecord:
    path = run_dir / RUN_JSON
    try:
        return RunRecord.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise CkptrunError(f"{run_dir} is not a ckptrun run directory (no {RUN_JSON})",
                           "pass --run-dir RUN_DIR of a run made by `ckptrun launch`", EXIT_REFUSED) from None
    except (ValidationError, json.JSONDecodeError) as exc:
        raise CkptrunError(f"{path} is unreadable: {str(exc).splitlines()[0]}",
                           "restore run.json, or start a new run with `ckptrun launch`", EXIT_REFUSED) from None
