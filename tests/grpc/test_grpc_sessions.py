"""Sessions over gRPC are issued by the server and bound to a credential: no client
reaches another's handles by naming a session or counting handle numbers."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from bridge_py.client import BridgeError, Client, connect
from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.transports.grpc_sessions import SessionTable, TooManySessions
from tests.grpc.conftest import ROOT, GrpcWorker
from tests.worker.port_client import PortClient

pytestmark = pytest.mark.timeout(120)

_GUESSED = "grpc-" + "0" * 64


def _raw(worker: GrpcWorker, rpc: str, session: str, op: pb.Operation) -> pb.Reply:
    """One RPC with the worker's token and a session of our choosing (a hostile client)."""
    with grpc.insecure_channel(worker.target) as channel:
        stub = channel.unary_unary(
            f"/bridge.BridgeService/{rpc}",
            request_serializer=pb.encode_request,
            response_deserializer=pb.decode_reply,
        )
        return stub(
            pb.Request(id=1, session=session, op=op),
            timeout=10,
            metadata=(("authorization", f"Bearer {worker.token}"),),
        )


def _denied(worker: GrpcWorker, rpc: str, session: str, op: pb.Operation) -> str:
    with pytest.raises(grpc.RpcError) as info:
        _raw(worker, rpc, session, op)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    return info.value.details()


@pytest.fixture(scope="module")
def worker() -> Iterator[GrpcWorker]:
    """A gRPC worker that also serves the port (the BEAM's sessions live there)."""
    worker = GrpcWorker("--stdio")
    yield worker
    worker.stop()


def test_a_second_client_cannot_reach_the_first_clients_objects(worker: GrpcWorker) -> None:
    first = worker.connect()
    counters = [first.create("Counter", 10 * i) for i in range(3)]
    top = max(c._handle for c in counters)
    try:
        with worker.connect() as second:
            assert second.session != first.session
            assert first.session.startswith("grpc-") and len(first.session) >= 5 + 32
            # Naming a session: the default one, a name, a guess. None was issued to it.
            for session in ["", "default", _GUESSED, first.session + "x"]:
                for rpc, op in [
                    ("Call", pb.CallMethod(1, "incr")),
                    ("GetAttribute", pb.GetAttribute(1, "value")),
                    ("Release", pb.ReleaseHandles(list(range(1, top + 1)))),
                    ("ReleaseSession", pb.ReleaseSession()),
                    ("Ping", pb.Ping(b"\xc0")),
                ]:
                    details = _denied(worker, rpc, session, op)
                    assert "OpenSession" in details
            assert "empty (default) session" in _denied(worker, "Ping", "", pb.Ping(b"\xc0"))
            with pytest.raises(BridgeError) as named:
                connect(worker.target, token=worker.token, session="default").ping(1)
            assert named.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(ValueError, match="not empty"):
                Client(worker.target, token=worker.token, session="")

            # Counting handles in its own session: every one is another session's.
            for handle in range(1, top + 1):
                for call in (
                    lambda h=handle: second.attach(h, "Counter").incr(),
                    lambda h=handle: second._request(pb.GetAttribute(h, "value")),
                ):
                    with pytest.raises(BridgeError) as info:
                        call()
                    assert info.value.category == "not_found"
                    # told apart from a free number by nothing, its class not named
                    with pytest.raises(BridgeError) as free:
                        second._request(pb.GetAttribute(handle + 1000, "value"))
                    free_message = free.value.message.replace(str(handle + 1000), str(handle))
                    assert info.value.message == free_message and "Counter" not in free_message
            assert second._request(pb.ReleaseHandles(list(range(1, top + 1)))) == 0
            assert second._request(pb.ReleaseSession()) == 0
        # The first client's objects are all still there.
        assert [c.incr() for c in counters] == [1, 11, 21]
    finally:
        first.close()


def test_an_issued_session_is_refused_with_another_credential(worker: GrpcWorker) -> None:
    elsewhere = GrpcWorker()  # another token
    try:
        with worker.connect() as first:
            counter = first.create("Counter")
            # The id is no key: with another server's token it is refused at the door,
            with pytest.raises(BridgeError) as wrong:
                connect(worker.target, token=elsewhere.token, session=first.session).ping(1)
            assert wrong.value.code == grpc.StatusCode.UNAUTHENTICATED
            # and that server, which did not issue it, refuses it too.
            with pytest.raises(BridgeError) as foreign:
                elsewhere.connect(session=first.session).ping(1)
            assert foreign.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert counter.incr() == 1
    finally:
        elsewhere.stop()


