"""Large values of a StatelessProcessGroup through shared memory, when all ranks share a node.

A value whose pickle (or a tensor's payload, see ``tensors``: never pickled) exceeds
:data:`THRESHOLD` bytes (256 KiB; ``$VLLM_BRIDGE_SPG_SHM_THRESHOLD`` overrides it) is written
straight into a file under ``/dev/shm`` (a *segment*, see ``shm.segments``: reused once its
readers are done), and only a small *descriptor* goes into the store::

    DESCRIPTOR_MAGIC (b"\\x00VBS2") || u64be(size) || u64be(generation) || digest (32 bytes)
        || segment name

The descriptor is sealed like any other value (``auth.seal_payload``: with an auth key it
carries an HMAC bound to its store key), and with an auth key ``digest`` is the SHA-256 of
the value's bytes, which a receiver checks on a private copy before unpickling: whoever can
write ``/dev/shm`` but lacks the key can neither forge a descriptor nor swap the contents.
Without a key the digest is zeros (values are trusted, as plain pickles are). No pickle starts
with a NUL byte, so a descriptor is never mistaken for one. ``generation`` names the value in
a reused segment: a reader refuses a segment that holds another one.

A reader opens the segment, loads the value and marks it as read for its rank (a one-shot
segment, generation 0, is unlinked by its last reader instead). The creator removes the rest
(``segments.SegmentOwner``).

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
import socket
import struct
import sys
from typing import Any

import torch

from bridge_py.distributed.auth import (
    AuthenticationError,
    load_failure,
    load_object,
    open_payload,
    sign,
)
from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm import segments
from bridge_py.distributed.shm.segments import SHM_DIR, Segment, SegmentOwner
from bridge_py.distributed.shm.wait import pid_namespace
from bridge_py.distributed.spg import tensors

__all__ = [
    "DESCRIPTOR_MAGIC",
    "ENV_VAR",
    "NOT_LOCAL",
    "THRESHOLD",
    "THRESHOLD_ENV_VAR",
    "SharedValue",
    "Values",
    "dump",
    "enabled",
    "is_descriptor",
    "node_identity",
    "open_descriptor",
    "segment_name",
    "threshold",
]

ENV_VAR = "VLLM_BRIDGE_SPG_SHM"
THRESHOLD_ENV_VAR = "VLLM_BRIDGE_SPG_SHM_THRESHOLD"
THRESHOLD = 256 * 1024
DESCRIPTOR_MAGIC = b"\x00VBS2"
NOT_LOCAL = b"-"  # the node identity of a rank that does not take shared memory
_DESCRIPTOR = struct.Struct(">QQ32s")  # size, generation, digest
_NO_DIGEST = bytes(32)
_PROTOCOL = pickle.HIGHEST_PROTOCOL


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


class _NoSharedMemory(Exception):
    """Creating or writing a segment failed (``/dev/shm`` full): the value goes in the store."""


class _Spill:
    """A file for ``pickle.Pickler``: bytes stay in memory up to a limit, then go to a segment."""

    def __init__(self, limit: int, owner: SegmentOwner, digest: bool) -> None:
        self._limit = limit
        self._owner = owner
        self._chunks: list[bytes] = []
        self.size = 0
        self.segment: Segment | None = None
        self._at = 0  # where the next bytes go in the segment
        self.hash = hashlib.sha256() if digest else None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.segment is None and self.size + size <= self._limit:
            self._chunks.append(data if isinstance(data, bytes) else view.tobytes())
        else:
            try:
                if self.segment is None:
                    self.segment = self._owner.take()
                    self._at = self._owner.offset
                    for chunk in self._chunks:
                        self._put(memoryview(chunk))
                    self._chunks = []
                self._put(view)
            except OSError as exc:
                raise _NoSharedMemory from exc
        self.size += size
        return size

    def _put(self, view: memoryview) -> None:
        assert self.segment is not None
        if self.hash is not None:
            self.hash.update(view)
        self._at = segments.write_at(self.segment.fd, view, self._at)

    def in_memory(self) -> bytes:
        return b"".join(self._chunks)


def dump(
    obj: Any,
    owner: SegmentOwner,
    digest: bool,
    readers: list[int],
    *,
    pickled: bytes | None = None,
) -> bytes:
    """``obj`` pickled: the pickle itself, or (if larger than the threshold) a descriptor.

    ``readers`` are the ranks that will read the value. ``pickled``: ``obj`` already pickled
    (and larger than the threshold; ``pickle.dumps`` is much cheaper than pickling into a
    spill file, so a sender whose values are usually small pickles plainly and copies only
    a payload that turned out large). The descriptor is returned unsealed. On any error
    creating or writing a segment (``/dev/shm`` full) the segment is dropped and the pickle
    is returned instead.
    """
    spill = _Spill(threshold() if pickled is None else 0, owner, digest)
    try:
        if pickled is None:
            pickle.Pickler(spill, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        else:
            spill.write(pickled)
        if spill.segment is None:
            return spill.in_memory()
        generation = owner.publish(spill.segment, spill.size, readers)
    except (_NoSharedMemory, OSError) as exc:
        if spill.segment is None and not isinstance(exc, _NoSharedMemory):
            raise  # from the object's own pickling, not from shared memory
        if spill.segment is not None:
            owner.drop(spill.segment)
        return pickled if pickled is not None else pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    tag = spill.hash.digest() if spill.hash is not None else _NO_DIGEST
    return (
        DESCRIPTOR_MAGIC
        + _DESCRIPTOR.pack(spill.size, generation, tag)
        + spill.segment.name.encode()
    )


class SharedValue:
    """A segment named by a descriptor, held open by one reader until it has loaded it.

    The last reader of a one-shot segment (generation 0) unlinks it once open
    (:meth:`retire`); a pooled one belongs to its creator, and :meth:`load` marks it as read.
    """

    def __init__(
        self,
        name: str,
        fd: int,
        size: int,
        digest: bytes | None,
        what: str,
        *,
        offset: int,
        generation: int,
        rank: int,
    ) -> None:
        """The value of ``size`` bytes at ``offset`` of segment ``name`` (open as ``fd``),
        holding ``generation``, read by ``rank``; ``digest`` to check, if keyed."""
        self.name = name
        self._fd = fd
        self._size = size
        self._digest = digest
        self._what = what
        self._offset = offset
        self._generation = generation
        self._rank = rank

    def retire(self) -> None:
        """The last reader holds the value open: remove a one-shot segment's name."""
        if self._generation == 0:
            segments.unlink(self.name)

    def load(self, like: torch.Tensor | None = None) -> Any:
        """The object in the segment (its digest checked first, when there is one); closes it.

        ``like``: a tensor is expected, of its dtype and shape (see ``tensors.decode``).
        A pooled segment is marked as read by this rank, even when loading fails (it is
        done with it either way).
        """
        try:
            value = self._read(like)
            if self._generation and segments.read_generation(self._fd) != self._generation:
                raise SharedMemoryError(
                    f"{self._what}: shared-memory segment {self.name!r} was overwritten while "
                    "it was read (something other than its creator writes /dev/shm)"
                )
            return value
        finally:
            if self._generation:
                with contextlib.suppress(OSError):
                    segments.write_mark(self._fd, self._rank, self._generation)
            self.close()

    def _read(self, like: torch.Tensor | None) -> Any:
        with open(self._fd, "rb", buffering=0, closefd=False) as file:
            file.seek(self._offset)
            if self._digest is None and like is None and not self._holds_tensor():
                try:
                    return pickle.load(file)
                except Exception as exc:
                    raise load_failure(self._what, exc) from exc
            data = bytearray(self._size)
            if file.readinto(data) != self._size:
                raise AuthenticationError(f"refused {self._what}: its segment is truncated")
            tag = self._digest
            if tag is not None and not hmac.compare_digest(hashlib.sha256(data).digest(), tag):
                raise AuthenticationError(
                    f"refused {self._what}: the contents of shared-memory segment "
                    f"{self.name!r} do not match its authenticated digest"
                )
            return decode(data, like, self._what)

    def _holds_tensor(self) -> bool:
        return tensors.is_tensor(os.pread(self._fd, len(tensors.MAGIC), self._offset))

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def open_descriptor(
    descriptor: bytes | bytearray | memoryview, keyed: bool, what: str, rank: int
) -> SharedValue:
    """Open the segment a descriptor names, for reader ``rank`` (``keyed``: check its digest).

    Raises SharedMemoryError when the descriptor is malformed, the segment is gone (its creator
    died and it was cleaned up), is not a file of this user's that only it may write (see
    ``shm_files``: refused before it is read), holds another value than the descriptor
    names, or is too short.
    """
    head = len(DESCRIPTOR_MAGIC) + _DESCRIPTOR.size
    try:
        size, generation, digest = _DESCRIPTOR.unpack(
            bytes(descriptor[len(DESCRIPTOR_MAGIC) : head])
        )
        name = bytes(descriptor[head:]).decode("ascii")
    except (struct.error, UnicodeDecodeError):
        raise SharedMemoryError(f"{what} is a malformed shared-memory descriptor") from None
    if not segments.NAME_PATTERN.match(name):
        raise SharedMemoryError(f"{what} names an invalid shared-memory segment {name!r}")
    try:
        fd, offset, _ = segments.open_value(name, generation, rank, size)
    except SharedMemoryError as exc:
        raise SharedMemoryError(f"{what}: {exc}") from None
    return SharedValue(
        name,
        fd,
        size,
        digest if keyed else None,
        what,
        offset=offset,
        generation=generation,
        rank=rank,
    )


