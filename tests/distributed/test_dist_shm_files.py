"""Shared-memory files and node cards another rank made are checked before they are believed.

Real files under ``/dev/shm`` made the way ranks make them (boards, doorbells, segments,
message-queue rings), then changed the way someone else on the host could: replaced by a
symbolic link, made writable by others, given to another user (``chown``, as root only),
or a doorbell that is not a FIFO. Each is refused with an error naming the file, before
anything is read from it. With an auth key, a node card forged in the store (it names the
node and the board to open) is refused before the group acts on it.
"""

from __future__ import annotations

import dataclasses
import datetime
import mmap
import os
import pickle
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from bridge_py.distributed import StatelessProcessGroup, auth
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm import posix
from bridge_py.distributed.shm.files import UntrustedFileError, open_peer_file
from bridge_py.distributed.shm.segments import SHM_DIR, SegmentOwner
from bridge_py.distributed.spg import board as spg_board
from bridge_py.distributed.spg import values as spg_shm
from tests.distributed.harness import traced_memory, transport_of

pytestmark = pytest.mark.timeout(60)

SHM = Path(SHM_DIR)
KEY = b"k" * 32
OTHER_UID = 65534


def _as_root() -> bool:
    return os.geteuid() == 0


def _give_away(path: Path) -> None:
    """Make ``path`` another user's (root only; the caller skips otherwise)."""
    os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A directory on /dev/shm's file system (removed afterwards) for files to check."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    path = SHM / f"vbtest_{os.getpid()}_{tmp_path.name}"
    path.mkdir()
    yield path
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            child.rmdir()
        else:
            child.unlink()
    path.rmdir()


def _refused(path: Path, flags: int, reason: str, *, fifo: bool = False) -> None:
    with pytest.raises(UntrustedFileError) as info:
        os.close(open_peer_file(str(path), flags, fifo=fifo))
    message = str(info.value)
    assert str(path) in message and reason in message, message
    assert isinstance(info.value, PermissionError)


def test_open_peer_file_checks(scratch: Path) -> None:
    good = scratch / "good"
    good.write_bytes(b"x")
    good.chmod(0o600)
    os.close(open_peer_file(str(good), os.O_RDWR))
    bell = scratch / "bell"
    os.mkfifo(bell, 0o600)
    os.close(open_peer_file(str(bell), os.O_RDWR | os.O_NONBLOCK, fifo=True))

    link = scratch / "link"
    link.symlink_to(good)
    _refused(link, os.O_RDWR, "symbolic link")
    shared = scratch / "shared"
    shared.write_bytes(b"x")
    shared.chmod(0o620)
    _refused(shared, os.O_RDWR, "group or others may write it (mode 620)")
    shared.chmod(0o606)
    _refused(shared, os.O_RDWR, "group or others may write it (mode 606)")
    _refused(good, os.O_RDWR, "not a FIFO", fifo=True)
    _refused(bell, os.O_RDWR | os.O_NONBLOCK, "not a regular file")
    folder = scratch / "folder"
    folder.mkdir(mode=0o700)
    _refused(folder, os.O_RDWR, "it is a directory")  # (not a bare IsADirectoryError)
    with pytest.raises(FileNotFoundError):
        open_peer_file(str(scratch / "missing"), os.O_RDWR)
    if not _as_root():
        pytest.skip("another user's file needs root to chown (the other checks passed)")
    theirs = scratch / "theirs"
    theirs.write_bytes(b"x")
    theirs.chmod(0o600)
    _give_away(theirs)
    _refused(theirs, os.O_RDWR, f"owned by uid {OTHER_UID}")


# --- boards and doorbells ---------------------------------------------------------------------


@pytest.fixture
def boards() -> Iterator[tuple[spg_board.Board, spg_board.Board]]:
    """Boards of ranks 0 and 1 of a 2-rank group, made in this process (not connected)."""
    pair = (spg_board.Board(0, 2), spg_board.Board(1, 2))
    yield pair
    for board in pair:
        board.close()


def _connect_refused(board: spg_board.Board, names: list[str], path: Path, reason: str) -> None:
    with pytest.raises(spg_board.BoardError) as info:
        board.connect(names)
    message = str(info.value)
    assert str(path) in message and reason in message, message
    assert not board.is_open(1)