def test_clients_of_one_credential_may_share_an_issued_session(worker: GrpcWorker) -> None:
    with worker.connect() as owner:
        counter = owner.create("Counter", 7)
        with worker.connect(session=owner.session) as sharer:
            assert sharer._request(pb.CallMethod(counter._handle, "incr")) == 8
            sharers = sharer.create("Counter")
        # The sharer released only its own proxies' handles: the session lives on.
        assert counter.incr() == 9
        with pytest.raises(BridgeError) as gone:
            owner.attach(sharers._handle).incr()
        assert gone.value.category == "not_found"


def test_the_beams_sessions_are_not_reachable_over_grpc(worker: GrpcWorker) -> None:
    port = PortClient(proc=worker.proc)
    beam = port.create("Counter", 100, session="beam")
    default = port.create("Counter", 200)
    for session in ["beam", ""]:
        _denied(worker, "Call", session, pb.CallMethod(beam.handle, "incr"))
        _denied(worker, "ReleaseSession", session, pb.ReleaseSession())
    with worker.connect() as client:
        for ref in (beam, default):
            with pytest.raises(BridgeError) as info:
                client.attach(ref.handle).incr()
            assert info.value.category == "not_found"
    assert port.call(beam, "incr", session="beam") == 101
    assert port.call(default, "incr") == 201


def test_open_session_takes_no_session_and_a_ping(worker: GrpcWorker) -> None:
    with pytest.raises(grpc.RpcError) as named:
        _raw(worker, "OpenSession", "mine", pb.Ping(b"\xc0"))
    assert named.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "leave Request.session empty" in named.value.details()
    with pytest.raises(grpc.RpcError) as wrong_op:
        _raw(worker, "OpenSession", "", pb.Describe())
    assert wrong_op.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_object_returned_after_its_session_was_released_is_not_held(
    worker: GrpcWorker,
) -> None:
    # A client closes (ReleaseSession) while another of its threads has a call in
    # flight that returns a new object: the object must go with the session, not stay
    # held in a session nobody can name any more.
    with worker.connect() as probe:
        before = probe.call_function("live_counters")
        client = worker.connect()
        outcome: dict[str, object] = {}

        def late_call() -> None:
            try:
                outcome["value"] = client.call_function("counter_after", 1.5)
            except BridgeError as exc:
                outcome["error"] = exc

        late = threading.Thread(target=late_call)
        late.start()
        deadline = time.monotonic() + 20
        while probe.call_function("live_counters") == before:  # the call has started
            assert time.monotonic() < deadline, "the late call never started"
            time.sleep(0.01)
        client.close()
        late.join(20)
        assert not late.is_alive()
        error = outcome.get("error")  # the close ended the call on the client's side
        assert isinstance(error, BridgeError) and "closed" in str(error), outcome
        # In the worker the call ends later; what it returned must not stay held.
        while probe.call_function("live_counters") != before:
            assert time.monotonic() < deadline, "the late call's object is still held"
            time.sleep(0.05)
        # The session stays closed.
        assert "OpenSession" in _denied(worker, "Call", client.session, pb.CallMethod(1, "incr"))


_NEVER_CLOSED = """
import sys
from bridge_py.client import connect
client = connect(sys.argv[1], token=sys.argv[2])
kept = client.create("Counter")
print(client.session, flush=True)
"""


