"""vLLM 0.34's MessageQueue additions: raw ring slots (acquire_write/acquire_read), recv,
and create_from_process_group_single_reader. Real processes and real shared memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.device_communicators.shm_ring import CHUNK_HEADER_BYTES
from bridge_py.distributed.errors import StateError
from tests.distributed.harness import free_port, join_gloo, run_ranks
from tests.distributed.test_message_queue import no_leftover_segments  # noqa: F401

CHUNK = 4096
PAYLOAD = CHUNK - CHUNK_HEADER_BYTES
TIMEOUT = 30.0


def _slots_across(rank: int, port: int) -> list:
    """Rank 0 writes raw slots, then a message; ranks 1 and 2 read them."""
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 3)
    if rank == 0:
        queue = MessageQueue(2, 2, max_chunk_bytes=CHUNK, max_chunks=2)
        pg.broadcast_obj(queue.export_handle(), 0)
        queue.wait_until_ready(TIMEOUT)
        with queue.acquire_write(TIMEOUT) as buf:
            assert len(buf) == PAYLOAD and not buf.readonly
            buf[:9] = b"hello" + (42).to_bytes(4, "big")
        with pytest.raises(RuntimeError, match="abandoned"), queue.acquire_write(TIMEOUT) as buf:
            buf[:5] = b"WRONG"
            raise RuntimeError("abandoned")  # nothing published: the readers never see it
        with queue.acquire_write(TIMEOUT) as buf:
            buf[-5:] = b"world"  # the whole payload is the caller's
        queue.enqueue({"after": "the slots"}, timeout=TIMEOUT)
        queue.enqueue("for recv", timeout=TIMEOUT)
        pg.barrier(TIMEOUT)
        queue.close()
        return []
    queue = MessageQueue.create_from_handle(pg.broadcast_obj(None, 0), rank - 1)
    queue.wait_until_ready(TIMEOUT)
    got: list = []
    with queue.acquire_read(TIMEOUT) as buf:
        assert len(buf) == PAYLOAD and buf.readonly
        got.append(bytes(buf[:9]))
    with queue.acquire_read(TIMEOUT) as buf:
        got.append(bytes(buf[-5:]))
    got.append(queue.dequeue(TIMEOUT))
    got.append(MessageQueue.recv(queue, TIMEOUT))
    pg.barrier(TIMEOUT)
    queue.close()
    return got


def test_raw_slots_reach_every_local_reader() -> None:
    expected = [b"hello\x00\x00\x00\x2a", b"world", {"after": "the slots"}, "for recv"]
    assert run_ranks(_slots_across, 3, free_port(), timeout=60) == [[], expected, expected]


@pytest.fixture
def pair() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    """A writer with one local reader, in this process, on a ring of two chunks."""
    writer = MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(TIMEOUT)
    reader.wait_until_ready(TIMEOUT)
    yield writer, reader
    reader.close()
    writer.close()


@pytest.mark.timeout(60)
def test_slots_and_messages_do_not_read_each_other(pair) -> None:
    writer, reader = pair
    writer.enqueue("message")
    refused = pytest.raises(StateError, match="part of a message written by enqueue")
    with refused, reader.acquire_read(TIMEOUT):
        pass
    assert reader.dequeue(TIMEOUT) == "message"  # it was left unread
    with writer.acquire_write(TIMEOUT) as buf:
        buf[0] = 7
        with pytest.raises(StateError, match="slot of this end is open"):
            writer.enqueue("inside")
    with pytest.raises(StateError, match="raw slot of acquire_write"):
        reader.dequeue(TIMEOUT)
    with reader.acquire_read(TIMEOUT) as buf:
        assert buf[0] == 7
        with pytest.raises(StateError, match="slot of this end is open"):
            reader.dequeue(TIMEOUT)
        with pytest.raises(TypeError):
            buf[0] = 1  # type: ignore[index]  # read-only
    with pytest.raises(StateError, match="needs the writer"), reader.acquire_write():
        pass
    with pytest.raises(StateError, match="local reader"), writer.acquire_read():
        pass


@pytest.mark.timeout(60)
def test_slot_waits_are_bounded_and_an_exception_still_consumes_a_read(pair) -> None:
    writer, reader = pair
    with pytest.raises(TimeoutError), reader.acquire_read(timeout=0.1):
        pass
    for value in (1, 2):  # fills the ring of two chunks
        with writer.acquire_write(TIMEOUT) as buf:
            buf[0] = value
    with pytest.raises(TimeoutError), writer.acquire_write(timeout=0.1):
        pass
    with pytest.raises(KeyError), reader.acquire_read(TIMEOUT) as buf:
        assert buf[0] == 1
        raise KeyError("the reader's own failure")
    with writer.acquire_write(timeout=0.1) as buf:  # chunk 0 counts as read: free again
        buf[0] = 3
    for value in (2, 3):
        with reader.acquire_read(TIMEOUT) as buf:
            assert buf[0] == value


@pytest.mark.timeout(60)
def test_recv_reads_a_readers_end_with_vllms_timeouts(pair) -> None:
    writer, reader = pair
    with pytest.raises(TimeoutError):
        MessageQueue.recv(reader, -1.0)  # negative: look once, as 0
    writer.enqueue([1, 2])
    assert MessageQueue.recv(reader, -5) == [1, 2]
    writer.enqueue("later")
    assert MessageQueue.recv(reader, None) == "later"
    with pytest.raises(TypeError, match="socket must be a MessageQueue"):
        MessageQueue.recv("socket", 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be a number"):
        MessageQueue.recv(reader, "1")  # type: ignore[arg-type]
    with pytest.raises(StateError, match="Only readers"):
        MessageQueue.recv(writer, 1.0)


def test_acquire_write_needs_a_ring() -> None:
    writer = MessageQueue(1, 0)  # its one reader is remote: no shared memory
    try:
        with pytest.raises(StateError, match="no local readers"), writer.acquire_write():
            pass
    finally:
        writer.close()


def _single_reader(rank: int, port: int, spg_port: int) -> list:
    """A queue per rank read by one rank: over a torch subgroup of global ranks [1, 2]
    (reader_rank is global: 2), and over a StatelessProcessGroup (reader 0)."""
    join_gloo(rank, port, 3)
    with pytest.raises(ValueError, match="reader_rank 5 is not a global rank"):
        MessageQueue.create_from_process_group_single_reader(dist.group.WORLD, CHUNK, 2, 5)
    sub = dist.new_group([1, 2])
    got: list = []
    if rank in (1, 2):
        queue, handles = MessageQueue.create_from_process_group_single_reader(
            sub, CHUNK, 2, reader_rank=2, blocking=True
        )
        if rank == 2:
            readers = [MessageQueue.create_from_handle(handle, 0) for handle in handles]
            queue.wait_until_ready(TIMEOUT)
            for reader in readers:
                reader.wait_until_ready(TIMEOUT)
            queue.enqueue("from 2 (itself)")
            got = [reader.dequeue(TIMEOUT) for reader in readers]
        else:
            assert handles == []
            queue.enqueue("from 1")
        dist.barrier(group=sub)
    pg = StatelessProcessGroup.create("127.0.0.1", spg_port, rank, 3)
    queue, handles = MessageQueue.create_from_process_group_single_reader(pg, CHUNK, 2)
    if rank == 0:
        readers = [MessageQueue.create_from_handle(handle, 0) for handle in handles]
        for end in (queue, *readers):
            end.wait_until_ready(TIMEOUT)
        queue.enqueue(0)
        got += [reader.dequeue(TIMEOUT) for reader in readers]
    else:
        queue.wait_until_ready(TIMEOUT)
        queue.enqueue(rank)
    pg.barrier(TIMEOUT)
    dist.barrier()
    dist.destroy_process_group()
    return got


def test_create_from_process_group_single_reader() -> None:
    got = run_ranks(_single_reader, 3, free_port(), free_port(), timeout=90)
    assert got == [[0, 1, 2], [], ["from 1", "from 2 (itself)"]]
