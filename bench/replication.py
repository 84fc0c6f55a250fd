"""Memory replicas on another node: the transport against a plain socket copy, and what it costs training.

Two processes on 127.0.0.1 (world size 2, gloo), as two nodes' first ranks. Process 0 holds a real memory
snapshot of ~``--mib`` MiB of model + AdamW state (written by ckptrun's Saver into /dev/shm, with its chunk
digests); per repeat, interleaved, the order rotated:

* ``replicate`` — ckptrun's replication of that snapshot to process 1 (:mod:`ckptrun.runtime.checkpoint.replication`:
  the manifest, 16 MiB pieces over gloo, each chunk hashed on arrival, published atomically), timed by the
  sender until the receiver's verdict;
* ``socket`` — the same files' bytes over one plain TCP socket (``sendfile``) into files on /dev/shm (no hash,
  no manifest): the floor a transport could reach here;
* ``durable`` — ckptrun's durable background persist of the same state to ``--scratch`` (stage, DCP write with
  digests, fsync, publish), the cost a job pays today for a copy that survives the node.

While each runs, a small training loop (the template's model) steps in process 0: its median step time ÷ its
median alone just before and after is the slowdown. Goals: replicate ÷ socket ≤ 1.3; the training slowdown
while replicating ≤ the slowdown of the durable persist.

    python bench/replication.py --mib 1024 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MiB, ProbeLoop, build_state, free_port, init_world, save_once, settle  # noqa: E402

GOAL_TRANSPORT, GOAL_SLOWDOWN = 1.3, 1.0


def socket_send(snapshot: Path, files: list[tuple[str, int]], port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for rel, size in files:
            with open(snapshot / rel, "rb") as stream:
                sock.sendfile(stream, 0, size)
        sock.recv(1)  # the receiver has every byte


def socket_receive(server: socket.socket, into: Path, files: list[tuple[str, int]]) -> None:
    connection, _ = server.accept()
    with connection:
        for rel, size in files:
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb+") as stream:
                stream.truncate(size)
                with mmap.mmap(stream.fileno(), size) as mapped:
                    view, got = memoryview(mapped), 0
                    while got < size:
                        got += connection.recv_into(view[got:], size - got)
                    view.release()
        connection.sendall(b"k")


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ckptrun.runtime.checkpoint import replication
    from ckptrun.runtime.checkpoint.saver import Saver
    from ckptrun.runtime.manifest import read_manifest

    torch.set_num_threads(1)
    init_world(rank, 2, port)
    group = replication.leads_group(replication.Ring((0, 1), 1))
    shm = Path("/dev/shm") / f"ckptrun-bench-replication-{os.getppid()}"
    if rank == 1:
        shm.mkdir(parents=True, exist_ok=True)
        server = socket.create_server(("127.0.0.1", 0))
        dist.broadcast_object_list([server.getsockname()[1]], src=1)
        files = _received(0)
        while True:
            order = _received(0)
            if order == "stop":
                break
            target = shm / order
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            if order == "replicate":
                replication.receive_snapshot(target, 0, group, replication.TAG_REPLICA)
            elif order == "socket":
                socket_receive(server, target, files)
            dist.barrier()
        shutil.rmtree(shm, ignore_errors=True)
        return
    socket_port = _received(1)
    state = build_state(args.mib * MiB)
    memory = Saver(shm / "memory", "sha256", asynchronous=False)
    save_once(memory, state)
    settle(memory)
    snapshot = sorted((shm / "memory").glob("step-*"))[-1]
    manifest = read_manifest(snapshot)
    files = [(e.path, e.size) for e in manifest.files if e.size] + [("manifest.json", (snapshot / "manifest.json").stat().st_size)]
    _send(files)
    durable = Saver(args.scratch / "durable", "sha256", asynchronous=True)
    save_once(durable, state)
    settle(durable)
    loop = ProbeLoop()
    samples: dict[str, list[float]] = {}
    names = ["replicate", "socket", "durable"]
    for repeat in range(args.repeats):
        for name in names[repeat % 3:] + names[:repeat % 3]:
            _send(name)
            before = loop.for_seconds(0.5)
            finished: list[float] = []
            started = time.perf_counter()
            if name == "durable":
                save_once(durable, state, on_result=lambda result: finished.append(time.perf_counter()))
            else:
                def move() -> None:
                    if name == "replicate":
                        replication.send_snapshot(snapshot, 1, group, replication.TAG_REPLICA)
                    else:
                        socket_send(snapshot, files, socket_port)
                    finished.append(time.perf_counter())
                threading.Thread(target=move, daemon=True).start()
            during = loop.until(lambda: bool(finished))
            if name == "durable":
                settle(durable)
            alone = statistics.median(before + loop.for_seconds(0.25))
            samples.setdefault(f"{name}_s", []).append(finished[0] - started)
            samples.setdefault(f"{name}_slowdown", []).append(statistics.median(during) / alone)
            dist.barrier()
    _send("stop")
    report(samples, manifest.total_bytes, args)
    shutil.rmtree(shm, ignore_errors=True)


def _send(obj: Any) -> None:
    import torch.distributed as dist
    dist.broadcast_object_list([obj], src=0)


def _received(src: int) -> Any:
    import torch.distributed as dist
    box = [None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def report(samples: dict[str, list[float]], nbytes: int, args: argparse.Namespace) -> None:
    ratio = [a / b for a, b in zip(samples["replicate_s"], samples["socket_s"])]
    slowdown = [a / b for a, b in zip(samples["replicate_slowdown"], samples["durable_slowdown"])]
    figures = {key: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for key, v in samples.items()}
    figures["replicate_over_socket"] = {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio),
                                        "goal": GOAL_TRANSPORT, "verdict": "PASS" if statistics.median(ratio) <= GOAL_TRANSPORT else "MISS"}
    figures["slowdown_replicate_over_durable"] = {"median": statistics.median(slowdown), "min": min(slowdown),
                                                  "max": max(slowdown), "goal": GOAL_SLOWDOWN,
                                                  "verdict": "PASS" if statistics.median(slowdown) <= GOAL_SLOWDOWN else "MISS"}
    out = {"bytes": nbytes, "repeats": args.repeats, "cores": os.cpu_count(), "figures": figures}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"replication of a {nbytes / MiB:.0f} MiB memory snapshot between two processes on 127.0.0.1 ({args.repeats} repeats)")
    for key, figure in figures.items():
        verdict = f"  goal ≤ {figure['goal']}: {figure['verdict']}" if "goal" in figure else ""
        print(f"  {key:34s} {figure['median']:8.3f}  ({figure['min']:.3f}–{figure['max']:.3f}){verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of the memory snapshot (model + AdamW state)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", type=Path, default=Path("bench/results/replication"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.port, args)
        return 0
    args.scratch.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = [sys.executable, __file__, "--mib", str(args.mib), "--repeats", str(args.repeats), "--scratch", str(args.scratch),
            "--port", str(port)] + (["--json"] if args.json else [])
    receiver = subprocess.Popen([*base, "--rank", "1"])
    sender = subprocess.run([*base, "--rank", "0"])
    receiver.wait(timeout=600)
    shutil.rmtree(args.scratch / "durable", ignore_errors=True)
    return sender.returncode or receiver.returncode


if __name__ == "__main__":
    sys.exit(main())
