"""Saving to and restoring from an object store (a local moto S3 server) beside the local disk.

Same 64 MiB model + AdamW state, world size 1, sync saves, interleaved per repeat:

* ``local_save_s`` — ckptrun sync save to a local dir until published (sha256 while writing, fsync, rename);
* ``s3_save_s`` — the same save to ``s3://`` until committed: published in the
  staging dir, every file streamed to the server and hashed against its digest,
  the manifest written last, staging emptied;
* ``s3_upload_s`` — of which the upload and commit;
* ``local_restore_s`` — ``verify_snapshot`` (every byte hashed) + ``snapshot.load``, page cache evicted;
* ``s3_restore_s`` — the restore choice of a restart with no local copy: listing,
  download into an empty cache with every object hashed against the manifest,
  then ``snapshot.load`` of that copy;
* ``s3_restore_cached_s`` — the same with a verified local copy in the cache
  (``--local-cache``): listing + local verify + load, no download;
* ``*_vs_local`` — per-repeat ratios to the local figure.

The server runs on 127.0.0.1 in another process: the figures are the protocol's
and the client's cost (HTTP, multipart, hashing), not a network's. A real
store adds its bandwidth and latency; ``estimate-rto`` measures those against
the store itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from common import EVICTED, MiB, WRITTEN, Figure, build_state, evict, free_port, interleave, ratio_samples, save_once

STATE_MIB = 64
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    """``moto_server`` on a free loopback port (127.0.0.1 only); its endpoint once it answers."""
    port = free_port()
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    process = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return process, endpoint
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"moto_server did not answer on {endpoint}")


def _store(endpoint: str):
    from ckptrun.runtime.storage.ckpt_url import StoreUrl
    from ckptrun.runtime.storage.remote_store import FsspecStore

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    store = FsspecStore(StoreUrl("s3", f"{bucket}/ckpt"), {"endpoint_url": endpoint})
    store.fs.mkdir(bucket)
    return store


def _save(saver, state) -> tuple[float, object]:
    started = time.perf_counter()
    save_once(saver, state)
    result = saver.collect(wait=True)[-1]
    seconds = time.perf_counter() - started
    if not result.ok:
        raise RuntimeError(f"save failed: {result.error}")
    return seconds, result


def measure(scratch: Path, repeats: int) -> dict[str, Figure]:
    from ckptrun.runtime.checkpoint import snapshot
    from ckptrun.runtime.storage import store as local_store
    from ckptrun.runtime.checkpoint.saver import Saver
    from ckptrun.runtime.checkpoint.tiering import choose
    from ckptrun.runtime.checkpoint.verify import verify_snapshot

    os.environ.update(CREDENTIALS)
    scratch.mkdir(parents=True, exist_ok=True)
    server, endpoint = start_server(scratch / "moto.log")
    try:
        state = build_state(STATE_MIB * MiB)
        remote = _store(endpoint)
        local_saver = Saver(scratch / "local", "sha256", asynchronous=False)
        s3_saver = Saver(scratch / "staging", "sha256", asynchronous=False, remote=remote, keep_local=False)
        kept: dict[str, Path] = {}

        def local_save() -> dict[str, float]:
            seconds, result = _save(local_saver, state)
            if "local" in kept:
                local_store.delete_snapshot(kept["local"])
            kept["local"] = result.path
            return {"local_save_s": seconds}

        def s3_save() -> dict[str, float]:
            seconds, result = _save(s3_saver, state)
            return {"s3_save_s": seconds, "s3_upload_s": result.upload_s}

        def local_restore() -> dict[str, float]:
            evict(kept["local"])
            started = time.perf_counter()
            if not verify_snapshot(kept["local"]).ok:
                raise RuntimeError("local snapshot does not verify")
            snapshot.load(kept["local"])
            return {"local_restore_s": time.perf_counter() - started}

        def s3_restore() -> dict[str, float]:
            cache = scratch / f"cache-{uuid.uuid4().hex[:6]}"
            started = time.perf_counter()
            chosen = choose(remote, cache)
            snapshot.load(chosen.path)
            cold = time.perf_counter() - started
            evict(chosen.path)
            started = time.perf_counter()
            cached = choose(remote, cache)
            snapshot.load(cached.path)
            warm = time.perf_counter() - started
            assert chosen.source == "remote" and cached.source == "local-cache"
            shutil.rmtree(cache)
            return {"s3_restore_s": cold, "s3_restore_cached_s": warm}

        local_save(), s3_save()  # staging buffers and connections exist before the first timed repeat
        samples = interleave(repeats, {"local_save": local_save, "s3_save": s3_save})
        samples.update(interleave(repeats, {"local_restore": local_restore, "s3_restore": s3_restore}))
    finally:
        server.kill()
        server.wait()
    note = f"{STATE_MIB} MiB state, moto S3 on 127.0.0.1"
    figures = {key: Figure(values, "s", WRITTEN if "save" in key or "upload" in key else EVICTED, note=note)
               for key, values in samples.items()}
    figures["s3_save_vs_local"] = Figure(ratio_samples(samples["s3_save_s"], samples["local_save_s"]), "x", WRITTEN, note=note)
    figures["s3_restore_vs_local"] = Figure(ratio_samples(samples["s3_restore_s"], samples["local_restore_s"]), "x", EVICTED, note=note)
    figures["s3_restore_cached_vs_local"] = Figure(ratio_samples(samples["s3_restore_cached_s"], samples["local_restore_s"]),
                                                   "x", EVICTED, note=note)
    return figures


def figures(scratch: Path, repeats: int) -> dict[str, Figure]:
    """:func:`measure`, or one error figure when moto/s3fs are missing (``pip install 'ckptrun[test]'``) or it fails."""
    from common import failed

    try:
        return measure(scratch, repeats)
    except Exception as exc:  # noqa: BLE001 - a missing optional server must not hide the other figures
        return {"error: object store": failed(exc)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    import warnings

    from common import init_world

    warnings.filterwarnings("ignore")
    init_world()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results/scratch-object-store")
    try:
        for key, fig in measure(out, int(os.environ.get("REPEATS", "5"))).items():
            print(f"{key:28} median {fig.median:8.3f}  min {min(fig.samples):8.3f}  max {max(fig.samples):8.3f}  {fig.unit}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
