"""Objects between the ranks of a torch CPU (gloo) group, sealed when there is an auth key.

torch's object collectives (``broadcast_object_list``, ``gather_object``, ...) unpickle
whatever arrives on the group's connections, and gloo has no authentication. An
:class:`ObjectChannel` sends each object as its size, then its bytes (two plain tensor
operations, which unpickle nothing), as torch's do, and with an auth key seals the bytes
(:func:`~bridge_py.distributed.auth.seal_object`), checked before they are unpickled. Without
a key they are plain pickles, as in vLLM (a tagged value is then refused rather than
unpickled as garbage). It is what GroupCoordinator's object paths, the same-node probe and
``MessageQueue.create_from_process_group`` use.

It calls the group's own methods (``pg.broadcast``, ``pg.send``, ...), with group ranks, so
groups unknown to torch's global state (``stateless_init_torch_distributed_process_group``)
work too.

Each tag is bound to a context naming the group (torch's group name and the ranks the
caller gives), what the channel is for, the operation, the sender, the receiver or root, and
a sequence number per operation kind (collectives: one counter that every rank of the group
advances; point to point: one per pair and direction). A value replayed from another group,
operation, peer or position, or reordered, fails its check: AuthenticationError naming what
was refused, and nothing unpickled. Sizes are not authenticated (a forged one can only make
the exchange fail).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup, Work

from bridge_py.distributed.auth import open_object, seal_object
from bridge_py.distributed.errors import DistributedError
from bridge_py.distributed.groups.work import PendingWork, finish, refuse_if_unusable

__all__ = ["ObjectChannel", "ObjectGroup", "all_gather_bytes", "object_group"]


class ObjectGroup(Protocol):
    """Object collectives under StatelessProcessGroup's names: its size, our rank, two calls.

    A StatelessProcessGroup is one; so is an :class:`ObjectChannel`.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_obj(self, obj: Any | None, src: int) -> Any: ...

    def all_gather_obj(self, obj: Any) -> list[Any]: ...


