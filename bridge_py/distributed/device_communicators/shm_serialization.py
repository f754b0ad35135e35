"""How MessageQueue turns objects into bytes and back: the one place to change it.

Like vLLM, messages are pickled with the highest protocol: the queue is a rank-to-rank data
plane between processes that trust each other (the writer runs code in every reader by
construction of pickle). Everything that crosses the queue, shared memory or TCP, and the
handle exchanged when a queue is created from a group, goes through :func:`dumps` and
:func:`loads` (or, with a key resolved once for many messages, :func:`pack` and
:func:`unpack`).

With an auth key (``key=``, else ``$VLLM_BRIDGE_AUTH_KEY``) the bytes carry an HMAC-SHA256
tag bound to ``context`` (see :mod:`bridge_py.distributed.auth`), and :func:`loads` checks it
before unpickling: a reader never runs code from a writer that does not hold the key. Keys go
through :func:`~bridge_py.distributed.auth.resolve_key`, so the operator's policy applies (a
key that differs from ``$VLLM_BRIDGE_AUTH_KEY`` is refused).
"""

from __future__ import annotations

import pickle
from typing import Any

from bridge_py.distributed.auth import AuthKey, open_payload, resolve_key, seal_payload

__all__ = ["DEFAULT_CONTEXT", "dumps", "loads", "pack", "unpack"]

# The context of values whose callers give none (the object collectives of shm_group.py).
DEFAULT_CONTEXT = "mq/object"


def dumps(obj: Any, key: AuthKey | None = None, *, context: str = DEFAULT_CONTEXT) -> bytes:
    """The bytes that carry ``obj`` to the readers.

    ``key`` (None: ``$VLLM_BRIDGE_AUTH_KEY``, read now) authenticates them for ``context``,
    which :func:`loads` must be given too.
    """
    return pack(obj, resolve_key(key, param="key"), context)


def loads(
    data: bytes | bytearray | memoryview,
    key: AuthKey | None = None,
    *,
    context: str = DEFAULT_CONTEXT,
    what: str = "a message",
) -> Any:
    """The object that :func:`dumps` turned into ``data``.

    With a key (None: ``$VLLM_BRIDGE_AUTH_KEY``), raises
    :class:`~bridge_py.distributed.auth.AuthenticationError` naming ``what`` before
    unpickling anything when the tag is missing or wrong for ``context``.
    """
    return unpack(data, resolve_key(key, param="key"), context, what)


def pack(obj: Any, key: bytes | None, context: str) -> bytes:
    """:func:`dumps` with ``key`` already resolved (``resolve_key``; None: no key).

    For a queue's messages: the key is resolved once when the queue is made, not per message.
    """
    return seal_payload(key, context, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def unpack(data: bytes | bytearray | memoryview, key: bytes | None, context: str, what: str) -> Any:
    """:func:`loads` with ``key`` already resolved: checked (with a key), then unpickled."""
    return pickle.loads(open_payload(key, context, data, what))
