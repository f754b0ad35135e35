"""The TCPStore behind every group: serving and joining it, bounded waits, deferred deletes."""

from bridge_py.distributed.store.connect import (
    StoreError,
    bind_listen_socket,
    format_address,
    format_seconds,
    join_group,
    open_store,
    plain_host,
    remaining,
    require_queues,
)

__all__ = [
    "StoreError",
    "bind_listen_socket",
    "format_address",
    "format_seconds",
    "join_group",
    "open_store",
    "plain_host",
    "remaining",
    "require_queues",
]
