"""StatelessProcessGroup.create: join rendezvous, clear errors, interfaces, IPv6, listen_socket."""

from __future__ import annotations

import errno
import logging
import socket
import time

import pytest

from bridge_py.distributed import StatelessProcessGroup, StoreError
from bridge_py.distributed.spg import group as spg_group
from tests.distributed.harness import free_port, run_ranks


def _join_with_missing_rank(rank: int, port: int) -> dict:
    start = time.monotonic()
    try:
        StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=2)
    except StoreError as exc:
        result = {"error": str(exc), "elapsed": time.monotonic() - start}
    else:
        raise AssertionError("create returned although rank 2 never joined")
    if rank == 0:
        time.sleep(0.2)
        # The failed create stopped serving: another listener can take the port (Linux
        # refuses a second listener on a port, SO_REUSEADDR only skips TIME_WAIT).
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
    return result


def test_create_reports_how_many_ranks_joined() -> None:
    port = free_port()
    results = run_ranks(_join_with_missing_rank, 3, port, ranks=[0, 1])
    assert f"2 of 3 ranks joined 127.0.0.1:{port} within 2 s" in results[0]["error"]
    assert "rank 0 gave up" in results[0]["error"]
    # Rank 1 either times out the same way or, if rank 0 gave up first, loses the store.
    assert (
        f"2 of 3 ranks joined 127.0.0.1:{port}" in results[1]["error"]
        or f"rank 1 lost the store at 127.0.0.1:{port}" in results[1]["error"]
    ), results[1]["error"]
    for result in results:
        assert result["elapsed"] < 4, result


def test_create_reports_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StoreError, match=f"127.0.0.1:{port} is already in use") as info:
            StatelessProcessGroup.create("127.0.0.1", port, 0, 2, store_timeout=1)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EADDRINUSE


def test_create_reports_unreachable_store() -> None:
    with socket.socket() as bound_only:  # bound, never listening: connections are refused
        bound_only.bind(("127.0.0.1", 0))
        port = bound_only.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(StoreError) as info:
            StatelessProcessGroup.create("127.0.0.1", port, 1, 2, store_timeout=1)
    assert time.monotonic() - start < 4
    message = str(info.value)
    assert f"rank 1 could not reach the store at 127.0.0.1:{port} within 1 s" in message
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own error, kept as cause


def test_create_reports_unknown_host() -> None:
    with pytest.raises(StoreError, match=r"cannot resolve the store host 'no-such-host\.invalid'"):
        StatelessProcessGroup.create("no-such-host.invalid", 1234, 1, 2, store_timeout=1)


def _other_local_address() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except socket.gaierror:
        infos = []
    candidates = {info[4][0] for info in infos}
    try:  # the address of the default route's interface (UDP connect sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("198.51.100.1", 9))  # TEST-NET-2
            candidates.add(probe.getsockname()[0])
    except OSError:
        pass
    for address in sorted(candidates):
        if not address.startswith("127.") and address != "0.0.0.0":
            return address
    return None


def test_store_listens_only_on_the_given_interface() -> None:
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    group = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=5)
    port = group.socket.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((other, port), timeout=2).close()


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def _ipv6_group(rank: int, port: int, host: str = "::1") -> list:
    group = StatelessProcessGroup.create(host, port, rank, 2, store_timeout=30)
    if rank == 0:
        assert group.socket.family == socket.AF_INET6
    gathered = group.all_gather_obj(f"v6-{rank}")
    group.barrier()
    return gathered


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_loopback_group() -> None:
    results = run_ranks(_ipv6_group, 2, free_port("::1"))
    assert results == [["v6-0", "v6-1"]] * 2


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_host_in_brackets_as_torch_users_write_it() -> None:
    # issue 38: "[::1]" failed with "cannot resolve the store host"
    results = run_ranks(_ipv6_group, 2, free_port("::1"), "[::1]")
    assert results == [["v6-0", "v6-1"]] * 2


def _listen_socket_seventh(rank: int, sock: socket.socket, port: int) -> list:
    # vLLM 0.34's order: (host, port, rank, world_size, data_expiration_seconds,
    # store_timeout, listen_socket)
    group = StatelessProcessGroup.create(
        "127.0.0.1", port, rank, 2, 3600, 30, sock if rank == 0 else None
    )
    gathered = group.all_gather_obj(rank)
    group.barrier()
    return gathered


def test_listen_socket_is_the_seventh_positional_argument_as_in_vllm() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        results = run_ranks(_listen_socket_seventh, 2, sock, sock.getsockname()[1])
    assert results == [[0, 1]] * 2


def _with_listen_socket(rank: int, sock: socket.socket, port: int) -> list:
    listen_socket = sock if rank == 0 else None  # rank 1 only needs the port
    group = StatelessProcessGroup.create(
        "127.0.0.1", port, rank, 2, store_timeout=30, listen_socket=listen_socket
    )
    if rank == 0:
        assert group.socket is listen_socket
    gathered = group.all_gather_obj(rank + 100)
    group.barrier()
    return gathered


def test_listen_socket_avoids_port_races() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not yet listening: create makes it listen
        port = sock.getsockname()[1]
        # The socket travels to the children as a duplicated descriptor.
        results = run_ranks(_with_listen_socket, 2, sock, port)
    assert results == [[100, 101]] * 2


def test_listen_socket_port_mismatch() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"bound to port {port}"):
            StatelessProcessGroup.create("127.0.0.1", port + 1, 0, 1, listen_socket=sock)


def test_a_store_without_queues_is_refused_when_the_group_is_made(tmp_path) -> None:
    # FileStore has no queues: the group says so when made, not at its first send or barrier.
    from torch.distributed import FileStore, HashStore, PrefixStore

    files = FileStore(str(tmp_path / "store"), 2)
    for store in (files, PrefixStore("job", files)):
        with pytest.raises(TypeError, match=r"needs a store with queues.*FileStore has none"):
            StatelessProcessGroup(rank=0, world_size=2, store=store, socket=None)
    # One rank sends nothing, so it needs no queues; HashStore has them.
    assert StatelessProcessGroup(rank=0, world_size=1, store=files, socket=None).world_size == 1
    group = StatelessProcessGroup(rank=1, world_size=2, store=HashStore(), socket=None)
    group.send_obj("x", 0)


def test_a_lone_rank_says_once_that_it_is_still_waiting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(spg_group, "JOIN_NOTICE_AFTER", 0.3)  # (store_timeout: 1.5 s)
    port = free_port()
    with caplog.at_level(logging.WARNING), pytest.raises(StoreError):
        StatelessProcessGroup.create("127.0.0.1", port, 1, 2, store_timeout=1.5)
    notices = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert notices == [
        f"rank 1 of 2 has waited 0.3 s in create for all ranks to join the store at "
        f"127.0.0.1:{port} (it gives up after 1.5 s)"
    ]


@pytest.mark.parametrize(("port", "rank"), [(65536, 0), (70000, 1), (-1, 0), (0, 1)])
def test_a_port_out_of_range_is_refused_at_once(port: int, rank: int) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"port must be a TCP port.*got {port} on rank {rank}"):
        StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=5)
    assert time.monotonic() - start < 1
