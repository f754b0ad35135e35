"""Every documented StatelessProcessGroup operation, numerically, across real processes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import resource
import time
from collections import deque

import pytest
import torch
from torch.distributed import HashStore

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.errors import GroupTimeout
from bridge_py.distributed.spg import keys
from tests.distributed.harness import (
    TRANSPORTS,
    free_port,
    run_ranks,
    transport_of,
    use_transport,
)

BIG = bytes(range(256)) * (4 * 1024 * 1024 // 256)  # 4 MiB
OBJECTS = [
    0,
    -(2**70),
    3.5,
    "héllo",
    b"\x00\xff",
    None,
    True,
    [1, [2, 3]],
    (4, "five"),
    {"a": 1, 2: [3.0]},
    {1, 2},
    torch.arange(6, dtype=torch.float32).reshape(2, 3),
    BIG,
]


def _create(
    rank: int, port: int, world_size: int, transport: str, **kwargs: object
) -> StatelessProcessGroup:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, **kwargs)
    assert transport_of(group) == transport
    return group


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _send_recv(rank: int, port: int, transport: str) -> dict:
    group = _create(rank, port, 2, transport, store_timeout=30)
    peer = 1 - rank
    if rank == 0:
        for obj in OBJECTS:
            group.send_obj(obj, dst=peer)
        echoed = [group.recv_obj(src=peer) for _ in OBJECTS]
    else:
        echoed = [group.recv_obj(src=peer) for _ in OBJECTS]
        for obj in echoed:
            group.send_obj(obj, dst=peer)
    group.barrier()
    return {
        "same": [_same(a, b) for a, b in zip(OBJECTS, echoed, strict=True)],
        "send": group.send_dst_counter,
        "recv": group.recv_src_counter,
        "keys": group.store.num_keys() if rank == 0 else None,
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_send_recv_objects_of_several_types(transport: str) -> None:
    results = run_ranks(_send_recv, 2, free_port(), transport)
    n = len(OBJECTS)
    for rank, result in enumerate(results):
        assert all(result["same"]), result["same"]
        assert result["send"] == {rank: 0, 1 - rank: n}
        assert result["recv"] == {rank: 0, 1 - rank: n}
    # Only the two join keys remain: every object was deleted once received.
    assert results[0]["keys"] == 2


def _two_senders(rank: int, port: int, transport: str) -> list | None:
    group = _create(rank, port, 3, transport, store_timeout=30)
    if rank == 0:
        group.barrier()  # both senders have sent everything before anything is read
        from_2 = [group.recv_obj(src=2) for _ in range(5)]
        from_1 = [group.recv_obj(src=1) for _ in range(5)]
        return [from_1, from_2]
    for i in range(5):
        group.send_obj((rank, i), dst=0)
    group.barrier()
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_senders_to_one_receiver_do_not_collide(transport: str) -> None:
    from_1, from_2 = run_ranks(_two_senders, 3, free_port(), transport)[0]
    assert from_1 == [(1, i) for i in range(5)]
    assert from_2 == [(2, i) for i in range(5)]


def _broadcast_each(rank: int, port: int, transport: str) -> dict:
    group = _create(rank, port, 3, transport, store_timeout=30)
    received = []
    for round_ in range(2):
        for src in range(3):
            mine = {"src": src, "round": round_, "data": [src * 10 + round_] * 3}
            received.append(group.broadcast_obj(mine if rank == src else None, src=src))
    group.barrier()
    return {
        "received": received,
        "send": group.broadcast_send_counter,
        "recv": group.broadcast_recv_src_counter,
        # Only rank 0 reads the store after the barrier: it serves the store, and the
        # others may exit (their reads could race rank 0's exit otherwise).
        "keys": group.store.num_keys() if rank == 0 else None,
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_broadcast_from_each_src(transport: str) -> None:
    results = run_ranks(_broadcast_each, 3, free_port(), transport)
    expected = [
        {"src": src, "round": r, "data": [src * 10 + r] * 3} for r in range(2) for src in range(3)
    ]
    for rank, result in enumerate(results):
        assert result["received"] == expected
        assert result["send"] == 2
        assert result["recv"] == {src: 0 if src == rank else 2 for src in range(3)}
    assert results[0]["keys"] == 2


def _all_gather(rank: int, port: int, transport: str) -> dict:
    group = _create(rank, port, 4, transport, store_timeout=30)
    first = group.all_gather_obj(rank * rank)
    second = group.all_gather_obj({"rank": rank, "t": torch.full((2,), float(rank))})
    group.barrier()
    return {
        "first": first,
        "second": [(d["rank"], d["t"].tolist()) for d in second],
        "send": group.broadcast_send_counter,
        "recv": group.broadcast_recv_src_counter,
        # Only rank 0 reads the store after the barrier: it serves the store, and the
        # others may exit (their reads could race rank 0's exit otherwise).
        "keys": group.store.num_keys() if rank == 0 else None,
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_gather_obj_returns_rank_order(transport: str) -> None:
    results = run_ranks(_all_gather, 4, free_port(), transport)
    for rank, result in enumerate(results):
        assert result["first"] == [0, 1, 4, 9]
        assert result["second"] == [(r, [float(r)] * 2) for r in range(4)]
        # Like vLLM: an all_gather is one broadcast from every rank.
        assert result["send"] == 2
        assert result["recv"] == {src: 0 if src == rank else 2 for src in range(4)}
    assert results[0]["keys"] == 2


def _barrier_sync(rank: int, port: int, transport: str) -> tuple[float, float]:
    group = _create(rank, port, 3, transport, store_timeout=30)
    if rank == 2:
        time.sleep(0.5)
    entered = time.time()
    group.barrier(timeout=10)
    left = time.time()
    group.barrier(timeout=10)
    return entered, left


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_barrier_waits_for_the_last_rank(transport: str) -> None:
    times = run_ranks(_barrier_sync, 3, free_port(), transport)
    last_entry = max(entered for entered, _ in times)
    assert all(left >= last_entry for _, left in times)


def _data_keys(group: StatelessProcessGroup) -> list[str]:
    """The store's keys, but those of a barrier another rank may already have entered.

    Point-to-point objects are not keys but queue items: each one still queued from rank 0 to
    rank 1 is listed as ``p2p/0/1/<n>`` (n counting from the front of the queue).
    """
    found = [k for k in group.store.list_keys() if not k.startswith("barrier/")]
    queued = group.store.queue_len(keys.p2p_queue(0, 1))
    return sorted(found + [keys.p2p_value(0, 1, n) for n in range(queued)])


def _expire(rank: int, port: int, transport: str) -> dict:
    group = _create(rank, port, 2, transport, data_expiration_seconds=1, store_timeout=30)
    written = []
    if rank == 0:
        for i in range(3):
            group.send_obj(i, dst=1)  # never received
        group.broadcast_obj("b", src=0)  # received, so already deleted by rank 1
        written = [key for key, _ in group.entries]
    else:
        group.broadcast_obj(None, src=0)
    group.barrier()
    before = _data_keys(group)
    if rank == 0:
        time.sleep(1.5)
        group.expire_data()
    group.barrier()
    after = _data_keys(group)
    group.barrier()  # rank 0 serves the store: it stays until rank 1 has read it
    return {"written": written, "before": before, "after": after, "entries": len(group.entries)}


def test_expire_data_deletes_old_keys() -> None:
    # What expire_data deletes is in the store: ranks on several machines.
    results = run_ranks(_expire, 2, free_port(), "store")
    assert len(results[0]["written"]) == 5  # 3 sends, a broadcast value and its ack counter
    join_keys = ["join/count", "join/done"]
    unreceived = [f"p2p/0/1/{i}" for i in range(3)]
    for rank, result in enumerate(results):
        before = result["before"]
        if rank == 1:
            # Rank 0 leaves a barrier last, once every rank's deferred deletes are done; rank 1
            # may look before rank 0's own are (create's node cards, which rank 0 deletes).
            before = [key for key in before if not key.startswith("node/")]
        assert before == join_keys + unreceived
        assert result["after"] == join_keys
    assert results[0]["entries"] == 0


def test_fields_and_post_init() -> None:
    names = [f.name for f in dataclasses.fields(StatelessProcessGroup)]
    assert names == [
        "rank",
        "world_size",
        "store",
        "socket",
        "data_expiration_seconds",
        "send_dst_counter",
        "recv_src_counter",
        "broadcast_send_counter",
        "broadcast_recv_src_counter",
        "entries",
    ]
    group = StatelessProcessGroup(rank=1, world_size=3, store=HashStore(), socket=None)
    assert group.send_dst_counter == {0: 0, 1: 0, 2: 0}
    assert group.recv_src_counter == {0: 0, 1: 0, 2: 0}
    assert group.broadcast_recv_src_counter == {0: 0, 1: 0, 2: 0}
    assert group.broadcast_send_counter == 0
    assert group.data_expiration_seconds == 3600
    assert group.entries == deque()
    for rank, world_size in [(3, 3), (-1, 3), (0, 0)]:
        with pytest.raises(ValueError):
            StatelessProcessGroup(rank=rank, world_size=world_size, store=HashStore(), socket=None)
    with pytest.raises(TypeError):
        StatelessProcessGroup(rank="0", world_size=2, store=HashStore(), socket=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dst"):
        group.send_obj(1, dst=3)


def test_docstrings_follow_the_documented_summaries() -> None:
    summaries = {
        "all_gather_obj": "All gather an object from all ranks.",
        "barrier": "A robust barrier to synchronize all ranks.",
        "broadcast_obj": "Broadcast an object from a source rank to all other ranks.",
        "create": "A replacement for `torch.distributed.init_process_group` that does not",
        "expire_data": "Expire data that is older than data_expiration_seconds seconds.",
        "recv_obj": "Receive an object from a source rank.",
        "send_obj": "Send an object to a destination rank.",
    }
    for name, summary in summaries.items():
        doc = getattr(StatelessProcessGroup, name).__doc__
        assert doc.strip().splitlines()[0] == summary, name
    barrier_doc = StatelessProcessGroup.barrier.__doc__
    assert "timeout: Maximum time in seconds to wait for each phase" in barrier_doc
    for phase in ("1. Each process", "2. Each process", "3. Rank 0 waits"):
        assert phase in barrier_doc


def test_single_rank_group_in_process() -> None:
    group = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=5)
    assert group.socket is not None
    assert group.all_gather_obj("x") == ["x"]
    assert group.broadcast_obj(7, src=0) == 7
    group.send_obj("self", dst=0)
    assert group.recv_obj(src=0) == "self"
    group.barrier(timeout=1)
    assert group.store.num_keys() == 2


def _gather_alone(rank: int, port: int, transport: str) -> dict:
    group = _create(rank, port, 2, transport, store_timeout=2)
    result: dict = {}
    group.barrier(timeout=10)  # the first barrier learns where the ranks run
    if rank == 1:
        time.sleep(4)  # skips the gather, and stays until rank 0 is done
        return result
    start = time.monotonic()
    try:
        group.all_gather_obj("alone")
    except RuntimeError as exc:
        result["error"] = str(exc)
    result["elapsed"] = time.monotonic() - start
    # The ranks are now a gather apart: the group refuses what comes next, at once.
    start = time.monotonic()
    try:
        group.send_obj("after", dst=1)
    except RuntimeError as exc:
        result["after"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_gather_times_out_within_the_store_timeout_naming_the_missing_rank(
    transport: str,
) -> None:
    (result,) = run_ranks(_gather_alone, 2, free_port(), transport, timeout=60)[:1]
    error = result["error"]
    assert "all_gather_obj on rank 0 timed out" in error and "ranks [1]" in error, error
    assert result["elapsed"] < 2 * 2, result  # one wait of the store timeout, not two
    kind, message, elapsed = result["after"]
    assert kind == "StateError" and elapsed < 0.5, result
    assert "send_obj on rank 0 of a StatelessProcessGroup of 2 refused" in message
    assert "all_gather_obj failed on it (GroupTimeout: all_gather_obj on rank 0" in message


def _too_large_for_the_store(rank: int, port: int) -> dict:
    group = _create(rank, port, 2, "store")
    huge = b"x" * (9 << 20)  # torch's TCPStore takes at most 8 MiB in one request
    out: dict = {}
    if rank == 0:
        calls = {
            "broadcast_obj": lambda: group.broadcast_obj(huge, 0),
            "send_obj": lambda: group.send_obj(huge, 1),
            "all_gather_obj": lambda: group.all_gather_obj(huge),
        }
        for name, call in calls.items():
            try:
                call()
                out[name] = "sent"
            except ValueError as exc:
                out[name] = str(exc)
    # Nothing was sent, and the group goes on as if those calls had not been made.
    out["broadcast"] = group.broadcast_obj("small" if rank == 0 else None, 0)
    if rank == 0:
        group.send_obj("hi", 1)
    else:
        out["recv"] = group.recv_obj(0)
    out["gather"] = group.all_gather_obj(rank)
    group.barrier()
    return out


def test_a_value_too_large_for_the_store_is_refused_and_the_group_goes_on() -> None:
    # Sent, it made torch's server drop this rank's connection: every later request of
    # the rank failed ("Connection reset by peer"), its group dead.
    first, second = run_ranks(_too_large_for_the_store, 2, free_port(), timeout=60)
    for op, key in (
        ("broadcast_obj", "bcast/0/0"),
        ("send_obj", "p2p/0/1/0"),
        ("all_gather_obj", "bcast/0/0"),
    ):
        assert first[op].startswith(f"{op} on rank 0: the value for {key!r} is 9,437,"), first
        assert "more than the 8,388,608 a TCPStore takes in one request" in first[op]
    assert first["broadcast"] == second["broadcast"] == "small"
    assert second["recv"] == "hi"
    assert first["gather"] == second["gather"] == [0, 1]


def _out_of_descriptors(rank: int, port: int) -> str:
    group = _create(rank, port, 2, "shm")
    message = ""
    if rank == 0:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
        filler = []
        with contextlib.suppress(OSError):
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        try:
            group.recv_obj(1, timeout=0.5)
        except GroupTimeout as exc:
            message = str(exc)
        for fd in filler:
            os.close(fd)
    group.barrier(timeout=30)  # the group goes on
    return message


def test_a_wait_that_times_out_says_when_the_process_is_out_of_descriptors() -> None:
    # Out of file descriptors, rank 0's store server cannot accept the other ranks, and a
    # rank cannot connect: that looked like ranks that never came, and said nothing more.
    message = run_ranks(_out_of_descriptors, 2, free_port(), timeout=60)[0]
    assert message.startswith("recv_obj on rank 0 timed out after"), message
    assert re.search(r"this process has (\d+) of its 256 file descriptors open", message)
