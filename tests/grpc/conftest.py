"""Fixtures: real worker subprocesses serving gRPC, always stopped after the test."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.processes import ROOT, start_worker, stop_worker, wait_for_port_file

__all__ = ["ROOT", "SAMPLE", "GrpcWorker"]
SAMPLE = "tests.worker.sample_exports:table"


class GrpcWorker:
    """``python -m bridge_py.worker --grpc 127.0.0.1:0`` as a subprocess."""

    def __init__(self, *args: str, exports: str | None = SAMPLE, env: dict | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory()
        port_file = Path(self._dir.name, "port")
        if "--grpc" not in args:
            args = (*args, "--grpc", "127.0.0.1:0")
        self.stderr = open(Path(self._dir.name, "stderr"), "w+b")  # noqa: SIM115
        self.proc = start_worker(
            *args, "--port-file", str(port_file), exports=exports, stderr=self.stderr, env=env
        )
        try:
            self.port = wait_for_port_file(self.proc, port_file)
        except (RuntimeError, TimeoutError) as exc:
            log = self.log()
            self.stop()
            raise RuntimeError(f"{exc}: {log}") from None
        self.target = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        """What the worker wrote to stderr."""
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def stop(self) -> None:
        """Stop the worker and remove its files."""
        stop_worker(self.proc)
        self.stderr.close()
        self._dir.cleanup()


@pytest.fixture(scope="module")
def grpc_worker() -> Iterator[GrpcWorker]:
    """A gRPC worker serving the sample export table, shared by a module's tests."""
    worker = GrpcWorker()
    yield worker
    worker.stop()
