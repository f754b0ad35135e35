"""Large values of a StatelessProcessGroup through shared memory, when all ranks share a node.

A value whose pickle exceeds :data:`THRESHOLD` bytes (256 KiB; ``$VLLM_BRIDGE_SPG_SHM_THRESHOLD``
overrides it) is pickled straight into a new file under ``/dev/shm`` (a *segment*), and only
a small *descriptor* goes into the store::

    DESCRIPTOR_MAGIC (b"\\x00VBS1") || u64be(size) || digest (32 bytes) || segment name

The descriptor is sealed like any other value (``auth.seal_payload``: with an auth key it
carries an HMAC bound to its store key), and with an auth key ``digest`` is the SHA-256 of
the segment's bytes, which a receiver checks on a private copy before unpickling: whoever can
write ``/dev/shm`` but lacks the key can neither forge a descriptor nor swap the contents.
Without a key the digest is zeros (values are trusted, as plain pickles are). No pickle starts
with a NUL byte, so a descriptor is never mistaken for one.

Segments are named ``vbspg_<pid namespace>_<creator pid>_<token>_<n>`` and removed:

* by their reader(s): a point-to-point receiver and the last receiver of a broadcast unlink
  the name once they hold the file open (an open file stays readable after unlinking);
* by their creator: all_gather values once every rank has read them, and any segment of this
  rank still present after ``data_expiration_seconds`` (``expire_data``), when the group is
  garbage-collected, or at interpreter exit (:class:`SegmentOwner`);
* by any rank of the same PID namespace, when a segment's creator process is gone (it was
  killed before a receiver came): :func:`remove_orphans` runs when a group learns that its
  ranks share a node and when a group is released.

Shared memory is only used once a group knows that all ranks (for point-to-point: the
destination) report the same :func:`node_identity`. Set ``VLLM_BRIDGE_SPG_SHM=0`` to never use
it: such a rank reports no identity, so no rank sends it (or its group, for collectives) a
segment.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import re
import secrets
import socket
import struct
import sys
import threading
import time
from collections import deque
from typing import Any

from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.device_communicators.shm_wait import pid_namespace, process_alive

__all__ = [
    "DESCRIPTOR_MAGIC",
    "ENV_VAR",
    "NAME_PREFIX",
    "NOT_LOCAL",
    "SHM_DIR",
    "THRESHOLD",
    "THRESHOLD_ENV_VAR",
    "SegmentOwner",
    "SharedValue",
    "dump",
    "dump_pickled",
    "enabled",
    "is_descriptor",
    "node_identity",
    "open_descriptor",
    "remove_orphans",
    "segment_name",
    "threshold",
    "unlink",
]

ENV_VAR = "VLLM_BRIDGE_SPG_SHM"
THRESHOLD_ENV_VAR = "VLLM_BRIDGE_SPG_SHM_THRESHOLD"
THRESHOLD = 256 * 1024
SHM_DIR = "/dev/shm"
NAME_PREFIX = "vbspg_"
DESCRIPTOR_MAGIC = b"\x00VBS1"
NOT_LOCAL = b"-"  # the node identity of a rank that does not take shared memory
_DESCRIPTOR = struct.Struct(">Q32s")
_NO_DIGEST = bytes(32)
_NAME = re.compile(r"vbspg_[0-9]+_[0-9]+_[0-9a-f]+_[0-9]+\Z")
_CHUNK = 1 << 20


def enabled() -> bool:
    """Whether this process may use shared memory (Linux, ``/dev/shm``, not switched off)."""
    return (
        os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")
        and sys.platform.startswith("linux")
        and os.path.isdir(SHM_DIR)
    )


def threshold() -> int:
    """Pickles larger than this many bytes go through shared memory (when possible)."""
    try:
        return max(0, int(os.environ.get(THRESHOLD_ENV_VAR, THRESHOLD)))
    except ValueError:
        return THRESHOLD


def node_identity() -> bytes:
    """What this process shares with the ranks it can pass segments to; NOT_LOCAL if disabled.

    The boot id and host name (one machine), the device and inode of ``/dev/shm`` (one and the
    same tmpfs, not a container's private one) and the PID namespace (orphaned segments are
    recognised by their creator's PID).
    """
    if not enabled():
        return NOT_LOCAL
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as boot:
            boot_id = boot.read().strip().decode()
        shm = os.stat(SHM_DIR)
    except OSError:
        return NOT_LOCAL
    return f"{boot_id}|{socket.gethostname()}|{shm.st_dev}:{shm.st_ino}|{pid_namespace()}".encode()


def is_descriptor(payload: bytes | bytearray | memoryview) -> bool:
    """Whether an (opened) store value names a segment rather than holding a pickle."""
    return bytes(payload[: len(DESCRIPTOR_MAGIC)]) == DESCRIPTOR_MAGIC


def segment_name(payload: bytes) -> str | None:
    """The segment an unsealed payload from :func:`dump` names, or None for a plain pickle."""
    if not is_descriptor(payload):
        return None
    return payload[len(DESCRIPTOR_MAGIC) + _DESCRIPTOR.size :].decode("ascii")


def unlink(name: str) -> None:
    """Remove segment ``name`` if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


class _Spill:
    """A file for ``pickle.Pickler``: bytes stay in memory up to a limit, then go to a segment."""

    def __init__(self, limit: int, owner: SegmentOwner, digest: bool) -> None:
        self._limit = limit
        self._owner = owner
        self._chunks: list[bytes] = []
        self.size = 0
        self.fd: int | None = None
        self.name: str | None = None
        self.hash = hashlib.sha256() if digest else None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.fd is None and self.size + size <= self._limit:
            self._chunks.append(data if isinstance(data, bytes) else view.tobytes())
        else:
            if self.fd is None:
                self.name, self.fd = self._owner.create()
                for chunk in self._chunks:
                    self._put(memoryview(chunk))
                self._chunks = []
            self._put(view)
        self.size += size
        return size

    def _put(self, view: memoryview) -> None:
        assert self.fd is not None
        if self.hash is not None:
            self.hash.update(view)
        while view:
            view = view[os.write(self.fd, view[:_CHUNK] if len(view) > _CHUNK else view) :]

    def in_memory(self) -> bytes:
        return b"".join(self._chunks)


def dump(obj: Any, owner: SegmentOwner, digest: bool) -> bytes:
    """``obj`` pickled: the pickle itself, or (if larger than the threshold) a descriptor.

    The descriptor is returned unsealed; a segment it names is recorded by ``owner``. On any
    error writing shared memory (``/dev/shm`` full) the segment is removed and the pickle is
    returned instead.
    """
    spill = _Spill(threshold(), owner, digest)
    try:
        pickle.Pickler(spill, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except OSError:
        if spill.name is None:
            raise
        owner.discard(spill.name)
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        if spill.fd is not None:
            os.close(spill.fd)
    if spill.name is None:
        return spill.in_memory()
    tag = spill.hash.digest() if spill.hash is not None else _NO_DIGEST
    return DESCRIPTOR_MAGIC + _DESCRIPTOR.pack(spill.size, tag) + spill.name.encode()


def dump_pickled(payload: bytes, owner: SegmentOwner, digest: bool) -> bytes:
    """Like :func:`dump`, for an object already pickled into ``payload`` (over the threshold).

    For a sender whose values are usually small: ``pickle.dumps`` is much cheaper than
    pickling into a spill file, so a sender pickles plainly and copies only a payload that
    turned out large into a new segment; the descriptor is returned. On any error writing
    shared memory the segment is removed and the payload itself is returned.
    """
    name, fd = owner.create()
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view[:_CHUNK] if len(view) > _CHUNK else view) :]
    except OSError:
        owner.discard(name)
        return payload
    finally:
        os.close(fd)
    tag = hashlib.sha256(payload).digest() if digest else _NO_DIGEST
    return DESCRIPTOR_MAGIC + _DESCRIPTOR.pack(len(payload), tag) + name.encode()