def test_boards_and_doorbells_are_checked(boards: tuple[spg_board.Board, ...]) -> None:
    rank0, rank1 = boards
    names = [rank0.name, rank1.name]
    board = SHM / rank1.name
    bell = SHM / (rank1.name[: -len("board")] + "bell")
    moved = SHM / (rank1.name + "_moved")

    board.chmod(0o666)  # anyone may write it
    _connect_refused(rank0, names, board, "mode 666")
    board.chmod(0o600)

    os.rename(board, moved)  # a link where the board should be
    board.symlink_to(moved)
    try:
        _connect_refused(rank0, names, board, "symbolic link")
    finally:
        board.unlink()
        os.rename(moved, board)

    os.rename(bell, moved)  # a regular file where the doorbell should be
    bell.write_bytes(b"")
    bell.chmod(0o600)
    try:
        _connect_refused(rank0, names, bell, "not a FIFO")
    finally:
        bell.unlink()
        os.rename(moved, bell)

    if _as_root():
        os.chown(board, OTHER_UID, OTHER_UID)
        try:
            _connect_refused(rank0, names, board, f"owned by uid {OTHER_UID}")
        finally:
            os.chown(board, os.geteuid(), os.getegid())
    # Put back as made, the same boards connect.
    assert rank0.connect(names) == [] and rank0.is_open(1)


# --- segments and queue rings -----------------------------------------------------------------


def test_segments_are_checked_before_they_are_read() -> None:
    owner = SegmentOwner(2)
    payload = pickle.dumps(b"v" * (400 << 10))
    descriptor = spg_shm.dump(None, owner, False, [1], pickled=payload)
    name = spg_shm.segment_name(descriptor)
    assert name is not None
    path = SHM / name
    try:
        path.chmod(0o622)
        with pytest.raises(RuntimeError) as info:
            spg_shm.open_descriptor(descriptor, False, "the value", 1)
        assert str(path) in str(info.value) and "mode 622" in str(info.value)
        path.chmod(0o600)
        if _as_root():
            _give_away(path)
            with pytest.raises(RuntimeError, match=f"owned by uid {OTHER_UID}"):
                spg_shm.open_descriptor(descriptor, False, "the value", 1)
            os.chown(path, os.geteuid(), os.getegid())
        assert spg_shm.open_descriptor(descriptor, False, "the value", 1).load() == b"v" * (
            400 << 10
        )
    finally:
        owner.release()


def test_a_queue_ring_is_checked_before_a_reader_attaches() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    try:
        handle = writer.export_handle()
        assert handle.buffer_handle is not None
        path = SHM / handle.buffer_handle[3]
        path.chmod(0o666)
        with pytest.raises(UntrustedFileError) as info:
            MessageQueue.create_from_handle(handle, 0)
        assert str(path) in str(info.value) and "mode 666" in str(info.value)
        path.chmod(0o600)
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.close()
    finally:
        writer.close()


def test_a_board_length_word_is_held_to_its_slot(boards: tuple[spg_board.Board, ...]) -> None:
    # A slot's length word is another process's: one that says more than a slot holds
    # made the reader copy the rest of the board with the message.
    rank0, rank1 = boards
    names = [rank0.name, rank1.name]
    rank0.connect(names)
    rank1.connect(names)
    assert rank0.send(1, 0, b"hello")
    assert rank1.take(0, 0) == b"hello"
    fd = os.open(SHM / rank0.name, os.O_RDWR)  # as another process of the user would
    try:
        with mmap.mmap(fd, 0) as board:
            at = rank0.layout.message_at(1, 0)
            struct.pack_into("<Q", board, at + 8, 1 << 40)
    finally:
        os.close(fd)
    taken = rank1.take(0, 0)
    assert taken is not None and len(taken) <= spg_board.MESSAGE_CAPACITY
    assert taken[:5] == b"hello"


