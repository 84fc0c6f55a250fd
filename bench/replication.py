"""Issue 25's figure: a memory replica's transport against a plain socket copy of the same bytes, same run.

    python bench/replication.py [--mib 1024] [--repeats 3] [--scratch DIR] [--json] [--timeout 900]

One real published snapshot of ~``--mib`` MiB (model + AdamW state written by ckptrun's own sync ``Saver``:
DCP data file with chunk digests, manifest, atomic publish) is built first, in a process of its own (a world
of one rank). Then two processes on 127.0.0.1 (gloo, world size 2) run, per repeat, interleaved (order rotated):

* ``replication`` - process 0 ``replication.send_snapshot`` -> process 1 ``replication.receive_snapshot`` into
  a fresh directory: manifest, 16 MiB pieces over a gloo group, every chunk hashed on arrival, published
  (renamed into place) only when every chunk matched, the sender told (the ack);
* ``socket`` - the same bytes (the manifest file and every listed file) over one plain TCP socket
  (``socket.sendfile``), received with ``recv_into`` a 16 MiB buffer and ``write`` into files in the same target
  filesystem (as the transport writes them): no hashing, no manifest check, no rename.

Both are timed on the receiver from the moment it starts waiting (right after a barrier that puts the two
processes in step) to the replica published / the last byte in its file; one untimed round of each comes
first (the group's first large messages, the first buffers). The ratio is median ÷ median,
goal <= 1.3. Each copy's CPU seconds (both processes, every thread) come beside it: on a loaded machine
the wall times swing, the CPU ratio barely moves. Target directories are deleted after every sample, outside the timing. Every gloo operation
and socket has a timeout, the parent kills both processes at ``--timeout`` or as soon as either fails.
Progress goes to stderr, the table (or with ``--json`` one JSON document) to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import filecmp
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MiB, free_port, init_world, load_average  # noqa: E402

from ckptrun.runtime import hashing  # noqa: E402

GOAL = 1.3
OP_TIMEOUT_S = 120  # any one gloo operation or socket call; a barrier waits at most for the other side's cleanup
VARIANTS = ("replication", "socket")


def log(message: str) -> None:
    print(f"[replication] {message}", file=sys.stderr, flush=True)


# --- the snapshot under test (its own process: Saver makes collectives, which must not meet the pair's) ----


def build(args: argparse.Namespace) -> None:
    from common import build_state, save_once

    from ckptrun.runtime.checkpoint.saver import Saver

    init_world(0, 1)
    state = build_state(args.mib * MiB)
    saver = Saver(args.scratch / "source", args.hash, asynchronous=False)
    save_once(saver, state)
    result = saver.collect(wait=True)[-1]
    if not result.ok or result.path is None:
        raise RuntimeError(f"ckptrun save failed: {result.error}")
    (args.scratch / "snapshot.txt").write_text(str(result.path))


# --- the two processes ----------------------------------------------------------------------------------------


def socket_send(snapshot: Path, files: list[tuple[str, int]], port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=OP_TIMEOUT_S) as sock:
        for rel, size in files:
            with open(snapshot / rel, "rb") as stream:
                sock.sendfile(stream, 0, size)
        if sock.recv(1) != b"k":  # the receiver has every byte in its files
            raise RuntimeError("socket copy: the receiver did not confirm")


def socket_receive(server: socket.socket, into: Path, files: list[tuple[str, int]]) -> None:
    """A plain receiver: ``recv_into`` one piece-sized buffer, ``write`` it to the file (cheaper here than
    ``recv_into`` a fresh ``mmap`` of the file, which faults its pages in one by one)."""
    connection, _ = server.accept()
    buffer = memoryview(bytearray(16 * MiB))
    with connection:
        connection.settimeout(OP_TIMEOUT_S)
        for rel, size in files:
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb", buffering=0) as stream:
                left = size
                while left:
                    count = connection.recv_into(buffer[:min(left, len(buffer))])
                    if not count:
                        raise RuntimeError(f"socket copy: the sender closed with {left} bytes of {rel} to come")
                    view, left = buffer[:count], left - count
                    while len(view):
                        view = view[stream.write(view):]
        connection.sendall(b"k")


def pair(args: argparse.Namespace) -> None:
    """One of the two processes (RANK 0 sends, RANK 1 receives and times). Every step below is taken by both
    ranks in the same order: barrier, the variant's exchange, barrier; nothing else crosses between them."""
    import torch
    import torch.distributed as dist

    from ckptrun.runtime.checkpoint import replication
    from ckptrun.runtime.manifest import MANIFEST_NAME, read_manifest

    signal.alarm(args.timeout)  # a backstop of the parent's kill: SIGALRM's default action ends the process
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(seconds=OP_TIMEOUT_S)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    group = dist.new_group([0, 1], backend="gloo", timeout=timeout)  # as replication.leads_group, finite timeout
    snapshot = args.snapshot
    manifest = read_manifest(snapshot)
    files = [(MANIFEST_NAME, (snapshot / MANIFEST_NAME).stat().st_size)]
    files += [(entry.path, entry.size) for entry in manifest.files if entry.size]
    nbytes = sum(size for _, size in files)
    server, port = None, torch.zeros(1, dtype=torch.int64)
    if rank == 1:
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(OP_TIMEOUT_S)
        port[0] = server.getsockname()[1]
    dist.broadcast(port, src=1)
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}  # this process's CPU seconds (every thread)
    checked = False
    for repeat in range(-1, args.repeats):  # repeat -1: one untimed round of each (first use of the group, buffers)
        shift = max(repeat, 0) % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            target = args.into / f"{name}-{repeat + 1}"
            if rank == 1:
                target.mkdir(parents=True)
            dist.barrier()  # both in step: the target exists and is empty, nothing is in flight
            cpu_started = time.process_time()
            if rank == 0:
                if name == "replication":
                    if not replication.send_snapshot(snapshot, 1, group, replication.TAG_REPLICA):
                        raise RuntimeError("replication: the receiver rejected the snapshot")
                else:
                    socket_send(snapshot, files, int(port.item()))
            else:
                started = time.perf_counter()
                if name == "replication":
                    got = replication.receive_snapshot(target, 0, group, replication.TAG_REPLICA)
                    seconds = time.perf_counter() - started
                    if got is None or got.path is None or got.problem is not None:
                        raise RuntimeError(f"replication: not published: {got.problem if got else 'ended'}")
                else:
                    socket_receive(server, target, files)
                    seconds = time.perf_counter() - started
                    if not checked:  # once, outside the timing: the baseline moved the right bytes
                        bad = [rel for rel, _ in files if not filecmp.cmp(snapshot / rel, target / rel, shallow=False)]
                        if bad:
                            raise RuntimeError(f"socket copy: {bad} differ from the source")
                        checked = True
                if repeat >= 0:
                    samples[name].append(seconds)
                log(f"{'warm-up' if repeat < 0 else f'repeat {repeat + 1}/{args.repeats}'} {name:11s} {seconds:7.3f} s "
                    f"{nbytes / 2**30 / seconds:6.2f} GiB/s  load {load_average()[0]}")
            if repeat >= 0:
                cpu[name].append(time.process_time() - cpu_started)
            dist.barrier()  # the exchange is over on both sides
            if rank == 1:
                shutil.rmtree(target)
    if rank == 1:
        server.close()
        args.report.write_text(json.dumps({"bytes": nbytes, "files": len(files), "samples": samples, "cpu": cpu}))
    else:
        args.report.with_suffix(".rank0.json").write_text(json.dumps({"cpu": cpu}))
    dist.destroy_process_group()


