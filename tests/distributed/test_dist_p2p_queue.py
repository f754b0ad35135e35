"""Point-to-point objects and barrier messages travel on store queues, in order, popped once."""

from __future__ import annotations

import datetime
import time

import pytest
from torch.distributed import TCPStore

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg import p2p as spg_p2p
from bridge_py.distributed.spg.store_transport import Mailbox
from tests.distributed.harness import TRANSPORTS, free_port, run_ranks, use_transport


def _store() -> TCPStore:
    """A store served in this process (HashStore's blocking pops misbehave after a timeout)."""
    return TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )


def _group(rank: int, store: TCPStore, world_size: int = 2) -> StatelessProcessGroup:
    return StatelessProcessGroup(rank=rank, world_size=world_size, store=store, socket=None)


def test_sends_are_queued_per_pair_and_receiving_removes_them() -> None:
    store = _store()
    rank0, rank1 = _group(0, store), _group(1, store)
    for i in range(3):
        rank1.send_obj({"i": i}, dst=0)
    assert store.queue_len(keys.p2p_queue(1, 0)) == 3
    assert store.num_keys() == 0  # no key per object
    assert [rank0.recv_obj(1, timeout=5) for _ in range(3)] == [{"i": i} for i in range(3)]
    assert store.queue_len(keys.p2p_queue(1, 0)) == 0
    assert store.num_keys() == 0
    assert [key for key, _ in rank1.entries] == [keys.p2p_value(1, 0, i) for i in range(3)]


def test_items_out_of_turn_are_set_aside_and_stale_ones_skipped() -> None:
    store = _store()
    inbox = spg_p2p.Inbox(store, 0, 2)
    queue = keys.p2p_queue(1, 0)
    for seq in (2, 0, 1):  # 2 before its turn; 0 then 1 in turn
        store.queue_push(queue, spg_p2p.frame(seq, b"v%d" % seq))
    assert bytes(inbox.receive(1, 1, 5.0)) == b"v1"  # 2 set aside, 0 (stale) skipped
    assert bytes(inbox.receive(1, 2, 5.0)) == b"v2"  # from the set-aside items
    started = time.monotonic()
    assert inbox.receive(1, 3, 0.3) is None  # nothing queued: None once the limit is up
    assert time.monotonic() - started < 5


def test_drop_removes_an_unreceived_message_and_keeps_later_ones_in_order() -> None:
    store = _store()
    queue = keys.p2p_queue(0, 1)
    for seq in range(4):
        store.queue_push(queue, spg_p2p.frame(seq, b"v%d" % seq))
    spg_p2p.drop(store, queue, 0, sent=4)  # message 0 is at the front: removed
    assert store.queue_len(queue) == 3
    inbox = spg_p2p.Inbox(store, 1, 2)
    assert bytes(inbox.receive(0, 1, 5.0)) == b"v1"  # received: 2 and 3 wait
    spg_p2p.drop(store, queue, 1, sent=4)  # already gone: 2 and 3 stay, in their order
    assert store.queue_len(queue) == 2
    assert bytes(inbox.receive(0, 2, 5.0)) == b"v2" and not inbox._early
    assert bytes(inbox.receive(0, 3, 5.0)) == b"v3"


def _timeout_on_main(rank: int, port: int) -> str:
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=30)
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"timed out .* waiting for 'p2p/0/1/0'"):
            group.recv_obj(0, timeout=0.5)
    group.barrier(timeout=10)  # the connection that timed out still works
    if rank == 0:
        group.send_obj("late", dst=1)
    else:
        assert group.recv_obj(0, timeout=10) == "late"
    group.barrier(timeout=10)
    return "ok"


def test_a_timed_out_receive_leaves_the_group_usable() -> None:
    assert run_ranks(_timeout_on_main, 2, free_port(), timeout=60) == ["ok", "ok"]


def test_barrier_messages_of_later_barriers_are_kept_and_earlier_ones_dropped() -> None:
    store = _store()
    rank0, rank1 = Mailbox(store, 0), Mailbox(store, 1)
    rank1.send(0, 3, 2)  # barrier 3, left over from a barrier that failed
    rank1.send(0, 5, 4, b"verdict of 5")  # barrier 5, sent before rank 0 got there
    rank1.send(0, 4, 2)
    assert rank0.receive(4, time.monotonic() + 5) == (2, 1, b"")
    assert rank0.receive(5, time.monotonic() + 5) == (4, 1, b"verdict of 5")
    assert rank0.receive(5, time.monotonic() + 0.2) is None
    assert store.queue_len(keys.barrier_queue(0)) == 0


def _two_rank_gathers(rank: int, port: int, transport: str) -> dict:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=30)
    big = bytes([rank + 1]) * (300 * 1024)  # over the shared-memory threshold
    gathered = [group.all_gather_obj((rank, i)) for i in range(3)] + [group.all_gather_obj(big)]
    gathered.append(group.all_gather_obj("last"))
    group.barrier(timeout=10)
    # Only rank 0 (the store's server) reads it after the last barrier: rank 1 could race
    # its exit.
    return {
        "gathered": gathered,
        "keys": sorted(group.store.list_keys()) if rank == 0 else None,
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_ranks_gather_small_and_large_values_and_leave_no_key(transport: str) -> None:
    results = run_ranks(_two_rank_gathers, 2, free_port(), transport, timeout=60)
    big = [bytes([r + 1]) * (300 * 1024) for r in range(2)]
    expected = [[(0, i), (1, i)] for i in range(3)] + [big, ["last", "last"]]
    assert all(result["gathered"] == expected for result in results)
    assert results[0]["keys"] == ["join/count", "join/done"]  # every value deleted
