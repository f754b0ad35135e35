"""The operator's key policy: its ``VLLM_BRIDGE_AUTH_KEY`` wins, ``..._REQUIRE_AUTH_KEY`` refuses.

Every place that accepts a key goes through ``auth.resolve_key``; these tests call each of
them (StatelessProcessGroup.create, its ``auth_key`` setter and constructor, MessageQueue's
constructor and both of its factories) with a key other than the
operator's, and without any key under the require switch (GroupCoordinator, which takes
its key from the environment only, under the switch). Real stores, queues and gloo groups;
the worker-level attack is in tests/worker/test_auth_policy.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bridge_py.distributed import StatelessProcessGroup, auth
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from tests.distributed.harness import free_port, run_ranks

pytestmark = pytest.mark.timeout(60)

OPERATOR = "operator-key-31f0"
OTHER = b"caller-key-9a2e"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    monkeypatch.delenv(auth.REQUIRE_ENV_VAR, raising=False)


@pytest.fixture
def writer() -> Iterator[MessageQueue]:
    """A queue made before any policy is set (its handle is what readers are given)."""
    queue = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, auth_key=OPERATOR)
    yield queue
    queue.close()


def _refusals(writer: MessageQueue) -> dict[str, Callable[[Any], Any]]:
    """Every way to hand over a key, each a function of the key (None: no explicit key)."""
    served = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=5, auth_key=OPERATOR)

    def setter(key: Any) -> None:
        served.auth_key = key

    return {
        "create": lambda key: StatelessProcessGroup.create(
            "127.0.0.1", 0, 0, 1, store_timeout=5, auth_key=key
        ),
        "setter": setter,
        "MessageQueue": lambda key: MessageQueue(
            1, 1, max_chunk_bytes=4096, max_chunks=2, auth_key=key
        ),
        "create_from_handle": lambda key: MessageQueue.create_from_handle(
            writer.export_handle(), 0, auth_key=key
        ),
        "create_from_process_group": lambda key: MessageQueue.create_from_process_group(
            served, 4096, 2, auth_key=key
        ),
    }


def _close(made: Any) -> None:
    with contextlib.suppress(Exception):
        if isinstance(made, MessageQueue):
            made.close()
        elif isinstance(made, StatelessProcessGroup) and made.socket is not None:
            made.socket.close()


def test_resolve_key_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert auth.resolve_key(None) is None and auth.resolve_key(OTHER) == OTHER
    monkeypatch.setenv(auth.ENV_VAR, OPERATOR)
    assert auth.resolve_key(None) == OPERATOR.encode()
    assert auth.resolve_key(OPERATOR) == auth.resolve_key(bytearray(OPERATOR.encode()))
    with pytest.raises(AuthenticationError) as info:
        auth.resolve_key(OTHER, param="the_key")
    message = str(info.value)
    assert "refused the_key" in message and auth.ENV_VAR in message
    assert OPERATOR not in message and OTHER.decode() not in message
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="empty"):
        auth.resolve_key(b"")  # a mistake is still reported as one
    monkeypatch.delenv(auth.ENV_VAR)
    for value, required in [("1", True), ("yes", True), ("TRUE", True), ("2", True),
                            ("", False), ("0", False), ("off", False), ("No", False)]:  # fmt: skip
        monkeypatch.setenv(auth.REQUIRE_ENV_VAR, value)
        assert auth.key_required() is required, value
    monkeypatch.setenv(auth.REQUIRE_ENV_VAR, "1")
    with pytest.raises(AuthenticationError) as info:
        auth.resolve_key(None)
    assert auth.REQUIRE_ENV_VAR in str(info.value) and auth.ENV_VAR in str(info.value)
    assert auth.resolve_key(OTHER) == OTHER  # any explicit key satisfies the switch
    monkeypatch.setenv(auth.ENV_VAR, OPERATOR)
    assert auth.resolve_key(None) == OPERATOR.encode()  # and so does the operator's


def test_every_entry_point_refuses_a_key_other_than_the_operators(
    writer: MessageQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusals = _refusals(writer)
    monkeypatch.setenv(auth.ENV_VAR, OPERATOR)
    for name, attempt in refusals.items():
        with pytest.raises(AuthenticationError) as info:
            _close(attempt(OTHER))
        message = str(info.value)
        assert "refused auth_key:" in message and auth.ENV_VAR in message, (name, message)
        assert OPERATOR not in message and OTHER.decode() not in message, name
    # The operator's key, given explicitly or not at all, is accepted everywhere.
    for name, attempt in refusals.items():
        if name == "create_from_process_group":
            continue  # a queue of one rank has no reader; checked across ranks elsewhere
        for key in (OPERATOR, None):
            _close(attempt(key))


def test_require_auth_key_refuses_every_keyless_entry_point(
    writer: MessageQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusals = _refusals(writer)
    store_group = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=5)
    monkeypatch.setenv(auth.REQUIRE_ENV_VAR, "1")
    refusals["constructor"] = lambda key: StatelessProcessGroup(
        rank=0, world_size=1, store=store_group.store, socket=None
    )
    for name, attempt in refusals.items():
        with pytest.raises(AuthenticationError, match=auth.REQUIRE_ENV_VAR):
            _close(attempt(None))
            pytest.fail(f"{name} made something without a key")
    # An explicit key satisfies it: create keeps the key it was given.
    group = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=5, auth_key=OTHER)
    assert group.auth_key == OTHER and group.broadcast_obj(3, 0) == 3
    _close(group)
    _close(store_group)


def _coordinator_policy(rank: int, port: int) -> list[str]:
    """In a fresh process: a GroupCoordinator under the require switch, without and with a key."""
    import datetime

    import torch.distributed as dist

    from bridge_py.distributed.parallel_state import GroupCoordinator

    os.environ.pop(auth.ENV_VAR, None)
    os.environ[auth.REQUIRE_ENV_VAR] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    seen = []
    try:
        GroupCoordinator([[0]], 0, "gloo", False, group_name="strict")
    except AuthenticationError as exc:
        seen.append(str(exc))
    os.environ[auth.ENV_VAR] = OPERATOR
    group = GroupCoordinator([[0]], 0, "gloo", False, group_name="strict")
    seen.append(str(group.broadcast_object("fine")))
    group.destroy()
    dist.destroy_process_group()
    return seen


def test_require_auth_key_refuses_a_keyless_group_coordinator() -> None:
    (seen,) = run_ranks(_coordinator_policy, 1, free_port(), timeout=60)
    assert len(seen) == 2, seen
    assert auth.REQUIRE_ENV_VAR in seen[0] and auth.ENV_VAR in seen[0]
    assert seen[1] == "fine"
