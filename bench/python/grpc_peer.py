"""The gRPC peer of the call benchmark, driven by bench/elixir/calls.exs over a Port.

Starts ``python -m bridge_py.worker --grpc 127.0.0.1:0`` serving the sample export table,
with a fresh token in ``$VLLM_BRIDGE_TOKEN`` (as a deployment would), connects
``bridge_py.client`` with that token (which opens a session), creates a ``Counter`` and
sends one ``ready`` frame. Then, for every {:packet, 4} frame it reads (an ASCII count
N), it makes N sequential ``Counter.incr`` calls, checks each result, and answers one
frame of N latencies in nanoseconds (little-endian int64). Exits, stopping the server,
when stdin closes.
"""

from __future__ import annotations

import os
import secrets
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.worker.processes import start_worker, stop_worker, wait_for_port_file  # noqa: E402

_HEADER = struct.Struct(">I")


def _read_frame(stream) -> bytes | None:
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = _HEADER.unpack(header)
    return stream.read(size)


def _write_frame(fd: int, payload: bytes) -> None:
    os.write(fd, _HEADER.pack(len(payload)) + payload)


def main() -> int:
    out = os.dup(1)
    os.dup2(2, 1)  # keep the frames clean of anything printed
    stream = os.fdopen(os.dup(0), "rb")
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        token = secrets.token_urlsafe(32)
        server = start_worker(
            "--grpc", "127.0.0.1:0", "--port-file", str(port_file),
            exports="tests.worker.sample_exports:table",
            stdin=subprocess.DEVNULL, stdout=2, env={"VLLM_BRIDGE_TOKEN": token},
        )  # fmt: skip
        try:
            port = wait_for_port_file(server, port_file, timeout=120)
            from bridge_py.client import connect

            with connect(f"127.0.0.1:{port}", token=token) as client:
                counter = client.create("Counter")
                expected = 0
                _write_frame(out, b"ready")
                while (frame := _read_frame(stream)) is not None:
                    lat = []
                    for _ in range(int(frame)):
                        t0 = time.perf_counter_ns()
                        value = client.call_method(counter, "incr")
                        lat.append(time.perf_counter_ns() - t0)
                        expected += 1
                        if value != expected:
                            raise SystemExit(f"Counter.incr returned {value}, not {expected}")
                    _write_frame(out, struct.pack(f"<{len(lat)}q", *lat))
        finally:
            stop_worker(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
