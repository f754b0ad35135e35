"""The shared-memory MessageQueues a GroupCoordinator makes over its CPU group: their sizes,
and the single-reader queues (a queue per rank, one reader)."""

from __future__ import annotations

from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.shm_broadcast import Handle, MessageQueue
from bridge_py.distributed.groups.node import in_the_same_node_as
from bridge_py.distributed.groups.objects import ObjectChannel

__all__ = ["CHUNKS", "CHUNK_BYTES", "single_reader_queues"]

# Message queue broadcaster sizes, as vLLM: 4 MiB chunks, 6 of them.
CHUNK_BYTES = 1 << 22
CHUNKS = 6


def single_reader_queues(
    cpu_group: ProcessGroup,
    objects: ObjectChannel,
    reader: int,
    blocking: bool,
    key: bytes | None,
) -> tuple[MessageQueue, list[Handle]]:
    """GroupCoordinator.create_single_reader_mq_broadcasters: a queue per rank, all read by
    ``reader``; every handle gathered there (over ``objects``)."""
    rank = objects.rank
    same_node = in_the_same_node_as(cpu_group, source_rank=reader)
    queue = MessageQueue(
        n_reader=1,
        n_local_reader=1 if same_node[rank] else 0,
        max_chunk_bytes=CHUNK_BYTES,
        max_chunks=CHUNKS,
        auth_key=key,
    )
    handles = objects.gather(queue.export_handle(), reader)
    if blocking and rank != reader:
        queue.wait_until_ready()
    return queue, list(handles or [])
