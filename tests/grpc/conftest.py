"""Fixtures: real worker subprocesses serving gRPC, always stopped after the test."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = "tests.worker.sample_exports:table"


class GrpcWorker:
    """``python -m bridge_py.worker --grpc 127.0.0.1:0`` as a subprocess."""

    def __init__(self, *args: str, exports: str | None = SAMPLE, env: dict | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory()
        port_file = Path(self._dir.name, "port")
        cmd = [sys.executable, "-m", "bridge_py.worker", "--port-file", str(port_file), *args]
        if "--grpc" not in args:
            cmd += ["--grpc", "127.0.0.1:0"]
        if exports:
            cmd += ["--exports", exports]
        self.stderr = open(Path(self._dir.name, "stderr"), "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            cwd=ROOT,
        )
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("worker did not start serving gRPC within 60 s")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.target = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        """What the worker wrote to stderr."""
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def stop(self) -> None:
        """Terminate the worker (kill it if it does not go)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()
        self.stderr.close()
        self._dir.cleanup()


@pytest.fixture(scope="module")
def grpc_worker() -> Iterator[GrpcWorker]:
    """A gRPC worker serving the sample export table, shared by a module's tests."""
    worker = GrpcWorker()
    yield worker
    worker.stop()
