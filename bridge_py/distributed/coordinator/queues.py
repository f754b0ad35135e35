"""The sizes of the shared-memory MessageQueues a GroupCoordinator makes over its CPU group
(its broadcaster, and the single-reader queues), as vLLM's: 4 MiB chunks, 6 of them."""

from __future__ import annotations

__all__ = ["CHUNKS", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 22
CHUNKS = 6
