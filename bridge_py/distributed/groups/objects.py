"""Objects between the ranks of a torch CPU (gloo) group: GroupCoordinator's object paths.

torch's object collectives (``broadcast_object_list``, ``gather_object``, ...) unpickle
whatever arrives on the group's connections, and gloo has no authentication. An
:class:`ObjectChannel` sends each object as its size, then its bytes (two plain tensor
operations, which unpickle nothing), as torch's do, and with an auth key seals the bytes
(:func:`~bridge_py.distributed.auth.seal_payload`) and checks them before ``pickle.loads``
(:func:`~bridge_py.distributed.auth.open_payload`). Without a key the bytes are plain
pickles, as in vLLM; a tagged value then is refused rather than unpickled as garbage.

Each tag is bound to a context naming the group (torch's group name, which every rank of a
torch group shares, and its global ranks), what the channel is for, the operation, the
sender, the receiver or root, and a sequence number per operation kind (broadcasts and
gathers: one counter that every rank of the group advances; point to point: one per pair and
direction). A value replayed from another group, operation, peer or position, or reordered,
fails its check: AuthenticationError naming what was refused, and nothing unpickled. Sizes
are not authenticated (a forged one can only make the exchange fail).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.auth import open_payload, seal_payload

__all__ = ["ObjectChannel"]


class ObjectChannel:
    """Objects over one torch CPU group, sealed when there is a key (see the module docstring).

    ``ranks`` are the group's global ranks in group order, ``rank_in_group`` this rank's
    index in them; every method takes group ranks. ``purpose`` names what the channel
    carries, so that two channels on one group never accept each other's values.
    """

    def __init__(
        self,
        group: ProcessGroup,
        ranks: Sequence[int],
        rank_in_group: int,
        key: bytes | None,
        purpose: str = "objects",
    ) -> None:
        self._group = group
        self._ranks = list(ranks)
        self._me = rank_in_group
        self._key = key
        name = getattr(group, "group_name", "")
        self._prefix = f"gc/{name}/{','.join(map(str, self._ranks))}/{purpose}"
        self._broadcasts = 0
        self._gathers = 0
        self._sent = [0] * len(self._ranks)
        self._received = [0] * len(self._ranks)

    # --- broadcast ---

    def broadcast(self, obj: Any, src: int) -> Any:
        """``obj`` on ``src``; on the other ranks, ``src``'s object, checked and unpickled."""
        seq = self._broadcasts
        self._broadcasts = seq + 1
        context = f"{self._prefix}/bcast/{src}/{seq}"
        if self._me == src:
            self._broadcast_bytes(self._seal(obj, context), src)
            return obj
        data = self._broadcast_bytes(None, src)
        return self._open(data, context, f"broadcast {seq} from rank {src}")

    def _broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        root = self._ranks[src]
        size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
        dist.broadcast(size, src=root, group=self._group)
        if data is not None:
            dist.broadcast(_tensor(data), src=root, group=self._group)
            return data
        buffer = torch.empty(self._size(size, f"broadcast from rank {src}"), dtype=torch.uint8)
        dist.broadcast(buffer, src=root, group=self._group)
        return buffer.numpy().tobytes()

    # --- point to point ---

    def send(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to group rank ``dst`` (its size, then its sealed bytes)."""
        seq = self._sent[dst]
        self._sent[dst] = seq + 1
        data = self._seal(obj, f"{self._prefix}/p2p/{self._me}/{dst}/{seq}")
        peer = self._ranks[dst]
        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=peer, group=self._group)
        dist.send(_tensor(data), dst=peer, group=self._group)

    def recv(self, src: int) -> Any:
        """The next object from group rank ``src``, checked and unpickled."""
        seq = self._received[src]
        self._received[src] = seq + 1  # consumed, whether or not it passes the check
        peer = self._ranks[src]
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=peer, group=self._group)
        buffer = torch.empty(self._size(size, f"object from rank {src}"), dtype=torch.uint8)
        dist.recv(buffer, src=peer, group=self._group)
        context = f"{self._prefix}/p2p/{src}/{self._me}/{seq}"
        return self._open(buffer.numpy().tobytes(), context, f"object {seq} from rank {src}")

    # --- gather ---

    def gather(self, obj: Any, dst: int) -> list[Any] | None:
        """Every rank's object on group rank ``dst`` (in group order), None elsewhere."""
        seq = self._gathers
        self._gathers = seq + 1
        context = f"{self._prefix}/gather/{dst}/{seq}"
        data = self._seal(obj, f"{context}/{self._me}")
        world = len(self._ranks)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        mine_size = torch.tensor([len(data)], dtype=torch.int64)
        dist.all_gather(sizes, mine_size, group=self._group)
        lengths = [self._size(sizes[r], f"gather from rank {r}") for r in range(world)]
        longest = max(lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = _tensor(data)
        root = self._ranks[dst]
        if self._me != dst:
            dist.gather(mine, None, dst=root, group=self._group)
            return None
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.gather(mine, parts, dst=root, group=self._group)
        result = []
        for r, part in enumerate(parts):
            if r == self._me:
                result.append(obj)
                continue
            raw = part[: lengths[r]].numpy().tobytes()
            result.append(self._open(raw, f"{context}/{r}", f"gather {seq} value of rank {r}"))
        return result

    # --- sealing ---

    def _seal(self, obj: Any, context: str) -> bytes:
        return seal_payload(self._key, context, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _open(self, data: bytes, context: str, what: str) -> Any:
        """The object in ``data``, unpickled only once its tag is right for ``context``."""
        return pickle.loads(open_payload(self._key, context, data, f"the {what} on {self._prefix}"))

    def _size(self, size: torch.Tensor, what: str) -> int:
        value = int(size.item())
        if value < 0:
            raise RuntimeError(
                f"refused the {what} on {self._prefix}: its size {value} is negative (the "
                "group's connection carries something other than this channel's values)"
            )
        return value


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