class ObjectChannel:
    """Objects over one torch CPU group (see the module docstring); group ranks throughout.

    ``ranks`` (default: the group ranks) and ``purpose`` go into every tag, so that two
    channels on one group, or on groups of other ranks, never accept each other's values.
    """

    def __init__(
        self,
        group: ProcessGroup,
        key: bytes | None,
        *,
        ranks: Sequence[int] | None = None,
        purpose: str = "objects",
    ) -> None:
        self._group = group
        self._key = key
        self.rank = group.rank()
        self.world_size = group.size()
        members = range(self.world_size) if ranks is None else ranks
        name = getattr(group, "group_name", "")
        self._prefix = f"gc/{name}/{','.join(map(str, members))}/{purpose}"
        self._where = f"rank {self.rank} of group {self._prefix!r}"  # named in timeouts
        self._collectives = 0
        self._sent = [0] * self.world_size
        self._received = [0] * self.world_size

    # --- collectives ---

    def broadcast(self, obj: Any, src: int) -> Any:
        """``obj`` on ``src``; on the other ranks, ``src``'s object, checked and unpickled."""
        seq = self._next()
        context = f"{self._prefix}/bcast/{src}/{seq}"
        data = seal_object(self._key, context, obj) if self.rank == src else None
        move = lambda tensor: self._wait(self._group.broadcast(tensor, src), "broadcast")  # noqa: E731
        got = self._sized(move, data, f"broadcast from rank {src}")
        if data is not None:
            return obj
        return self._open(got, context, f"broadcast {seq} from rank {src}")

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's object, in group rank order."""
        context = f"{self._prefix}/all_gather/{self._next()}"
        data = seal_object(self._key, f"{context}/{self.rank}", obj)
        what = f"all_gather on {self._prefix}"
        parts = all_gather_bytes(self._group, data, what=what, where=self._where)
        return [
            obj
            if r == self.rank
            else self._open(parts[r], f"{context}/{r}", f"the value of rank {r}")
            for r in range(self.world_size)
        ]

    def gather(self, obj: Any, dst: int) -> list[Any] | None:
        """Every rank's object on group rank ``dst`` (in group order), None elsewhere.

        The bytes travel as in :meth:`all_gather` (the others drop what they receive: the
        objects gathered here are small, and one exchange serves both).
        """
        context = f"{self._prefix}/gather/{dst}/{self._next()}"
        data = seal_object(self._key, f"{context}/{self.rank}", obj)
        what = f"gather on {self._prefix}"
        parts = all_gather_bytes(self._group, data, what=what, where=self._where)
        if self.rank != dst:
            return None
        return [
            obj
            if r == self.rank
            else self._open(parts[r], f"{context}/{r}", f"the value of rank {r}")
            for r in range(self.world_size)
        ]

    # --- point to point ---

    def send(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to group rank ``dst`` (its size, then its sealed bytes)."""
        self.isend(obj, dst).wait()

    def isend(self, obj: Any, dst: int) -> PendingWork:
        """Post the sends of ``obj`` to group rank ``dst`` (as :meth:`send`) and return
        without waiting; the handle keeps the bytes until they are sent."""
        refuse_if_unusable(self._group, "send of an object", self._where)
        seq = self._sent[dst]
        self._sent[dst] = seq + 1
        data = seal_object(self._key, f"{self._prefix}/p2p/{self.rank}/{dst}/{seq}", obj)
        tensors = (torch.tensor([len(data)], dtype=torch.int64), _tensor(data))
        works = [self._group.send([tensor], dst, 0) for tensor in tensors]
        return PendingWork(works, "send of an object", self._where, group=self._group, keep=tensors)

    def recv(self, src: int) -> Any:
        """The next object from group rank ``src``, checked and unpickled."""
        seq = self._received[src]
        self._received[src] = seq + 1  # consumed, whether or not it passes the check
        move = lambda tensor: self._wait(self._group.recv([tensor], src, 0), "recv")  # noqa: E731
        got = self._sized(move, None, f"object from rank {src}")
        context = f"{self._prefix}/p2p/{src}/{self.rank}/{seq}"
        return self._open(got, context, f"object {seq} from rank {src}")

    # --- ObjectGroup's names ---

    def broadcast_obj(self, obj: Any | None, src: int) -> Any:
        """:meth:`broadcast` (StatelessProcessGroup's name)."""
        return self.broadcast(obj, src)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """:meth:`all_gather` (StatelessProcessGroup's name)."""
        return self.all_gather(obj)

    # --- plumbing ---

    def _wait(self, work: Work, op: str) -> None:
        finish(work, f"{op} of an object", self._where, group=self._group)

    def _next(self) -> int:
        seq = self._collectives
        self._collectives = seq + 1
        return seq

    def _sized(
        self, move: Callable[[torch.Tensor], object], data: bytes | None, what: str
    ) -> bytes:
        """Its size, then ``data`` through ``move`` (one side of a send or broadcast), or
        with ``data`` None the other side: the bytes that arrive (``what``: whose, for
        the error about a size that is not one)."""
        if data is not None:
            move(torch.tensor([len(data)], dtype=torch.int64))
            move(_tensor(data))
            return data
        size = torch.zeros(1, dtype=torch.int64)
        move(size)
        buffer = torch.empty(self._size(size, what), dtype=torch.uint8)
        move(buffer)
        return buffer.numpy().tobytes()

    def _open(self, data: bytes, context: str, what: str) -> Any:
        """The object in ``data``, unpickled only once its tag is right for ``context``."""
        return open_object(self._key, context, data, f"{what} on {self._prefix}")

    def _size(self, size: torch.Tensor, what: str) -> int:
        return _checked_size(int(size.item()), None, f"{what} on {self._prefix}")


def all_gather_bytes(
    group: ProcessGroup,
    data: bytes,
    limit: int | None = None,
    *,
    what: str = "all_gather",
    where: str = "",
) -> list[bytes]:
    """Every rank's ``data``, in group rank order, over the torch group ``group``.

    Its size, then its bytes padded to the longest (as torch's ``all_gather_object`` sends
    them): two tensor all-gathers, nothing unpickled. A size that is negative or over
    ``limit`` (not what a rank of this code sends) raises DistributedError on every rank
    rather than allocate what it asks for; ``what`` names the exchange in that message, and
    with ``where`` (this rank and the group) in a timeout's (``work.finish``).
    """
    world = group.size()
    where = where or f"rank {group.rank()} of its group"
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    finish(
        group.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]),
        what,
        where,
        group=group,
    )
    lengths = [
        _checked_size(int(s.item()), limit, f"{what} from rank {r}") for r, s in enumerate(sizes)
    ]
    parts = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(world)]
    finish(group.allgather([parts], [_padded(data, max(lengths))]), what, where, group=group)
    return [part[:n].numpy().tobytes() for part, n in zip(parts, lengths, strict=True)]


def _checked_size(value: int, limit: int | None, what: str) -> int:
    if value < 0 or (limit is not None and value > limit):
        bound = "is negative" if value < 0 else f"is over {limit}"
        raise DistributedError(
            f"refused the {what}: its size {value} {bound} (the group's connection carries "
            "something other than this exchange's values)"
        )
    return value


def object_group(pg: Any, key: bytes | None = None, *, purpose: str = "objects") -> ObjectGroup:
    """``pg`` as an :class:`ObjectGroup`: a StatelessProcessGroup (or anything with its
    ``rank``, ``world_size``, ``broadcast_obj`` and ``all_gather_obj``) as it is, a torch
    ProcessGroup through an :class:`ObjectChannel` sealed with ``key``, a GroupCoordinator
    through its CPU group. TypeError for anything else."""
    if hasattr(pg, "cpu_group"):
        return object_group(pg.cpu_group, key, purpose=purpose)
    if isinstance(pg, ProcessGroup):
        return ObjectChannel(pg, key, purpose=purpose)
    if all(hasattr(pg, name) for name in ("rank", "world_size", "broadcast_obj", "all_gather_obj")):
        group: ObjectGroup = pg
        return group
    raise TypeError(
        "expected a StatelessProcessGroup, a torch ProcessGroup or an object with a "
        f"cpu_group, got {type(pg).__name__}"
    )


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _padded(data: bytes, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.uint8)
    if data:
        out[: len(data)] = _tensor(data)
    return out
