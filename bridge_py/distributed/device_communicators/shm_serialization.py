"""How MessageQueue turns objects into bytes and back: the one place to change it.

Like vLLM, messages are pickled with the highest protocol: the queue is a rank-to-rank data
plane between processes that trust each other (the writer runs code in every reader by
construction of pickle). Everything that crosses the queue, shared memory or TCP, and the
handle exchanged when a queue is created from a group, goes through :func:`dumps` and
:func:`loads`, so authenticating messages (an HMAC over the bytes) needs changes here only.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["dumps", "loads"]


def dumps(obj: Any) -> bytes:
    """The bytes that carry ``obj`` to the readers."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes | bytearray | memoryview) -> Any:
    """The object that :func:`dumps` turned into ``data``."""
    return pickle.loads(data)
