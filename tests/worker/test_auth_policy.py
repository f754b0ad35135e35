"""The operator's auth key wins over a caller's: a real worker, attacked through its exported API.

A worker (``python -m bridge_py.worker``, the shipped export table) runs with the operator's
``VLLM_BRIDGE_AUTH_KEY`` in its environment. The test plays the attacker, a client of the
worker: it serves its own TCPStore, plants an object whose unpickling writes a marker file,
signed with the attacker's own key, and asks the worker to join that store with
``StatelessProcessGroup.create(..., auth_key=<attacker's key>)`` and then to ``recv_obj`` it.
The worker must refuse the foreign key (or, without an explicit key, the foreign signature of
the first value it reads, the attacker's node card)
with a clear error, and the marker must never appear. A worker run with
``VLLM_BRIDGE_REQUIRE_AUTH_KEY=1`` and no key refuses to form groups and queues at all.
"""

from __future__ import annotations

import contextlib
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge_py.distributed import auth
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg import p2p as spg_p2p
from bridge_py.distributed.store import open_store
from bridge_py.worker.codec import RefValue
from tests.worker.port_client import PortClient, WorkerError
from tests.worker.processes import start_worker

pytestmark = pytest.mark.timeout(120)

OPERATOR_KEY = "operator-secret-4f1c9a"
ATTACKER_KEY = "attacker-chosen-77d0e2"
# store.join_group's counter: an attacker serving the store joins as rank 0 by adding to it.
JOIN_COUNT = "join/count"


class Evil:
    """Unpickling this creates ``path``: proof that the attacker's code ran in the worker."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


def _worker(env: dict[str, str], *args: str) -> Iterator[PortClient]:
    """A worker serving the shipped table with ``env`` added to its environment."""
    base = {auth.ENV_VAR: "", auth.REQUIRE_ENV_VAR: "0"}  # nothing inherited from the test
    with tempfile.TemporaryFile() as stderr:
        client = PortClient(proc=start_worker(*args, env={**base, **env}, stderr=stderr))
        try:
            yield client
        finally:
            client.close()


@pytest.fixture(scope="module")
def operated() -> Iterator[PortClient]:
    """A worker whose operator set ``VLLM_BRIDGE_AUTH_KEY``."""
    yield from _worker({auth.ENV_VAR: OPERATOR_KEY})


@pytest.fixture(scope="module", params=["env", "flag"])
def strict(request: pytest.FixtureRequest) -> Iterator[PortClient]:
    """A worker whose operator asked for keys and gave none: ``VLLM_BRIDGE_REQUIRE_AUTH_KEY=1``
    in its environment, or the worker's flag ``--require-auth-key``."""
    if request.param == "env":
        yield from _worker({auth.REQUIRE_ENV_VAR: "1"})
    else:
        yield from _worker({}, "--require-auth-key")


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The attacker's store (rank 0 joined) holding a signed evil object for rank 1.

    Yields the store's port and the marker file the object would create.
    """
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Evil(probe))).close()
    assert probe.exists(), "the attack payload must really run code when unpickled"
    target = tmp_path / "pwned"
    store, sock = open_store("127.0.0.1", 0, 0, 30)
    assert sock is not None
    try:
        store.add(JOIN_COUNT, 1)  # rank 0 (the attacker) has joined; the worker makes two
        # Rank 0's node card, as a group's create() exchanges them: on another machine.
        store.set("node/0", auth.sign(ATTACKER_KEY.encode(), "spg/node/0", b"-"))
        context = "spg/" + keys.p2p_value(0, 1, 0)  # what StatelessProcessGroup's tags bind
        sealed = auth.sign(ATTACKER_KEY.encode(), context, pickle.dumps(Evil(target)))
        store.queue_push(keys.p2p_queue(0, 1), spg_p2p.frame(0, sealed))
        yield sock.getsockname()[1], target
    finally:
        del store
        sock.close()


def _no_key_in(error: WorkerError) -> None:
    text = error.error.message + error.error.traceback
    for key in (OPERATOR_KEY, ATTACKER_KEY):
        assert key not in text, "an error message must never carry a key"


def test_a_callers_own_key_is_refused_and_nothing_is_unpickled(
    operated: PortClient, planted: tuple[int, Path]
) -> None:
    port, target = planted
    refused: WorkerError | None = None
    try:
        group = operated.function(
            "StatelessProcessGroup.create", "127.0.0.1", port, 1, 2,
            store_timeout=10, auth_key=ATTACKER_KEY,
        )  # fmt: skip
    except WorkerError as exc:
        refused = exc
    else:  # the key was accepted: the attack goes on, as a real attacker's would
        assert isinstance(group, RefValue)
        with contextlib.suppress(WorkerError):
            operated.call(group, "recv_obj", 0, timeout=10)
    assert not target.exists(), "the worker unpickled the attacker's object"
    assert refused is not None, "the worker accepted an auth_key that is not the operator's"
    message = refused.error.message
    assert "refused auth_key" in message and auth.ENV_VAR in message, message
    assert refused.error.python_type.endswith("AuthenticationError"), refused.error
    _no_key_in(refused)
    # The same key as the operator's, given explicitly, is accepted (a group of one).
    alone = operated.function(
        "StatelessProcessGroup.create", "127.0.0.1", 0, 0, 1, store_timeout=10,
        auth_key=OPERATOR_KEY,
    )  # fmt: skip
    assert operated.call(alone, "broadcast_obj", "fine", 0) == "fine"


def test_with_the_operators_key_a_foreign_signature_is_never_unpickled(
    operated: PortClient, planted: tuple[int, Path]
) -> None:
    port, target = planted
    # The attacker's first signed value is its node card, exchanged in create: refused there.
    with pytest.raises(WorkerError) as info:
        operated.function("StatelessProcessGroup.create", "127.0.0.1", port, 1, 2, store_timeout=10)
    message = info.value.error.message
    assert "refused the node card 'node/0' of rank 0" in message, message
    assert "HMAC does not match" in message, message
    assert info.value.error.python_type.endswith("AuthenticationError"), info.value.error
    assert not target.exists(), "the worker unpickled the attacker's object"
    _no_key_in(info.value)


def test_require_auth_key_refuses_groups_and_queues_without_one(strict: PortClient) -> None:
    with pytest.raises(WorkerError) as info:
        strict.function("StatelessProcessGroup.create", "127.0.0.1", 0, 0, 1, store_timeout=10)
    message = info.value.error.message
    assert auth.REQUIRE_ENV_VAR in message and auth.ENV_VAR in message, message
    assert "auth_key" in message, message
    with pytest.raises(WorkerError, match=auth.REQUIRE_ENV_VAR):
        strict.create("MessageQueue", 1, 1, max_chunk_bytes=4096, max_chunks=2)
    # With a key the operator's switch is satisfied.
    group = strict.function(
        "StatelessProcessGroup.create", "127.0.0.1", 0, 0, 1, store_timeout=10,
        auth_key="a key of the caller's",
    )  # fmt: skip
    assert strict.call(group, "broadcast_obj", [1], 0) == [1]
