"""Where this node stands in a multi-node job: node count, node rank, rendezvous endpoint, job id.

One ``ckptrun launch`` runs per node. It learns its place from, in order of
precedence: the flags a person typed; torchrun's ``PET_*`` environment (the
variables torchrun reads for its own flags, set by Kubeflow's PyTorchJob and
TorchX, so those launch ``ckptrun`` unchanged); Slurm's job environment
(``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST`` → the first host is
the rendezvous host, ``SLURM_JOB_ID`` → the run name ``slurm-<id>``, the same
after a requeue). Slurm host lists such as ``node[01-04],gpu7`` are expanded
here, without ``scontrol``. Torch-free; nothing here touches the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ckptrun.cli.errors import CkptrunError

DEFAULT_RDZV_PORT = 29500  # torchrun's default master port: the endpoint's port when only a host is known
DEFAULT_BACKEND = "c10d"

# (our field, torchrun's PET_* variable); torchrun itself reads PET_<FLAG> for each of its flags
PET_VARIABLES = (("nnodes", "PET_NNODES"), ("node_rank", "PET_NODE_RANK"), ("rdzv_endpoint", "PET_RDZV_ENDPOINT"),
                 ("rdzv_backend", "PET_RDZV_BACKEND"), ("rdzv_id", "PET_RDZV_ID"), ("master_addr", "PET_MASTER_ADDR"),
                 ("master_port", "PET_MASTER_PORT"))


@dataclass(frozen=True)
class NodeSettings:
    """This node's place in the job, and where each setting came from (``flag``, ``PET_*``, ``SLURM_*``)."""

    nnodes: str = "1"  # N or MIN:MAX, as torchrun takes it
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the c10d rendezvous (node rank 0 hosts it)
    rdzv_backend: str = DEFAULT_BACKEND
    job_id: str | None = None  # the run name every node agrees on (run id, rendezvous ids, store keys)
    coord_port: int | None = None  # the leader's TCPStore; default: the rendezvous port + 1
    sources: dict[str, str] = field(default_factory=dict)
    spare: int | None = None  # a promoted spare (``launch --spare``) now running node_rank: its spare number

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1

    @property
    def leader(self) -> bool:
        """Node rank 0's supervisor leads: it hosts the job's store and owns the restart budget."""
        return self.node_rank == 0

    @property
    def host(self) -> str:
        return split_endpoint(self.rdzv_endpoint or "")[0]

    @property
    def rdzv_port(self) -> int:
        return split_endpoint(self.rdzv_endpoint or "")[1]

    @property
    def store_port(self) -> int:
        """The leader's TCPStore port: never the rendezvous port (torchrun's c10d store lives there)."""
        return self.coord_port if self.coord_port is not None else self.rdzv_port + 1


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → (host, port); a bare host gets torchrun's default port."""
    match = re.fullmatch(r"\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?|(?P<host>[^:\[\]]+)(?::(?P<port>\d+))?", endpoint.strip())
    if not match:
        raise CkptrunError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT",
                           "pass the node-rank-0 host and a free port, e.g. --rdzv-endpoint node01:29500")
    host = match["v6"] or match["host"]
    port = int(match["p6"] or match["port"] or DEFAULT_RDZV_PORT)
    if not 1 <= port <= 65534:
        raise CkptrunError(f"--rdzv-endpoint {endpoint!r}: port {port} is out of range",
                           "pick a port between 1 and 65534 (the next port is the job's coordination store)")
    return host, port


# --- Slurm host lists -------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """``node[01-04,07],gpu7`` → node01 … node04, node07, gpu7 (zero padding kept; brackets may repeat)."""
    return [host for item in _split_top(hostlist) for host in _expand_item(item)]


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, current = [], 0, ""
    for char in text.strip():
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise CkptrunError(f"SLURM_JOB_NODELIST {text!r} has unbalanced brackets",
                           "pass --rdzv-endpoint HOST:PORT (the first node's host) explicitly")
    return [item for item in [*items, current] if item]


