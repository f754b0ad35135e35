"""MessageQueue when things go wrong: timeouts, cancel, shutdown, dead peers, misuse, cleanup.

Peers that die are real processes killed with SIGKILL; after each test no segment of ours may
be left in /dev/shm (the killed-writer test removes the one a killed writer cannot).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory

import pytest

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.auth import seal_object
from bridge_py.distributed.device_communicators.shm_broadcast import (
    Handle,
    MessageQueue,
    PeerGoneError,
)
from bridge_py.distributed.device_communicators.shm_remote import READY
from bridge_py.distributed.device_communicators.shm_ring import CHUNK, ShmRingBuffer
from bridge_py.distributed.errors import (
    DistributedError,
    GroupTimeout,
    ObjectLoadError,
    SharedMemoryError,
    StateError,
)
from bridge_py.distributed.groups.node import same_node_as
from bridge_py.distributed.shm import segments, wait
from tests.distributed.harness import (
    call_with_small_dev_shm,
    free_port,
    run_ranks,
    traced_memory,
)
from tests.distributed.test_message_queue import orphaned_segments

TIMEOUT = 30.0


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Every segment a test's writers created is gone once its processes have exited.

    Only orphans count (segments whose writer has exited): other people's live queues may
    come and go in /dev/shm meanwhile.
    """
    before = set(orphaned_segments())
    yield
    assert set(orphaned_segments()) - before == set()


def _timed(call: object, *args: object, **kwargs: object) -> tuple[str, float]:
    """``(exception type: message, seconds)`` of a call expected to raise."""
    start = time.monotonic()
    try:
        call(*args, **kwargs)  # type: ignore[operator]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "returned", time.monotonic() - start


def _timeouts(rank: int, port: int) -> dict:
    """Rank 0 writes, rank 1 reads shared memory, rank 2 reads over TCP."""
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 3)
    big = b"b" * 5000  # five chunks of 1 KiB
    if rank == 0:
        queue = MessageQueue(2, 1, max_chunk_bytes=1024, max_chunks=2)
        pg.broadcast_obj(queue.export_handle(), 0)
        queue.wait_until_ready(TIMEOUT)
        pg.barrier(TIMEOUT)  # readers have timed out on an empty queue
        queue.enqueue("m1", timeout=TIMEOUT)
        queue.enqueue("m2", timeout=TIMEOUT)  # the ring is full now
        full = _timed(queue.enqueue, big, timeout=0.3)
        pg.barrier(TIMEOUT)  # readers start reading
        queue.enqueue("after", timeout=TIMEOUT)  # finishes `big` first
        pg.barrier(TIMEOUT)
        queue.close()
        return {"full": full}
    queue = MessageQueue.create_from_handle(pg.broadcast_obj(None, 0), rank - 1)
    queue.wait_until_ready(TIMEOUT)
    empty = _timed(queue.dequeue, timeout=0.3)
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    cancelled = _timed(queue.dequeue, cancel=cancel)
    pg.barrier(TIMEOUT)
    pg.barrier(TIMEOUT)
    received = [queue.dequeue(timeout=TIMEOUT) for _ in range(4)]
    pg.barrier(TIMEOUT)
    queue.close()
    return {
        "empty": empty,
        "cancelled": cancelled,
        "received": received == ["m1", "m2", big, "after"],
    }


def test_timeouts_are_prompt_and_resumable() -> None:
    writer, local, remote = run_ranks(_timeouts, 3, free_port(), timeout=60)
    message, seconds = writer["full"]
    assert message.startswith("GroupTimeout") and "local reader ranks [0]" in message
    assert 0.3 <= seconds < 2.0
    for reader in (local, remote):
        message, seconds = reader["empty"]
        assert message.startswith("GroupTimeout") and "waiting for a message" in message
        assert 0.3 <= seconds < 2.0
        message, seconds = reader["cancelled"]
        assert message == "WaitCancelled: cancelled" and seconds < 2.0
        assert reader["received"] is True


def _shut_down_from_a_thread(queue: MessageQueue, call: Callable[[], object]) -> dict:
    """Call ``call`` (it must wait) while a thread shuts ``queue`` down 0.3 s later:
    ``{"error", "woke": seconds from shutdown() to the error, "later": a second call}``."""
    shut_at: list[float] = []

    def shut() -> None:
        time.sleep(0.3)
        shut_at.append(time.monotonic())
        queue.shutdown()

    assert queue.shutting_down is False
    thread = threading.Thread(target=shut)
    thread.start()
    error, _ = _timed(call)
    woke = time.monotonic() - shut_at[0] if shut_at else -1.0
    thread.join(TIMEOUT)
    return {"error": error, "woke": woke, "later": _timed(call), "flag": queue.shutting_down}