# --- the parent: scratch, the processes, the timeout, the table ---------------------------------------------------


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _scratch_base(args: argparse.Namespace, need: int) -> Path:
    candidates = [args.scratch] if args.scratch else [Path("/dev/shm"), Path(tempfile.gettempdir())]
    for base in candidates:
        base.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(base).free >= need:
            return base
    raise SystemExit(f"replication bench: no room for {need / 2**30:.1f} GiB in {', '.join(map(str, candidates))}")


def _supervise(procs: list[subprocess.Popen], deadline: float, what: str) -> None:
    """Wait for every process to end 0; on a failure or the deadline, raise (the caller kills the rest)."""
    while True:
        codes = [p.poll() for p in procs]
        if all(code == 0 for code in codes):
            return
        if any(code not in (None, 0) for code in codes):
            raise RuntimeError(f"{what}: a process failed (exit codes {codes})")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: still running at the --timeout deadline (exit codes {codes})")
        with contextlib.suppress(subprocess.TimeoutExpired):  # still running: look at all of them again
            procs[codes.index(None)].wait(timeout=min(1.0, left))


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *argv], env=env, stdout=sys.stderr, preexec_fn=_die_with_parent)


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    deadline, procs = time.monotonic() + args.timeout, []
    common = ["--mib", str(args.mib), "--repeats", str(args.repeats), "--scratch", str(scratch),
              "--timeout", str(args.timeout), "--hash", args.hash]
    try:
        log(f"building a {args.mib} MiB snapshot with ckptrun's Saver in {scratch}")
        procs = [_spawn([*common, "--role", "build"], dict(os.environ))]
        _supervise(procs, deadline, "building the snapshot")
        snapshot = (scratch / "snapshot.txt").read_text()
        log(f"snapshot {snapshot}; starting the two processes")
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        report = scratch / "report.json"
        pair_argv = [*common, "--role", "pair", "--snapshot", snapshot, "--into", str(scratch / "into"),
                     "--report", str(report)]
        procs = [_spawn(pair_argv, {**env, "RANK": str(rank)}) for rank in (0, 1)]
        _supervise(procs, deadline, "the two processes")
        got = json.loads(report.read_text())
        sender = json.loads(report.with_suffix(".rank0.json").read_text())["cpu"]
        got["cpu"] = {name: [a + b for a, b in zip(got["cpu"][name], sender[name])] for name in VARIANTS}
        return got
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def figure(samples: list[float], nbytes: int | None = None) -> dict[str, Any]:
    median = statistics.median(samples)
    out = {"median": median, "min": min(samples), "max": max(samples), "samples": samples}
    return {**out, "gib_per_s": nbytes / 2**30 / median} if nbytes else out


