"""Authenticated values: with a shared key nothing forged, foreign or replayed is unpickled.

Most tests run in this process: two ``StatelessProcessGroup`` objects (ranks 0 and 1) over one
real TCPStore, and an "attacker" writing raw bytes into the same store. The payload used for
the attacks creates a file when it is unpickled (a ``__reduce__`` that calls ``open``), and
the tests check that the file never appears. One test runs real processes: a 3-rank group and
message queues (shared memory and TCP) with keys given by argument and by environment.
"""

from __future__ import annotations

import hmac
import os
import pickle
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge_py.distributed import StatelessProcessGroup, auth
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg import p2p as spg_p2p
from tests.distributed.harness import free_port, run_ranks

KEY = b"k" * 32
OTHER_KEY = b"o" * 32

pytestmark = pytest.mark.timeout(60)


class Evil:
    """Unpickling this creates ``path``: proof that code from the bytes ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_VAR, raising=False)


@pytest.fixture
def evil(tmp_path: Path) -> tuple[bytes, Path]:
    """The pickle of an :class:`Evil`, and the file it would create; checks it is live."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Evil(probe))).close()
    assert probe.exists(), "the attack payload must really run code when unpickled"
    target = tmp_path / "pwned"
    return pickle.dumps(Evil(target)), target


@pytest.fixture
def pair() -> Iterator[tuple[StatelessProcessGroup, StatelessProcessGroup]]:
    """Ranks 0 and 1 of a 2-rank group, in this process, over one real TCPStore."""
    served = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=10)
    rank0 = StatelessProcessGroup(rank=0, world_size=2, store=served.store, socket=None)
    rank1 = StatelessProcessGroup(rank=1, world_size=2, store=served.store, socket=None)
    yield rank0, rank1
    served.socket.close()


# --- the MAC itself -------------------------------------------------------------------------


def test_tag_format_and_checks() -> None:
    sealed = auth.sign(KEY, "ctx", b"payload")
    assert sealed[:4] == auth.MAGIC and len(sealed) == 4 + auth.TAG_BYTES + len(b"payload")
    assert bytes(auth.verify(KEY, "ctx", sealed, "v")) == b"payload"
    flipped = bytearray(sealed)
    flipped[-1] ^= 1
    bad_tag = bytearray(sealed)
    bad_tag[5] ^= 1
    for data, key, context in [
        (sealed, OTHER_KEY, "ctx"),  # another key
        (sealed, KEY, "ctx2"),  # replayed elsewhere
        (bytes(flipped), KEY, "ctx"),  # tampered payload
        (bytes(bad_tag), KEY, "ctx"),  # tampered tag
        (b"payload", KEY, "ctx"),  # no tag
        (sealed[:10], KEY, "ctx"),  # truncated
    ]:
        with pytest.raises(AuthenticationError, match="refused v"):
            auth.verify(key, context, data, "v")
    # Contexts are length-prefixed: moving bytes between context and payload changes the tag.
    assert auth.sign(KEY, "ab", b"c")[4:36] != auth.sign(KEY, "a", b"bc")[4:36]


def test_tags_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    auth.verify(KEY, "c", auth.sign(KEY, "c", b"x"), "v")
    assert len(calls) == 1 and len(calls[0][0]) == auth.TAG_BYTES


def test_keys_from_argument_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert auth.resolve_key(None) is None
    assert auth.resolve_key("clé") == "clé".encode()
    assert auth.resolve_key(bytearray(b"b")) == b"b"
    with pytest.raises(ValueError, match="empty"):
        auth.resolve_key(b"")
    with pytest.raises(TypeError):
        auth.resolve_key(123)  # type: ignore[arg-type]
    monkeypatch.setenv(auth.ENV_VAR, "")
    assert auth.resolve_key(None) is None
    monkeypatch.setenv(auth.ENV_VAR, "from-env")
    assert auth.resolve_key(None) == b"from-env"
    assert auth.resolve_key(b"from-env") == b"from-env"  # the operator's key, given again
    with pytest.raises(AuthenticationError, match="differs from the operator's key"):
        auth.resolve_key(b"explicit")  # any other is refused (see test_dist_auth_policy.py)
    with pytest.raises(ValueError, match="empty"):
        StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=5, auth_key="")


# --- StatelessProcessGroup ------------------------------------------------------------------


def _take(store, src: int, dst: int) -> bytes:
    """The stored value of the next object queued from ``src`` to ``dst``, taken off the queue."""
    return spg_p2p.unframe(store.queue_pop(keys.p2p_queue(src, dst), False))[1].tobytes()


def _put(store, src: int, dst: int, seq: int, value: bytes) -> None:
    """Queue ``value`` as object number ``seq`` from ``src`` to ``dst``, as send_obj does."""
    store.queue_push(keys.p2p_queue(src, dst), spg_p2p.frame(seq, value))