def _shutdown(rank: int, port: int) -> dict:
    """Rank 0 writes, rank 1 reads shared memory, rank 2 reads over TCP; each end is shut
    down by a thread of its own process while it waits."""
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 3)
    if rank == 0:
        queue = MessageQueue(2, 1, max_chunk_bytes=1024, max_chunks=2)
        pg.broadcast_obj(queue.export_handle(), 0)
        queue.wait_until_ready(TIMEOUT)
        pg.barrier(TIMEOUT)  # the readers were shut down while nothing was written
        queue.enqueue("m1", timeout=TIMEOUT)
        queue.enqueue("m2", timeout=TIMEOUT)  # the ring is full now: "m3" has to wait
        result = _shut_down_from_a_thread(queue, lambda: queue.enqueue("m3"))
        pg.barrier(TIMEOUT)  # the readers take m1 and m2
        pg.barrier(TIMEOUT)
        queue.enqueue("m4", timeout=TIMEOUT)  # room again: m3 is finished, then m4 goes
        pg.barrier(TIMEOUT)
        pg.barrier(TIMEOUT)
        queue.close()
        return result
    queue = MessageQueue.create_from_handle(pg.broadcast_obj(None, 0), rank - 1)
    queue.wait_until_ready(TIMEOUT)
    result = _shut_down_from_a_thread(queue, queue.dequeue)  # no timeout: only shutdown ends it
    pg.barrier(TIMEOUT)
    pg.barrier(TIMEOUT)
    result["written"] = [queue.dequeue(timeout=TIMEOUT) for _ in range(2)]
    result["drained"] = _timed(queue.dequeue, timeout=TIMEOUT)
    pg.barrier(TIMEOUT)
    pg.barrier(TIMEOUT)
    result["written"] += [queue.dequeue(timeout=TIMEOUT) for _ in range(2)]
    pg.barrier(TIMEOUT)
    queue.close()
    return result


def test_shutdown_wakes_every_wait_and_later_waits_fail_at_once() -> None:
    writer, local, remote = run_ranks(_shutdown, 3, free_port(), timeout=60)
    for end in (writer, local, remote):
        assert end["error"] == "WaitCancelled: cancelled", end
        assert 0 <= end["woke"] < 0.5, end  # 10 ms but for a busy machine
        message, seconds = end["later"]
        assert message == "WaitCancelled: cancelled" and seconds < 0.5, end
        assert end["flag"] is True
    for reader in (local, remote):
        # What is there is still read after shutdown (vLLM's readers too); nothing is waited for.
        assert reader["written"] == ["m1", "m2", "m3", "m4"]
        message, seconds = reader["drained"]
        assert message == "WaitCancelled: cancelled" and seconds < 0.5


