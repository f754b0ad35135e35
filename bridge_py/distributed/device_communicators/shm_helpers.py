"""vLLM 0.34's module-level helpers of ``shm_broadcast``, for code written against vLLM that
imports them from there (``shm_broadcast`` re-exports them): a memory fence, big-endian
integers, and a check that ``/dev/shm`` has room for a segment."""

from __future__ import annotations

import os
import shutil
import threading

from bridge_py.distributed.errors import SharedMemoryError

__all__ = ["SHM_PATH", "check_shm_free_space", "from_bytes_big", "memory_fence", "to_bytes_big"]

SHM_PATH = "/dev/shm"

_fence = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier (taking and releasing a lock), as vLLM's helper of that name:
    writes before it are seen by other processes before reads after it. This package's
    ring orders its flags itself; the helper is here for code written against vLLM."""
    with _fence:
        pass


def to_bytes_big(value: int, size: int) -> bytes:
    """``value`` as ``size`` big-endian bytes (vLLM's helper)."""
    return value.to_bytes(size, byteorder="big")


def from_bytes_big(data: bytes | bytearray | memoryview) -> int:
    """The unsigned big-endian integer in ``data`` (vLLM's helper)."""
    return int.from_bytes(data, byteorder="big")


def check_shm_free_space(
    required_bytes: int,
    shm_path: str = SHM_PATH,
    *,
    allocation_name: str = "shared-memory allocation",
) -> None:
    """Raise SharedMemoryError (a RuntimeError) when the filesystem at ``shm_path`` has
    less room than ``required_bytes`` for ``allocation_name``; a path that is not a
    directory is not checked. (vLLM also logs the cgroup's memory headroom; this does not.)
    """
    if not os.path.isdir(shm_path):
        return
    free = shutil.disk_usage(shm_path).free
    if required_bytes > free:
        mib = 1 << 20
        raise SharedMemoryError(
            f"Insufficient space in {shm_path} for {allocation_name}: "
            f"{required_bytes / mib:.0f} MiB required, {free / mib:.0f} MiB free. Increase "
            f"{shm_path} (e.g. --shm-size or --ipc=host)."
        )