def test_without_a_key_values_are_plain_pickles(pair) -> None:
    rank0, rank1 = pair
    assert rank0.auth_key is None
    rank1.send_obj({"a": 1}, dst=0)
    stored = _take(rank0.store, 1, 0)
    assert pickle.loads(stored) == {"a": 1}
    _put(rank0.store, 1, 0, 0, stored)
    assert rank0.recv_obj(1) == {"a": 1}


def test_keyed_values_round_trip_and_are_tagged(pair) -> None:
    rank0, rank1 = pair
    rank0.auth_key = rank1.auth_key = KEY
    rank1.send_obj([1, "two"], dst=0)
    stored = _take(rank0.store, 1, 0)
    assert stored.startswith(auth.MAGIC)
    _put(rank0.store, 1, 0, 0, stored)
    assert rank0.recv_obj(1, timeout=5) == [1, "two"]
    assert rank1.broadcast_obj("b", src=1) == "b"
    assert rank0.broadcast_obj(None, src=1, timeout=5) == "b"


def test_forged_values_are_refused_before_unpickling(pair, evil) -> None:
    rank0, rank1 = pair
    rank0.auth_key = rank1.auth_key = KEY
    payload, target = evil
    store = rank0.store
    attempts = {
        "no tag": payload,
        "wrong key": auth.sign(OTHER_KEY, "spg/" + keys.p2p_value(1, 0, 1), payload),
        # A genuine tag for this very key, in front of another payload.
        "tampered": auth.sign(KEY, "spg/" + keys.p2p_value(1, 0, 2), b"benign")[:36] + payload,
    }
    for seq, (label, data) in enumerate(attempts.items()):
        key = keys.p2p_value(1, 0, seq)
        _put(store, 1, 0, seq, data)
        with pytest.raises(AuthenticationError) as info:
            rank0.recv_obj(1, timeout=5)
        message = str(info.value)
        assert f"message {key!r} from rank 1" in message, label
        assert "refused" in message, label
        assert not target.exists(), label
    # The refused values were consumed: the next genuine one still arrives.
    rank1.send_dst_counter[0] = len(attempts)
    rank1.send_obj("genuine", dst=0)
    assert rank0.recv_obj(1, timeout=5) == "genuine"
    # Broadcasts are checked too, naming their key and sender.
    store.set(keys.broadcast_value(1, 0), payload)
    with pytest.raises(AuthenticationError, match=r"key 'bcast/1/0' from rank 1"):
        rank0.broadcast_obj(None, src=1, timeout=5)
    assert not target.exists()


def test_a_genuine_value_replayed_under_another_key_is_refused(pair) -> None:
    rank0, rank1 = pair
    rank0.auth_key = rank1.auth_key = KEY
    rank1.send_obj("pay 1 coin", dst=0)
    genuine = _take(rank0.store, 1, 0)
    _put(rank0.store, 1, 0, 0, genuine)
    assert rank0.recv_obj(1, timeout=5) == "pay 1 coin"
    _put(rank0.store, 1, 0, 1, genuine)  # the next position of the same pair
    _put(rank0.store, 0, 0, 0, genuine)  # another pair
    rank0.store.set(keys.broadcast_value(1, 0), genuine)
    with pytest.raises(AuthenticationError, match="p2p/1/0/1"):
        rank0.recv_obj(1, timeout=5)  # next sequence number
    with pytest.raises(AuthenticationError, match="from rank 0"):
        rank0.recv_obj(0, timeout=5)  # as if another rank sent it
    with pytest.raises(AuthenticationError, match="bcast/1/0"):
        rank0.broadcast_obj(None, src=1, timeout=5)  # as a broadcast