def test_a_queue_ring_that_is_no_ring_is_refused_naming_it(scratch: Path) -> None:
    # What a handle names is a peer's word: a name that leaves /dev/shm, a directory or an
    # empty file in its place, or numbers that are not the ring's (sized from the file,
    # not from the handle: a reader that sized its bookkeeping by the handle first took
    # seconds and gigabytes for n_reader=10**8, or raised a bare MemoryError).
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    try:
        handle = writer.export_handle()
        assert handle.buffer_handle is not None
        ring = handle.buffer_handle
        own = scratch / "own"
        own.write_bytes(b"x" * 4096)
        own.chmod(0o600)

        def attach(buffer_handle: tuple) -> None:
            MessageQueue.create_from_handle(
                dataclasses.replace(handle, buffer_handle=buffer_handle), 0
            ).close()

        escape = f"../..{own}"
        with pytest.raises(UntrustedFileError, match="not a file directly in /dev/shm"):
            attach((*ring[:3], escape))
        empty = SHM / f"{ring[3]}_empty"
        empty.touch(mode=0o600)
        try:
            with pytest.raises(SharedMemoryError, match=f"{empty.name}' is empty"):
                attach((*ring[:3], empty.name))
        finally:
            empty.unlink()
        folder = SHM / f"{ring[3]}_dir"
        folder.mkdir(mode=0o700)
        try:
            with pytest.raises(UntrustedFileError, match="it is a directory"):
                attach((*ring[:3], folder.name))
        finally:
            folder.rmdir()
        with traced_memory() as traced:
            for numbers in [(10**8, ring[1], ring[2]), (ring[0], ring[1], 10**12)]:
                with pytest.raises(SharedMemoryError, match="has not the handle's layout"):
                    attach((numbers[0], numbers[1], numbers[2], ring[3]))
            peak = traced()[1]
        assert peak < 1 << 20, f"a refused handle cost {peak} bytes"
    finally:
        writer.close()


# --- node cards, with a key -------------------------------------------------------------------


@pytest.fixture
def keyed_rank0(monkeypatch: pytest.MonkeyPatch) -> Iterator[StatelessProcessGroup]:
    """Rank 0 of a keyed 2-rank group over a real store, whose rank 1 is the test itself:
    rank 0's side of ``create`` learning where the ranks run is ``_choose_transport``."""
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    served = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=10)
    rank0 = StatelessProcessGroup(rank=0, world_size=2, store=served.store, socket=None)
    rank0.auth_key = KEY
    yield rank0
    if transport_of(rank0) == "shm":
        rank0._transport.board.close()
    rank0._values.segments.release()
    served.socket.close()


def _forged_card(board: spg_board.Board) -> bytes:
    """What rank 1 would store as its node card (this node, ``board``), without a key."""
    return spg_shm.node_identity() + b"\n" + board.name.encode()


def _play_rank1(group: StatelessProcessGroup, card: bytes) -> None:
    """Store ``card`` as rank 1's node card and say that rank 1 has read the cards, as
    rank 1's create would (rank 0 waits for that before it returns)."""
    group.store.set("node/1", card)
    group.store.set("node/read/1", b"1")


def test_a_forged_node_card_is_refused(keyed_rank0) -> None:
    foreign = spg_board.Board(1, 2)  # a real board: the card would be believed and opened
    try:
        _play_rank1(keyed_rank0, _forged_card(foreign))
        with pytest.raises(AuthenticationError) as info:
            keyed_rank0._choose_transport()
        assert "the node card 'node/1' of rank 1" in str(info.value)
        assert transport_of(keyed_rank0) == "store"
    finally:
        foreign.close()


def test_sealed_node_cards_are_believed(keyed_rank0) -> None:
    peer = spg_board.Board(1, 2)
    try:
        _play_rank1(keyed_rank0, auth.sign(KEY, "spg/node/1", _forged_card(peer)))
        keyed_rank0._choose_transport()
        assert transport_of(keyed_rank0) == "shm"  # both boards open, values sealed on them
    finally:
        peer.close()


@pytest.fixture
def plain_rank0(monkeypatch: pytest.MonkeyPatch) -> Iterator[StatelessProcessGroup]:
    """Rank 0 of a 2-rank group without a key over a real store; rank 1 is the test."""
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    served = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=10)
    rank0 = StatelessProcessGroup(rank=0, world_size=2, store=served.store, socket=None)
    yield rank0
    rank0._values.segments.release()
    served.socket.close()


def test_a_group_refuses_a_board_others_may_write(plain_rank0) -> None:
    peer = spg_board.Board(1, 2)  # rank 1's board, then opened up to everyone
    path = SHM / peer.name
    path.chmod(0o666)
    try:
        _play_rank1(plain_rank0, _forged_card(peer))
        with pytest.raises(spg_board.BoardError) as info:
            plain_rank0._choose_transport()
        message = str(info.value)
        assert "rank 0 could not join the boards" in message and str(path) in message, message
        assert "mode 666" in message, message
        assert transport_of(plain_rank0) == "store"  # nothing goes over the boards
    finally:
        peer.close()


def test_a_closed_segment_has_no_memory_to_view() -> None:
    segment = posix.create(f"vbtest_view_{os.getpid()}", 16, tracked=False)
    try:
        posix.view(segment)[:4] = b"abcd"
        assert bytes(posix.view(segment)[:4]) == b"abcd"
        segment.close()
        with pytest.raises(SharedMemoryError, match=r"segment 'vbtest_view_\d+' is closed"):
            posix.view(segment)
    finally:
        posix.unlink(segment, tracked=False)