class SharedValue:
    """A segment named by a descriptor, held open: it can be unlinked, then still loaded."""

    def __init__(self, name: str, fd: int, size: int, digest: bytes | None, what: str) -> None:
        self.name = name
        self._fd = fd
        self._size = size
        self._digest = digest
        self._what = what

    def unlink(self) -> None:
        unlink(self.name)

    def load(self) -> Any:
        """The object in the segment (its digest checked first, when there is one); closes it."""
        try:
            with open(self._fd, "rb", buffering=0, closefd=False) as file:
                if self._digest is None:
                    return pickle.load(file)
                data = bytearray(self._size)
                if file.readinto(data) != self._size:
                    raise AuthenticationError(f"refused {self._what}: its segment is truncated")
                if not hmac.compare_digest(hashlib.sha256(data).digest(), self._digest):
                    raise AuthenticationError(
                        f"refused {self._what}: the contents of shared-memory segment "
                        f"{self.name!r} do not match its authenticated digest"
                    )
                return pickle.loads(data)
        finally:
            self.close()

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def open_descriptor(descriptor: bytes | memoryview, keyed: bool, what: str) -> SharedValue:
    """Open the segment a descriptor names (``keyed``: its digest will be checked on load).

    Raises RuntimeError when the descriptor is malformed or the segment is gone (its creator
    died and it was cleaned up) or of the wrong size.
    """
    head = len(DESCRIPTOR_MAGIC) + _DESCRIPTOR.size
    try:
        size, digest = _DESCRIPTOR.unpack(bytes(descriptor[len(DESCRIPTOR_MAGIC) : head]))
        name = bytes(descriptor[head:]).decode("ascii")
    except (struct.error, UnicodeDecodeError):
        raise RuntimeError(f"{what} is a malformed shared-memory descriptor") from None
    if not _NAME.match(name):
        raise RuntimeError(f"{what} names an invalid shared-memory segment {name!r}")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise RuntimeError(
            f"{what} is in shared-memory segment {name!r}, which cannot be opened "
            f"({exc.strerror}): did its sender exit?"
        ) from exc
    if os.fstat(fd).st_size != size:
        os.close(fd)
        raise RuntimeError(f"{what}: shared-memory segment {name!r} does not hold {size} bytes")
    return SharedValue(name, fd, size, digest if keyed else None, what)


