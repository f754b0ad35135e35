"""vLLM 0.34's store helpers of ``vllm.distributed.utils``: a TCPStore on a socket the caller
bound, one cached client, and ports published through a store.

``allocate_group_ports`` is vLLM's cure for port races: the rank that picks the ports binds
them first and keeps the sockets open while it publishes the numbers, so nothing else can
take them before the group that needs them listens there. The numbers travel as vLLM's do
(``count`` big-endian unsigned 32-bit integers), so ranks of vLLM and of this package read
each other's; a value of another length is refused, not unpacked.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
from typing import Any

from torch.distributed import Store, TCPStore

from bridge_py.distributed.store.client import plain_host
from bridge_py.distributed.store.torch_api import set_bytes

__all__ = [
    "allocate_group_ports",
    "create_tcp_store",
    "fetch_group_ports",
    "get_cached_tcp_store_client",
]


def create_tcp_store(
    host: str, port: int, listen_socket: socket.socket | None = None, **kwargs: Any
) -> TCPStore:
    """A TCPStore on ``host:port`` (``kwargs`` are TCPStore's); with ``listen_socket`` (bound
    by the caller) the store serves on it and owns it from then on."""
    if listen_socket is None:
        return TCPStore(host_name=host, port=port, **kwargs)
    fd = listen_socket.detach()
    try:
        return TCPStore(host_name=host, port=port, master_listen_fd=fd, **kwargs)
    except Exception:
        os.close(fd)
        raise


@functools.lru_cache(maxsize=1)
def get_cached_tcp_store_client(host: str, port: int) -> TCPStore:
    """A client of the TCPStore at ``host:port``, the same one for every call with the same
    address (a new address replaces it)."""
    return TCPStore(host, port, is_master=False, wait_for_workers=False)


def allocate_group_ports(
    store: Store, key: str, host: str, count: int
) -> tuple[list[int], list[socket.socket]]:
    """Bind ``count`` listening sockets on ``host`` (free ports), publish their ports under
    ``key`` in ``store``, and return ``(ports, sockets)`` with the sockets still open."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    address = plain_host(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((address, 0))
            sock.listen()
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    ports = [sock.getsockname()[1] for sock in sockets]
    set_bytes(store, key, struct.pack(f"!{count}I", *ports))
    return ports, sockets


def fetch_group_ports(store: Store, key: str, count: int) -> list[int]:
    """The ``count`` ports published under ``key`` by :func:`allocate_group_ports` (waits
    for the key as ``store.get`` does, within the store's timeout); ValueError naming the
    key when its value is not ``count`` ports."""
    value = store.get(key)
    if len(value) != 4 * count:
        raise ValueError(
            f"the value of {key!r} is {len(value)} bytes, not the {count} ports "
            f"({4 * count} bytes) that were asked for"
        )
    return list(struct.unpack(f"!{count}I", value))