@pytest.mark.timeout(60)
def test_dequeue_takes_vllms_positional_order(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``dequeue(timeout, indefinite)``: a True second argument silences the long-wait log."""
    monkeypatch.setattr(wait, "LOG_INTERVAL_SECONDS", 0.05)
    with _writer_and_readers() as (_writer, local, remote):
        for reader in (local, remote):
            caplog.clear()
            with caplog.at_level(logging.INFO, logger=wait.__name__):
                with pytest.raises(TimeoutError):
                    reader.dequeue(0.3, True)
                assert "still waiting" not in caplog.text
                with pytest.raises(TimeoutError):
                    reader.dequeue(0.3, False)
                assert "still waiting for a message" in caplog.text


@contextlib.contextmanager
def _writer_and_readers() -> Iterator[tuple[MessageQueue, MessageQueue, MessageQueue]]:
    """A writer with a local reader (rank 0) and a remote one (rank 1), all ready; closed
    on leaving."""
    writer = MessageQueue(2, 1, max_chunk_bytes=256, max_chunks=2)
    local = MessageQueue.create_from_handle(writer.export_handle(), 0)
    remote = MessageQueue.create_from_handle(writer.export_handle(), 1)
    try:
        for end in (writer, local, remote):
            end.wait_until_ready(TIMEOUT)
        yield writer, local, remote
    finally:
        for end in (remote, local, writer):
            end.close()


def _fork(target: Callable[..., None], *args: object) -> int:
    """Run ``target(*args)`` in a forked child (rank processes are daemons: no mp children)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            target(*args)
        finally:
            os._exit(0)
    return pid


def _kill(pid: int) -> int:
    """SIGKILL ``pid`` and reap it; its wait status."""
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def _victim_reader(handle: object, conn: object) -> None:
    queue = MessageQueue.create_from_handle(handle, 0)  # type: ignore[arg-type]
    queue.wait_until_ready(TIMEOUT)
    conn.send(queue.dequeue(timeout=TIMEOUT))  # type: ignore[attr-defined]
    time.sleep(TIMEOUT)


def _killed_reader(rank: int, port: int) -> object:
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2)
    if rank == 0:
        queue = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
        pg.broadcast_obj(queue.export_handle(), 0)
        queue.wait_until_ready(TIMEOUT)
        queue.enqueue("first", timeout=TIMEOUT)
        pg.barrier(TIMEOUT)  # the reader has been killed
        start = time.monotonic()
        try:
            for i in range(10):  # the second one fills the ring
                queue.enqueue(i)  # no timeout: only the dead reader can stop it
        except PeerGoneError as exc:
            error = str(exc)
        name = queue.buffer.name if queue.buffer is not None else ""
        queue.close()
        return error, time.monotonic() - start, name, os.path.exists(f"/dev/shm/{name}")
    handle = pg.broadcast_obj(None, 0)
    mine, theirs = multiprocessing.Pipe()
    victim = _fork(_victim_reader, handle, theirs)
    assert mine.poll(TIMEOUT) and mine.recv() == "first"
    status = _kill(victim)
    pg.barrier(TIMEOUT)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_writer_notices_a_killed_reader_and_cleans_up() -> None:
    (error, seconds, name, exists), killed = run_ranks(_killed_reader, 2, free_port(), timeout=60)
    assert killed
    assert "local reader rank 0" in error and "exited" in error
    assert seconds < 5.0
    assert name.startswith(segments.NAME_PREFIX) and not exists


def _victim_writer(conn: object) -> None:
    queue = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    conn.send(queue.export_handle())  # type: ignore[attr-defined]
    queue.wait_until_ready(TIMEOUT)
    queue.enqueue("last words", timeout=TIMEOUT)
    time.sleep(TIMEOUT)


def _killed_writer(rank: int) -> tuple:
    mine, theirs = multiprocessing.Pipe()
    victim = _fork(_victim_writer, theirs)
    assert mine.poll(TIMEOUT)
    handle = mine.recv()
    name = handle.buffer_handle[3]
    try:
        queue = MessageQueue.create_from_handle(handle, 0)
        queue.wait_until_ready(TIMEOUT)
        time.sleep(0.2)  # the message is written
        _kill(victim)
        first = queue.dequeue(timeout=TIMEOUT)  # written before the writer died
        gone = _timed(queue.dequeue)  # no timeout: the dead writer ends the wait
        queue.close()
        orphaned = name in orphaned_segments()
        # A killed writer cannot unlink: the next same-node group's orphan sweep does (and
        # multiprocessing's resource tracker, at its exit).
        removed = name in segments.remove_orphans() and not os.path.exists(f"/dev/shm/{name}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            segment = shared_memory.SharedMemory(name=name)
            segment.close()
            segment.unlink()
    return first, gone, orphaned, removed


def test_reader_notices_a_killed_writer() -> None:
    [(first, (message, seconds), orphaned, removed)] = run_ranks(_killed_writer, 1, timeout=60)
    assert first == "last words"
    assert orphaned and removed  # found by orphaned_segments(), removed by remove_orphans()
    assert message.startswith("PeerGoneError") and "exited" in message
    assert seconds < 5.0


def _closed_writer(rank: int) -> tuple:
    writer = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=2)
    name = writer.buffer.name  # type: ignore[union-attr]
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(TIMEOUT)
    reader.wait_until_ready(TIMEOUT)
    received: list = []
    reader_thread = threading.Thread(
        target=lambda: received.append(reader.dequeue(timeout=TIMEOUT))
    )
    reader_thread.start()
    writer.enqueue(b"x" * 600, timeout=TIMEOUT)  # three chunks: more than the ring
    reader_thread.join(TIMEOUT)
    writer.enqueue("bye", timeout=TIMEOUT)
    del writer
    gc.collect()  # collecting the writer closes the queue and unlinks its segment
    unlinked = not os.path.exists(f"/dev/shm/{name}")
    received.append(reader.dequeue(timeout=TIMEOUT))  # written before the writer went
    after = _timed(reader.dequeue)
    reader.close()
    reader.close()  # idempotent
    return unlinked, received == [b"x" * 600, "bye"], after[0]