class SegmentOwner:
    """The segments one group's rank created, for removal on expiry, release and exit."""

    def __init__(self) -> None:
        self._token = secrets.token_hex(4)
        self._count = 0
        self._pid = os.getpid()
        self._created: deque[tuple[str, float]] = deque()
        self._lock = threading.Lock()

    def create(self) -> tuple[str, int]:
        """A new, empty segment (readable and writable by this user only): name and fd."""
        with self._lock:
            self._count += 1
            name = f"{NAME_PREFIX}{pid_namespace()}_{os.getpid()}_{self._token}_{self._count}"
            self._created.append((name, time.time()))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return name, os.open(os.path.join(SHM_DIR, name), flags, 0o600)

    def __bool__(self) -> bool:
        """Whether any segment this owner created may still exist (``expire`` has work)."""
        return bool(self._created)

    def discard(self, name: str) -> None:
        """Unlink ``name`` now (readers are done with it)."""
        unlink(name)

    def expire(self, max_age: float) -> None:
        """Unlink the segments created more than ``max_age`` seconds ago (read or not)."""
        now = time.time()
        with self._lock:
            while self._created and now - self._created[0][1] > max_age:
                unlink(self._created.popleft()[0])

    def release(self) -> None:
        """Unlink every segment this owner created, then the orphans of dead creators."""
        if os.getpid() != self._pid:
            return  # a forked child: the segments still belong to the parent
        with self._lock:
            while self._created:
                unlink(self._created.popleft()[0])
        remove_orphans()


def remove_orphans() -> list[str]:
    """Unlink segments whose creator (in this PID namespace) has exited; return their names."""
    prefix = f"{NAME_PREFIX}{pid_namespace()}_"
    try:
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for name in names:
        try:
            pid = int(name[len(prefix) :].split("_", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not process_alive(pid):
            unlink(name)
            removed.append(name)
    return removed
