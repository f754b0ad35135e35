"""How MessageQueue turns objects into bytes and back: the one place to change it.

Like vLLM, messages are pickled with the highest protocol: the queue is a rank-to-rank data
plane between processes that trust each other (the writer runs code in every reader by
construction of pickle). Everything that crosses the queue, shared memory or TCP, and the
handle exchanged when a queue is created from a group, goes through :func:`dumps` and
:func:`loads`.

With an auth key (``key=``, else ``$VLLM_BRIDGE_AUTH_KEY``) the bytes carry an HMAC-SHA256
tag bound to ``context`` (see :mod:`bridge_py.distributed.auth`), and :func:`loads` checks it
before unpickling: a reader never runs code from a writer that does not hold the key.
"""

from __future__ import annotations

import pickle
from typing import Any

from bridge_py.distributed.auth import AuthKey, open_payload, resolve_key, seal_payload

__all__ = ["DEFAULT_CONTEXT", "dumps", "loads"]

# The context of values whose callers give none (the object collectives of shm_group.py).
DEFAULT_CONTEXT = "mq/object"


def dumps(obj: Any, key: AuthKey | None = None, *, context: str = DEFAULT_CONTEXT) -> bytes:
    """The bytes that carry ``obj`` to the readers.

    ``key`` (None: ``$VLLM_BRIDGE_AUTH_KEY``, read now) authenticates them for ``context``,
    which :func:`loads` must be given too.
    """
    return seal_payload(
        resolve_key(key), context, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    )


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
    return pickle.loads(open_payload(resolve_key(key), context, data, what))