class Values:
    """How one rank of a group turns objects into what it sends, and back.

    An object becomes its pickle, or, when every reader shares this node (``readers``
    given) and the pickle is large, a descriptor of a segment holding it; the result is
    sealed for its name (``auth.seal_payload``: with the group's key, an HMAC bound to
    ``spg/<name>``). Reading checks the seal before anything is unpickled.
    """

    def __init__(self, rank: int, world_size: int, key: bytes | None) -> None:
        self.rank = rank
        self.key = key
        self.segments = SegmentOwner(world_size)
        self._threshold = threshold()  # read once: the environment lookup costs
        # Whether the last value for shared memory was large: pickle the next into a segment.
        self._spilled = False

    def pack(
        self, name: str, obj: Any, readers: list[int] | None = None
    ) -> tuple[bytes, str | None]:
        """What to send for ``obj`` under ``name``, and the segment it named (or None).

        ``readers``: the ranks that will read it, when all share this node (else None: no
        segment). A large pickle then goes to a segment, reused once they all marked it read.
        """
        limit, key = self._threshold, self.key
        raw = obj.payload if type(obj) is tensors.Encoded else None  # sent as it is
        if raw is None and readers and (self._spilled or sys.getsizeof(obj) > limit):
            # Looks large (or the last value was): pickle straight into a segment.
            payload = dump(obj, self.segments, key is not None, readers)
        else:
            # Pickling into a spill file costs several times a plain pickle, so small objects
            # (most) are pickled plainly, and copied to a segment only if that was wrong.
            payload = pickle.dumps(obj, _PROTOCOL) if raw is None else raw
            if not readers or len(payload) <= limit:
                return self.seal(name, payload), None
            payload = dump(obj, self.segments, key is not None, readers, pickled=payload)
        segment = segment_name(payload)
        self._spilled = segment is not None
        return self.seal(name, payload), segment

    def open(self, name: str, data: bytes | memoryview, src: int, label: str = "key") -> Any:
        """The checked payload of ``data`` (``name``, from ``src``): bytes, or an open
        :class:`SharedValue`. ``label`` says what ``name`` is in error messages."""
        return self._open(name, data, self.describe(name, src, label))

    def _open(self, name: str, data: bytes | memoryview, what: str) -> Any:
        payload = open_payload(self.key, _context(name), data, what)
        if is_descriptor(payload):
            return open_descriptor(payload, self.key is not None, what, self.rank)
        return payload

    def describe(self, name: str, src: int, label: str = "key") -> str:
        """The value ``name`` from ``src``, as error messages name it."""
        return f"the value of {label} {name!r} from rank {src} (received by rank {self.rank})"

    @staticmethod
    def load(payload: Any, like: torch.Tensor | None, what: str) -> Any:
        """The object in a payload from :meth:`open` (``what``, see :meth:`unpack`)."""
        if isinstance(payload, SharedValue):
            return payload.load(like)
        return decode(payload, like, what)

    def unpack(
        self,
        name: str,
        data: bytes | memoryview,
        src: int,
        last: bool = True,
        label: str = "key",
        like: torch.Tensor | None = None,
    ) -> Any:
        """The object in ``data`` (``name``, from ``src``), checked, then unpickled or (a
        tensor) decoded.

        ``last``: this rank is the value's last reader (a one-shot segment is unlinked once
        open). ``like``: a tensor of its dtype and shape is expected, and nothing is
        unpickled. Without a key a plain pickle (it starts with the PROTO opcode, which
        neither a tag nor a descriptor does) is unpickled at once where no tensor is.
        """
        if self.key is None and data[:1] == b"\x80" and like is None:
            try:
                return pickle.loads(data)
            except Exception as exc:  # (named only then: this is every small value's way)
                raise load_failure(self.describe(name, src, label), exc) from exc
        what = self.describe(name, src, label)
        payload = self._open(name, data, what)
        if last and isinstance(payload, SharedValue):
            payload.retire()
        return self.load(payload, like, what)

    def seal(self, name: str, data: bytes) -> bytes:
        """``data`` (a pickle, a descriptor, a node card) sealed for ``name``
        (``auth.seal_payload``; the context is worked out only with a key)."""
        key = self.key
        return data if key is None else sign(key, _context(name), data)

    def unseal(self, name: str, data: bytes, what: str) -> bytes:
        """The inverse of :meth:`seal`; AuthenticationError naming ``what`` if forged."""
        return bytes(open_payload(self.key, _context(name), data, what))


def decode(payload: bytes | bytearray | memoryview, like: torch.Tensor | None, what: str) -> Any:
    """The object in a checked payload: a tensor (which must fit ``like``, if given), or,
    where no tensor is expected (``like`` None), a pickle."""
    if like is None and not tensors.is_tensor(payload):
        return load_object(payload, what)
    return tensors.decode(payload, like, what)


def _context(name: str) -> str:
    """What a value's tag is bound to: its name, which names sender, receiver and number."""
    return f"spg/{name}"
