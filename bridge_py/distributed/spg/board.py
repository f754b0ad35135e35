"""Shared-memory boards and doorbells: the messages of a StatelessProcessGroup on one node.

Through the store, every message costs a hop through a third process (the server thread of
rank 0), which with more ranks than cores is most of the time. When every rank of a group
runs on one node, each rank instead writes what it sends on a *board* of its own, a small
file under ``/dev/shm`` mapped by every rank, and rings the receivers' *doorbells*, FIFOs
next to it; a rank waiting for a value sleeps in ``poll`` on its own doorbell.

A doorbell is rung only when it is worth a system call: a waiting rank first looks again for
a moment (it waits with ``shm.wait.wait_until`` at the ``DOORBELL`` pace, and
:meth:`Board.wait` is its sleep), which is when most answers come; a rank about to sleep
then says on its board whom it waits for (``asleep``), looks once more, and sleeps; a writer
writes, then reads the receiver's ``asleep`` word, and rings only if it names the writer (or
anyone). Each side puts a full fence between its write and its read, so either the sleeper
sees the write on its last look or the writer sees the sleeper's word (and rings). A rank
that is busy, or waits for another rank, is not rung, not woken for nothing, and finds no
stale byte on its doorbell when it next sleeps.

A board has a head, a barrier page and slots of one format, in rings: one ring of
:data:`RING` slots per destination rank (point-to-point messages) and one of
:data:`BROADCAST_RING` slots read by every other rank (broadcasts, and the values of
all_gather, which is a broadcast from every rank)::

    0                   the shared-memory header (``shm.header``): b"VBBD", layout version,
                        u32 world size, u64 creator pid
    24                  u64 one past the last broadcast number used
    32                  u64 asleep: 0 while this rank does not sleep on its doorbell, else
                        what wakes it: ``src + 1`` (news from rank ``src``) or ANY
    64 + 8 * src        u64 acks[src]: messages from ``src`` this rank has received
    64 + 8 * (n + dst)  u64 spills[dst]: messages to ``dst`` sent through the store
    64 + 8 * (2n + src) u64 broadcasts of ``src`` this rank is done with (last number + 1)
    barrier page        arrivals, departures and decisions (see ``shm_transport``)
    ring[dst][j]        u64 number + 1 (0: never used), u64 length, the value
    broadcasts[j]       the same, for this rank's broadcasts

Item ``n`` goes into slot ``n % size`` of its ring once every reader has received what the
slot held before (their receipt counters say so). The writer writes the length and the value,
then (after a memory fence) the number; a reader reads the number, then (after a fence) the
rest. The first page of every slot (and the head and barrier page) is allocated when the
board is made, so a value that fits in it (:data:`PAGE_CAPACITY` bytes) is copied through
the mapping; a larger one is written with ``pwrite``, where a full ``/dev/shm`` is an error
(ENOSPC) and not the SIGBUS a store through the mapping would get. Writing never waits: an
item that finds its slot busy, that is larger than :data:`MESSAGE_CAPACITY` or that finds
no room on ``/dev/shm`` goes through the store, and the counters say so (a message's
``spills``, a broadcast's number being used).

Boards and doorbells are named like the group's segments
(``vbspg_<pid namespace>_<pid>_<token>_board``/``_bell``), so that
``segments.remove_orphans`` removes those of a rank that was killed. A rank creates its own
before ``create`` exchanges node cards, and unlinks the names once every other rank has
opened them; the mappings live on until the group is closed. A waiting rank checks every
second (the pace's ``check_every``) whether the rank it waits for still runs.

What a rank trusts: a board or doorbell it opens (named in another rank's node card, which
is sealed with the group's key) must be a file of its own user that only this user may
write, and not a link (``shm.files``), of a board's size and header, or it is refused
naming the file. Values on a board
are sealed and checked as they are in the store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import select
import struct
from collections.abc import Callable, Sequence

from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm.files import open_peer_file
from bridge_py.distributed.shm.header import Header
from bridge_py.distributed.shm.segments import NAME_PREFIX, SHM_DIR, unlink
from bridge_py.distributed.shm.wait import (
    fence,
    pid_namespace,
    process_alive,
)

__all__ = [
    "BOARD_PATTERN",
    "BROADCAST_RING",
    "MESSAGE_CAPACITY",
    "PAGE_CAPACITY",
    "RING",
    "Board",
    "BoardError",
    "Layout",
]

RING = 8  # message slots per destination
BROADCAST_RING = 32  # broadcast slots (a source may run further ahead of several readers)
MESSAGE_CAPACITY = (64 << 10) - 16  # bytes of one slot's value
BOARD_PATTERN = re.compile(r"vbspg_[0-9]+_[0-9]+_[0-9a-f]+_board\Z")
_HEADER = Header(b"VBBD", 2, "2xIQ")  # world size, creator pid
_U64 = struct.Struct("<Q")
_SLOT_HEAD = 16
_PAGE = 4096
PAGE_CAPACITY = _PAGE - _SLOT_HEAD  # bytes of a value copied through the mapping
_COUNTERS_AT = 64
_BROADCASTS_SENT = 24  # in the head: one past the last broadcast number this rank used
_ASLEEP = 32  # in the head: whom this rank sleeps waiting for (0: it does not sleep)
ANY = (1 << 64) - 1  # the asleep word of a rank that any rank's news wakes
# Barriers (see shm_transport.ShmTransport.barrier): offsets in the barrier page.
_ARRIVED, _DEPARTED, _DECISIONS, _VERDICT = 0, 8, 64, 64 + 16 * 64
DECISION_CELLS = 64
PASSED, FAILED = 1, 2
_VERDICT_MAX = _PAGE - _VERDICT - 16


def _pages(size: int) -> int:
    return (size + _PAGE - 1) // _PAGE * _PAGE


_MESSAGE_SLOT = _SLOT_HEAD + MESSAGE_CAPACITY  # a multiple of the page: slots start on one


class Layout:
    """Where things are on the board of a group of ``world_size`` ranks (offsets worked
    out once: they are read on every operation)."""

    __slots__ = ("_broadcasts_at", "_messages_at", "barrier_at", "size", "world_size")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier_at = _pages(_COUNTERS_AT + 24 * world_size)
        self._messages_at = self.barrier_at + _PAGE
        self._broadcasts_at = self._messages_at + _MESSAGE_SLOT * RING * world_size
        self.size = self._broadcasts_at + _MESSAGE_SLOT * BROADCAST_RING

    def ack_at(self, src: int) -> int:
        return _COUNTERS_AT + 8 * src

    def spill_at(self, dst: int) -> int:
        return _COUNTERS_AT + 8 * (self.world_size + dst)

    def message_at(self, dst: int, number: int) -> int:
        return self._messages_at + _MESSAGE_SLOT * (RING * dst + number % RING)

    def broadcast_received_at(self, src: int) -> int:
        return _COUNTERS_AT + 8 * (2 * self.world_size + src)

    def broadcast_at(self, number: int) -> int:
        return self._broadcasts_at + _MESSAGE_SLOT * (number % BROADCAST_RING)


class BoardError(SharedMemoryError):
    """A board could not be made or opened, or a peer's board is not what it should be."""


