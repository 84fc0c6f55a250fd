"""A real S3 endpoint for tests: ``moto_server`` on a free loopback port (127.0.0.1 only, never 0.0.0.0).

The server is a separate process (the real HTTP protocol, real s3fs/botocore
clients), started once per test module and killed with its whole tree.
Credentials and the endpoint reach ckptrun the way a user's would: through
the environment (``AWS_*``, ``FSSPEC_S3_*``), never through the run dir.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil
from ports import free_port


@dataclass
class S3Server:
    """A running moto server: its endpoint and the environment a client needs."""

    process: subprocess.Popen
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint, "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def apply(self, monkeypatch: object | None = None) -> None:
        """Put the client environment into this process (tests spawn the CLI with it too)."""
        for key, value in self.env.items():
            if monkeypatch is not None:
                monkeypatch.setenv(key, value)  # type: ignore[attr-defined]
            else:
                os.environ[key] = value

    def new_bucket(self) -> str:
        """A fresh bucket (unique name), so tests sharing the server never see each other's objects."""
        import boto3

        name = f"ckpt-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        kill_tree(self.process.pid)
        self.process.wait(timeout=10)


def kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for proc in [*parent.children(recursive=True), parent]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def start_server(log: Path, timeout: float = 60.0, tries: int = 3) -> S3Server:
    """Start ``moto_server`` bound to 127.0.0.1 and wait until it answers (on another port if one was taken
    between the probe and the server's bind)."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    for _ in range(tries):
        port = free_port(span=1)
        with open(log, "ab") as stream:
            process = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=stream, stderr=subprocess.STDOUT)
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                return S3Server(process, endpoint)
            except OSError:
                time.sleep(0.1)
        if process.poll() is None:
            kill_tree(process.pid)
            raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout:g}s; see {log}")
    raise RuntimeError(f"moto_server exited with {process.returncode} {tries} times; see {log}")


@contextmanager
def serving(log: Path) -> Iterator[S3Server]:
    """A server whose client environment this process (and so every launch it spawns) has while it runs; the
    environment is put back and the server killed after."""
    server = start_server(log)
    saved = {key: os.environ.get(key) for key in server.env}
    server.apply()
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
