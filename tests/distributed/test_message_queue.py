"""MessageQueue data path: local and remote readers, every message size, order, groups.

Every test runs real processes (tests.distributed.harness.run_ranks); handles travel
through a StatelessProcessGroup or through create_from_process_group. After each test no
segment of ours may be left in /dev/shm.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from bridge_py.distributed import (
    StatelessProcessGroup,
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from bridge_py.distributed.auth import seal_object
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.device_communicators.shm_ring import CHUNK_HEADER_BYTES, NAME_SUFFIX
from bridge_py.distributed.shm.wait import pid_namespace, process_alive
from tests.distributed.harness import free_port, run_ranks

CHUNK = 4096
CHUNKS = 4
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


def orphaned_segments() -> list[str]:
    """Queue rings under /dev/shm whose writer (named in the ring's name) has exited."""
    prefix = f"vbspg_{pid_namespace()}_"
    return [
        name
        for name in os.listdir("/dev/shm")
        if name.startswith(prefix)
        and name.endswith(NAME_SUFFIX)
        and not process_alive(int(name[len(prefix) :].split("_")[0]))
    ]


def _exactly(size: int) -> bytes:
    """A bytes object whose serialized form is exactly ``size`` bytes long."""
    for n in range(size - 64, size):
        if len(seal_object(None, "", b"m" * n)) == size:
            return b"m" * n
    raise AssertionError(f"no bytes object serializes to {size} bytes")


def _messages() -> list:
    """Small, one full chunk, exactly a chunk's size (two chunks), and far larger than the ring."""
    payload = CHUNK - CHUNK_HEADER_BYTES
    return [
        0,
        "small",
        {"step": 1, "ids": list(range(10))},
        _exactly(payload),  # fills one chunk exactly
        _exactly(CHUNK),  # max_chunk_bytes: just over one chunk
        _exactly(payload + 1),
        bytes(range(256)) * (CHUNK * 3 // 256 + 7),  # several chunks
        random.Random(5).randbytes(CHUNK * CHUNKS * 5),  # five times the whole ring
        None,
    ]


def _direct(
    rank: int, port: int, world_size: int, local_ranks: list[int], remote_ranks: list[int] | None
) -> tuple:
    """Rank 0 writes with the constructor, the others read (local or remote by their rank)."""
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size)
    messages = _messages()
    if rank == 0:
        queue = MessageQueue(
            n_reader=world_size - 1,
            n_local_reader=len(local_ranks),
            local_reader_ranks=local_ranks,
            max_chunk_bytes=CHUNK,
            max_chunks=CHUNKS,
            remote_reader_ranks=remote_ranks,
        )
        pg.broadcast_obj(queue.export_handle(), 0)
        queue.wait_until_ready(TIMEOUT)
        queue.wait_until_ready(TIMEOUT)  # a second call returns at once
        for message in messages:
            queue.enqueue(message, timeout=TIMEOUT)
        pg.barrier(TIMEOUT)
        queue.close()
        return ("writer", True)
    queue = MessageQueue.create_from_handle(pg.broadcast_obj(None, 0), rank)
    queue.wait_until_ready(TIMEOUT)
    queue.wait_until_ready(TIMEOUT)
    received = [queue.dequeue(timeout=TIMEOUT) for _ in messages]
    kind = "local" if queue._is_local_reader else "remote"
    pg.barrier(TIMEOUT)
    queue.close()
    return (kind, received == messages)


@pytest.mark.parametrize("n_reader", [2, 3])
def test_local_readers_get_every_size(n_reader: int) -> None:
    readers = list(range(1, n_reader + 1))
    results = run_ranks(_direct, n_reader + 1, free_port(), n_reader + 1, readers, None, timeout=60)
    assert results == [("writer", True)] + [("local", True)] * n_reader


def test_remote_reader_mixed_with_local_ones() -> None:
    results = run_ranks(_direct, 4, free_port(), 4, [1, 3], [2], timeout=60)
    assert results == [("writer", True), ("local", True), ("remote", True), ("local", True)]


def _in_order(rank: int, port: int, count: int) -> tuple:
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 4)
    if rank == 0:
        queue = MessageQueue(3, 2, max_chunk_bytes=1024, max_chunks=8)  # reader 2 is remote
        pg.broadcast_obj(queue.export_handle(), 0)
        queue.wait_until_ready(TIMEOUT)
        start = time.perf_counter()
        for i in range(count):
            queue.enqueue((i, f"message {i}"), timeout=TIMEOUT)
        elapsed = time.perf_counter() - start
        pg.barrier(TIMEOUT)
        queue.close()
        return ("writer", elapsed)
    queue = MessageQueue.create_from_handle(pg.broadcast_obj(None, 0), rank - 1)
    queue.wait_until_ready(TIMEOUT)
    out_of_order = 0
    for i in range(count):
        if queue.dequeue(timeout=TIMEOUT) != (i, f"message {i}"):
            out_of_order += 1
    pg.barrier(TIMEOUT)
    queue.close()
    return ("remote" if queue._is_remote_reader else "local", out_of_order)