def test_mismatched_configuration_is_reported(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    rank0, rank1 = pair
    rank1.auth_key = KEY  # sender has a key, receiver none: refused, not unpickled as garbage
    rank1.send_obj("x", dst=0)
    with pytest.raises(AuthenticationError, match="this side has no auth key"):
        rank0.recv_obj(1, timeout=5)
    rank0.auth_key = KEY  # receiver has a key, sender none
    rank1.auth_key = None
    rank1.send_obj("y", dst=0)
    with pytest.raises(AuthenticationError, match="not authenticated"):
        rank0.recv_obj(1, timeout=5)
    # The environment variable is read by groups made after it is set (and by auth_key = None).
    monkeypatch.setenv(auth.ENV_VAR, KEY.decode())
    rank1.auth_key = None
    assert rank1.auth_key == KEY
    rank1.send_obj("z", dst=0)
    assert rank0.recv_obj(1, timeout=5) == "z"
    fresh = StatelessProcessGroup(rank=0, world_size=2, store=rank0.store, socket=None)
    assert fresh.auth_key == KEY


def test_store_binds_only_the_given_interface() -> None:
    try:
        group = StatelessProcessGroup.create("127.0.0.2", 0, 0, 1, store_timeout=5, auth_key=KEY)
    except RuntimeError as exc:
        pytest.skip(f"127.0.0.2 is not usable here: {exc}")
    port = group.socket.getsockname()[1]
    assert group.socket.getsockname()[0] == "127.0.0.2"
    socket.create_connection(("127.0.0.2", port), timeout=2).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    group.socket.close()


# --- MessageQueue ---------------------------------------------------------------------------


def test_sealed_objects_are_bound_to_their_context() -> None:
    key, other = KEY, OTHER_KEY
    data = auth.seal_object(key, "mq/t/0", {"m": 1})
    assert auth.open_object(key, "mq/t/0", data, "a message") == {"m": 1}
    with pytest.raises(AuthenticationError, match="refused a message"):
        auth.open_object(key, "mq/t/1", data, "a message")
    with pytest.raises(AuthenticationError):
        auth.open_object(other, "mq/t/0", data, "a message")
    plain = auth.seal_object(None, "mq/t/0", 3)
    assert auth.open_object(None, "mq/t/0", plain, "a message") == 3  # no key: a plain pickle
    with pytest.raises(AuthenticationError, match="no auth key"):
        auth.open_object(None, "mq/t/0", data, "a message")  # tagged, and no key to check it


def test_queue_refuses_messages_without_the_key(evil) -> None:
    _payload, target = evil
    writer = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=4, auth_key=KEY)
    good = MessageQueue.create_from_handle(writer.export_handle(), 0, auth_key=KEY)
    wrong = MessageQueue.create_from_handle(writer.export_handle(), 1, auth_key=OTHER_KEY)
    try:
        writer.wait_until_ready(5)
        good.wait_until_ready(5)
        wrong.wait_until_ready(5)
        for message in ("first", b"x" * 10_000):  # one chunk, then several
            writer.enqueue(message, timeout=5)
            assert good.dequeue(timeout=5) == message
            with pytest.raises(AuthenticationError, match="refused message"):
                wrong.dequeue(timeout=5)
    finally:
        for queue in (good, wrong, writer):
            queue.close()

    # A writer without the key (whoever can write the ring) cannot make a keyed reader unpickle.
    forger = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    reader = MessageQueue.create_from_handle(forger.export_handle(), 0, auth_key=KEY)
    try:
        forger.wait_until_ready(5)
        reader.wait_until_ready(5)
        forger.enqueue(Evil(target), timeout=5)
        with pytest.raises(AuthenticationError, match="not authenticated"):
            reader.dequeue(timeout=5)
        assert not target.exists()
    finally:
        reader.close()
        forger.close()


# --- real processes -------------------------------------------------------------------------


def _keyed_group(rank: int, port: int) -> dict:
    # Rank 1 takes the key from the environment, the others by argument.
    if rank == 1:
        os.environ[auth.ENV_VAR] = KEY.decode()
        group = StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=30)
    else:
        group = StatelessProcessGroup.create(
            "127.0.0.1", port, rank, 3, store_timeout=30, auth_key=KEY
        )
    result: dict = {"gathered": group.all_gather_obj(rank * 10)}
    if rank == 0:
        group.send_obj("to 2", dst=2)
    if rank == 2:
        result["p2p"] = group.recv_obj(0, timeout=10)
    result["bcast"] = group.broadcast_obj("from 1" if rank == 1 else None, src=1, timeout=10)
    group.barrier(timeout=10)

    # A queue over the group: the handle exchange and messages are keyed.
    queue = MessageQueue.create_from_process_group(group, 4096, 4, auth_key=KEY)
    result["mq"] = [queue.broadcast_object(i if rank == 0 else None, timeout=10) for i in range(3)]
    group.barrier(timeout=10)
    queue.close()

    # Rank 1 reads shared memory, rank 2 over TCP with the wrong key: it refuses every message.
    if rank == 0:
        writer = MessageQueue(
            2, 1, [1], 4096, 4, "127.0.0.1", remote_reader_ranks=[2], auth_key=KEY
        )
        group.broadcast_obj(writer.export_handle(), src=0)
        writer.wait_until_ready(10)
        for i in range(2):
            writer.enqueue(f"m{i}", timeout=10)
        group.barrier(timeout=10)
        writer.close()
        return result
    handle = group.broadcast_obj(None, src=0, timeout=10)
    reader = MessageQueue.create_from_handle(handle, rank, auth_key=KEY if rank == 1 else OTHER_KEY)
    reader.wait_until_ready(10)
    got = []
    for _ in range(2):
        try:
            got.append(reader.dequeue(timeout=10))
        except AuthenticationError as exc:
            got.append(type(exc).__name__)
    result["remote_or_local"] = got
    group.barrier(timeout=10)
    reader.close()
    return result


def test_keyed_group_and_queues_across_processes() -> None:
    results = run_ranks(_keyed_group, 3, free_port(), timeout=60)
    for result in results:
        assert result["gathered"] == [0, 10, 20]
        assert result["bcast"] == "from 1"
        assert result["mq"] == [0, 1, 2]
    assert results[2]["p2p"] == "to 2"
    assert results[1]["remote_or_local"] == ["m0", "m1"]
    assert results[2]["remote_or_local"] == ["AuthenticationError"] * 2