def report_out(args: argparse.Namespace, got: dict[str, Any], load: list[list[float]], scratch: Path) -> dict[str, Any]:
    nbytes, samples, cpu = got["bytes"], got["samples"], got["cpu"]
    replication_s, socket_s = figure(samples["replication"], nbytes), figure(samples["socket"], nbytes)
    replication_cpu, socket_cpu = figure(cpu["replication"]), figure(cpu["socket"])
    ratio = replication_s["median"] / socket_s["median"]
    return {"mib": args.mib, "hash": args.hash, "bytes": nbytes, "files": got["files"], "repeats": args.repeats,
            "scratch": str(scratch.parent), "replication_s": replication_s, "socket_s": socket_s, "ratio": ratio,
            "ratio_per_repeat": [a / b for a, b in zip(samples["replication"], samples["socket"])],
            "goal": GOAL, "pass": ratio <= GOAL, "load": load, "cores": os.cpu_count(),
            "replication_cpu_s": replication_cpu, "socket_cpu_s": socket_cpu,
            "cpu_ratio": replication_cpu["median"] / socket_cpu["median"]}


def print_table(out: dict[str, Any]) -> None:
    (start, end) = out["load"]
    print(f"replication of a {out['bytes'] / MiB:.0f} MiB snapshot ({out['files']} files) between two processes on "
          f"127.0.0.1, {out['hash']} digests, {out['repeats']} repeats, scratch {out['scratch']}, load {start[0]} -> {end[0]} "
          f"on {out['cores']} cores")
    print(f"  {'figure':18s} {'median':>8s} {'min':>8s} {'max':>8s} {'GiB/s':>7s}")
    for key in ("replication_s", "socket_s", "replication_cpu_s", "socket_cpu_s"):
        f = out[key]
        speed = f"{f['gib_per_s']:7.2f}" if "gib_per_s" in f else ""
        print(f"  {key:18s} {f['median']:8.3f} {f['min']:8.3f} {f['max']:8.3f} {speed}".rstrip())
    spread = out["ratio_per_repeat"]
    print(f"  replication / socket: {out['ratio']:.2f} (per repeat {min(spread):.2f}-{max(spread):.2f}), "
          f"goal <= {out['goal']}: {'PASS' if out['pass'] else 'MISS'}; CPU seconds (both processes): "
          f"{out['cpu_ratio']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of the snapshot (model + AdamW state), MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", type=Path, default=None,
                        help="where the snapshot and the copies go (default /dev/shm if it has room, else the temp dir)")
    parser.add_argument("--hash", choices=("sha256", "blake3"), default=hashing.memory_algorithm("sha256"),
                        help="the snapshot's digest, checked on receipt (default: the memory tier's, blake3 where installed)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--timeout", type=int, default=900, help="seconds before everything is killed")
    parser.add_argument("--role", choices=("build", "pair"), default=None, help=argparse.SUPPRESS)
    for hidden in ("--snapshot", "--into", "--report"):
        parser.add_argument(hidden, type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "build":
        build(args)
        return 0
    if args.role == "pair":
        pair(args)
        return 0
    need = 3 * args.mib * MiB + 256 * MiB  # the snapshot + two copies (one at a time) + the Saver's small files
    scratch = Path(tempfile.mkdtemp(prefix="ckptrun-bench-replication-", dir=_scratch_base(args, need)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # an outer `timeout`: the finally below still cleans
    load_start = load_average()
    try:
        got = measure(args, scratch)
    except (RuntimeError, TimeoutError) as exc:
        log(f"failed: {exc}")
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = report_out(args, got, [load_start, load_average()], scratch)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