def _bell_name(board_name: str) -> str:
    return board_name[: -len("board")] + "bell"


class Board:
    """This rank's board and doorbell, and (once :meth:`connect` ed) every other rank's."""

    def __init__(self, rank: int, world_size: int) -> None:
        """Create this rank's board and doorbell under ``/dev/shm`` (raises OSError)."""
        self.rank = rank
        self.world_size = world_size
        self.name = f"{NAME_PREFIX}{pid_namespace()}_{os.getpid()}_{secrets.token_hex(6)}_board"
        self.layout = Layout(world_size)
        self._maps: list[mmap.mmap | None] = [None] * world_size
        self._peers = [r for r in range(world_size) if r != rank]
        self._bells: list[int] = [-1] * world_size
        self._pids = [0] * world_size
        self._own_bell = -1
        self._armed = 0  # what this rank's asleep word says (0: awake)
        self._connected = False  # every rank's board open (asked on every collective)
        self._lock_fd = -1
        self._fd = -1
        self._named = True
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(os.path.join(SHM_DIR, self.name), flags, 0o600)
        try:
            os.ftruncate(fd, self.layout.size)
            # The pages written through the mapping (the head, the barrier page and the
            # first page of every slot) are allocated now, so that a full /dev/shm fails
            # here (no board: the store) and not with SIGBUS later; the rest of a slot is
            # written with pwrite, which reports ENOSPC instead.
            os.posix_fallocate(fd, 0, self.layout.barrier_at + _PAGE)
            for dst in range(world_size):
                for slot in range(RING):
                    os.posix_fallocate(fd, self.layout.message_at(dst, slot), _PAGE)
            for slot in range(BROADCAST_RING):
                os.posix_fallocate(fd, self.layout.broadcast_at(slot), _PAGE)
            board = mmap.mmap(fd, self.layout.size)
        except BaseException:
            os.close(fd)
            unlink(self.name)
            raise
        self._fd = fd  # large values are written with pwrite; on rank 0, also the lock
        if rank == 0:
            self._lock_fd = fd
        _HEADER.pack_into(board, world_size, os.getpid())
        self._maps[rank] = board
        self._own = board  # this rank's board, read and written on every operation
        self._me = rank + 1  # the asleep word of a rank that waits for this one
        # Offsets read on every operation, worked out once: where this rank's ring for each
        # rank starts, and the receipts (on a reader's board) of this rank's messages and
        # broadcasts and (on this board) of each rank's broadcasts.
        layout = self.layout
        self._rings_at = [layout.message_at(dst, 0) for dst in range(world_size)]
        self._inbox_at = layout.message_at(rank, 0)  # on a sender's board: its ring for us
        self._acks_mine = layout.ack_at(rank)
        self._broadcast_receipts = [layout.broadcast_received_at(r) for r in range(world_size)]
        self._broadcasts_at = layout.broadcast_at(0)
        # The receipts last read (then fenced): of this rank's messages, per reader, and of
        # its broadcasts, the least over the readers. A slot whose item they cover is free
        # without reading them again.
        self._acked = [0] * world_size
        self._broadcasts_done = 0
        # (board, doorbell) of every other rank whose board is open: those ring_all looks at.
        self._ringable: list[tuple[mmap.mmap, int]] = []
        # Every rank's board in rank order once all are open (else empty): barriers read them.
        self._boards: list[mmap.mmap] = []
        self._barrier_at = layout.barrier_at
        self._pids[rank] = os.getpid()
        bell = os.path.join(SHM_DIR, _bell_name(self.name))
        try:
            os.mkfifo(bell, 0o600)
            # Read and write: the doorbell never reports end of file and opening never blocks.
            self._own_bell = open_peer_file(bell, os.O_RDWR | os.O_NONBLOCK, fifo=True)
        except BaseException:
            self.close()
            raise
        self._poll = select.poll()
        self._poll.register(self._own_bell, select.POLLIN)

    def _map(self, rank: int) -> mmap.mmap:
        """Rank ``rank``'s board, which must be open."""
        board = self._maps[rank]
        if board is None:
            raise BoardError(f"rank {self.rank} has not opened the board of rank {rank}")
        return board

    @property
    def connected(self) -> bool:
        """Whether every other rank's board and doorbell are open."""
        return self._connected

    def is_open(self, src: int) -> bool:
        """Whether rank ``src``'s board is open here."""
        return self._maps[src] is not None

    def connect(self, names: Sequence[str], missing_ok: bool = False) -> list[int]:
        """Open the boards (and doorbells) ``names`` of all ranks not open yet; return the
        ranks whose board was gone (only with ``missing_ok``: the rank has closed its group).

        Each file is checked before it is mapped or rung (``shm_files.open_peer_file``: no
        link, this user's, a regular file or, for a doorbell, a FIFO, writable by this user
        only), and a board's header (``shm.header``) checked once mapped. Raises BoardError
        naming the rank and the file whose board is missing, malformed or refused by those
        checks.
        """
        gone = []
        for src, name in enumerate(names):
            if self._maps[src] is not None:
                continue
            if not BOARD_PATTERN.match(name):
                raise BoardError(f"rank {src} named a board {name!r} that is not one")
            board = None
            try:
                fd = open_peer_file(os.path.join(SHM_DIR, name), os.O_RDWR)
                try:
                    if os.fstat(fd).st_size != self.layout.size:
                        raise ValueError("its size is not that of a board of this group")
                    board = mmap.mmap(fd, self.layout.size)
                    size, pid = _HEADER.unpack_from(board, name)
                    if size != self.world_size:
                        raise ValueError(f"it is the board of a group of {size} ranks")
                    bell = open_peer_file(
                        os.path.join(SHM_DIR, _bell_name(name)),
                        os.O_WRONLY | os.O_NONBLOCK,
                        fifo=True,
                    )
                except BaseException:
                    if board is not None:
                        board.close()
                    os.close(fd)
                    raise
                if src == 0:
                    self._lock_fd = fd  # barrier decisions are taken under its lock
                else:
                    os.close(fd)
            except FileNotFoundError as exc:
                if missing_ok:
                    gone.append(src)
                    continue
                raise BoardError(
                    f"rank {self.rank} cannot open the board {name!r} of rank {src} "
                    f"(did it exit?): {exc}"
                ) from exc
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise BoardError(
                        f"rank {self.rank} cannot open the board {name!r} of rank {src}: {exc}"
                    ) from exc
                # Its doorbell has no reader: its owner, which holds it open while its
                # group lives, is gone.
                if missing_ok:
                    gone.append(src)
                    continue
                raise BoardError(
                    f"rank {self.rank} cannot ring rank {src}: rank {src} has exited "
                    f"(its doorbell {_bell_name(name)!r} has no reader)"
                ) from exc
            except (ValueError, SharedMemoryError) as exc:
                raise BoardError(
                    f"rank {self.rank} cannot open the board {name!r} of rank {src}: {exc}"
                ) from exc
            self._maps[src], self._bells[src], self._pids[src] = board, bell, pid
        self._connected = all(m is not None for m in self._maps)
        self._boards = [m for m in self._maps if m is not None] if self._connected else []
        self._ringable = []
        for dst in self._peers:
            board, bell = self._maps[dst], self._bells[dst]
            if board is not None and bell >= 0:
                self._ringable.append((board, bell))
        return gone

    # --- messages ---

    def send(self, dst: int, number: int, value: bytes) -> bool:
        """Put message ``number`` to ``dst`` in its ring slot and ring ``dst``; False (nothing
        written) if it does not fit or ``dst`` has not received the slot's last one."""
        reader = self._maps[dst]
        if reader is None:
            return False
        at = self._rings_at[dst] + _MESSAGE_SLOT * (number % RING)
        held = _U64.unpack_from(self._own, at)[0]  # the number + 1 of the message there
        if held > self._acked[dst]:
            self._acked[dst] = _U64.unpack_from(reader, self._acks_mine)[0]
            fence()  # the receipt is seen before the slot is written over
            if held > self._acked[dst]:
                return False
        if not self._fill(at, number, value):
            return False
        self.ring(dst)
        return True

    # --- broadcasts ---

    def broadcast(self, number: int, value: bytes) -> bool:
        """Put broadcast ``number`` of this rank in its ring slot; False (nothing written) if
        it does not fit or some rank has not received the slot's last broadcast. The caller
        then says it was sent (:meth:`broadcast_sent`), whichever way it went."""
        if not self._connected:
            return False
        at = self._broadcasts_at + _MESSAGE_SLOT * (number % BROADCAST_RING)
        held = _U64.unpack_from(self._own, at)[0]  # the number + 1 of the broadcast there
        if held > self._broadcasts_done:
            self._broadcasts_done = self.broadcasts_read()
            if held > self._broadcasts_done:
                return False
        return self._fill(at, number, value)

    def broadcast_sent(self, number: int) -> None:
        """Record that broadcast ``number`` went out (ring slot or store); ring the ranks
        asleep waiting for this one."""
        fence()
        _U64.pack_into(self._own, _BROADCASTS_SENT, number + 1)
        self.ring_all()

    def broadcasts_read(self) -> int:
        """How many of this rank's broadcasts every other rank is done with."""
        receipt = self.layout.broadcast_received_at(self.rank)
        read = min(_U64.unpack_from(self._map(r), receipt)[0] for r in self._peers)
        fence()
        return read

    def poll_broadcast(self, src: int, number: int) -> bytes | None:
        """``src``'s broadcast ``number``: a copy of its ring slot, b"" when it went
        through the store instead, None while ``src`` has not sent it."""
        board = self._maps[src] or self._map(src)
        at = self._broadcasts_at + _MESSAGE_SLOT * (number % BROADCAST_RING)
        if _U64.unpack_from(board, at)[0] != number + 1:  # _slot, inline: read on every look
            if _U64.unpack_from(board, _BROADCASTS_SENT)[0] <= number:
                return None
            fence()  # sent: a slot is written before the count, so a second look is final
            data = _slot(board, at, number)
            return b"" if data is None else data
        fence()  # the value is read after its number
        return _value(board, at)

    def broadcast_received(self, src: int, number: int) -> None:
        """Record that this rank is done with broadcast ``number`` of ``src``."""
        fence()
        _U64.pack_into(self._own, self._broadcast_receipts[src], number + 1)

    def broadcasts_received(self, numbers: Sequence[int]) -> None:
        """Record that this rank is done with broadcast ``numbers[src]`` of every other
        rank ``src``."""
        fence()
        board, receipts = self._own, self._broadcast_receipts
        for src in self._peers:
            _U64.pack_into(board, receipts[src], numbers[src] + 1)

    def _fill(self, at: int, number: int, value: bytes) -> bool:
        """Write item ``number`` into this rank's slot at ``at``, whose readers are done with
        what it held; False (nothing written) if the value is too large, or ``/dev/shm`` has
        no room for all of it (a write cut short counts as none)."""
        size = len(value)
        board = self._own
        if size <= PAGE_CAPACITY:  # the slot's first page, allocated with the board
            _U64.pack_into(board, at + 8, size)
            board[at + _SLOT_HEAD : at + _SLOT_HEAD + size] = value
        elif size > MESSAGE_CAPACITY:
            return False
        else:
            try:
                if os.pwritev(self._fd, [_U64.pack(size), value], at + 8) != 8 + size:
                    return False
            except OSError:
                return False
        fence()  # the value is seen before its number
        _U64.pack_into(board, at, number + 1)
        return True

    def spilled(self, dst: int, count: int) -> None:
        """Record that ``count`` messages to ``dst`` went through the store; ring ``dst``."""
        fence()  # the store has the message before its count moves
        _U64.pack_into(self._map(self.rank), self.layout.spill_at(dst), count)
        self.ring(dst)

    def spills(self, src: int) -> int:
        """How many messages from ``src`` to this rank went through the store so far."""
        count = _U64.unpack_from(self._map(src), self.layout.spill_at(self.rank))[0]
        fence()
        return count

    def take(self, src: int, number: int) -> bytes | None:
        """Message ``number`` from ``src`` if it is in its ring slot (a copy), else None."""
        at = self._inbox_at + _MESSAGE_SLOT * (number % RING)
        return _slot(self._maps[src] or self._map(src), at, number)

    def received(self, src: int, count: int) -> None:
        """Record that ``count`` messages from ``src`` have been received (its slots free)."""
        fence()  # the copy of the message is done before the slot is given back
        _U64.pack_into(self._own, _COUNTERS_AT + 8 * src, count)  # layout.ack_at(src)

    def ring(self, dst: int) -> None:
        """Ring ``dst``'s doorbell if ``dst`` sleeps waiting for this rank (or anyone):
        what this rank wrote before is then seen by ``dst`` (see the module docstring)."""
        board, bell = self._maps[dst], self._bells[dst]
        if board is not None and bell >= 0:
            fence()  # this rank's writes are seen before dst's asleep word is read
            if _U64.unpack_from(board, _ASLEEP)[0] in (self._me, ANY):
                _ring(bell)

    def ring_all(self, everyone: bool = False) -> None:
        """Ring the doorbell of every other rank that sleeps waiting for this one (or
        anyone; ``everyone``: that sleeps at all, waiting for whomever)."""
        fence()  # this rank's writes are seen before the asleep words are read
        wake = (self._me, ANY)
        for board, bell in self._ringable:
            asleep = _U64.unpack_from(board, _ASLEEP)[0]
            if asleep in wake or (everyone and asleep):
                _ring(bell)

    def wait(self, timeout: float, src: int = -1) -> None:
        """Sleep until rank ``src`` (-1: any rank) rings, or ``timeout`` seconds pass; empty
        the doorbell. The ``sleep`` of a ``shm.wait.wait_until`` with the ``DOORBELL`` pace.

        The first call (or one for another ``src``) says on the board whom this rank waits
        for, and returns at once: the caller looks once more before it sleeps, so a write
        made before a writer read that word is not missed. The caller says when the wait is
        over (:meth:`awake`).
        """
        want = ANY if src < 0 else src + 1
        if self._armed != want:
            self._armed = want
            _U64.pack_into(self._own, _ASLEEP, want)
            fence()  # the word is seen before this rank looks again
            return
        if self._poll.poll(max(timeout, 0.0) * 1000.0):
            try:  # noqa: SIM105 (cheaper than contextlib.suppress, on every wake-up)
                os.read(self._own_bell, 4096)
            except BlockingIOError:
                pass

    def awake(self) -> None:
        """Say that this rank no longer sleeps (its wait is over): nobody rings it."""
        if self._armed:
            self._armed = 0
            _U64.pack_into(self._own, _ASLEEP, 0)

    def gone(self, ranks: Sequence[int]) -> list[int]:
        """Those of ``ranks`` whose process has exited."""
        return [r for r in ranks if not process_alive(self._pids[r])]

    # --- barriers ---

    def arrive(self, barrier_id: int) -> None:
        """Mark this rank arrived at barrier ``barrier_id``; ring the ranks asleep waiting
        for this one."""
        self._put(_ARRIVED, barrier_id + 1)
        self.ring_all()

    def depart(self, barrier_id: int) -> None:
        """Mark this rank gone from barrier ``barrier_id`` and ring rank 0."""
        self._put(_DEPARTED, barrier_id + 1)
        self.ring(0)

    def not_arrived(self, barrier_id: int) -> list[int]:
        """The ranks that have not arrived at barrier ``barrier_id``."""
        return self._behind(_ARRIVED, barrier_id)

    def not_departed(self, barrier_id: int) -> list[int]:
        """The ranks that have not left barrier ``barrier_id``."""
        return self._behind(_DEPARTED, barrier_id)

    def decision(self, barrier_id: int) -> int:
        """PASSED or FAILED once a rank decided barrier ``barrier_id``; else 0."""
        at = self._barrier_at + _DECISIONS + 16 * (barrier_id % DECISION_CELLS)
        return self._settled(at, barrier_id)

    def _settled(self, at: int, barrier_id: int) -> int:
        """The outcome in the decision cell at ``at`` if it is barrier ``barrier_id``'s,
        else 0 (the cell's number is written after its outcome, and read before it)."""
        board = self._maps[0] or self._map(0)
        if _U64.unpack_from(board, at)[0] != barrier_id + 1:
            return 0
        fence()
        return int(_U64.unpack_from(board, at + 8)[0])

    def decide(self, barrier_id: int, outcome: int, verdict: str = "") -> tuple[int, str]:
        """Settle barrier ``barrier_id`` as ``outcome`` (with ``verdict`` if FAILED) unless a
        rank did first; return what was settled. Taken under a lock on rank 0's board, so
        every rank settles the same outcome; a rank that finds it settled already (the
        cell is written once) takes no lock. A failure wakes every rank asleep."""
        board = self._map(0)
        base = self.layout.barrier_at
        at = base + _DECISIONS + 16 * (barrier_id % DECISION_CELLS)
        settled = self._settled(at, barrier_id)
        if settled:
            return settled, self._verdict(barrier_id) if settled == FAILED else ""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            cell = _U64.unpack_from(board, at)[0]
            if cell > barrier_id + 1:
                return FAILED, (
                    f"the other ranks went on {DECISION_CELLS} barriers past this one while "
                    "this rank was inside it"
                )
            if cell == barrier_id + 1:
                settled = self._settled(at, barrier_id)
                return settled, self._verdict(barrier_id) if settled == FAILED else ""
            if outcome == FAILED:
                text = verdict.encode()[:_VERDICT_MAX]
                board[base + _VERDICT + 16 : base + _VERDICT + 16 + len(text)] = text
                struct.pack_into("<QQ", board, base + _VERDICT, barrier_id + 1, len(text))
            _U64.pack_into(board, at + 8, outcome)
            fence()  # the outcome (and verdict) are seen before the cell's number
            _U64.pack_into(board, at, barrier_id + 1)
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        if outcome == FAILED:
            # Ranks still waiting for arrivals learn it at once; those that saw every rank
            # arrive need no ring to pass.
            self.ring_all(everyone=True)
        return outcome, verdict

    def _verdict(self, barrier_id: int) -> str:
        board = self._map(0)
        base = self.layout.barrier_at + _VERDICT
        cell, size = struct.unpack_from("<QQ", board, base)
        if cell != barrier_id + 1:
            return "another rank gave up before all ranks arrived"
        size = min(size, _VERDICT_MAX)  # (a length word from another process)
        return bytes(board[base + 16 : base + 16 + size]).decode(errors="replace")

    def _put(self, offset: int, value: int) -> None:
        fence()
        _U64.pack_into(self._own, self._barrier_at + offset, value)

    def _behind(self, offset: int, barrier_id: int) -> list[int]:
        at, unpack = self._barrier_at + offset, _U64.unpack_from
        boards = self._boards or [self._map(r) for r in range(self.world_size)]
        behind = [r for r, board in enumerate(boards) if unpack(board, at)[0] <= barrier_id]
        fence()
        return behind

    def unname(self) -> None:
        """Remove this rank's board and doorbell names (everyone has opened them)."""
        if self._named:
            self._named = False
            unlink(self.name)
            unlink(_bell_name(self.name))

    def unreceived(self, dst: int) -> list[tuple[int, bytes]]:
        """``(number, value)`` of the messages to ``dst`` still in its ring, unreceived."""
        board, peer = self._maps[self.rank], self._maps[dst]
        if board is None or peer is None:
            return []
        acked = _U64.unpack_from(peer, self.layout.ack_at(self.rank))[0]
        fence()
        found = []
        for slot in range(RING):
            at = self.layout.message_at(dst, slot)
            held = _U64.unpack_from(board, at)[0]
            if held > acked:
                found.append((held - 1, _value(board, at)))
        return sorted(found)

    def close(self, flush: Callable[[int, int, bytes], None] | None = None) -> None:
        """Unmap every board, close every doorbell and remove this rank's names.

        ``flush(dst, number, value)`` is first given every message still unreceived in a
        ring, to send another way (a receiver that has not opened this board cannot get
        it once it is gone); errors it raises are ignored. In a forked child, which
        inherited the board but does not own it, only this process's mappings and
        descriptors are closed.
        """
        if os.getpid() == self._pids[self.rank]:
            if flush is not None:
                for dst in range(self.world_size):
                    with contextlib.suppress(Exception):
                        for number, value in self.unreceived(dst):
                            flush(dst, number, value)
            self.unname()
        self._connected = False
        self._ringable, self._boards = [], []
        for i, board in enumerate(self._maps):
            if board is not None:
                with contextlib.suppress(BufferError):
                    board.close()
                self._maps[i] = None
        for i, bell in enumerate(self._bells):
            if bell >= 0:
                with contextlib.suppress(OSError):
                    os.close(bell)
                self._bells[i] = -1
        for fd in {self._own_bell, self._lock_fd, self._fd}:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._own_bell = self._lock_fd = self._fd = -1


def _ring(bell: int) -> None:
    # A full doorbell already rings; one whose rank is gone is found while waiting.
    try:  # noqa: SIM105 (cheaper than contextlib.suppress, on every operation)
        os.write(bell, b"\x01")
    except (BlockingIOError, BrokenPipeError):
        pass


def _slot(board: mmap.mmap, at: int, number: int) -> bytes | None:
    """A copy of the value in the ring slot at ``at`` if the slot holds item ``number``
    (its first word is ``number + 1``), else None."""
    if _U64.unpack_from(board, at)[0] != number + 1:
        return None
    fence()  # the value is read after its number
    return _value(board, at)


def _value(board: mmap.mmap, at: int) -> bytes:
    """A copy of the value in the slot at ``at``: as long as its length word says, and
    never longer than a slot holds (the word is another process's)."""
    size = min(_U64.unpack_from(board, at + 8)[0], MESSAGE_CAPACITY)
    return board[at + _SLOT_HEAD : at + _SLOT_HEAD + size]
