"""What bridge_py.distributed raises when ranks cannot work together, in one hierarchy.

Every class is a ``RuntimeError``, as what vLLM and torch.distributed raise in the same
situations is, so code written for them keeps working; the subclasses say what happened::

    DistributedError (RuntimeError)
    ├── GroupTimeout (also TimeoutError)      a wait ran out: a peer did not send, arrive or read
    │   ├── BarrierTimeout (also BarrierFailure)
    │   └── CollectiveTimeout                 a collective ran out: its group is unusable now
    ├── PeerGoneError                         a peer exited, or closed its end
    ├── StoreError                            the store could not be served, reached or joined
    ├── AuthenticationError                   a value whose tag is missing or wrong
    ├── BarrierFailure                        a barrier failed (every rank of it fails)
    │   └── BarrierStoreError (also StoreError)    because the store was lost
    ├── CollectiveMismatchError (also ValueError)  ranks called different collectives
    ├── ObjectLoadError (also pickle.UnpicklingError)  a received object does not unpickle
    ├── SharedMemoryError                     a shared-memory file is missing, short or changed
    ├── WaitCancelled                         a wait ended by its cancel event or a shutdown()
    └── StateError                            not allowed now: not initialized, already
                                              initialized, destroyed, or missing here

Messages name this rank, the peer and the key or operation that was waited for, so that one
line of a log says who was waiting for whom.
"""

from __future__ import annotations

import pickle

from torch.distributed import DistStoreError

__all__ = [
    "AuthenticationError",
    "BarrierFailure",
    "BarrierStoreError",
    "BarrierTimeout",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "DistributedError",
    "GroupTimeout",
    "ObjectLoadError",
    "PeerGoneError",
    "SharedMemoryError",
    "StateError",
    "StoreError",
    "WaitCancelled",
    "is_store_timeout",
    "unusable_group",
]


class DistributedError(RuntimeError):
    """Ranks of a group could not complete an operation together."""


class GroupTimeout(DistributedError, TimeoutError):
    """A wait for another rank ran out (a RuntimeError, as vLLM's, and a TimeoutError)."""


class CollectiveTimeout(GroupTimeout):
    """A collective (torch.distributed's, or the shared-memory one) ran out of time, at the
    caller's deadline or the group's timeout. The ranks of its group are out of step (the
    others may still run it, or the next one), so the group cannot be used again: destroy
    it and make it anew on every rank."""


class PeerGoneError(DistributedError):
    """The rank on the other side exited, or closed its end of the group or queue."""


class StoreError(DistributedError):
    """The store of a group could not be served, reached or joined, or was lost."""


class AuthenticationError(DistributedError):
    """A value whose tag is missing or wrong: forged, tampered with, replayed or foreign;
    or a key that the operator's policy refuses."""


class BarrierFailure(DistributedError):
    """A barrier failed: the message names the rank, the phase and who did not arrive."""


class BarrierTimeout(BarrierFailure, GroupTimeout):
    """A barrier failed because some rank did not arrive (or leave) within the timeout."""


class BarrierStoreError(BarrierFailure, StoreError):
    """A barrier failed because this rank lost the store (rank 0, which serves it, exited)."""


class CollectiveMismatchError(DistributedError, ValueError):
    """The ranks of a group called different collectives, or one with bad arguments: raised
    on every rank, before any data moves."""


class ObjectLoadError(DistributedError, pickle.UnpicklingError):
    """An object another rank or process sent does not unpickle here: it is corrupt
    (without an auth key nothing checks it on the way), or of a class this process cannot
    load. Names the object; what pickle raised is its cause. Also a pickle.UnpicklingError,
    as most of what pickle raises there is."""


class SharedMemoryError(DistributedError):
    """A shared-memory file another rank named is missing, too short, or changed while read."""


class StateError(DistributedError):
    """The call is not allowed in the present state of its object or of the process: a
    group not initialized yet (or already, differently), an object already destroyed, a
    method of the other end of a queue, or a backend this machine or torch build lacks."""


class WaitCancelled(DistributedError):
    """A wait ended early by its ``cancel`` event or by its queue's ``shutdown()``; the
    message is ``"cancelled"``, as vLLM's RuntimeError says."""


def unusable_group(op: str, where: str, why: str) -> StateError:
    """The error of an operation ``op`` on ``where`` (this rank and its group) refused
    because an earlier one failed there (``why``), leaving the ranks out of step: the
    group cannot pair this rank's calls with the others' again, it must be made anew."""
    return StateError(
        f"{op} on {where} refused: {why}, so the group is unusable: "
        "destroy it and create it again on every rank"
    )


def is_store_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a torch store request that ran out of time.

    torch raises ``DistStoreError`` both for a timeout and for a lost connection; only its
    message tells them apart, so this is the one place that reads it.
    """
    return isinstance(exc, DistStoreError) and "timeout" in str(exc).lower()
