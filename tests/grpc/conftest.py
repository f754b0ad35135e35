"""Fixtures: real worker subprocesses serving gRPC, always stopped after the test."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge_py.client import Client, connect
from tests.worker.processes import ROOT, start_worker, stop_worker, wait_for_port_file

__all__ = ["ROOT", "SAMPLE", "GrpcWorker"]
SAMPLE = "tests.worker.sample_exports:table"


class GrpcWorker:
    """``python -m bridge_py.worker --grpc 127.0.0.1:0`` as a subprocess.

    By default it gets a fresh token through ``$VLLM_BRIDGE_TOKEN`` (``self.token``)
    and :meth:`connect` sends it; ``token_env=False`` starts it with that variable
    empty, so the worker finds its credential itself (a generated token, a
    ``--token-file``, a Unix socket).
    """

    def __init__(
        self,
        *args: str,
        exports: str | None = SAMPLE,
        env: dict | None = None,
        token_env: bool = True,
    ) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self.dir = Path(self._dir.name)
        port_file = self.dir / "port"
        if "--grpc" not in args:
            args = (*args, "--grpc", "127.0.0.1:0")
        self.token: str | None = secrets.token_urlsafe(32) if token_env else None
        env = {"VLLM_BRIDGE_TOKEN": self.token or "", **(env or {})}
        self.stderr = open(self.dir / "stderr", "w+b")  # noqa: SIM115
        self.proc = start_worker(
            *args, "--port-file", str(port_file), exports=exports, stderr=self.stderr, env=env
        )
        try:
            self.port = wait_for_port_file(self.proc, port_file)
        except (RuntimeError, TimeoutError) as exc:
            log = self.log()
            self.stop()
            raise RuntimeError(f"{exc}: {log}") from None
        address = args[args.index("--grpc") + 1]
        self.target = address if address.startswith("unix:") else f"127.0.0.1:{self.port}"

    def connect(self, **options: Any) -> Client:
        """A client of this worker with its token (``options`` go to ``connect``)."""
        options.setdefault("token", self.token)
        return connect(self.target, **options)

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
