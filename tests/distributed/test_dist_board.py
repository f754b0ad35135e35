"""all_gather_obj over shared-memory boards and doorbells (spg_board), real processes.

Ranks on one node without an auth key gather through boards once they know where the others
run (after the first all_gather or barrier): these tests check that the store is not used
then, that values of every size arrive (inline, in a segment, in the store), that a rank that
exits or never comes is reported, and that nothing is left in /dev/shm.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import resource
import signal
import time
from collections.abc import Callable

import pytest
from torch.distributed import HashStore

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.shm import segments as spg_segments
from bridge_py.distributed.spg import board as spg_board
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg import values as spg_shm
from tests.distributed.harness import free_port, late_barrier, run_ranks, transport_of


def _create(rank: int, port: int, world_size: int, timeout: int = 30) -> StatelessProcessGroup:
    return StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=timeout)


def _files_of(*pids: int) -> list[str]:
    names = os.listdir(spg_segments.SHM_DIR)
    return sorted(n for n in names for p in pids if f"_{p}_" in n and n.startswith("vbspg_"))


def _error_of(operation: Callable[[], object]) -> dict:
    """``{"error": message, "elapsed": seconds}`` of an operation that should fail."""
    start = time.monotonic()
    try:
        operation()
    except RuntimeError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None}


def _gathers(rank: int, port: int, world_size: int) -> dict:
    group = _create(rank, port, world_size)
    pids = group.all_gather_obj(os.getpid())
    assert transport_of(group) == "shm", "all ranks are on this node: boards expected"
    # The gathers below do not touch the store: give the group an empty one, where a value
    # written would show and a value waited for would never come.
    store, empty = group.store, HashStore()
    empty.set_timeout(datetime.timedelta(seconds=5))
    group.store = empty
    ok = []
    for step in range(50):
        value = {"rank": rank, "step": step, "pad": "x" * (step * 997)}
        got = group.all_gather_obj(value)
        expected = [{"rank": r, "step": step, "pad": "x" * (step * 997)} for r in range(world_size)]
        ok.append(got == expected)
    group.store = store
    names_left = [n for n in _files_of(os.getpid()) if n.endswith(("_board", "_bell"))]
    group.barrier(timeout=10)
    return {
        "ok": ok,
        "keys": empty.num_keys(),
        "names_left": names_left,
        "send": group.broadcast_send_counter,
        "recv": dict(group.broadcast_recv_src_counter),
        "pids": pids,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathers_on_one_node_go_over_boards(world_size: int) -> None:
    results = run_ranks(_gathers, world_size, free_port(), world_size, timeout=90)
    for rank, result in enumerate(results):
        assert all(result["ok"])
        assert result["keys"] == 0  # not one key written by a gather
        assert result["names_left"] == []  # unlinked once every rank had opened them
        # The counters advance as vLLM's: one broadcast from every rank per gather.
        assert result["send"] == 51
        assert result["recv"] == {src: 0 if src == rank else 51 for src in range(world_size)}
    assert _files_of(*results[0]["pids"]) == []


def _sizes(rank: int, port: int) -> dict:
    # Pickles up to 4 MiB stay out of segments, so those over a slot's capacity go to the
    # store; the second group spills them into segments as usual.
    os.environ[spg_shm.THRESHOLD_ENV_VAR] = str(4 << 20)
    group = _create(rank, port, 3)
    group.all_gather_obj(None)
    big = bytes([rank]) * (spg_board.MESSAGE_CAPACITY + 1000)
    got = group.all_gather_obj(big)  # this rank's broadcast 1
    ok = [got == [bytes([r]) * (spg_board.MESSAGE_CAPACITY + 1000) for r in range(3)]]
    overflow = group.store.check([keys.broadcast_value(rank, 1)])
    got = group.all_gather_obj(rank)  # the store key of the last gather goes now
    ok.append(got == [0, 1, 2])
    group.barrier(timeout=10)
    gone = not group.store.check([keys.broadcast_value(rank, 1)])
    group.barrier(timeout=10)
    return {"ok": ok, "overflow": overflow, "gone": gone}


def test_a_value_too_large_for_the_board_goes_through_the_store() -> None:
    results = run_ranks(_sizes, 3, free_port(), timeout=90)
    for result in results:
        assert all(result["ok"]), result
        assert result["overflow"] and result["gone"], result


def _exits(rank: int, port: int) -> dict:
    group = _create(rank, port, 3, timeout=60)
    group.all_gather_obj(os.getpid())
    group.all_gather_obj(rank)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _error_of(lambda: group.all_gather_obj(rank))


def _with_rank_2_killed(target: Callable[[int, int], dict]) -> list[dict]:
    """Ranks 0 and 1 of ``target`` under the harness, rank 2 beside them: it kills itself."""
    port = free_port()
    ctx = multiprocessing.get_context("forkserver")
    victim = ctx.Process(target=target, args=(2, port), daemon=True)
    victim.start()
    try:
        results = run_ranks(target, 3, port, ranks=[0, 1], timeout=60)
    finally:
        victim.join(10)
        if victim.is_alive():
            victim.kill()
    assert victim.exitcode == -signal.SIGKILL
    return results


def test_a_rank_that_exits_is_reported_before_the_timeout() -> None:
    results = _with_rank_2_killed(_exits)
    for rank, result in enumerate(results):
        assert result["error"] is not None
        assert f"all_gather_obj on rank {rank}: ranks [2] exited" in result["error"]
        assert result["elapsed"] < 10  # the store's timeout is 60 s


def _late(rank: int, port: int) -> dict:
    group = _create(rank, port, 2, timeout=2)
    group.all_gather_obj(None)
    if rank == 1:
        time.sleep(6)  # does not gather; rank 0 gives up after 2 s
        return {"error": None}
    return _error_of(lambda: group.all_gather_obj(rank))


def test_the_store_timeout_bounds_a_board_gather() -> None:
    result = run_ranks(_late, 2, free_port(), timeout=60)[0]
    assert "all_gather_obj on rank 0 timed out after" in result["error"], result
    assert "values of ranks [1]" in result["error"]
    assert 1.5 < result["elapsed"] < 5


def _no_shm(rank: int, port: int, off_rank: int) -> dict:
    if rank == off_rank:
        os.environ[spg_shm.ENV_VAR] = "0"
    group = _create(rank, port, 2)
    got = [group.all_gather_obj((rank, i)) for i in range(5)]
    group.barrier(timeout=10)  # rank 0 serves the store: nobody is still using it after this
    return {
        "boards": transport_of(group) == "shm",
        "ok": got == [[(0, i), (1, i)] for i in range(5)],
    }


def test_boards_need_every_rank() -> None:
    # One rank may not use shared memory: nobody gathers over boards, nobody keeps one.
    for result in run_ranks(_no_shm, 2, free_port(), 1, timeout=60):
        assert result == {"boards": False, "ok": True}


def _messages(rank: int, port: int) -> dict:
    group = _create(rank, port, 2)
    peer = 1 - rank
    assert transport_of(group) == "shm"
    group.send_obj(("early", rank), peer)
    # Both ranks send more than a ring holds before receiving anything (sending never
    # waits), in sizes for a slot, for the store queue, and for a segment.
    sizes = [10, 70_000, 10, 300_000] + [5] * (2 * spg_board.RING)
    for i, size in enumerate(sizes):
        group.send_obj((rank, i, b"x" * size), peer)
    # Nobody receives before both have sent everything, so a full ring must turn some away.
    group.barrier(timeout=20)
    got = [group.recv_obj(peer, timeout=20) for _ in range(len(sizes) + 1)]
    expected = [("early", peer)] + [(peer, i, b"x" * size) for i, size in enumerate(sizes)]
    # A round trip after that: the rings are free again.
    for step in range(20):
        if rank == 0:
            group.send_obj(step, peer)
            back = group.recv_obj(peer, timeout=20)
        else:
            back = group.recv_obj(peer, timeout=20)
            group.send_obj(back, peer)
        assert back == step
    group.barrier(timeout=10)
    left = group.store.queue_len(f"p2p/{peer}/{rank}") if rank == 0 else 0
    left += group.store.queue_len(f"p2p/{rank}/{peer}") if rank == 0 else 0
    group.barrier(timeout=10)
    return {"ok": got == expected, "left": left, "spilled": group._transport._queue_sent[peer]}


def test_messages_over_the_boards_keep_their_order_whichever_way_they_go() -> None:
    for result in run_ranks(_messages, 2, free_port(), timeout=90):
        assert result["ok"]
        assert result["left"] == 0  # every message that took a store queue was received
        assert result["spilled"] >= 2  # the 70 KB one, and those a full ring turned away


def test_a_closing_board_hands_over_its_unreceived_messages() -> None:
    sender, receiver = spg_board.Board(0, 2), spg_board.Board(1, 2)
    try:
        names = [sender.name, receiver.name]
        sender.connect(names)
        receiver.connect(names)
        for number in range(3):
            assert sender.send(1, number, b"m%d" % number)
        assert receiver.take(0, 0) == b"m0"
        receiver.received(0, 1)
        handed: list = []
        sender.close(lambda dst, number, value: handed.append((dst, number, bytes(value))))
        assert handed == [(1, 1, b"m1"), (1, 2, b"m2")]
        assert sender.name not in os.listdir(spg_segments.SHM_DIR)
    finally:
        sender.close()
        receiver.close()


def _barriers(rank: int, port: int, world_size: int) -> dict:
    group = _create(rank, port, world_size, timeout=300)
    group.barrier(timeout=10)  # the probe
    assert transport_of(group) == "shm"
    # Barriers over the boards make no store request (an empty store would show writes and
    # never answer a wait).
    store, empty = group.store, HashStore()
    empty.set_timeout(datetime.timedelta(seconds=5))
    group.store = empty
    for _ in range(30):
        group.barrier(timeout=10)
    group.store = store
    keys = empty.num_keys()
    # A rank that comes late: the others give up after 1 s, all with the same verdict, and
    # the late one learns it at once instead of passing.
    return {"keys": keys, **late_barrier(group, rank == world_size - 1, 2.0, 1.0)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_barriers_over_boards_agree_and_time_out(world_size: int) -> None:
    results = run_ranks(_barriers, world_size, free_port(), world_size, timeout=90)
    verdict = f"in phase 1 (arrival): {world_size - 1} of {world_size} ranks arrived"
    for rank, result in enumerate(results):
        assert result["keys"] == 0
        assert f"barrier 31 failed on rank {rank}: rank " in result["error"], result
        assert "timed out after 1 s " + verdict in result["error"], result
        assert "refused: barrier 31 failed on it" in result["next"], result
        if rank == world_size - 1:
            assert result["elapsed"] < 0.5, result  # learnt the outcome at once
        else:
            assert result["elapsed"] < 2.0, result


def _barrier_exits(rank: int, port: int) -> dict:
    group = _create(rank, port, 3, timeout=60)
    group.barrier(timeout=10)
    group.barrier(timeout=10)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _error_of(lambda: group.barrier(timeout=30))


def test_a_rank_that_exits_fails_a_board_barrier_at_once() -> None:
    results = _with_rank_2_killed(_barrier_exits)
    for rank, result in enumerate(results):
        assert f"barrier 2 failed on rank {rank}: ranks [2] exited" in result["error"], result
        assert result["elapsed"] < 10  # not the barrier's 30 s


def _no_room(rank: int, port: int) -> dict:
    group = _create(rank, port, 2)
    group.all_gather_obj(None)
    board = group._transport.board
    # Writes past the barrier page into a file now fail (EFBIG, as ENOSPC would on a full
    # /dev/shm): every slot lies beyond.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (board.layout.message_at(0, 0), hard))
    try:
        values = [bytes([rank, i]) * 30_000 for i in range(4)]
        gathered = [group.all_gather_obj(v) for v in values]
        peer = 1 - rank
        # Larger than a slot's first page (allocated with the board): the store.
        big = [(rank, i, b"m" * spg_board.PAGE_CAPACITY) for i in range(3)]
        for message in big:
            group.send_obj(message, peer)
        got = [group.recv_obj(peer, timeout=20) for _ in range(3)]
        queued = group._transport._queue_sent[peer]
        # Small values need no new page: they still go on the board.
        group.send_obj((rank, "small"), peer)
        small = group.recv_obj(peer, timeout=20)
        small_gathered = group.all_gather_obj(rank)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    group.barrier(timeout=10)
    expected = [[bytes([r, i]) * 30_000 for r in range(2)] for i in range(4)]
    return {
        "gathered": gathered == expected and small_gathered == [0, 1],
        "messages": got == [(peer, i, b"m" * spg_board.PAGE_CAPACITY) for i in range(3)]
        and small == (peer, "small"),
        "queued": queued,
        "queued after the small one": group._transport._queue_sent[peer],
    }


def test_no_room_on_dev_shm_sends_values_through_the_store() -> None:
    for result in run_ranks(_no_room, 2, free_port(), timeout=60):
        assert result == {
            "gathered": True,
            "messages": True,
            "queued": 3,
            "queued after the small one": 3,
        }


def _broadcasts(rank: int, port: int, world_size: int) -> dict:
    group = _create(rank, port, world_size)
    group.all_gather_obj(None)
    # Small broadcasts from every rank in turn: no store request at all.
    store, empty = group.store, HashStore()
    empty.set_timeout(datetime.timedelta(seconds=5))
    group.store = empty
    ok = [
        group.broadcast_obj((src, i) if rank == src else None, src) == (src, i)
        for i in range(10)
        for src in range(world_size)
    ]
    group.store = store
    # Rank 0 broadcasts more than a ring holds before anyone reads (it never waits), in sizes
    # for a slot, for the store and for a segment; the others read them all afterwards.
    sizes = [10, 70_000, 10, 300_000] + [5] * (2 * spg_board.BROADCAST_RING)
    if rank == 0:
        for i, size in enumerate(sizes):
            group.broadcast_obj((i, b"x" * size), 0)
        got = [(i, b"x" * size) for i, size in enumerate(sizes)]
    else:
        time.sleep(0.5)
        got = [group.broadcast_obj(None, 0) for _ in sizes]
    ok.append(got == [(i, b"x" * size) for i, size in enumerate(sizes)])
    group.barrier(timeout=10)
    keys_left = [k for k in store.list_keys() if k.startswith("bcast/")] if rank == 0 else []
    group.barrier(timeout=10)
    return {"ok": ok, "keys": empty.num_keys(), "left": keys_left}


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcasts_over_boards(world_size: int) -> None:
    for result in run_ranks(_broadcasts, world_size, free_port(), world_size, timeout=90):
        assert all(result["ok"]), result["ok"]
        assert result["keys"] == 0
        assert result["left"] == []  # what took the store was deleted once read


def test_a_forked_child_closing_an_inherited_board_leaves_it_to_its_owner() -> None:
    board = spg_board.Board(0, 2)
    try:
        pid = os.fork()
        if pid == 0:  # the child: close what it inherited, as its exit would
            board.close(lambda *_: os._exit(3))  # a flush here would be a bug
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert board.name in os.listdir(spg_segments.SHM_DIR)  # still the owner's
    finally:
        board.close()
    assert board.name not in os.listdir(spg_segments.SHM_DIR)


def test_a_board_whose_owner_exited_before_we_connected_names_the_rank() -> None:
    # The owner of a doorbell holds it open while its group lives; a rank killed before a
    # peer first connects leaves the files (until someone cleans up) but no reader, and
    # opening the doorbell then fails with ENXIO.
    first, second = spg_board.Board(0, 2), spg_board.Board(1, 2)
    try:
        os.close(second._own_bell)  # what its process's exit does
        second._own_bell = -1
        with pytest.raises(spg_board.BoardError) as info:
            first.connect([first.name, second.name])
        assert "rank 1 has exited" in str(info.value), info.value
        assert first.connect([first.name, second.name], missing_ok=True) == [1]
    finally:
        first.close()
        second.close()
