"""What anyone who reaches a group's TCPStore can do to it: make operations fail, each with
one clear error within its timeout, and no more.

The store has no authentication (docs/security.md). These tests are that someone: a plain
TCPStore client beside two ranks of a 2-rank group (in this process, over the store
transport, as ranks on several machines use it), writing what no rank writes into the keys
and queues the ranks read. With a key nothing is unpickled (test_dist_auth.py); here the
waits must still end by their timeout without taking a CPU, values that hold nothing must
be refused at once, and what a rank keeps of what it pops must stay bounded.
"""

from __future__ import annotations

import datetime
import resource
import struct
import time
from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore

from bridge_py.distributed import StatelessProcessGroup, auth
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.errors import (
    BarrierFailure,
    DistributedError,
    GroupTimeout,
    ObjectLoadError,
)
from bridge_py.distributed.spg import keys, p2p
from tests.distributed.harness import traced_memory

pytestmark = pytest.mark.timeout(90)

KEY = b"k" * 32


@pytest.fixture(params=[KEY], ids=["keyed"])
def ranks(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[StatelessProcessGroup, TCPStore]]:
    """Rank 1 of a 2-rank group (keyed, unless a test asks for None) whose rank 0 never
    acts, and the attacker's client."""
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    served = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=5)
    rank1 = StatelessProcessGroup(rank=1, world_size=2, store=served.store, socket=None)
    rank1.auth_key = request.param
    attacker = TCPStore(
        "127.0.0.1", served.store.port, None, False, timeout=datetime.timedelta(seconds=10)
    )
    yield rank1, attacker
    served.socket.close()


def _thread_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def test_a_key_that_reads_as_absent_ends_the_wait_at_its_timeout(ranks) -> None:
    # A rank reads a key without waiting by a compare_set with a value no rank writes;
    # a key that holds that value ended every later wait at once, so the wait spun (one
    # CPU) until a round trip happened to outlast its deadline, seconds late.
    rank1, attacker = ranks
    attacker.set(keys.broadcast_value(0, 0), b"\x00absent")
    cpu, start = _thread_cpu(), time.monotonic()
    with pytest.raises(GroupTimeout, match="bcast/0/0"):
        rank1.broadcast_obj(None, 0, timeout=1.0)
    took, used = time.monotonic() - start, _thread_cpu() - cpu
    assert took < 1.5, f"a 1 s wait took {took:.2f} s"
    assert used < 0.2, f"a 1 s wait took {used:.2f} s of CPU"


def test_a_value_that_holds_nothing_is_refused_at_once(ranks) -> None:
    # An all_gather took an empty value for one not written yet, and waited (spinning)
    # for the store's timeout and past it.
    rank1, attacker = ranks
    attacker.set(keys.broadcast_value(0, 0), b"")
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="bcast/0/0"):
        rank1.all_gather_obj("mine")
    assert time.monotonic() - start < 2.0


def test_a_barrier_verdict_that_is_not_text_is_a_barrier_failure(ranks) -> None:
    rank1, attacker = ranks
    failed = struct.pack(">QBI", 0, 4, 0)  # barrier 0, "failed", from rank 0
    attacker.queue_push(keys.barrier_queue(1), failed + b"\xff\xfe")
    with pytest.raises(BarrierFailure, match=r"failed on rank 1: \\xff\\xfe"):
        rank1.barrier(timeout=5)


def test_what_a_rank_keeps_of_pushed_items_is_bounded(ranks) -> None:
    # Items popped before their turn (messages numbered later, messages of later
    # barriers) were all kept for the group's life, whoever pushed them.
    rank1, attacker = ranks
    item = bytes(1 << 20)
    for seq in range(1, 101):  # 100 MiB of messages 1..100; message 0 never comes
        attacker.queue_push(keys.p2p_queue(0, 1), p2p.frame(seq, item))
    later = struct.pack(">QBI", 7, 4, 0) + bytes(10_000)  # barrier 7, "failed"
    for _ in range(3000):
        attacker.queue_push(keys.barrier_queue(1), later)
    with traced_memory() as traced:
        with pytest.raises(GroupTimeout):
            rank1.recv_obj(0, timeout=3.0)
        with pytest.raises(BarrierFailure):
            rank1.barrier(timeout=2.0)
        held = traced()[0]
    assert held < 80 << 20, f"rank 1 keeps {held >> 20} MiB of pushed items"


@pytest.mark.parametrize("ranks", [None], ids=["no key"], indirect=True)
def test_without_a_key_a_value_that_does_not_unpickle_is_named(ranks) -> None:
    # Without a key nothing checks a value before it is unpickled (docs/security.md); what
    # pickle raised came out bare, naming nothing.
    rank1, attacker = ranks
    attacker.queue_push(keys.p2p_queue(0, 1), p2p.frame(0, b"\x80\x05\x95garbage"))
    with pytest.raises(ObjectLoadError, match=r"p2p/0/1/0.* does not unpickle") as info:
        rank1.recv_obj(0, timeout=5.0)
    assert isinstance(info.value, DistributedError) and info.value.__cause__ is not None
