"""StatelessProcessGroup's fast paths: all_gather in one multi_get, shared memory on one node.

Real processes (``run_ranks``, bounded) check that large values take shared memory once the
group knows its ranks share a node, that ``VLLM_BRIDGE_SPG_SHM=0`` falls back to the store,
that gathers of mixed sizes come back right for 2-4 ranks, that a sender writes its next
value over a segment every reader is done with (and into one-shot segments, unlinked by their
reader, when too many are in flight), and that no segment is left in /dev/shm, even when a
receiver or a creator is killed. In-process tests check that with an auth key a tampered
segment is refused before it is unpickled, and that a segment holding another value than its
descriptor names is refused.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bridge_py.distributed import StatelessProcessGroup, auth
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm import segments as spg_segments
from bridge_py.distributed.shm.wait import process_alive
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg import values as spg_shm
from bridge_py.distributed.spg.store_transport import StoreTransport
from tests.distributed.harness import free_port, run_ranks

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not spg_shm.enabled(), reason="needs Linux /dev/shm"),
]

BIG = bytes(range(256)) * 4096  # 1 MiB, above the 256 KiB threshold
KEY = b"k" * 32
JOIN_KEYS = ["join/count", "join/done"]


def _files_of(*pids: int) -> list[str]:
    """Names in /dev/shm of the files (segments, boards, doorbells) of any of ``pids``."""
    prefixes = [f"{spg_segments.NAME_PREFIX}{_pidns()}_{pid}_" for pid in pids]
    return sorted(n for n in os.listdir(spg_segments.SHM_DIR) if n.startswith(tuple(prefixes)))


def _segments_of(*pids: int) -> list[str]:
    """Names in /dev/shm of segments created by any of ``pids``."""
    return [n for n in _files_of(*pids) if spg_segments.NAME_PATTERN.match(n)]


def _pidns() -> int:
    link = os.readlink("/proc/self/ns/pid")
    return int(link[link.index("[") + 1 : -1])


def _create(rank: int, port: int, world_size: int, **kwargs: object) -> StatelessProcessGroup:
    return StatelessProcessGroup.create(
        "127.0.0.1", port, rank, world_size, store_timeout=30, **kwargs
    )


def _big(rank: int) -> bytes:
    return bytes([rank + 1]) * (300 * 1024)


# --- the shared-memory path and its fallback -------------------------------------------------


def _large_values(rank: int, port: int, disabled_rank: int | None) -> dict:
    if rank == disabled_rank:
        os.environ[spg_shm.ENV_VAR] = "0"
    group = _create(rank, port, 3)
    result: dict = {"pid": os.getpid()}
    # The first all_gather also tells every rank where the others run (its values go
    # through the store: nobody knows yet).
    group.all_gather_obj(os.getpid())
    result["gather"] = group.all_gather_obj(_big(rank)) == [_big(r) for r in range(3)]
    result["segments_after_gather"] = group._values.segments._generation
    result["bcast"] = group.broadcast_obj(BIG if rank == 0 else None, src=0) == BIG
    result["segments_after_bcast"] = group._values.segments._generation
    if rank == 0:
        group.send_obj(BIG, dst=2)
    if rank == 2:
        result["p2p"] = group.recv_obj(0, timeout=10) == BIG
    result["segments_after_p2p"] = group._values.segments._generation
    tensor = torch.arange(100_000, dtype=torch.float32)
    got = group.broadcast_obj(tensor if rank == 1 else None, src=1)
    result["tensor"] = torch.equal(got, tensor)
    group.barrier(timeout=10)
    # Another rank may already be in the next barrier: leave its keys out.
    listed = group.store.list_keys() if rank == 0 else []
    result["keys"] = sorted(k for k in listed if not k.startswith("barrier/"))
    group.barrier(timeout=10)
    return result


def test_large_values_go_through_shared_memory_on_one_node() -> None:
    results = run_ranks(_large_values, 3, free_port(), None, timeout=60)
    for result in results:
        assert result["gather"] and result["bcast"] and result["tensor"], result
        assert result["segments_after_gather"] == 1  # its own gather value
    assert results[0]["segments_after_bcast"] == 2  # the broadcast
    assert results[0]["segments_after_p2p"] == 3  # and the message to rank 2
    assert results[1]["segments_after_bcast"] == 1  # receivers write none
    assert results[2]["p2p"]
    assert results[0]["keys"] == JOIN_KEYS  # values and probe keys deleted
    assert _files_of(*(r["pid"] for r in results)) == []


class _LargeOncePickled:
    """Small to ``sys.getsizeof``, 1 MiB once pickled (it unpickles to ``BIG``); counts how
    often this process pickles one."""

    pickled = 0

    def __reduce__(self) -> tuple:
        type(self).pickled += 1
        return (bytes, (BIG,))


def _pickled_once(rank: int, port: int) -> dict:
    pg = _create(rank, port, 2)
    pg.barrier()  # from here on the ranks know they share a node
    got = pg.broadcast_obj(_LargeOncePickled() if rank == 0 else None, src=0)
    gathered = pg.all_gather_obj(_LargeOncePickled())
    if rank == 0:
        pg.send_obj(_LargeOncePickled(), dst=1)
        sent = None
    else:
        sent = pg.recv_obj(src=0)
    pg.barrier()

    # What crossed from the other rank (a rank keeps its own object as it is).
    crossed = [gathered[1 - rank]] + ([got, sent] if rank == 1 else [])
    return {"pickled": _LargeOncePickled.pickled, "crossed": crossed}


def test_a_value_large_only_once_pickled_is_pickled_once() -> None:
    # The size of such a value shows only in its pickle; that pickle is what goes to the
    # segment (broadcast, gather and send each pickle their value once).
    results = run_ranks(_pickled_once, 2, free_port(), timeout=60)
    assert all(value == BIG for r in results for value in r["crossed"])
    assert [r["pickled"] for r in results] == [3, 1]


def test_shared_memory_can_be_switched_off() -> None:
    # Rank 1 refuses shared memory: collectives go through the store, point-to-point between
    # ranks 0 and 2 (both willing, one node) still through shared memory.
    results = run_ranks(_large_values, 3, free_port(), 1, timeout=60)
    for result in results:
        assert result["gather"] and result["bcast"] and result["tensor"], result
        assert result["segments_after_gather"] == 0
    assert results[0]["segments_after_bcast"] == 0
    assert results[0]["segments_after_p2p"] == 1
    assert results[2]["p2p"]
    assert results[0]["keys"] == JOIN_KEYS
    assert _files_of(*(r["pid"] for r in results)) == []


# --- all_gather correctness -----------------------------------------------------------------


def _mixed_gathers(rank: int, port: int, world_size: int) -> dict:
    group = _create(rank, port, world_size)
    sizes = [0, 10, 300 * 1024, 1000]  # small and shared-memory values side by side

    def mine(i: int) -> object:
        size = sizes[(rank + i) % len(sizes)]
        return {"rank": rank, "i": i, "data": bytes([rank]) * size}

    gathered = []
    for i in range(6):
        gathered.append(group.all_gather_obj(mine(i)) == [
            {"rank": r, "i": i, "data": bytes([r]) * sizes[(r + i) % len(sizes)]}
            for r in range(world_size)
        ])  # fmt: skip
        if i == 2:  # a broadcast between gathers shifts one sender's sequence numbers
            group.broadcast_obj("between" if rank == 1 else None, src=1)
    group.barrier(timeout=10)
    return {
        "gathered": gathered,
        "send": group.broadcast_send_counter,
        "recv": group.broadcast_recv_src_counter,
        "keys": group.store.num_keys() if rank == 0 else None,
        "pid": os.getpid(),
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_of_mixed_sizes(world_size: int) -> None:
    results = run_ranks(_mixed_gathers, world_size, free_port(), world_size, timeout=60)
    for rank, result in enumerate(results):
        assert all(result["gathered"]), result["gathered"]
        assert result["send"] == 6 + (rank == 1)
        assert result["recv"] == {
            src: 0 if src == rank else 6 + (src == 1) for src in range(world_size)
        }
    assert results[0]["keys"] == 2
    assert _files_of(*(r["pid"] for r in results)) == []


# --- nothing left in /dev/shm when a rank dies ---------------------------------------------


def _start(target: object, *args: object) -> multiprocessing.Process:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "bridge_py.distributed"])
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


@pytest.fixture
def reap() -> Iterator[list[multiprocessing.Process]]:
    procs: list[multiprocessing.Process] = []
    yield procs
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _receiver_then_killed(rank: int, port: int, world_size: int) -> None:
    group = _create(rank, port, world_size)
    group.all_gather_obj(os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def _creator_keeps_unread(rank: int, port: int) -> dict:
    group = _create(rank, port, 2)
    pids = group.all_gather_obj(os.getpid())
    group.broadcast_obj(BIG, src=0)  # rank 1 dies without reading it
    created = _segments_of(os.getpid())
    # Rank 1's board (made when it told its node) is an orphan once rank 1 is gone: the
    # release below removes it then.
    deadline = time.monotonic() + 20
    while process_alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.02)
    del group
    gc.collect()
    return {"created": created, "left": _files_of(os.getpid()), "pids": pids}


def test_no_segment_left_when_the_receiver_is_killed(reap: list) -> None:
    port = free_port()
    reap.append(_start(_receiver_then_killed, 1, port, 2))
    (result,) = run_ranks(_creator_keeps_unread, 2, port, ranks=[0], timeout=60)
    assert len(result["created"]) >= 1  # the broadcast went to shared memory (and gather)
    assert result["left"] == []  # released with the group
    assert _files_of(*result["pids"]) == []


def _creator_then_killed(rank: int, port: int) -> None:
    group = _create(rank, port, 3)
    group.all_gather_obj(os.getpid())
    group.broadcast_obj(BIG, src=rank)
    group.send_obj(BIG, dst=0)
    time.sleep(0.5)  # the others have seen the segments
    os.kill(os.getpid(), signal.SIGKILL)


def _survivor(rank: int, port: int) -> dict:
    group = _create(rank, port, 3)
    pids = group.all_gather_obj(os.getpid())
    creator = pids[2]
    deadline = time.monotonic() + 20
    while process_alive(creator) and time.monotonic() < deadline:
        time.sleep(0.05)
    # A killed creator leaves its segments behind (rank 1 looks: rank 0 cleans up only once
    # rank 1 is done).
    seen = _segments_of(creator)
    result = {"seen": seen, "creator_alive": process_alive(creator), "pids": pids}
    if rank == 1:
        # Read the dead creator's broadcast: its segment is still there (rank 0 never reads).
        result["read"] = group.broadcast_obj(None, src=2, timeout=10) == BIG
        group.send_obj("done", dst=0)
    else:  # rank 0 serves the store: it stays until rank 1 is done
        group.recv_obj(1, timeout=20)
    del group
    gc.collect()
    result["left"] = _files_of(creator)
    return result


def test_no_segment_left_when_the_creator_is_killed(reap: list) -> None:
    port = free_port()
    reap.append(_start(_creator_then_killed, 2, port))
    results = run_ranks(_survivor, 3, port, ranks=[0, 1], timeout=60)
    creator = results[0]["pids"][2]
    assert len(results[1]["seen"]) >= 2  # its broadcast and its message to rank 0
    assert not results[0]["creator_alive"]
    assert results[1]["read"]
    assert results[0]["left"] == [] and results[1]["left"] == []
    assert _files_of(creator) == []


# --- authentication of shared-memory values -------------------------------------------------


@pytest.fixture
def keyed_pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """Ranks 0 and 1 of a keyed 2-rank group in this process, both told they share a node."""
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    served = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=10)
    pair = tuple(
        StatelessProcessGroup(rank=r, world_size=2, store=served.store, socket=None)
        for r in range(2)
    )
    for group in pair:
        group.auth_key = KEY
        # What create() would choose for ranks of one node that have no boards: the store,
        # with large values in segments.
        group._store_transport = StoreTransport(
            group.store, group.rank, 2, group._values, group.entries, [True, True]
        )
        group._transport = group._store_transport
    yield pair
    for group in pair:
        group._values.segments.release()
    served.socket.close()


def test_keyed_shared_memory_values_are_checked(keyed_pair) -> None:
    rank0, rank1 = keyed_pair
    rank1.broadcast_obj(BIG, src=1)
    stored = rank0.store.get(keys.broadcast_value(1, 0))
    assert len(stored) < 200 and stored.startswith(auth.MAGIC)  # a tagged descriptor
    assert rank0.broadcast_obj(None, src=1, timeout=5) == BIG

    rank1.broadcast_obj(BIG, src=1)  # written over the same segment: it was read
    (name,) = _segments_of(os.getpid())
    path = Path(spg_segments.SHM_DIR) / name
    data = bytearray(path.read_bytes())
    data[-100] ^= 1  # someone who can write /dev/shm but lacks the key
    path.write_bytes(bytes(data))
    with pytest.raises(AuthenticationError, match="do not match its authenticated digest"):
        rank0.broadcast_obj(None, src=1, timeout=5)
    # The refused value was consumed (marked read): the next one reuses the segment.
    rank1.broadcast_obj(BIG[::-1], src=1)
    assert rank0.broadcast_obj(None, src=1, timeout=5) == BIG[::-1]
    assert _segments_of(os.getpid()) == [name]
    assert rank1._values.segments._count == 1


def test_a_segment_holding_another_value_is_refused(keyed_pair) -> None:
    rank0, rank1 = keyed_pair
    rank1.auth_key = rank0.auth_key = None  # checked without a key too
    rank1.broadcast_obj(BIG, src=1)
    (name,) = _segments_of(os.getpid())
    fd = os.open(Path(spg_segments.SHM_DIR) / name, os.O_RDWR)
    try:
        generation = spg_segments.read_generation(fd)
        os.pwrite(fd, (generation + 7).to_bytes(8, "little"), 8)  # not the value it names
    finally:
        os.close(fd)
    with pytest.raises(SharedMemoryError, match=f"segment {name!r} does not hold that value"):
        rank0.broadcast_obj(None, src=1, timeout=5)


# --- reuse of segments ------------------------------------------------------------------------


def _value(round_: int) -> bytes:
    return bytes([round_ % 251]) * (300 * 1024 + round_)  # each round differs in size too


def _reuse(rank: int, port: int, world_size: int) -> dict:
    """Rank 0 broadcasts, then sends, a large value a round; it learns each was read first."""
    group = _create(rank, port, world_size)
    group.all_gather_obj(os.getpid())
    ok = []
    for i in range(5):
        got = group.broadcast_obj(_value(i) if rank == 0 else None, src=0)
        if rank:
            ok.append(got == _value(i))
            group.send_obj("read", dst=0)
        else:
            ok.extend(group.recv_obj(r, timeout=10) == "read" for r in range(1, world_size))
    for i in range(5):
        if rank == 0:
            group.send_obj(_value(100 + i), dst=1)
            ok.append(group.recv_obj(1, timeout=10) == "read")
        elif rank == 1:
            ok.append(group.recv_obj(0, timeout=10) == _value(100 + i))
            group.send_obj("read", dst=0)
    created = group._values.segments._count
    files = _segments_of(os.getpid())
    group.barrier(timeout=10)
    return {"ok": ok, "created": created, "files": files, "pid": os.getpid()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_read_segment_is_written_over(world_size: int) -> None:
    results = run_ranks(_reuse, world_size, free_port(), world_size, timeout=60)
    for result in results:
        assert result["ok"] and all(result["ok"]), result
    # Ten large values from rank 0, one segment: each round found the last one read.
    assert results[0]["created"] == 1
    assert len(results[0]["files"]) == 1
    assert all(r["created"] == 0 for r in results[1:])
    assert _files_of(*(r["pid"] for r in results)) == []


def _flood(rank: int, port: int) -> dict:
    """Rank 0 sends more large values than its pool holds before rank 1 reads any."""
    group = _create(rank, port, 2)
    pids = group.all_gather_obj(os.getpid())
    count = spg_segments.POOL_SIZE + 2
    result: dict = {"pids": pids}
    if rank == 0:
        for i in range(count):
            group.send_obj(_value(i), dst=1)
        result["created"] = group._values.segments._count
    group.barrier(timeout=10)  # all sent before any is read
    if rank == 1:
        result["ok"] = [group.recv_obj(0, timeout=20) == _value(i) for i in range(count)]
    group.barrier(timeout=10)  # all read
    if rank == 0:
        result["after_read"] = _segments_of(os.getpid())
    group.barrier(timeout=10)
    return result


def test_one_shot_segments_when_the_pool_is_full() -> None:
    results = run_ranks(_flood, 2, free_port(), timeout=60)
    sender, receiver = results
    assert receiver["ok"] and all(receiver["ok"])
    assert sender["created"] == spg_segments.POOL_SIZE + 2
    # The one-shot segments were unlinked by their reader; the pooled ones wait for reuse.
    assert len(sender["after_read"]) == spg_segments.POOL_SIZE
    assert _files_of(*sender["pids"]) == []


def _with_a_limit(rank: int, limit: str) -> dict:
    """Write a large value where no segment can be written (``files``: none may grow past
    128 KiB, as with /dev/shm full) or created (``descriptors``: no file can be opened)."""
    import pickle
    import resource

    payload = pickle.dumps(BIG, protocol=5)
    owner = spg_segments.SegmentOwner(2)
    which = resource.RLIMIT_FSIZE if limit == "files" else resource.RLIMIT_NOFILE
    soft, hard = resource.getrlimit(which)
    if limit == "files":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG instead
        resource.setrlimit(which, (128 * 1024, hard))
    else:
        lowest_free = os.open(os.devnull, os.O_RDONLY)  # open takes the lowest free number
        os.close(lowest_free)
        resource.setrlimit(which, (lowest_free, hard))
    try:
        spilled = spg_shm.dump(BIG, owner, False, [1])
        copied = spg_shm.dump(None, owner, False, [1], pickled=payload)
    finally:
        resource.setrlimit(which, (soft, hard))
    return {
        "spilled": pickle.loads(spilled) == BIG,
        "copied": pickle.loads(copied) == BIG,
        "left": _files_of(os.getpid()),
    }


@pytest.mark.parametrize("limit", ["files", "descriptors"])
def test_a_value_that_cannot_go_to_shared_memory_goes_in_the_store(limit: str) -> None:
    (result,) = run_ranks(_with_a_limit, 1, limit, timeout=60)
    assert result["spilled"] and result["copied"], result
    assert result["left"] == []  # what was created is gone
