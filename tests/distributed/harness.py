"""Run N real processes for one test, with a hard deadline, and report their failures.

``run_ranks(target, world_size, *args)`` starts ``target(rank, *args)`` in one fresh process
per rank and returns their results in rank order. If a rank raises, the others are killed
and the test fails with that rank's traceback; if the deadline passes or a rank dies without
a result, every child still running is killed and the test fails naming the missing ranks.
No child outlives the call.

Processes come from a ``forkserver`` (on Linux) that has imported torch once: each child is a
fresh fork of that clean, single-threaded server, so it starts in milliseconds instead of
re-importing torch for seconds, yet shares no state with the pytest process (as with
``spawn``, which is used where forkserver is unavailable). ``target`` and its arguments
must be picklable: module-level functions of a test module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import multiprocessing
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["call_with_small_dev_shm", "free_port", "run_ranks", "run_ranks_with_small_dev_shm"]

_PRELOAD = ["torch.distributed", "bridge_py.distributed"]


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def join_gloo(rank: int, port: int, world_size: int = 2) -> None:
    """torch.distributed's default group over gloo, rendezvous on 127.0.0.1:``port``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections and to bind(port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now and that no outgoing connection will take.

    A port from bind(port 0) comes from the kernel's ephemeral range, the one outgoing
    connections (gloo's, a store client's) draw from as well: one of them could take it
    between this call and the moment a test binds it (seen: a store's port taken while
    the test's first group ran). So the port is drawn at random below that range, and
    checked to be free.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free TCP port on {host} below {low}")


def _child(target: Callable[..., Any], rank: int, args: tuple, results: Any) -> None:
    try:
        value = target(rank, *args)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    else:
        results.put((rank, True, value))


def _stop(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5)


@contextlib.contextmanager
def traced_memory() -> Iterator[Callable[[], tuple[int, int]]]:
    """Python's allocations in this process traced for the block (tracemalloc); yields
    what reads them: ``(bytes held now, the most held at once)`` since the block began."""
    tracemalloc.start()
    try:
        yield tracemalloc.get_traced_memory
    finally:
        tracemalloc.stop()


def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    ranks: Sequence[int] | None = None,
) -> list[Any]:
    """Run ``target(rank, *args)`` for each rank (default: all of ``world_size``) in parallel.

    Returns the results in the order of ``ranks``. Raises AssertionError with the child's
    traceback when a rank raises, or naming the missing ranks after ``timeout`` seconds.
    """
    __tracebackhide__ = True  # pytest: show the child's traceback, not this function
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    ctx = _context()
    results = ctx.Queue()
    procs = {
        rank: ctx.Process(target=_child, args=(target, rank, args, results), daemon=True)
        for rank in ranks
    }
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for proc in procs.values():
            proc.start()
        while len(done) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(procs) - set(done))
                raise AssertionError(f"ranks {missing} did not finish within {timeout:g} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 0.2))
            except queue.Empty:
                exited = [r for r, p in procs.items() if r not in done and p.exitcode is not None]
                if not exited:
                    continue
                try:  # a result written just before exiting may still be in the pipe
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    codes = {r: procs[r].exitcode for r in exited}
                    raise AssertionError(f"ranks exited without a result: {codes}") from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            done[rank] = value
    finally:
        _stop(list(procs.values()))
        with contextlib.suppress(Exception):
            results.close()
    return [done[rank] for rank in ranks]


def call_with_small_dev_shm(
    size: str, target: Callable[..., Any], *args: Any, timeout: float = 120.0
) -> Any:
    """``target(*args)`` (a module-level function of a test module; arguments and result
    JSON) in a fresh Python process, in a mount namespace of its own whose ``/dev/shm`` is
    an empty tmpfs of ``size`` (as ``mount -o size=`` takes it: a container's small
    /dev/shm); killed after ``timeout`` seconds. The test fails with the process's output
    if it does not print a result, and is skipped where this machine cannot make such a
    namespace (``unshare`` and ``mount`` need root)."""
    import pytest  # (the harness is imported by children too, which need no pytest)

    why_not = _no_small_dev_shm()
    if why_not:
        pytest.skip(why_not)
    shell = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -c "$0"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell]
    script = (
        "import json\n"
        f"from {target.__module__} import {target.__name__} as target\n"
        f"print(json.dumps(target(*json.loads({json.dumps(json.dumps(args))}))))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [*command, script], capture_output=True, text=True, timeout=timeout, cwd=root
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def _no_small_dev_shm() -> str:
    """Why this machine cannot give a process a small /dev/shm of its own ("" if it can);
    asked once per test session."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return "needs unshare and root, to give a process a small /dev/shm of its own"
    mount = "mount -t tmpfs -o size=1m tmpfs /dev/shm"
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
    probe = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a small /dev/shm here: {probe.stderr.strip()}"
    return ""


def run_ranks_with_small_dev_shm(
    target: Callable[..., Any], world_size: int, size: str, timeout: float = 120.0
) -> list[Any]:
    """:func:`run_ranks` of ``target(rank, port)`` (module-level; JSON results) inside
    :func:`call_with_small_dev_shm`: the ranks' results, in rank order."""
    where = (target.__module__, target.__name__, world_size, timeout / 2)
    return call_with_small_dev_shm(size, _ranks_here, *where, timeout=timeout)


def _ranks_here(module: str, name: str, world_size: int, timeout: float) -> list[Any]:
    """:func:`run_ranks` of ``module.name`` on a port free in this process's namespace."""
    target = getattr(importlib.import_module(module), name)
    return run_ranks(target, world_size, free_port(), timeout=timeout)


def late_barrier(group: Any, late: bool, delay: float, timeout: float) -> dict:
    """One barrier with ``timeout`` that this rank joins ``delay`` seconds late if ``late``:
    ``{"error": message or absent, "elapsed": seconds}``, plus ``"next"``: the message of
    the next barrier, refused at once when this one failed (or "passed"), and ``"next_s"``
    its seconds."""
    result: dict = {}
    if late:
        time.sleep(delay)
    start = time.monotonic()
    try:
        group.barrier(timeout=timeout)
    except RuntimeError as exc:
        result["error"] = str(exc)
    result["elapsed"] = time.monotonic() - start
    start = time.monotonic()
    try:
        group.barrier(timeout=30)
        result["next"] = "passed"
    except RuntimeError as exc:
        result["next"] = f"{type(exc).__name__}: {exc}"
    result["next_s"] = time.monotonic() - start
    if group.rank == 0:
        time.sleep(delay)  # it serves the store: stay until the others are done
    return result


# The two transports of a StatelessProcessGroup made by create() on one machine: shared
# memory (the default there), and the store (what ranks on several machines use).
TRANSPORTS = ("shm", "store")


def use_transport(transport: str) -> None:
    """In a rank's process, before it creates its group: make create() choose ``transport``
    (the store: as if the ranks were on several machines)."""
    os.environ["VLLM_BRIDGE_SPG_SHM"] = "0" if transport == "store" else "1"


def transport_of(group: Any) -> str:
    """Which transport a StatelessProcessGroup uses: "shm" or "store"."""
    return "shm" if type(group._transport).__name__ == "ShmTransport" else "store"
