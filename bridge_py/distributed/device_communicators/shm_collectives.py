"""Shared-memory all-reduce, all-gather, reduce-scatter and broadcast for the CPU ranks of one
node.

Over gloo, every collective between processes of one machine crosses the loopback TCP
stack: two copies through the kernel, a wake-up per message, and gloo's own ring steps.
:class:`ShmCollectives` moves the same data through one shared-memory segment per group
instead, with torch ops on views of the mapping (vectorised, and they release the GIL).
vLLM does the same in C++ (``csrc/cpu/shm.cpp``); this is pure Python/torch.

Segment (created by group rank 0 at set-up, attached by the others, then **unlinked at
once**: nothing is left in ``/dev/shm`` whichever rank dies later, and the mappings live as
long as the ranks do)::

    +--------+--------------------------------+-----------------------------------------+
    | header | control block per rank (512 B) | data: 2 halves x world_size slots       |
    | 256 B  | phase counter, 2 agreement     |       of slot_bytes each                |
    |        | rows, pid and pid namespace    |                                         |
    +--------+--------------------------------+-----------------------------------------+

The header is the shared-memory header (``shm.header``: magic ``VBAR``, layout version,
world size, slot bytes, and a random token the handle names); a rank refuses a segment
whose header is not that of its group's.

Protocol. Ranks advance through *phases*: a rank finishes its writes for a phase, then
publishes the phase number in its counter, and waits until every counter has reached it.
Work is cut into *steps* (one chunk of a message, at most ``slot_bytes`` per rank); step
``s`` uses half ``s % 2`` of the data area (double buffering), and every step ends with a
wait on all ranks. A rank writes half ``h`` again only in step ``s + 2``, after the wait of
step ``s + 1``, which every rank reaches only once it has finished reading step ``s``: no
consecutive collectives race, without a trailing barrier.

* all-reduce, chunks up to ``DIRECT_BYTES``: each rank copies its chunk into its slot; one
  wait; each rank sums all slots in rank order into its result (one phase per chunk).
* larger chunks: reduce-scatter in shared memory (rank ``r`` copies into its slot all but
  slice ``r``, sums slice ``r`` of every slot, in rank order, taking its own addend from its
  input, into its result, and writes the sum into slice ``r`` of its own slot), a second
  wait, then an all-gather of the summed slices (two phases per chunk, and each rank adds
  only ``1/world_size`` of the chunk).
* all-gather: copy in, one wait, copy every slot out. reduce-scatter: copy in, one wait,
  sum this rank's piece of every slot.
* broadcast: the source copies its chunk into the whole half (every rank's slot: nobody
  else writes data), one wait, the others copy it out.

Determinism: every element is summed as ``((x0 + x1) + x2) + ...`` in group-rank order, in
the tensor's dtype (each partial sum rounded to it, as torch's own ``+``), on every rank and
whichever path ran. Integer sums are exact (and wrap as in torch and gloo). Floating-point
sums of two ranks equal gloo's bit for bit (addition is commutative, and gloo also rounds a
two-term sum once); with more ranks gloo's ring adds in a rotated order per chunk, so results
may differ from gloo's in the last bits (tests bound the difference), but never between runs
or between ranks.

Agreement. The first step of every operation also carries one row per rank (an
:class:`~bridge_py.distributed.device_communicators.agreement.Signature` encoding) in the
control block; after that step's wait every rank judges the same table, so ranks that call
different collectives, or with different shapes, all raise instead of reading each other's
data. :meth:`ShmCollectives.exchange` (a step with the row alone) is the shared-memory
carrier of the communicator's pre-collective argument check (one phase instead of a gloo
all-gather); the CPU communicator's all-reduce fuses that check into its data step.

Waiting spins on ``sched_yield`` for 2 ms, then naps (``shm.wait.wait_until``), checks every
0.2 s that the ranks it waits for are alive, and gives up at the group's timeout, or at the
caller's deadline (``bridge_py.deadline``) when that comes first. A dead or stuck peer raises
``PeerGoneError`` or ``CollectiveTimeout`` naming the rank and the group, and the
transport is then unusable (the ranks are out of step); set-up falls back to gloo when any
rank cannot open the segment (another node, no ``/dev/shm``, no space).

Environment (identical on every rank; set-up takes the most conservative choice of all):
``VLLM_BRIDGE_CPU_SHM`` (``0`` disables), ``VLLM_BRIDGE_CPU_SHM_BYTES`` (the segment's data
size, default 16 MiB), ``VLLM_BRIDGE_CPU_SHM_TIMEOUT`` (seconds; default: the group's).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import mmap
import os
import secrets
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.deadline import clamp_until
from bridge_py.distributed.device_communicators.agreement import ROW_BYTES, Judge
from bridge_py.distributed.device_communicators.shm_elementwise import Elementwise
from bridge_py.distributed.errors import (
    CollectiveTimeout,
    DistributedError,
    PeerGoneError,
    SharedMemoryError,
)
from bridge_py.distributed.groups.work import finish, mark_unusable, refuse_if_unusable
from bridge_py.distributed.shm import posix
from bridge_py.distributed.shm.header import Header
from bridge_py.distributed.shm.wait import (
    deadline_after,
    fence,
    pid_namespace,
    process_alive,
    wait_until,
)

__all__ = [
    "BYTES_ENV",
    "ENABLE_ENV",
    "NAME_PREFIX",
    "TIMEOUT_ENV",
    "ShmCollectives",
    "shm_enabled",
]

logger = logging.getLogger(__name__)

ENABLE_ENV = "VLLM_BRIDGE_CPU_SHM"
BYTES_ENV = "VLLM_BRIDGE_CPU_SHM_BYTES"
TIMEOUT_ENV = "VLLM_BRIDGE_CPU_SHM_TIMEOUT"

NAME_PREFIX = "vbsar_"
DEFAULT_BYTES = 16 << 20
MIN_SLOT_BYTES = 64 << 10
# A chunk up to this size is summed whole by every rank (one phase); larger ones are
# reduce-scattered then all-gathered (two phases, each rank adds 1/world_size of it).
DIRECT_BYTES = 256 << 10

_HEADER = Header(b"VBAR", 1, "2xIQ16s")  # world_size, slot_bytes, token
_HEADER_BYTES = 256
_CTRL_BYTES = 512  # per rank: counter at 0, rows at 64 and 192, pid at 320, CPUs at 336
_ROW_AT = (64, 192)
_ROW_BYTES = ROW_BYTES
_PID = struct.Struct("<QQ")  # pid, pid namespace
_PID_AT = 320
_NAME_BYTES = 64  # the name and token broadcast at set-up
_ALIGN = 64  # slices handed to ranks start on cache lines
_CPUS_AT = 336  # the CPUs the rank may run on, a bit each (the first 1024; 0: not known)
_CPUS_BYTES = 128
assert _ROW_AT[1] + _ROW_BYTES <= _PID_AT and _PID_AT + _PID.size <= _CPUS_AT
assert _CPUS_AT + _CPUS_BYTES <= _CTRL_BYTES


def shm_enabled() -> bool:
    """Whether this rank offers the shared-memory transport (``VLLM_BRIDGE_CPU_SHM``)."""
    value = os.environ.get(ENABLE_ENV, "").strip().lower()
    return value not in ("0", "false", "no", "off")


def _env_bytes() -> int:
    value = os.environ.get(BYTES_ENV, "").strip()
    if not value:
        return DEFAULT_BYTES
    try:
        return max(0, int(value))
    except ValueError:
        logger.warning("ignoring %s=%r (not an integer)", BYTES_ENV, value)
        return DEFAULT_BYTES


def _group_timeout(cpu_group: ProcessGroup) -> float:
    """The timeout of ``cpu_group`` in seconds (the env override first, else gloo's)."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if value:
        with contextlib.suppress(ValueError):
            return max(0.0, float(value))
        logger.warning("ignoring %s=%r (not a number)", TIMEOUT_ENV, value)
    with contextlib.suppress(Exception):
        timeout = cpu_group._get_backend(torch.device("cpu")).options._timeout
        if isinstance(timeout, datetime.timedelta):
            return timeout.total_seconds()
    return 1800.0


def _layout(world_size: int, slot_bytes: int) -> tuple[int, int]:
    """``(offset of the data area, total segment size)``."""
    data = -(-(_HEADER_BYTES + world_size * _CTRL_BYTES) // 4096) * 4096
    return data, data + 2 * world_size * slot_bytes


def _release(mapping: mmap.mmap, views: dict[Any, Any]) -> None:
    """Drop the tensor views, then unmap (a view still referenced elsewhere keeps it)."""
    views.clear()
    with contextlib.suppress(BufferError, OSError):
        mapping.close()


def _own_mapping(shm: posix.SharedMemory) -> mmap.mmap:
    """A mapping of ``shm``'s segment owned by us, and ``shm`` closed.

    ``SharedMemory.close`` (also run by its ``__del__``) fails while torch tensors view its
    buffer; a plain mmap is simply unmapped once its last view is gone.
    """
    try:
        return mmap.mmap(posix.fileno(shm), shm.size)
    finally:
        shm.close()


class ShmCollectives:
    """The shared-memory collectives of one group (see the module docstring).

    Build it with :meth:`create` (a collective over the group's gloo group). Operations take
    flat contiguous CPU tensors; every rank must call the same operations in the same order,
    and one operation at a time per object (a lock serialises threads of one rank).
    """

    def __init__(
        self,
        mapping: mmap.mmap,
        name: str,
        rank: int,
        world_size: int,
        slot_bytes: int,
        label: str,
        timeout: float,
        group: ProcessGroup,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.label = label
        self.timeout = timeout
        self.name = name
        self._buf = memoryview(mapping)
        self._data_at, self.total_bytes = _layout(world_size, slot_bytes)
        self._counters = self._buf.cast("q")
        self._counter_index = [_ctrl(r) // 8 for r in range(world_size)]
        self._mine = self._counter_index[rank]
        self._others = [i for r, i in enumerate(self._counter_index) if r != rank]
        self._data = torch.frombuffer(
            self._buf, dtype=torch.uint8, count=2 * world_size * slot_bytes, offset=self._data_at
        )
        # dtype -> (2, world_size, slot elements) view of the data area
        self._views: dict[torch.dtype, torch.Tensor] = {}
        self._phase = 0
        self._step = 0
        self._group = group  # marked unusable when a step fails (groups.work)
        self._lock = threading.Lock()
        self._pids = [_PID.unpack_from(self._buf, _ctrl(r) + _PID_AT) for r in range(world_size)]
        # operations run so far, by name
        self.calls = dict.fromkeys(
            ("agreement", "all_reduce", "all_gather", "reduce_scatter", "broadcast"), 0
        )
        self._finalizer = weakref.finalize(self, _release, mapping, self._views)
        # How many of the group's ranks may run on some of this rank's CPUs (itself
        # included; a rank whose CPUs are not known counts): those its intra-op threads
        # would compete with (shm_elementwise).
        mine = _cpu_mask(self._buf, rank)
        sharing = sum(
            1 for r in range(world_size) if not (other := _cpu_mask(self._buf, r)) or other & mine
        )
        self.elementwise = Elementwise(len(os.sched_getaffinity(0)), sharing)
        self._copy, self._ordered_sum = self.elementwise.copy, self.elementwise.ordered_sum

    # ------------------------------------------------------------------------ set-up

    @classmethod
    def create(
        cls,
        cpu_group: ProcessGroup,
        rank: int,
        ranks: list[int],
        label: str,
        *,
        enabled: bool | None = None,
        buffer_bytes: int | None = None,
        timeout: float | None = None,
    ) -> ShmCollectives | None:
        """Set up the transport on every rank of ``cpu_group``, or None on all of them.

        A collective (a broadcast, an all-reduce and a barrier on ``cpu_group``, called on the
        group object with group ranks, so that a group unknown to torch.distributed's global
        state works too; ``ranks`` only gives the group's size): rank 0 creates the
        segment, the others attach and check its token, and all learn whether every rank
        succeeded, so that they all take the same transport. The segment is unlinked before
        this returns. ``enabled``/``buffer_bytes``/``timeout`` default to the environment
        (the timeout else to the group's); rank 0's ``buffer_bytes`` decides the layout.
        """
        world_size = len(ranks)
        offer = shm_enabled() if enabled is None else enabled
        why = "" if offer else f"disabled by {ENABLE_ENV}"
        shm: posix.SharedMemory | None = None
        slot_bytes = 0
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        if rank == 0 and offer:
            try:
                budget = _env_bytes() if buffer_bytes is None else buffer_bytes
                slot_bytes = max(MIN_SLOT_BYTES, budget // (2 * world_size) // 4096 * 4096)
                shm, token = cls._create_segment(world_size, slot_bytes)
                text = (shm.name + ":" + token.hex()).encode()
                name[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            except (OSError, SharedMemoryError, ValueError) as exc:  # e.g. /dev/shm is full
                why = f"cannot create a shared-memory segment: {exc}"
        where = f"rank {rank} of {label}"
        finish(cpu_group.broadcast(name, 0), "shared-memory set-up", where, group=cpu_group)
        if rank != 0 and offer:
            shm, slot_bytes, why = cls._attach(bytes(name.tolist()).rstrip(b"\0"), world_size)
        mapping: mmap.mmap | None = None
        if shm is not None:
            try:
                mapping = _own_mapping(shm)
                at = _ctrl(rank) + _PID_AT
                _PID.pack_into(mapping, at, os.getpid(), pid_namespace())
                at = _ctrl(rank) + _CPUS_AT
                cpus = sum(1 << cpu for cpu in os.sched_getaffinity(0) if cpu < 8 * _CPUS_BYTES)
                mapping[at : at + _CPUS_BYTES] = cpus.to_bytes(_CPUS_BYTES, "little")
                fence()
            except (OSError, ValueError, AttributeError) as exc:
                why = f"cannot map the segment: {exc}"
        ok = mapping is not None
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        minimum = dist.AllreduceOptions()
        minimum.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        finish(cpu_group.allreduce([flag], minimum), "shared-memory set-up", where, group=cpu_group)
        if rank == 0 and shm is not None:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()  # every rank has it mapped (or gave up): remove the name now
        if int(flag.item()) == 1:
            # ... so that no rank returns before it is gone
            finish(cpu_group.barrier(), "shared-memory set-up", where, group=cpu_group)
        # (``shm`` is set whenever ``mapping`` is: tested for the type checker's sake.)
        if int(flag.item()) == 0 or mapping is None or shm is None:
            if mapping is not None:
                mapping.close()
            if why:
                logger.info("%s: shared-memory collectives off on rank %d: %s", label, rank, why)
            return None
        return cls(
            mapping,
            shm.name,
            rank,
            world_size,
            slot_bytes,
            label,
            _group_timeout(cpu_group) if timeout is None else timeout,
            cpu_group,
        )

    @staticmethod
    def _create_segment(world_size: int, slot_bytes: int) -> tuple[posix.SharedMemory, bytes]:
        _, size = _layout(world_size, slot_bytes)
        token = secrets.token_bytes(16)
        shm = posix.create(NAME_PREFIX + secrets.token_hex(8), size)  # its memory taken
        try:
            _HEADER.pack_into(posix.view(shm), world_size, slot_bytes, token)
            fence()
        except BaseException:
            shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
            raise
        return shm, token

    @staticmethod
    def _attach(handle: bytes, world_size: int) -> tuple[posix.SharedMemory | None, int, str]:
        if not handle:
            return None, 0, "rank 0 has no segment"
        try:
            name, token_hex = handle.decode().split(":")
            shm = posix.attach(name)
        except (OSError, ValueError) as exc:
            return None, 0, f"cannot open rank 0's segment (another node?): {exc}"
        try:
            size, slot_bytes, token = _HEADER.unpack_from(posix.view(shm), name)
            if size != world_size or token.hex() != token_hex:
                raise ValueError("the segment is not this group's")
            if shm.size < _layout(world_size, slot_bytes)[1]:
                raise ValueError("the segment is smaller than its header says")
        except (ValueError, SharedMemoryError) as exc:
            shm.close()
            return None, 0, f"rank 0's segment {name!r} is unusable: {exc}"
        return shm, slot_bytes, ""

    def close(self) -> None:
        """Unmap the segment (idempotent; the name was unlinked at set-up)."""
        self._counters.release()
        self._data = torch.empty(0, dtype=torch.uint8)
        self._buf = None  # type: ignore[assignment]  # closed: any later use fails at once
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return not self._finalizer.alive

    # ------------------------------------------------------------------ synchronisation

    def _arrive_and_wait(self, what: str) -> None:
        """Publish the next phase, then wait until every rank has published it."""
        self._phase += 1
        phase = self._phase
        counters = self._counters
        fence()  # this rank's data writes are visible before its counter moves
        counters[self._mine] = phase
        others = self._others

        def ready() -> bool:
            return all(counters[index] >= phase for index in others)

        if not ready():
            try:
                wait_until(
                    ready,
                    f"{what} (phase {phase})",
                    clamp_until(deadline_after(self.timeout)),  # the caller's, if sooner
                    check=lambda: self._check_peers(phase),
                )
            except TimeoutError as exc:
                raise CollectiveTimeout(self._fail(self._failure(phase, what, exc))) from exc
            except PeerGoneError as exc:
                raise PeerGoneError(self._fail(self._failure(phase, what, exc))) from exc
            except BaseException:
                self._fail(f"{what} was interrupted on rank {self.rank} of {self.label}")
                raise
        fence()  # everything the others wrote before their counters is now visible

    def _fail(self, why: str) -> str:
        """Mark the group unusable (its ranks are now out of step), saying ``why``: every
        later operation on it is refused, this transport's and the others'; returns
        ``why``."""
        mark_unusable(self._group, f"an earlier {why}")
        return why

    def _late(self, phase: int) -> list[int]:
        return [
            r
            for r, index in enumerate(self._counter_index)
            if r != self.rank and self._counters[index] < phase
        ]

    def _check_peers(self, phase: int) -> None:
        for r in self._late(phase):
            pid, namespace = self._pids[r]
            if namespace == pid_namespace() and pid and not process_alive(pid):
                raise PeerGoneError(f"rank {r} (pid {pid}) has exited")

    def _failure(self, phase: int, what: str, exc: BaseException) -> str:
        late = self._late(phase)
        return (
            f"shared-memory {what} failed on rank {self.rank} of {self.label}: {exc}; "
            f"ranks {late} never arrived. The group's shared-memory transport is unusable "
            "now (its ranks are out of step)"
        )

    def _enter(self, op: str) -> None:
        if self.closed:
            raise DistributedError(
                f"{op} on rank {self.rank} of {self.label}: its shared-memory collectives "
                "were closed"
            )
        refuse_if_unusable(self._group, op, f"rank {self.rank} of {self.label}")

    # --------------------------------------------------------------------- buffer views

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The data area as ``(2, world_size, slot elements)`` of ``dtype``."""
        view = self._views.get(dtype)
        if view is None:
            itemsize = torch.empty(0, dtype=dtype).element_size()
            per = self.slot_bytes // itemsize
            view = self._data.view(dtype).view(2, self.world_size, per)
            self._views[dtype] = view
        return view

    def _write_row(self, half: int, row: bytes) -> None:
        at = _ctrl(self.rank) + _ROW_AT[half]
        self._buf[at : at + _ROW_BYTES] = row

    def _rows(self, half: int) -> list[bytes]:
        base = _HEADER_BYTES + _ROW_AT[half]
        return [
            bytes(self._buf[base + r * _CTRL_BYTES : base + r * _CTRL_BYTES + _ROW_BYTES])
            for r in range(self.world_size)
        ]

    def _begin_step(self, row: bytes | None) -> int:
        half = self._step & 1
        self._step += 1
        if row is not None:
            if len(row) != _ROW_BYTES:
                raise ValueError(f"an agreement row has {_ROW_BYTES} bytes, got {len(row)}")
            self._write_row(half, row)
        return half

    def _bounds(self, n: int, rank: int) -> tuple[int, int]:
        """Slice ``rank`` of ``n`` elements: even split, boundaries on ``_ALIGN`` elements."""
        step = -(-n // self.world_size)
        step = -(-step // _ALIGN) * _ALIGN
        return min(n, rank * step), min(n, (rank + 1) * step)

    # ----------------------------------------------------------------------- collectives

    def _run(
        self,
        op: str,
        dtype: torch.dtype,
        n: int,
        per: int,
        row: bytes,
        judge: Judge,
        fill: Callable[[torch.Tensor, int, int], None],
        drain: Callable[[torch.Tensor, int, int], None],
    ) -> None:
        """Run ``op`` over ``n`` elements in steps of at most ``per`` (one operation; see
        the module docstring). Each step calls ``fill(half, start, k)`` (this rank's writes
        into ``half``, the step's ``(world_size, slot)`` view of the data area), waits for
        every rank, and calls ``drain(half, start, k)``; the first step carries ``row``, and
        ``judge`` sees every rank's row before anything is read."""
        with self._lock:
            self._enter(op)
            self.calls[op] += 1
            slots = self._slots(dtype)
            first: Judge | None = judge
            start = 0
            while True:
                k = min(per, n - start)
                half = self._begin_step(row if first is not None else None)
                fill(slots[half], start, k)
                self._arrive_and_wait(op)
                if first is not None:
                    first(self._rows(half))
                    first = None
                drain(slots[half], start, k)
                start += k
                if start >= n:
                    return

    def exchange(self, row: bytes, judge: Judge) -> None:
        """One step carrying only this rank's agreement row; ``judge`` sees every row."""
        self._run("agreement", torch.uint8, 0, 1, row, judge, _nothing, _nothing)

    def all_reduce(self, input_: torch.Tensor, out: torch.Tensor, row: bytes, judge: Judge) -> None:
        """``out`` = the rank-ordered sum of every rank's ``input_`` (flat, same dtype).

        The first step carries ``row`` (an agreement row), and ``judge`` decides after its
        wait, on every rank's row, whether the ranks may go on (as in every operation
        here); ``out`` may be ``input_`` itself.
        """
        rank, world = self.rank, self.world_size
        direct = DIRECT_BYTES // input_.element_size()
        # In a reduce-scatter step this rank sums its own slice with its own input read
        # where it is, so that slice is not copied into the segment (nobody else reads it):
        # a fifth less memory traffic at 2 ranks. When ``out`` is ``input_``, only where this
        # rank's addend is one of the first two: the sum's first step reads both before it
        # writes, elementwise; a later step would add an addend already overwritten.
        own_input = out.data_ptr() != input_.data_ptr() or rank < 2

        def fill(half: torch.Tensor, start: int, k: int) -> None:
            mine, source = half[rank, :k], input_[start : start + k]
            if k <= direct or not own_input:
                self._copy(mine, source)
                return
            lo, hi = self._bounds(k, rank)
            self._copy(mine[:lo], source[:lo])
            self._copy(mine[hi:], source[hi:])

        def drain(half: torch.Tensor, start: int, k: int) -> None:
            part, target = half[:, :k], out[start : start + k]
            if k <= direct:
                self._ordered_sum(list(part.unbind(0)), target)
                return
            lo, hi = self._bounds(k, rank)
            parts = list(part[:, lo:hi].unbind(0))
            if own_input:
                parts[rank] = input_[start + lo : start + hi]
            self._ordered_sum(parts, target[lo:hi])
            self._copy(part[rank, lo:hi], target[lo:hi])
            self._arrive_and_wait("all_reduce (all-gather)")
            for r in range(world):
                if r != rank:
                    lo, hi = self._bounds(k, r)
                    self._copy(target[lo:hi], part[r, lo:hi])

        per = self._slots(input_.dtype).shape[2]
        self._run("all_reduce", input_.dtype, input_.numel(), per, row, judge, fill, drain)

    def all_gather(
        self, output: torch.Tensor, input_: torch.Tensor, row: bytes, judge: Judge
    ) -> None:
        """``output`` (flat, ``world_size * input_.numel()``) = every rank's ``input_``, in
        rank order; ``row`` and ``judge`` as in :meth:`all_reduce`."""
        n = input_.numel()
        rows_out = output.view(self.world_size, n)

        def fill(half: torch.Tensor, start: int, k: int) -> None:
            self._copy(half[self.rank, :k], input_[start : start + k])

        def drain(half: torch.Tensor, start: int, k: int) -> None:
            for r in range(self.world_size):
                self._copy(rows_out[r, start : start + k], half[r, :k])

        per = self._slots(input_.dtype).shape[2]
        self._run("all_gather", input_.dtype, n, per, row, judge, fill, drain)

    def reduce_scatter(
        self, output: torch.Tensor, input_: torch.Tensor, row: bytes, judge: Judge
    ) -> None:
        """``output`` (flat, ``m`` elements) = the rank-ordered sum of piece ``rank`` of every
        rank's ``input_`` (flat, ``world_size * m``); ``row`` and ``judge`` as in
        :meth:`all_reduce`."""
        world, m = self.world_size, output.numel()
        pieces = input_.view(world, m)

        def fill(half: torch.Tensor, start: int, k: int) -> None:
            mine = half[self.rank, : world * k].view(world, k)
            for r in range(world):
                self._copy(mine[r], pieces[r, start : start + k])

        def drain(half: torch.Tensor, start: int, k: int) -> None:
            chunks = half[:, : world * k].view(world, world, k)
            self._ordered_sum(list(chunks[:, self.rank].unbind(0)), output[start : start + k])

        per = self._slots(input_.dtype).shape[2] // world
        self._run("reduce_scatter", input_.dtype, m, per, row, judge, fill, drain)

    def broadcast(self, tensor: torch.Tensor, src: int, row: bytes, judge: Judge) -> None:
        """Every rank's ``tensor`` (flat) = rank ``src``'s, in place; ``row`` and ``judge`` as
        in :meth:`all_reduce`. A step carries up to a whole half of the data area, since
        only the source writes."""
        mine = self.rank == src

        def fill(half: torch.Tensor, start: int, k: int) -> None:
            if mine:
                self._copy(half.view(-1)[:k], tensor[start : start + k])

        def drain(half: torch.Tensor, start: int, k: int) -> None:
            if not mine:
                self._copy(tensor[start : start + k], half.view(-1)[:k])

        slots = self._slots(tensor.dtype)
        per = slots.shape[1] * slots.shape[2]
        self._run("broadcast", tensor.dtype, tensor.numel(), per, row, judge, fill, drain)


def _ctrl(rank: int) -> int:
    """Where rank ``rank``'s control block starts in the segment."""
    return _HEADER_BYTES + rank * _CTRL_BYTES


def _cpu_mask(buf: memoryview, rank: int) -> int:
    """The CPUs rank ``rank`` wrote that it may run on, a bit each (0: not known)."""
    at = _ctrl(rank) + _CPUS_AT
    return int.from_bytes(buf[at : at + _CPUS_BYTES], "little")


def _nothing(half: torch.Tensor, start: int, k: int) -> None:
    """A step that writes or reads no data (an agreement exchange)."""
