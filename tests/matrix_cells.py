"""One cell of the scenario matrix (:mod:`matrix`), run for real and judged on what a user relies on.

A cell starts real `ckptrun launch` processes (one per node, on 127.0.0.1 with distinct ``--local-addr``),
drives its fault (an injected fault, a `ckptrun stop`, a byte flipped in the newest snapshot, a launcher
SIGKILLed, a node's launcher and memory taken away), lets `ckptrun resume --latest` continue where the fault
is a stop, and then checks, in order, each thing the README promises:

- every launcher's exit code is the documented one for that fault (:func:`expect`);
- a restart restored from the tier the cell asked for (memory, a peer's memory, the local cache, durable);
- wherever the state is exact, the losses equal the same topology's clean run bitwise (a reference run per
  topology and state, made once per harness run);
- `ckptrun verify` finds every snapshot retention kept intact, and a completed run published its final one;
- a tier the cell asked for worked, or the launch's last line said it did not (never a silent exit 0);
- no process of the run is left.

The first broken promise is the cell's FAIL reason, in one line. Each cell gets its own directory; every
process it started is killed when it ends, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launch_helpers import CKPTRUN, FIXTURES, kill_tree, run_processes, tail, wait_for
from matrix import OWN_CHECKPOINTS, RUNTIME_STATES, Cell, not_applicable
from ports import free_port

from ckptrun.runtime.records import final_losses, read_events, read_heartbeats, same_float

STEPS = 20
FAULT_STEP = 12  # after the durable snapshot of step 10 (every 5 steps) and the memory one of step 12 (every 2)
COMMON = ["--heartbeat-timeout", "5", "--startup-timeout", "90", "--restart-backoff", "0.1",
          "--save-every-steps", "5", "--keep-last", "2", "--grace-period", "30"]
SLOW = "slow-save:ms=400"  # long enough for a stop or a kill to land mid-run; never touches the losses
EXACT_FAULTS = ("none", "kill", "hang", "stop-resume", "corrupt", "poison", "supervisor-kill", "leader-loss",
                "lose-node")
TWO_PHASE = ("stop-resume", "corrupt", "supervisor-kill", "leader-loss")  # a first launch, then `resume --latest`
LAUNCH_TIMEOUT = 240.0


@dataclass
class Verdict:
    cell: Cell
    verdict: str  # PASS, FAIL or n/a
    reason: str = ""
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"cell": self.cell.as_dict(), "verdict": self.verdict, "reason": self.reason,
                "seconds": round(self.seconds, 1)}


@dataclass(frozen=True)
class Expect:
    """What the README says this cell ends with."""

    first: tuple[int, ...]  # each node's exit code of the first launch
    final: tuple[int, ...] | None  # ... of the resume, for the two-phase faults
    restarts: bool  # the first launch restarts from a snapshot
    exact: bool  # losses bitwise equal to the clean run's


def topology(cell: Cell) -> tuple[int, int]:
    """(nodes, ranks per node)."""
    if cell.topology == "elastic-2to1":
        return 2, 1
    nodes, per_node = cell.topology.split("x")
    return int(nodes), int(per_node)


def expect(cell: Cell) -> Expect:
    nodes, _ = topology(cell)
    every = lambda code: (code,) * nodes  # noqa: E731
    exact = cell.state in RUNTIME_STATES and cell.fault in EXACT_FAULTS and cell.topology != "elastic-2to1"
    first = {"stop-resume": every(3), "corrupt": every(3), "supervisor-kill": every(-9),
             "leader-loss": (-9, *(5,) * (nodes - 1)), "recurring-blowup": every(4), "disk-full": every(1)}
    restarts = cell.fault in ("kill", "hang", "lose-node", "poison")
    return Expect(first.get(cell.fault, every(0)), every(0) if cell.fault in TWO_PHASE else None, restarts, exact)


@dataclass
class Harness:
    """What the cells of one run share: a scratch root, the S3 server (started when a cell needs it), and the
    clean reference runs, one per topology and state."""

    root: Path
    s3: Any = None  # s3_server.S3Server
    start_s3: Callable[[], Any] | None = None
    references: dict[tuple[str, str], dict[int, float] | str] = field(default_factory=dict)

    def server(self) -> Any:
        if self.s3 is None and self.start_s3 is not None:
            self.s3 = self.start_s3()
        return self.s3

    def reference(self, cell: Cell) -> dict[int, float] | str:
        """The clean run of this topology and state (local tier, no fault): its losses, or why it failed."""
        key = (cell.topology, cell.state)
        if key not in self.references:
            clean = Cell(cell.topology, cell.state, "local", "none")
            run = Launch(self, clean, self.root / f"reference-{cell.topology}-{cell.state}")
            try:
                codes = run.launch_all()
                self.references[key] = final_losses(run.run_dir) if codes == expect(clean).first else \
                    f"the clean reference run exited {codes}: {run.last_lines()}"
            finally:
                run.close()
        return self.references[key]


class Launch:
    """The launchers of one cell (one per node), their flags, logs and the run directory they share."""

    def __init__(self, harness: Harness, cell: Cell, cwd: Path) -> None:
        self.harness, self.cell, self.cwd = harness, cell, cwd
        shutil.rmtree(cwd, ignore_errors=True)
        cwd.mkdir(parents=True)
        self.name = "cell"
        self.run_dir = cwd / "runs" / self.name
        self.nodes, self.per_node = topology(cell)
        self.port = free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}
        self.bucket = harness.server().new_bucket() if cell.tier in ("s3", "cache-s3") else None

    # --- flags ------------------------------------------------------------------------------------------

    def flags(self, node: int) -> list[str]:
        flags = [*COMMON, "--name", self.name, "--nproc-per-node", str(self.per_node)]
        if self.nodes > 1:
            nnodes = "1:2" if self.cell.topology == "elastic-2to1" else str(self.nodes)
            flags += ["--nnodes", nnodes, "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                      "--local-addr", f"127.0.0.{node + 1}"]
        if self.cell.topology == "elastic-2to1":
            flags += ["--allow-reshard", "--node-join-timeout", "5"]
        return flags + self._tier_flags(node) + self._fault_flags()

    def _tier_flags(self, node: int) -> list[str]:
        tier = self.cell.tier
        flags: list[str] = []
        if tier in ("s3", "cache-s3"):
            flags += ["--ckpt-dir", f"s3://{self.bucket}/ckpt"]
        if tier == "cache-s3":
            flags += ["--local-cache", str(self.cwd / f"cache-node{node}")]
        if tier in ("memory", "memory-replica"):
            flags += ["--memory-every-steps", "2", "--memory-dir", str(self.cwd / f"ram-node{node}")]
        if tier == "memory-replica":
            flags += ["--memory-replicas", "1"]
        if tier == "memory" and self.nodes > 1:
            flags += ["--memory-replicas", "0"]
        if self.nodes == 1 or self.cell.fault != "lose-node":
            flags += ["--no-standby"] if self.cell.fault in ("none", "recurring-blowup", "disk-full") else []
        return flags

    def _fault_flags(self) -> list[str]:
        last = self.nodes * self.per_node - 1  # a rank of the last node
        faults = {"kill": f"kill:rank={last}:step={FAULT_STEP}", "hang": f"hang:rank={last}:step={FAULT_STEP}",
                  "one-off-blowup": f"nan-after:step={FAULT_STEP}",
                  "recurring-blowup": f"nan-recurring:step={FAULT_STEP}",
                  "poison": f"poison-after-restore:step=10;kill:rank={last}:step={FAULT_STEP}",
                  "disk-full": f"enospc:step={STEPS}",
                  "lose-node": f"hang:rank={last}:step={FAULT_STEP}:attempt=1"}
        spec = faults.get(self.cell.fault)
        if self.cell.fault in TWO_PHASE and self.cell.state in RUNTIME_STATES:
            spec = SLOW  # the first attempt only: the resume runs at full speed
        flags = ["--inject-fault", spec] if spec else []
        if self.cell.fault == "lose-node" and self.cell.topology != "elastic-2to1":
            flags += ["--heartbeat-timeout", "60", "--node-join-timeout", "120"]  # the node comes back, relaunched
        if self.cell.state == "plain":
            flags += ["--heartbeat-timeout", "30"]  # a plain script is silent from its last step to its exit
        return flags

    def job(self) -> list[str]:
        state, out = self.cell.state, str(self.cwd / "own")
        slow = self.cell.fault in TWO_PHASE
        scripts = {
            "ddp": [str(FIXTURES / "state_job.py"), "--steps", str(STEPS)],
            "fsdp2": [str(FIXTURES / "fsdp_job.py"), "--steps", str(STEPS), "--width", "256"],
            "per-rank": [str(FIXTURES / "per_rank_job.py"), "--steps", str(STEPS), "--per-rank"],
            "unwrapped": [str(FIXTURES / "first_script.py"), "--steps", str(STEPS)],
            "plain": [str(FIXTURES / "plain_ddp.py"), "--out", out, "--steps", str(STEPS),
                      *(["--step-time", "0.3"] if slow else [])],
            "lightning": [str(FIXTURES / "lightning_job.py"), "--steps", str(STEPS), "--ckpt-every", "5",
                          "--ckpt-dir", out, *(["--step-delay", "0.3"] if slow else [])],
            "hf": [str(FIXTURES / "hf_trainer_job.py"), "--steps", str(STEPS), "--ckpt-every", "5",
                   "--output-dir", out, *(["--step-delay", "0.3"] if slow else [])],
        }
        return scripts[state]

    # --- processes --------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        server = self.harness.s3 if self.bucket else None
        return {**os.environ, "PYTHONWARNINGS": "ignore", **(server.env if server is not None else {})}

    def start(self, node: int, args: list[str]) -> subprocess.Popen:
        log = self.cwd / f"node{node}-{len(list(self.cwd.glob(f'node{node}-*.log')))}.log"
        with open(log, "wb") as stream:
            popen = subprocess.Popen([*CKPTRUN, *args], cwd=self.cwd, stdout=stream, stderr=subprocess.STDOUT,
                                     env=self.env(), start_new_session=True)
        self.procs[node], self.logs[node] = popen, log
        return popen

    def launch(self, node: int) -> subprocess.Popen:
        return self.start(node, ["launch", *self.flags(node), *self.job()])

    def resume(self, node: int) -> subprocess.Popen:
        many = ["--node-rank", str(node)] if self.nodes > 1 else []
        return self.start(node, ["resume", "--latest", "--run-dir", str(self.run_dir), *many])

    def wait_all(self, timeout: float = LAUNCH_TIMEOUT) -> tuple[int, ...]:
        deadline = time.monotonic() + timeout
        codes = []
        for node in sorted(self.procs):
            try:
                codes.append(self.procs[node].wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise CellFailed(f"node {node} did not exit within {timeout:.0f}s: {self.last_lines(node)}") from None
        return tuple(codes)

    def launch_all(self) -> tuple[int, ...]:
        for node in range(self.nodes):
            self.launch(node)
        return self.wait_all()

    def resume_all(self) -> tuple[int, ...]:
        for node in range(self.nodes):
            self.resume(node)
        return self.wait_all()

    def last_lines(self, node: int = 0, lines: int = 2) -> str:
        text = tail(self.logs[node], 4000).strip().splitlines() if node in self.logs else []
        return " | ".join(text[-lines:])

    def last_line(self, node: int = 0) -> str:
        text = tail(self.logs[node], 4000).strip().splitlines() if node in self.logs else []
        return text[-1] if text else ""

    def step(self) -> int:
        """The newest step any rank's heartbeat says (every node's heartbeats)."""
        beats = list(read_heartbeats(self.run_dir).values())
        for node_dir in self.run_dir.glob("nodes/node-*"):
            beats += list(read_heartbeats(node_dir).values())
        return max((b.step for b in beats), default=0)

    def close(self) -> None:
        for popen in self.procs.values():
            kill_tree(popen.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):  # its session: whatever it left behind
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
        for process in run_processes(self.run_dir):
            kill_tree(process.pid)


class CellFailed(Exception):
    """A broken promise: the cell's one-line FAIL reason."""


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    try:
        return wait_for(condition, timeout, what)
    except AssertionError as exc:  # the cell's reason, not a test failure of the harness
        raise CellFailed(str(exc)) from None


