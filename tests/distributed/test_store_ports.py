"""vLLM 0.34's store helpers (``utils.create_tcp_store``, ``get_cached_tcp_store_client``,
``allocate_group_ports``/``fetch_group_ports``), on real TCPStores and sockets."""

from __future__ import annotations

import socket
import struct
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from bridge_py.distributed import utils

pytestmark = pytest.mark.timeout(60)


def _served_on_a_bound_socket() -> tuple[TCPStore, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    store = utils.create_tcp_store(
        "127.0.0.1", port, sock, is_master=True, wait_for_workers=False, timeout=timedelta(10)
    )
    assert sock.fileno() == -1  # the store owns it now
    return store, port


def test_a_store_serves_on_the_socket_the_caller_bound_and_clients_are_cached() -> None:
    server, port = _served_on_a_bound_socket()
    client = utils.get_cached_tcp_store_client("127.0.0.1", port)
    assert utils.get_cached_tcp_store_client("127.0.0.1", port) is client
    client.set("k", b"v")
    assert server.get("k") == b"v"
    other, other_port = _served_on_a_bound_socket()
    replaced = utils.get_cached_tcp_store_client("127.0.0.1", other_port)
    assert replaced is not client
    replaced.set("k2", b"w")
    assert other.get("k2") == b"w"


def test_ports_are_held_while_published_and_read_back_as_vllm_packs_them() -> None:
    server, _port = _served_on_a_bound_socket()
    ports, sockets = utils.allocate_group_ports(server, "ports", "127.0.0.1", 3)
    try:
        assert len(set(ports)) == 3
        for port in ports:  # still bound and listening: nobody else can take them
            with socket.socket() as probe, pytest.raises(OSError):
                probe.bind(("127.0.0.1", port))
        assert server.get("ports") == struct.pack("!3I", *ports)  # vLLM's packing
        assert utils.fetch_group_ports(server, "ports", 3) == ports
        with pytest.raises(ValueError, match="'ports' is 12 bytes, not the 2 ports"):
            utils.fetch_group_ports(server, "ports", 2)
    finally:
        for sock in sockets:
            sock.close()
    with pytest.raises(ValueError, match="count must be at least 1"):
        utils.allocate_group_ports(server, "none", "127.0.0.1", 0)