def test_a_client_never_closed_releases_its_session_when_collected_or_at_exit(
    worker: GrpcWorker,
) -> None:
    # A session lives until its ReleaseSession; a client that was collected unclosed, or
    # was still open when its program ended, used to leave it (and what it held) in the
    # worker until the worker ended.
    client = worker.connect()
    session = client.session
    assert client.ping(1) == 1
    del client
    gc.collect()
    assert "OpenSession" in _denied(worker, "Ping", session, pb.Ping(b"\xc0"))
    ended = subprocess.run(
        [sys.executable, "-c", _NEVER_CLOSED, worker.target, str(worker.token)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    session = ended.stdout.strip()
    assert session.startswith("grpc-")
    assert "OpenSession" in _denied(worker, "Ping", session, pb.Ping(b"\xc0"))


_KILLED = """
import sys, time
from bridge_py.client import connect
client = connect(sys.argv[1], token=sys.argv[2])
kept = client.create("Counter")
print(client.session, flush=True)
time.sleep(60)
"""


def _killed_client(worker: GrpcWorker, while_alive: Callable[[], None]) -> str:
    """Run a client that makes a Counter, call ``while_alive``, kill the client; its
    session."""
    killed = subprocess.Popen(
        [sys.executable, "-c", _KILLED, worker.target, str(worker.token)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert killed.stdout is not None
        session = killed.stdout.readline().strip()
        assert session.startswith("grpc-")
        while_alive()
        return session
    finally:
        killed.kill()
        killed.wait(10)
        killed.stdout.close()  # type: ignore[union-attr]


def test_a_killed_clients_session_expires_and_an_idle_clients_does_not() -> None:
    # A killed client never releases its session; with no request for --session-idle-s
    # seconds the session expires and what it held goes. A live client that is idle
    # longer keeps its session (it pings), and so does one whose call runs longer.
    worker = GrpcWorker("--session-idle-s", "1")
    try:
        with worker.connect() as probe:
            assert probe.idle == 1.0
            before = probe.call_function("live_counters")

            def held() -> None:
                assert probe.call_function("live_counters") == before + 1

            session = _killed_client(worker, held)
            mine = probe.create("Counter", 7)
            time.sleep(3)  # three times the idle time, without a call of ours
            deadline = time.monotonic() + 20
            while probe.call_function("live_counters") != before + 1:  # ours alone
                assert time.monotonic() < deadline, "the killed client's object stays held"
                time.sleep(0.1)
            assert "OpenSession" in _denied(worker, "Ping", session, pb.Ping(b"\xc0"))
            assert mine.incr() == 8
            late = probe.call_function("counter_after", 2.5, 3)  # a call longer than that
            assert late.incr() == 4 and mine.incr() == 9
            # The probe pings meanwhile, so the call above would keep its session anyway.
            # A session that sends nothing else (no pings) is kept by its call in flight.
            opened = _raw(worker, "OpenSession", "", pb.Ping(b"\xc0"))
            bare = PLAIN.decode(opened.value)
            called = _raw(
                worker, "CallFunction", bare, pb.CallFunction("counter_after", PLAIN.encode([2.5]))
            )
            assert called.error is None, called.error
            assert _raw(worker, "Ping", bare, pb.Ping(b"\xc0")).error is None
    finally:
        worker.stop()


def test_a_killed_clients_session_expires_though_no_grpc_request_comes() -> None:
    # After the killed client, only the BEAM's calls come, over the port: the worker
    # still looks for expired sessions, and frees what the killed client held.
    worker = GrpcWorker("--stdio", "--session-idle-s", "1")
    port = PortClient(proc=worker.proc)
    try:
        live = pb.CallFunction("live_counters", PLAIN.encode([]))
        before = port.request(live)

        def held() -> None:
            assert port.request(live) == before + 1

        session = _killed_client(worker, held)
        deadline = time.monotonic() + 20
        while port.request(live) != before:
            assert time.monotonic() < deadline, "the killed client's object stays held"
            time.sleep(0.1)
        assert "OpenSession" in _denied(worker, "Ping", session, pb.Ping(b"\xc0"))
    finally:
        port.stderr.close()
        worker.stop()


def test_the_session_table_binds_each_session_to_its_credential() -> None:
    table = SessionTable(limit=2)
    mine = table.open("token:a")
    assert table.allows(mine, "token:a")
    assert not table.allows(mine, "token:b") and not table.allows("", "token:a")
    assert not table.close(mine, "token:b") and table.allows(mine, "token:a")
    table.open("token:b")
    with pytest.raises(TooManySessions, match="2 open sessions"):
        table.open("token:a")
    assert table.close(mine, "token:a") and not table.allows(mine, "token:a")
    assert table.open("token:a") != mine


def test_requests_in_flight_learn_that_their_session_was_closed() -> None:
    table = SessionTable()
    mine = table.open("token:a")
    assert not table.enter(mine, "token:b") and not table.enter("grpc-other", "token:a")
    assert table.enter(mine, "token:a") and table.enter(mine, "token:a")
    assert not table.leave(mine)  # still open: nothing to release
    assert table.enter(mine, "token:a")
    assert table.close(mine, "token:a")
    assert not table.enter(mine, "token:a")  # closed: no request is admitted
    assert table.leave(mine) and table.leave(mine)  # both release what they left
    assert len(table) == 0


def test_a_session_expires_only_when_idle_with_nothing_in_flight() -> None:
    table = SessionTable(idle=0.05)
    busy, idle = table.open("token:a"), table.open("token:a")
    assert table.enter(busy, "token:a")
    time.sleep(0.1)
    assert table.expired() == [idle]  # the busy one's request keeps it
    assert table.allows(busy, "token:a") and not table.allows(idle, "token:a")
    assert not table.leave(busy)
    time.sleep(0.1)
    assert table.expired() == [busy] and len(table) == 0
    never = SessionTable(idle=0)
    never.open("token:a")
    time.sleep(0.01)
    assert never.expired() == [] and len(never) == 1
    with pytest.raises(ValueError, match="idle time must be >= 0"):
        SessionTable(idle=-1)