def test_garbage_collected_writer_unlinks_and_readers_drain() -> None:
    [(unlinked, drained, after)] = run_ranks(_closed_writer, 1, timeout=60)
    assert unlinked and drained
    assert after == "PeerGoneError: the writer closed the queue"


def test_misuse_is_reported_clearly() -> None:
    with pytest.raises(ValueError, match="n_local_reader <= n_reader"):
        MessageQueue(1, 2)
    with pytest.raises(ValueError, match="local_reader_ranks has 1 ranks"):
        MessageQueue(2, 2, local_reader_ranks=[0])
    with pytest.raises(ValueError, match="both a local and a remote"):
        MessageQueue(2, 1, local_reader_ranks=[1], remote_reader_ranks=[1])
    with MessageQueue(2, 1, max_chunk_bytes=256, max_chunks=2) as writer:
        handle = writer.export_handle()
        with pytest.raises(ValueError, match=r"rank 5 is not a reader .* remote readers are \[1\]"):
            MessageQueue.create_from_handle(handle, 5)
        with pytest.raises(ValueError, match="non-negative int"):
            MessageQueue.create_from_handle(handle, -1)
        with pytest.raises(RuntimeError, match="Only readers can dequeue"):
            writer.dequeue(timeout=0)
        with pytest.raises(RuntimeError, match="wait_until_ready"):
            writer.enqueue("too early")  # a remote reader has not connected yet
        reader = MessageQueue.create_from_handle(handle, 0)
        with pytest.raises(RuntimeError, match="Only writers can enqueue"):
            reader.enqueue("x")
        reader.close()
        # A handle whose segment is not on this host: the reader is on another node.
        elsewhere = dataclasses.replace(
            handle,
            buffer_handle=(*handle.buffer_handle[:3], segments.NAME_PREFIX + "0_0_00_mq"),
            writer_host="far-away",
        )
        with pytest.raises(SharedMemoryError, match=r"rank 0 .* must be remote readers"):
            MessageQueue.create_from_handle(elsewhere, 0)
        with pytest.raises(TimeoutError, match=r"remote readers to connect.*ranks \[1\]"):
            writer.wait_until_ready(timeout=0.2)


@pytest.fixture
def local_pair() -> Iterator[tuple[ShmRingBuffer, MessageQueue]]:
    """The ring of a writer and its one local reader (this process), both ready; chunks of
    64 bytes. A test writes chunks into the ring as a writer would, and reads them."""
    writer = MessageQueue(1, 1, max_chunk_bytes=64, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.wait_until_ready(TIMEOUT)
        reader.wait_until_ready(TIMEOUT)
        assert writer.buffer is not None
        yield writer.buffer, reader
    finally:
        reader.close()
        writer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("chunks", "words"),
    [
        # (total message length, part index, payload) per chunk, as a writer would write them
        ([(3, 0, b"abcdef")], "chunk 0 of segment .* is corrupt: it holds 6 bytes of a 3-byte"),
        ([(10, 1, b"ab")], "local reader 0: chunk 0 of segment .* holds part 1 .* expected 0"),
        ([(10, 0, b"abcdefgh"), (10, 1, b"abcdefgh")], "chunk 1 of segment .* overflows its"),
        ([(2**20, 0, b"a" * 60)], "chunk 0 of segment .* is corrupt: it holds 60 bytes .* fit"),
        (
            [(10, 0, b"abc"), (12, 1, b"abc")],
            "chunk 1 of segment .* holds part 1 of a 12-byte message, expected one of 10",
        ),
    ],
    ids=[
        "longer than its message",
        "out of order",
        "overflowing",
        "longer than a chunk",
        "another length",
    ],
)
def test_a_corrupt_chunk_is_a_shared_memory_error(
    local_pair: tuple[ShmRingBuffer, MessageQueue], chunks: list[tuple[int, int, bytes]], words: str
) -> None:
    ring, reader = local_pair
    for idx, (total, part, payload) in enumerate(chunks):
        ring.write_chunk(idx, total, part, memoryview(payload))
    with pytest.raises(SharedMemoryError, match=words):
        reader.dequeue(timeout=TIMEOUT)