# --- headers: one format (shm.header), checked on attach --------------------------------------


def _patch(path: Path, at: int, data: bytes) -> bytes:
    """Overwrite ``data`` at ``at`` of file ``path``; return what was there."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, len(data), at)
        os.pwrite(fd, data, at)
    finally:
        os.close(fd)
    return old


def test_a_board_of_another_kind_or_layout_is_refused(boards: tuple[spg_board.Board, ...]) -> None:
    rank0, rank1 = boards
    names = [rank0.name, rank1.name]
    path = SHM / rank1.name
    magic = _patch(path, 0, b"VBXX")
    with pytest.raises(spg_board.BoardError, match="not of the expected kind") as info:
        rank0.connect(names)
    assert rank1.name in str(info.value) and isinstance(info.value, SharedMemoryError)
    _patch(path, 0, magic)
    version = _patch(path, 4, (99).to_bytes(2, "little"))
    with pytest.raises(spg_board.BoardError, match="layout version 99, expected 2"):
        rank0.connect(names)
    _patch(path, 4, version)
    _patch(path, 8, (3).to_bytes(4, "little"))  # a board of another group's size
    with pytest.raises(spg_board.BoardError, match="a group of 3 ranks"):
        rank0.connect(names)
    _patch(path, 8, (2).to_bytes(4, "little"))
    assert rank0.connect(names) == [] and rank0.is_open(1)


def test_a_segment_of_another_kind_is_refused_naming_it() -> None:
    owner = SegmentOwner(2)
    descriptor = spg_shm.dump(None, owner, False, [1], pickled=pickle.dumps(b"v" * (400 << 10)))
    name = spg_shm.segment_name(descriptor)
    assert name is not None
    try:
        _patch(SHM / name, 0, b"VBXX")
        with pytest.raises(SharedMemoryError, match="not of the expected kind") as info:
            spg_shm.open_descriptor(descriptor, False, "the value", 1)
        assert str(info.value).startswith("the value: ") and repr(name) in str(info.value)
        _patch(SHM / name, 0, b"VBSG")
        assert spg_shm.open_descriptor(descriptor, False, "the value", 1).load() == b"v" * (
            400 << 10
        )
    finally:
        owner.release()


def test_an_all_reduce_segment_of_another_layout_is_unusable() -> None:
    from bridge_py.distributed.device_communicators.shm_collectives import (
        MIN_SLOT_BYTES,
        ShmCollectives,
    )

    shm, token = ShmCollectives._create_segment(2, MIN_SLOT_BYTES)
    handle = f"{shm.name}:{token.hex()}".encode()
    try:
        _patch(SHM / shm.name, 4, (2).to_bytes(2, "little"))
        attached, _, why = ShmCollectives._attach(handle, 2)
        assert attached is None and repr(shm.name) in why and "layout version 2" in why, why
        _patch(SHM / shm.name, 4, (1).to_bytes(2, "little"))
        attached, _, why = ShmCollectives._attach(handle, 3)
        assert attached is None and "not this group's" in why, why
        attached, slot_bytes, why = ShmCollectives._attach(handle, 2)
        assert attached is not None and slot_bytes == MIN_SLOT_BYTES and why == ""
        attached.close()
    finally:
        shm.close()
        posix.unlink(shm)


def test_rank_0_leaves_create_only_once_every_rank_has_read_the_node_cards(
    plain_rank0,
) -> None:
    # Rank 0 serves the store: had it returned while rank 1 was still reading the cards,
    # and exited (a short program), rank 1's create would have lost the store.
    # rank 1's own connection to the store, on another machine
    rank1 = TCPStore("127.0.0.1", plain_rank0.store.port, is_master=False,
                     timeout=datetime.timedelta(seconds=10))  # fmt: skip
    rank1.set("node/1", spg_shm.NOT_LOCAL)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (plain_rank0._choose_transport(), done.set()))
    worker.start()
    try:
        time.sleep(0.5)
        assert not done.is_set(), "rank 0 left before rank 1 said it had read the cards"
        rank1.set("node/read/1", b"1")
        assert done.wait(10), "rank 0 did not leave once rank 1 had read the cards"
    finally:
        rank1.set("node/read/1", b"1")
        worker.join(15)
    assert transport_of(plain_rank0) == "store"