def _expand_item(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    return [head + value + rest for value in _expand_ranges(match[1], item) for rest in _expand_item(tail)]


def _expand_ranges(ranges: str, item: str) -> list[str]:
    values = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise CkptrunError(f"SLURM_JOB_NODELIST entry {item!r}: {part!r} is not a number or a range",
                               "pass --rdzv-endpoint HOST:PORT (the first node's host) explicitly")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return values


# --- the three sources ------------------------------------------------------------


def from_pet(environ: Mapping[str, str]) -> dict[str, Any]:
    """torchrun's own environment (``PET_*``), as Kubeflow's PyTorchJob and TorchX set it."""
    found = {name: environ[var] for name, var in PET_VARIABLES if environ.get(var)}
    if "rdzv_endpoint" not in found and "master_addr" in found:
        found["rdzv_endpoint"] = f"{found['master_addr']}:{found.get('master_port', DEFAULT_RDZV_PORT)}"
    found.pop("master_addr", None)
    found.pop("master_port", None)
    if "rdzv_id" in found:
        found["job_id"] = found.pop("rdzv_id")
    return found


def from_slurm(environ: Mapping[str, str]) -> dict[str, Any]:
    """A Slurm job step's environment: node count, this node's index, the first host, the job id."""
    found: dict[str, Any] = {}
    nnodes = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
    if nnodes:
        found["nnodes"] = nnodes
    if environ.get("SLURM_NODEID"):
        found["node_rank"] = environ["SLURM_NODEID"]
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        hosts = expand_hostlist(nodelist)
        if hosts:
            found["rdzv_endpoint"] = f"{hosts[0]}:{environ.get('MASTER_PORT') or DEFAULT_RDZV_PORT}"
    if environ.get("SLURM_JOB_ID"):
        found["job_id"] = f"slurm-{environ['SLURM_JOB_ID']}"
    return found


def node_settings(flags: Mapping[str, Any], environ: Mapping[str, str]) -> NodeSettings:
    """Flags (``None``: not given) over ``PET_*`` over ``SLURM_*``; refuses what cannot form a job (exit 2)."""
    explicit = {k: v for k, v in flags.items() if v is not None}
    if "rdzv_endpoint" not in explicit and explicit.get("master_addr") and explicit.get("master_port"):
        explicit["rdzv_endpoint"] = f"{explicit['master_addr']}:{explicit['master_port']}"
    explicit = {k: v for k, v in explicit.items() if k not in ("master_addr", "master_port")}
    if "name" in explicit:
        explicit["job_id"] = explicit.pop("name")
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for label, layer in (("SLURM_*", from_slurm(environ)), ("PET_*", from_pet(environ)), ("flag", explicit)):
        for key, value in layer.items():
            merged[key], sources[key] = value, label
    return _validated(merged, sources)


def _validated(values: dict[str, Any], sources: dict[str, str]) -> NodeSettings:
    nnodes = str(values.get("nnodes", "1"))
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
        raise CkptrunError(f"--nnodes {nnodes} ({sources.get('nnodes', 'flag')}) is not N or MIN:MAX",
                           "pass a node count such as 2, or 1:4 for an elastic job")
    node_rank = _integer(values.get("node_rank", 0), "--node-rank", sources.get("node_rank"))
    settings = NodeSettings(nnodes=nnodes, node_rank=node_rank,
                            rdzv_endpoint=values.get("rdzv_endpoint"),
                            rdzv_backend=str(values.get("rdzv_backend") or DEFAULT_BACKEND),
                            job_id=values.get("job_id"),
                            coord_port=_integer(values["coord_port"], "--coord-port", "flag") if values.get("coord_port") else None,
                            sources=sources)
    if settings.multi_node:
        _check_multi_node(settings)
    return settings


def _integer(value: Any, flag: str, source: str | None) -> int:
    text = str(value).strip()
    if not text.isdigit():
        raise CkptrunError(f"{flag} {value!r} ({source or 'flag'}) is not a whole number", f"pass {flag} N with N >= 0")
    return int(text)


def _check_multi_node(settings: NodeSettings) -> None:
    where = settings.sources.get("node_rank", "flag")
    if settings.node_rank >= settings.max_nodes:
        raise CkptrunError(f"--node-rank {settings.node_rank} ({where}) is not below --nnodes {settings.nnodes}",
                           f"node ranks run from 0 to {settings.max_nodes - 1}")
    if not settings.rdzv_endpoint:
        raise CkptrunError(f"--nnodes {settings.nnodes} needs the rendezvous endpoint of node rank 0",
                           "pass --rdzv-endpoint HOST:PORT (the same on every node), or set PET_RDZV_ENDPOINT")
    if settings.rdzv_backend != DEFAULT_BACKEND:
        raise CkptrunError(f"--rdzv-backend {settings.rdzv_backend}: only c10d is supported across nodes",
                           "pass --rdzv-backend c10d (or leave it out)")
    split_endpoint(settings.rdzv_endpoint)
    if settings.store_port == settings.rdzv_port:
        raise CkptrunError(f"--coord-port {settings.store_port} is the rendezvous port",
                           "pick another port for the job's coordination store (default: the rendezvous port + 1)")
    if not settings.job_id:
        raise CkptrunError(f"--nnodes {settings.nnodes} needs a run name every node shares",
                           "pass the same --name on every node (under Slurm, SLURM_JOB_ID names the run)")


def node_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """The launch options (by parameter name) that node settings are made of."""
    keys = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "master_addr", "master_port", "name", "coord_port")
    return {key: options.get(key) for key in keys}


def resume_settings(spec: Any, node_rank: int | None, environ: Mapping[str, str]) -> NodeSettings:
    """``resume`` on many nodes: the run's own job (``run.json``) with this node's rank (flag, ``PET_*``,
    ``SLURM_*``); the environment's rendezvous host wins (a requeued job may land on other hosts)."""
    found = {**from_slurm(environ), **from_pet(environ)}
    rank = node_rank if node_rank is not None else found.get("node_rank", 0)
    flags = {"nnodes": spec.nnodes, "node_rank": rank, "rdzv_endpoint": found.get("rdzv_endpoint") or spec.rdzv_endpoint,
             "rdzv_backend": spec.rdzv_backend, "name": spec.name, "coord_port": spec.coord_port}
    return node_settings(flags, {})