@pytest.mark.timeout(60)
def test_a_message_that_does_not_unpickle_is_named(
    local_pair: tuple[ShmRingBuffer, MessageQueue],
) -> None:
    # Without a key nothing checks a message before it is unpickled; what pickle raised
    # came out bare, naming neither the queue nor the message.
    ring, reader = local_pair
    garbage = b"\x80\x05\x95garbage"
    ring.write_chunk(0, len(garbage), 0, memoryview(garbage))
    with pytest.raises(ObjectLoadError, match=r"message 0 of the queue .* does not unpickle"):
        reader.dequeue(timeout=TIMEOUT)


@pytest.mark.timeout(60)
def test_a_chunk_that_claims_a_huge_message_takes_no_memory_for_it(
    local_pair: tuple[ShmRingBuffer, MessageQueue],
) -> None:
    # A corrupt length is checked against the parts that come, never allocated ahead: a
    # reader that took it at its word allocated (and kept) that much, or raised a bare
    # MemoryError, before any of the message existed.
    ring, reader = local_pair
    ring.write_chunk(0, 2**39, 0, memoryview(b"a" * 40))
    with traced_memory() as traced:
        with pytest.raises(GroupTimeout):
            reader.dequeue(timeout=0.3)
        peak = traced()[1]
    assert peak < 1 << 20, f"the reader allocated {peak} bytes for a 40-byte part"


def _fake_writer(listener: socket.socket, frames: list[bytes]) -> None:
    """Accept one remote reader, read its hello, send ``frames``, keep the line open."""
    with listener:
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(TIMEOUT)
        hello = b""
        while len(hello) < 24:  # magic, the queue's token, the reader's rank
            hello += conn.recv(24 - len(hello))
        for frame in frames:
            conn.sendall(frame)
        conn.recv(1)  # until the reader closes


