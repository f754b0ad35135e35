"""Names of the store keys a StatelessProcessGroup writes, in one place.

A group owns its store, so the names need no group prefix. Every name includes the rank that
wrote the value and a per-sender sequence number, so values from different senders never
share a key (vLLM's ``send_to/{dst}/{n}`` collides when two ranks send to the same dst).
"""

from __future__ import annotations

__all__ = [
    "barrier_arrivals",
    "barrier_queue",
    "broadcast_acks",
    "broadcast_value",
    "p2p_queue",
    "p2p_value",
]


def p2p_value(src: int, dst: int, seq: int) -> str:
    """The name of the ``seq``-th object ``src`` sends to ``dst`` (what its auth tag binds).

    Not a key: the object travels on :func:`p2p_queue` (see ``spg_p2p``).
    """
    return f"p2p/{src}/{dst}/{seq}"


def p2p_queue(src: int, dst: int) -> str:
    """The store queue of the objects ``src`` sends to ``dst``, popped (removed) by ``dst``."""
    return f"p2p/{src}/{dst}"


def broadcast_value(src: int, seq: int) -> str:
    """The ``seq``-th object ``src`` broadcasts (or gives to an all_gather).

    A broadcast's is deleted by its last receiver; an all_gather's by ``src`` itself, once
    every rank has read it (see ``StatelessProcessGroup.all_gather_obj``).
    """
    return f"bcast/{src}/{seq}"


def broadcast_acks(src: int, seq: int) -> str:
    """Counter of ranks that have read ``broadcast_value(src, seq)``."""
    return f"bcast/{src}/{seq}/acks"


def barrier_arrivals(barrier_id: int) -> str:
    """Counter of ranks that reached barrier ``barrier_id`` (phase 1); deleted by rank 0."""
    return f"barrier/{barrier_id}/arrivals"


def barrier_queue(rank: int) -> str:
    """The store queue of barrier messages to ``rank`` (popped, so removed, by ``rank``)."""
    return f"barrier/queue/{rank}"
