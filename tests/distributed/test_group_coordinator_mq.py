"""GroupCoordinator with shared-memory message queues (shm_broadcast.MessageQueue), 3 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.parallel_state import GroupCoordinator
from tests.distributed.harness import free_port, join_gloo, run_ranks


def _join(rank: int, port: int) -> None:
    """Join the 3-rank gloo world of one test."""
    join_gloo(rank, port, 3)


def _queues(rank: int, port: int) -> str:
    _join(rank, port)
    g = GroupCoordinator([[0, 1, 2]], rank, "gloo", True, use_message_queue_broadcaster=True)
    assert isinstance(g.mq_broadcaster, MessageQueue)

    # broadcast_object and the metadata of broadcast_tensor_dict go through the queue.
    for step in range(3):
        assert g.broadcast_object({"step": step} if rank == 0 else None) == {"step": step}
    sent = {"x": torch.arange(4.0), "tag": "t"} if rank == 0 else None
    got = g.broadcast_tensor_dict(sent)
    assert got is not None and got["tag"] == "t" and torch.equal(got["x"], torch.arange(4.0))
    with pytest.raises(ValueError, match="only supports src=0"):
        g.broadcast_object("x", src=1)

    # A queue written by rank 1.
    queue = g.create_mq_broadcaster(writer_rank=1)
    assert queue.broadcast_object("from 1" if rank == 1 else None) == "from 1"
    if rank == 1:
        queue.enqueue([1, 2, 3])
    else:
        assert queue.dequeue() == [1, 2, 3]

    # Every rank writes its own queue; rank 2 reads them all.
    # With blocking, ranks 0 and 1 return once rank 2 has opened their queues.
    own, handles = g.create_single_reader_mq_broadcasters(reader_rank_in_group=2, blocking=True)
    if rank == 2:
        assert len(handles) == 3
        readers = [MessageQueue.create_from_handle(handle, 0) for handle in handles]
        own.wait_until_ready()  # this rank is both the writer and the reader of its queue
        for reader in readers:
            reader.wait_until_ready()
        own.enqueue("self")
        assert [reader.dequeue() for reader in readers] == ["rank 0", "rank 1", "self"]
    else:
        assert handles == []
        own.enqueue(f"rank {rank}")
    g.barrier()
    g.destroy()
    assert g.mq_broadcaster is None
    dist.destroy_process_group()
    return "ok"


def test_message_queue_broadcasters() -> None:
    assert run_ranks(_queues, 3, free_port(), timeout=90) == ["ok"] * 3


def _external_writer(rank: int, port: int) -> list:
    """Rank 0 writes a queue from outside the group of ranks 1 and 2, which read it."""
    _join(rank, port)
    g = GroupCoordinator([[0], [1, 2]], rank, "gloo", True)
    # A handle that is not a queue's fails on every rank of the group, none waits.
    if rank != 0:
        with pytest.raises(TypeError, match="not the Handle of a MessageQueue"):
            g.create_mq_broadcaster(external_writer_handle="not a handle", blocking=False)

    writer = MessageQueue(n_reader=2, n_local_reader=2) if rank == 0 else None
    sent = [writer.export_handle() if writer is not None else None]
    dist.broadcast_object_list(sent, src=0)
    got: list = []
    if writer is not None:
        writer.wait_until_ready(timeout=60)
        for item in ["a", {"b": 2}, list(range(5))]:
            writer.enqueue(item)
        dist.barrier()
        writer.close()
    else:
        # As vLLM's workers: only the group's writer_rank needs the handle (rank 2 has none).
        handle = sent[0] if rank == 1 else None
        queue = g.create_mq_broadcaster(external_writer_handle=handle, blocking=False)
        assert not queue._is_writer
        queue.wait_until_ready(timeout=60)
        got = [queue.dequeue(timeout=30) for _ in range(3)]
        dist.barrier()
        queue.close()
    g.destroy()
    dist.destroy_process_group()
    return got


def test_create_mq_broadcaster_with_an_external_writer() -> None:
    got = run_ranks(_external_writer, 3, free_port(), timeout=90)
    assert got == [[], ["a", {"b": 2}, [0, 1, 2, 3, 4]], ["a", {"b": 2}, [0, 1, 2, 3, 4]]]
