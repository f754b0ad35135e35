"""Names of the store keys a StatelessProcessGroup writes, in one place.

A group owns its store, so the names need no group prefix. Every name includes the rank that
wrote the value and a per-sender sequence number, so values from different senders never
share a key (vLLM's ``send_to/{dst}/{n}`` collides when two ranks send to the same dst).
"""

from __future__ import annotations

__all__ = [
    "barrier_all_departed",
    "barrier_arrivals",
    "barrier_departures",
    "barrier_outcome",
    "broadcast_acks",
    "broadcast_value",
    "p2p_value",
]


def p2p_value(src: int, dst: int, seq: int) -> str:
    """The ``seq``-th object ``src`` sends to ``dst``; deleted by ``dst`` once read."""
    return f"p2p/{src}/{dst}/{seq}"


def broadcast_value(src: int, seq: int) -> str:
    """The ``seq``-th object ``src`` broadcasts; deleted by the last receiver."""
    return f"bcast/{src}/{seq}"


def broadcast_acks(src: int, seq: int) -> str:
    """Counter of ranks that have read ``broadcast_value(src, seq)``."""
    return f"bcast/{src}/{seq}/acks"


def barrier_arrivals(barrier_id: int) -> str:
    """Counter of ranks that reached barrier ``barrier_id`` (phase 1)."""
    return f"barrier/{barrier_id}/arrivals"


def barrier_outcome(barrier_id: int) -> str:
    """``ok`` once all ranks arrived, or why the barrier failed; written once (compare_set)."""
    return f"barrier/{barrier_id}/outcome"


def barrier_departures(barrier_id: int) -> str:
    """Counter of ranks that confirmed all arrivals and left (phase 2)."""
    return f"barrier/{barrier_id}/departures"


def barrier_all_departed(barrier_id: int) -> str:
    """Set by the last rank to leave, for rank 0 to wait on (phase 3)."""
    return f"barrier/{barrier_id}/all_departed"