# --- faults that the harness drives (the others are injected) --------------------------------------------


def _mid_run(launch: Launch) -> None:
    wait_until(lambda: launch.step() >= 7, 150, "step 7 (mid-run)")


def _snapshot_out(launch: Launch) -> None:
    """Mid-run with a published snapshot to resume from (a kill before the first one has nothing to resume:
    `resume` says so, exit 2, a cell of its own); a script with its own checkpoints, once it wrote one."""
    _mid_run(launch)
    if launch.cell.state in OWN_CHECKPOINTS:
        wait_until(lambda: launch.step() >= 7, 60, "the script's own checkpoint of step 5")
        return
    wait_until(lambda: read_events(launch.run_dir, "snapshot_saved"), 150, "the first published snapshot")


def _stop(launch: Launch) -> None:
    _mid_run(launch)
    result = subprocess.run([*CKPTRUN, "stop", str(launch.run_dir)], cwd=launch.cwd, capture_output=True, text=True,
                            timeout=120, env=launch.env())
    if result.returncode not in (0, 3):
        raise CellFailed(f"`ckptrun stop` exited {result.returncode}: {result.stderr.strip()[-300:]}")


def _corrupt_newest(launch: Launch) -> str:
    """Flip one byte in the middle of the newest snapshot's largest data file (or a framework's checkpoint)."""
    if launch.cell.state in OWN_CHECKPOINTS:
        files = sorted((p for p in (launch.cwd / "own").rglob("*") if p.is_file() and p.stat().st_size > 1000),
                       key=lambda p: (p.stat().st_mtime, p.stat().st_size))
        return _flip(files[-1]) if files else "nothing to corrupt"
    if launch.bucket:
        import s3fs

        server = launch.harness.s3
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint})
        steps = sorted(p for p in fs.ls(f"{launch.bucket}/ckpt") if p.rsplit("/", 1)[-1].startswith("step-"))
        data = sorted(fs.find(f"{steps[-1]}/dcp"), key=lambda p: -fs.size(p))[0]
        raw = bytearray(fs.cat(data))
        raw[len(raw) // 2] ^= 0x40
        fs.pipe(data, bytes(raw))
        for cache in launch.cwd.glob("cache-node*"):  # the local copies too: the store's bytes are the record
            shutil.rmtree(cache, ignore_errors=True)
        return data
    ckpt = launch.run_dir / "checkpoints"
    newest = sorted(p for p in ckpt.glob("step-*") if p.is_dir())[-1]
    return _flip(max((newest / "dcp").glob("*.safetensors"), key=lambda p: p.stat().st_size))


def _flip(path: Path) -> str:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    return str(path)


def _lose_last_node(launch: Launch) -> None:
    """The last node's launcher and everything under it SIGKILLed, its memory dir and local cache deleted,
    once the others hold what the restart needs (a replica of its step 10, or the durable step 10)."""
    last = launch.nodes - 1
    if launch.cell.tier == "memory-replica":
        wait_until(lambda: any(e.get("from_node") == last and e.get("step", 0) >= 10
                               for e in read_events(launch.run_dir, "replica_received")), 150,
                   f"node {last}'s memory step 10 on another node")
    else:
        wait_until(lambda: launch.step() >= FAULT_STEP, 150, f"step {FAULT_STEP}")
        wait_until(lambda: any(e.get("step", 0) >= 10 for e in read_events(launch.run_dir, "snapshot_saved"))
                   or launch.cell.state in OWN_CHECKPOINTS, 60, "the durable snapshot of step 10")
    kill_tree(launch.procs[last].pid)
    launch.procs[last].wait()
    for gone in (launch.cwd / f"ram-node{last}", launch.cwd / f"cache-node{last}"):
        shutil.rmtree(gone, ignore_errors=True)


def run_first_phase(launch: Launch) -> tuple[int, ...]:
    fault = launch.cell.fault
    for node in range(launch.nodes):
        launch.launch(node)
    if fault in ("stop-resume", "corrupt"):
        _stop(launch)
    elif fault == "supervisor-kill":
        _snapshot_out(launch)
        for popen in launch.procs.values():
            os.kill(popen.pid, signal.SIGKILL)
    elif fault == "leader-loss":
        _snapshot_out(launch)
        os.kill(launch.procs[0].pid, signal.SIGKILL)
    elif fault == "lose-node":
        _lose_last_node(launch)
        if launch.cell.topology != "elastic-2to1":
            launch.launch(launch.nodes - 1)  # relaunched: it rejoins the job the other nodes kept waiting
        else:
            launch.procs.pop(launch.nodes - 1)
    return launch.wait_all()


# --- the checks -------------------------------------------------------------------------------------------


def check_codes(launch: Launch, got: tuple[int, ...], want: tuple[int, ...], phase: str) -> None:
    if launch.cell.topology == "elastic-2to1" and launch.cell.fault == "lose-node":
        want = want[:1]
    if got != want:
        raise CellFailed(f"{phase} exited {list(got)}, the README says {list(want)}: {launch.last_lines()}")


def check_restore_source(launch: Launch) -> None:
    restarts = read_events(launch.run_dir, "restart")
    if not restarts:
        raise CellFailed("no restart was recorded")
    tier, fault = launch.cell.tier, launch.cell.fault
    sources = read_events(launch.run_dir, "restore_source")  # the supervisor's choice, per node, where tiers compete
    restored = [e for e in read_events(launch.run_dir, "restored") if (e.get("attempt") or 1) > 1]  # the ranks' load
    seen = {(e.get("node", 0), e.get("tier")) for e in sources} or {(0, e.get("tier")) for e in restored}
    want = {"memory": {"memory"}, "memory-replica": {"memory", "peer-memory"}, "cache-s3": {"local-cache"},
            "local": {"disk"}, "s3": {"disk", "durable", "local-cache"}}[tier]  # s3: its staging dir is a local copy
    if fault == "lose-node" and tier in ("memory", "cache-s3"):  # the lost node's memory or cache went with it
        want = want | {"disk", "durable"}
    if fault == "poison":  # the restored snapshot is quarantined; the next restart is durable again
        want = want | {"disk", "durable"}
    if launch.cell.state in OWN_CHECKPOINTS:
        return  # the script restores its own checkpoint; the restart is checked by its exit and steps
    if not seen or not {t for _, t in seen} <= want:
        raise CellFailed(f"restored from {sorted(seen)}, the {tier} tier promises {sorted(want)}")
    if tier == "memory-replica" and fault == "lose-node" and (launch.nodes - 1, "peer-memory") not in seen:
        raise CellFailed(f"the lost node restored from {sorted(seen)}, not from its replica (peer-memory)")


def check_losses(launch: Launch, reference: dict[int, float] | str) -> None:
    if isinstance(reference, str):
        raise CellFailed(reference)
    got = final_losses(launch.run_dir)
    if sorted(got) != sorted(reference):
        raise CellFailed(f"steps differ from the clean run: {sorted(set(got) ^ set(reference))[:5]}")
    differing = [s for s in reference if not same_float(got[s], reference[s])]
    if differing:
        raise CellFailed(f"losses differ from the clean run at steps {differing[:5]} (not bitwise exact)")


def check_state_faults(launch: Launch) -> None:
    fault = launch.cell.fault
    if fault == "one-off-blowup" and not read_events(launch.run_dir, "rollback"):
        raise CellFailed("the blow-up was not rolled back")
    if fault == "recurring-blowup":
        rollbacks = read_events(launch.run_dir, "rollback")
        if len(rollbacks) != 1 or "came back at the same step" not in launch.last_lines(0, 4):
            raise CellFailed(f"{len(rollbacks)} rollback(s), last lines: {launch.last_lines(0, 3)}")
    if fault == "poison" and not [e for e in read_events(launch.run_dir, "snapshot_quarantined")
                                  if e.get("cause") == "poisoned"]:
        raise CellFailed("the poisoned snapshot was not quarantined")
    if fault == "disk-full" and "the final save at step 20 failed" not in launch.last_lines(0, 3):
        raise CellFailed(f"the failed final save is not said: {launch.last_lines(0, 2)}")


def check_snapshots(launch: Launch, completed: bool) -> None:
    """`ckptrun verify` finds every snapshot outside quarantine/ intact (it exits 1 while a quarantined one is
    corrupt, as documented: the bad one is kept, set aside), and a completed run's final snapshot among them."""
    if launch.cell.state in OWN_CHECKPOINTS:
        return
    result = subprocess.run([*CKPTRUN, "verify", str(launch.run_dir), "--json"], cwd=launch.cwd,
                            capture_output=True, text=True, timeout=120, env=launch.env())
    if result.returncode not in (0, 1) or not result.stdout.strip():
        said = (result.stderr or result.stdout).strip()[-300:]
        raise CellFailed(f"`ckptrun verify` exited {result.returncode}: {said}")
    snapshots = json.loads(result.stdout).get("snapshots", [])
    kept = [s for s in snapshots if "/quarantine/" not in s.get("path", "") and not s.get("abandoned")]
    bad = [f"step {s.get('step')}: {s.get('status')}" for s in kept if s.get("status") != "ok"]
    if bad or (result.returncode == 1 and len(kept) == len(snapshots)):
        raise CellFailed(f"`ckptrun verify` exited {result.returncode}: {', '.join(bad) or 'no snapshot is bad'}")
    set_aside = [s for s in snapshots if s not in kept and s.get("status") != "ok"]  # quarantined, or a line left
    if launch.cell.fault == "corrupt" and not set_aside:
        raise CellFailed("the corrupt snapshot was neither set aside (quarantine/, an abandoned line) nor kept")
    steps = [s.get("step") for s in kept]
    if completed and STEPS not in steps:
        raise CellFailed(f"the run completed but its final snapshot (step {STEPS}) is not among {steps}")


def check_tier_used(launch: Launch) -> None:
    tier = launch.cell.tier
    if tier in ("memory", "memory-replica") and launch.cell.fault not in ("recurring-blowup",):
        if read_events(launch.run_dir, "memory_tier_off"):
            said = "memory tier" in launch.last_line(0)
            raise CellFailed(f"the memory tier switched off{' (said in the last line)' if said else ' silently'}: "
                             f"{read_events(launch.run_dir, 'memory_tier_off')[0].get('reason', '')[:200]}")
        if not read_events(launch.run_dir, "memory_saved"):
            raise CellFailed("the memory tier was asked for and saved nothing")
    if tier == "memory-replica" and not read_events(launch.run_dir, "replica_received"):
        raise CellFailed("no memory replica was received by another node")


def check_no_processes(launch: Launch) -> None:
    wait_until(lambda: not run_processes(launch.run_dir), 30, "every process of the run to exit")


def run_cell(cell: Cell, harness: Harness) -> Verdict:
    """Run one cell and judge it; n/a cells are not run."""
    reason = not_applicable(cell)
    if reason is not None:
        return Verdict(cell, "n/a", reason)
    started = time.monotonic()
    want = expect(cell)
    reference = harness.reference(cell) if want.exact else {}
    launch = Launch(harness, cell, harness.root / cell.name.replace("/", "-"))
    try:
        check_codes(launch, run_first_phase(launch), want.first, "the launch")
        if cell.fault == "corrupt":
            _corrupt_newest(launch)
        if want.final is not None:
            check_codes(launch, launch.resume_all(), want.final, "the resume")
        if want.restarts:
            check_restore_source(launch)
        check_state_faults(launch)
        if want.exact:
            check_losses(launch, reference)
        check_snapshots(launch, completed=(want.final or want.first)[0] == 0)
        check_tier_used(launch)
        check_no_processes(launch)
        return Verdict(cell, "PASS", "", time.monotonic() - started)
    except CellFailed as exc:
        return Verdict(cell, "FAIL", str(exc).replace("\n", " "), time.monotonic() - started)
    except Exception as exc:  # a harness error is a failed cell too, said in one line
        return Verdict(cell, "FAIL", f"harness: {type(exc).__name__}: {exc}"[:400], time.monotonic() - started)
    finally:
        launch.close()


def print_table(verdicts: list[Verdict], out: Any = sys.stdout) -> None:
    width = max((len(v.cell.name) for v in verdicts), default=10)
    for v in verdicts:
        print(f"{v.cell.name:<{width}}  {v.verdict:<4}  {v.seconds:6.1f}s  {v.reason}", file=out, flush=True)
