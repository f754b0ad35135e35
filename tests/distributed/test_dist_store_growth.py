"""The store stays small: every key is deleted once all its receivers have read it."""

from __future__ import annotations

import time

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.spg import keys
from tests.distributed.harness import free_port, run_ranks

OPERATIONS = 10_000
WORLD_SIZE = 3
# Between operations a rank may have at most a few values in flight (a send not yet received,
# a broadcast not yet read by all, the keys of a barrier another rank has not left).
MAX_KEYS = 2 + 4 * WORLD_SIZE


def _mixed_operations(rank: int, port: int) -> dict:
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, WORLD_SIZE, store_timeout=60)
    right, left = (rank + 1) % WORLD_SIZE, (rank - 1) % WORLD_SIZE
    most_keys = 0
    start = time.monotonic()
    for i in range(OPERATIONS):
        kind = i % 4
        if kind == 0:
            group.send_obj((rank, i), dst=right)
            assert group.recv_obj(src=left) == (left, i)
        elif kind == 1:
            src = i % WORLD_SIZE
            assert group.broadcast_obj(i if rank == src else None, src=src) == i
        elif kind == 2:
            assert group.all_gather_obj(rank * i) == [r * i for r in range(WORLD_SIZE)]
        else:
            group.barrier(timeout=30)
        if rank == 0 and i % 100 == 0:
            most_keys = max(most_keys, group.store.num_keys())
    group.barrier(timeout=30)
    return {
        "seconds": time.monotonic() - start,
        "most_keys": most_keys,
        # Only rank 0 (the store's server) reads it after the last barrier.
        "final_keys": group.store.num_keys() if rank == 0 else None,
        # Point-to-point objects are queue items, not keys: every queue must be empty too
        # (rank 0 looks at all of them, for the same reason).
        "queued": sum(
            group.store.queue_len(keys.p2p_queue(src, dst))
            for src in range(WORLD_SIZE)
            for dst in range(WORLD_SIZE)
        )
        if rank == 0
        else None,
        "entries": len(group.entries),
    }


def test_store_holds_a_constant_number_of_keys_after_many_operations() -> None:
    results = run_ranks(_mixed_operations, WORLD_SIZE, free_port(), timeout=150)
    print(
        f"{OPERATIONS} mixed operations in {results[0]['seconds']:.1f} s, "
        f"at most {results[0]['most_keys']} keys in the store"
    )
    assert results[0]["most_keys"] <= MAX_KEYS, results[0]
    assert results[0]["final_keys"] == 2  # the two join keys
    assert results[0]["queued"] == 0