def _remote_reader_of(frames: list[bytes]) -> tuple[MessageQueue, threading.Thread]:
    """Reader rank 3 of a queue whose "writer" is a plain socket sending ``frames``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    thread = threading.Thread(target=_fake_writer, args=(listener, frames), daemon=True)
    thread.start()
    handle = Handle(
        local_reader_ranks=[],
        remote_subscribe_addr=f"tcp://127.0.0.1:{port}",
        remote_reader_ranks=None,
        token=b"t" * 16,
    )
    return MessageQueue.create_from_handle(handle, 3), thread


@pytest.mark.timeout(60)
def test_a_writer_that_breaks_the_stream_is_a_distributed_error() -> None:
    def chunk(total: int, part: int, payload: bytes) -> bytes:
        return CHUNK.pack(total, part, len(payload)) + payload

    cases = [  # the chunks the writer sends, whether the reader gets ready first, the error
        ([READY, chunk(3, 0, b"abcdef")], True, r"rank 3: a chunk from .* is corrupt: it holds 6"),
        ([READY, chunk(10, 1, b"ab")], True, r"rank 3: a chunk from .* holds part 1 .* expected 0"),
        ([READY, chunk(9, 0, b"ab"), chunk(9, 1, b"abcdefgh")], True, r"rank 3: .* overflows"),
        ([chunk(1, 0, b"x")], False, r"rank 3 expected the READY signal from .*, got a part of"),
        ([READY, READY], True, r"rank 3: a chunk from .* expected a message, got the READY signal"),
    ]
    for frames, ready_first, words in cases:
        reader, writer = _remote_reader_of(frames)
        try:
            if ready_first:
                reader.wait_until_ready(TIMEOUT)
            with pytest.raises(DistributedError, match=words):
                reader.dequeue(timeout=TIMEOUT) if ready_first else reader.wait_until_ready(TIMEOUT)
        finally:
            reader.close()
            writer.join(TIMEOUT)


def _handle_of_another_version(rank: int, port: int) -> str:
    """Rank 0 plays a writer that sends something else than a Handle, in the right frame."""
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2)
    outcome = ""
    if rank == 0:
        same_node_as(pg, 0)  # the probe every rank of create_from_process_group takes part in
        pg.broadcast_obj(seal_object(None, "mq/handle/0", (False, "not a handle")), 0)
    else:
        try:
            MessageQueue.create_from_process_group(pg, 1024, 2, writer_rank=0)
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    pg.barrier(TIMEOUT)  # rank 0 serves the store: it stays until rank 1 is done
    return outcome


def test_a_writer_that_sends_no_handle_is_reported() -> None:
    _, message = run_ranks(_handle_of_another_version, 2, free_port(), timeout=60)
    assert message == (
        "TypeError: create_from_process_group on rank 1: writer rank 0 sent str, not the "
        "Handle of a MessageQueue: is the writer running another version?"
    )


def _queue_on_a_small_dev_shm() -> dict:
    """In a 6 MiB /dev/shm: a queue whose header region (4,000,000 chunks' flags) does not
    fit, then one whose ring of ten 1 MiB chunks does not."""
    out: dict = {}
    try:
        MessageQueue(1, 1, max_chunk_bytes=64, max_chunks=4_000_000)
    except SharedMemoryError as exc:
        out["create"] = str(exc)
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=10)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(10)
    reader.wait_until_ready(10)
    messages = [bytes([i]) * 900_000 for i in range(9)]
    sent = 0
    try:
        for message in messages:
            writer.enqueue(message, timeout=10)
            sent += 1
    except SharedMemoryError as exc:
        out["enqueue"] = str(exc)
    out["sent"] = sent
    out["intact"] = [reader.dequeue(timeout=10) == m for m in messages[:sent]]
    # The queue goes on with messages that fit.
    writer.enqueue("small", timeout=10)
    writer.enqueue(b"x" * 1000, timeout=10)
    out["after"] = [
        reader.dequeue(timeout=10) == "small",
        reader.dequeue(timeout=10) == b"x" * 1000,
    ]
    # vLLM's raw API of the ring: the writer's chunk writes and views take memory first too.
    ring = writer.buffer
    assert ring is not None
    try:
        ring.write_chunk(9, 900_000, 0, memoryview(bytes(900_000)))
    except SharedMemoryError as exc:
        out["write_chunk"] = str(exc)
    try:
        with ring.get_data(8):
            pass
    except SharedMemoryError as exc:
        out["get_data"] = str(exc)
    reader.close()
    writer.close()
    return out


@pytest.mark.timeout(120)
def test_a_full_dev_shm_is_an_error_and_the_queue_goes_on() -> None:
    # Without its memory taken first, the fifth message's store into the mapping is a
    # SIGBUS that kills the process (a container's 64 MiB /dev/shm against vLLM's 240 MiB
    # ring): here it is a SharedMemoryError, with nothing of that message sent.
    out = call_with_small_dev_shm("6m", _queue_on_a_small_dev_shm)
    assert "no room on /dev/shm" in out["create"], out
    assert "no room on /dev/shm for part 0" in out["enqueue"], out
    assert 0 < out["sent"] < 9 and out["intact"] == [True] * out["sent"], out
    assert out["after"] == [True, True], out
    assert "no room on /dev/shm for a 900000-byte part" in out["write_chunk"], out
    assert "no room on /dev/shm for a whole chunk" in out["get_data"], out


def _probe_on_a_full_dev_shm() -> list[bool]:
    # /dev/shm full
    with open("/dev/shm/filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(bytes(65536))
    return same_node_as(StatelessProcessGroup.create("127.0.0.1", free_port(), 0, 1), 0)


@pytest.mark.timeout(120)
def test_the_same_node_probe_answers_on_a_full_dev_shm() -> None:
    # The probe a MessageQueue (and GroupCoordinator) asks before it makes a ring: with no
    # room for it, the rank that makes it shares memory with nobody but itself.
    assert call_with_small_dev_shm("1m", _probe_on_a_full_dev_shm) == [True]


@pytest.mark.timeout(60)
def test_readable_and_spin_until_readable_for_local_and_remote_readers() -> None:
    """vLLM 0.34's non-blocking check and its spin, on both kinds of reader."""
    with _writer_and_readers() as (writer, local, remote):
        for reader in (local, remote):
            assert not reader.readable()
            start = time.monotonic()
            reader.spin_until_readable([], start + 0.2)  # nothing comes: until the deadline
            assert 0.2 <= time.monotonic() - start < 5
            reader.spin_until_readable(["pending"], time.monotonic() + 30)  # at once
        writer.enqueue({"step": 1}, timeout=TIMEOUT)
        for reader in (local, remote):
            reader.spin_until_readable([], time.monotonic() + TIMEOUT)
            assert reader.readable()
            assert reader.dequeue(timeout=TIMEOUT) == {"step": 1}
            assert not reader.readable()
        with pytest.raises(StateError, match="Only readers"):
            writer.readable()
        local.shutdown()
        with pytest.raises(RuntimeError, match="cancelled"):
            local.readable()
