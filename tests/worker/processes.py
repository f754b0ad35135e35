"""Starting and stopping real subprocesses (workers, load beside them), for tests and benchmarks.

One place knows how to launch ``python -m bridge_py.worker`` from this checkout
(``PYTHONPATH`` and working directory), how to wait until a gRPC worker serves, and
how to stop a worker for sure; ``PortClient``, the gRPC fixtures and the gRPC
benchmark peer all use it. :func:`every_cpu_taken` makes a machine whose CPUs are all
busy, for the tests of what the worker does then.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]


def start_worker(
    *args: str,
    exports: str | None = None,
    stdin: Any = subprocess.PIPE,
    stdout: Any = subprocess.PIPE,
    stderr: IO[bytes] | int | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``python -m bridge_py.worker *args [--exports exports]`` from this checkout.

    Give ``stderr`` a file, not a pipe nobody reads: a full pipe would block the worker.
    """
    cmd = [sys.executable, "-m", "bridge_py.worker", *args]
    if exports:
        cmd += ["--exports", exports]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        cmd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        cwd=ROOT,
    )


def wait_for_port_file(proc: subprocess.Popen, port_file: Path, timeout: float = 60.0) -> int:
    """The port a ``--grpc ... --port-file`` worker serves on (0 on unix:PATH), once serving."""
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker did not start serving gRPC within {timeout} s")
        time.sleep(0.02)
    return int(port_file.read_text())


def stop_worker(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate a worker, kill it if it does not go, and close our ends of its pipes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream:
            stream.close()


@contextmanager
def every_cpu_taken(cpus: int = 2) -> Iterator[int]:
    """Runs the block on ``cpus`` of this machine's CPUs (at most: the calling thread,
    and what it starts, are pinned to them) beside one busy process more than that, so
    that every one of them is taken. Yields how many CPUs that is. Pinning keeps the
    load small on a machine with many CPUs."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(before)[:cpus])
    busy: list[subprocess.Popen] = []
    try:
        taken = len(os.sched_getaffinity(0))
        for _ in range(taken + 1):
            busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(0.2)  # let them start
        yield taken
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait(10)
        os.sched_setaffinity(0, before)


def kernel_keeps_run_delay() -> bool:
    """Whether this kernel counts the time threads wait for a CPU
    (``/proc/<pid>/schedstat``, second field): this process has waited some by now
    wherever it does; a sandbox that fills the file with zeros does not."""
    try:
        with open("/proc/self/schedstat", "rb") as f:
            return int(f.read().split()[1]) > 0
    except (OSError, ValueError, IndexError):
        return False