def test_many_messages_arrive_in_order() -> None:
    count = 2000
    results = run_ranks(_in_order, 4, free_port(), count, timeout=60)
    assert [kind for kind, _ in results] == ["writer", "local", "local", "remote"]
    assert [bad for _, bad in results[1:]] == [0, 0, 0]
    print(f"{count} messages to 2 local readers and 1 remote one in {results[0][1]:.3f} s")


def _broadcast_over(rank: int, port: int, world_size: int, kind: str, writer: int) -> tuple:
    if kind == "stateless":
        pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size)
    else:
        pg = stateless_init_torch_distributed_process_group(
            "127.0.0.1", port, rank, world_size, backend="gloo", timeout=TIMEOUT
        )
    # A GroupCoordinator is used through its cpu_group.
    group = SimpleNamespace(cpu_group=pg) if kind == "cpu_group" else pg
    queue = MessageQueue.create_from_process_group(group, CHUNK, CHUNKS, writer_rank=writer)
    objects = [{"step": 7}, random.Random(3).randbytes(CHUNK * 3), "last"]
    tensor = torch.arange(20_000, dtype=torch.int64)
    results = []
    for obj in objects:
        results.append(queue.broadcast_object(obj if rank == writer else None) == obj)
    got = queue.broadcast_object(tensor if rank == writer else None)
    results.append(torch.equal(got, tensor))
    roles = (queue._is_writer, queue._is_local_reader, queue.n_local_reader)
    # Every rank is done reading before the writer unlinks (not needed, but tidy).
    if kind == "stateless":
        pg.barrier(TIMEOUT)
    else:
        pg.barrier().wait()
    queue.close()
    if kind != "stateless":
        stateless_destroy_torch_distributed_process_group(pg)
    return roles, results


@pytest.mark.parametrize("kind", ["stateless", "gloo", "cpu_group"])
def test_broadcast_object_from_process_group(kind: str) -> None:
    world_size, writer = 3, 1
    results = run_ranks(
        _broadcast_over, world_size, free_port(), world_size, kind, writer, timeout=60
    )
    for rank, (roles, ok) in enumerate(results):
        assert ok == [True] * 4, rank
        if rank == writer:
            assert roles == (True, False, world_size - 1)
        else:
            assert roles[:2] == (False, True)


@pytest.mark.timeout(60)
def test_vllms_defaults_and_the_tensor_arena_flag() -> None:
    """24 MiB chunks by default, as vLLM's; ``enable_shm_tensor_arena`` is taken and a
    tensor larger than a chunk still arrives whole (through two chunks of the ring)."""
    writer = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        assert writer.buffer is not None and writer.buffer.max_chunk_bytes == 24 * 1024 * 1024
        writer.wait_until_ready(TIMEOUT)
        reader.wait_until_ready(TIMEOUT)
        tensor = torch.arange(30 * 1024 * 1024 // 8, dtype=torch.float64)  # 30 MiB
        writer.enqueue(tensor, timeout=TIMEOUT)
        assert torch.equal(reader.dequeue(timeout=TIMEOUT), tensor)
    finally:
        reader.close()
        writer.close()


def test_vllm_034_module_helpers(tmp_path) -> None:
    from bridge_py.distributed.device_communicators import shm_broadcast as sb

    assert sb.to_bytes_big(258, 4) == b"\x00\x00\x01\x02"
    assert sb.from_bytes_big(b"\x00\x00\x01\x02") == 258
    assert sb.memory_fence() is None
    sb.check_shm_free_space(1, str(tmp_path))  # room for one byte
    sb.check_shm_free_space(1 << 62, str(tmp_path / "absent"))  # not a directory: unchecked
    with pytest.raises(RuntimeError, match=r"Insufficient space in .* for the ring: .* MiB req"):
        sb.check_shm_free_space(1 << 62, str(tmp_path), allocation_name="the ring")
