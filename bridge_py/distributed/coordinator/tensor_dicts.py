"""The tensor dictionaries of GroupCoordinator: metadata as one object, then each tensor.

``broadcast_tensor_dict``, ``send_tensor_dict`` and ``recv_tensor_dict`` split a dictionary
into its metadata (keys, non-tensor values, the device type, dtype and size of each
top-level tensor), which travels as one object, and its tensors, which travel as tensors:
CPU tensors on the group's CPU (gloo) group, device tensors on its device group, each in a
dtype the backend carries (``wire_dtypes``). Only top-level tensor values travel as tensors;
anything else (nested containers included) travels pickled in the metadata.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.wire_dtypes import for_transport
from bridge_py.distributed.groups.work import PendingWork, finish, refuse_if_unusable
from bridge_py.tensor_codec import non_dense

__all__ = ["TensorMetadata", "TensorWire", "own_slice", "split_tensor_dict", "use_all_gather"]

TensorMetadata = namedtuple("TensorMetadata", ["device", "dtype", "size"])


def split_tensor_dict(
    tensor_dict: dict[str, Any],
) -> tuple[list[tuple[str, Any]], list[torch.Tensor]]:
    """Split a tensor dictionary into (key, value-or-TensorMetadata) pairs and its tensors.

    Raises TypeError for a tensor that is not dense (sparse, nested), before anything is
    sent: it has no one block of memory to send.
    """
    metadata_list: list[tuple[str, Any]] = []
    tensor_list: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            kind = non_dense(value)
            if kind is not None:
                raise TypeError(f"tensor_dict[{key!r}] is a {kind} tensor: only dense ones travel")
            # Only the device type: the receiver places the tensor on its own device index.
            metadata_list.append(
                (key, TensorMetadata(value.device.type, value.dtype, value.size()))
            )
            tensor_list.append(value)
        else:
            metadata_list.append((key, value))
    return metadata_list, tensor_list


def use_all_gather(
    key: str,
    tensor: torch.Tensor,
    group: Any | None,
    all_gather_tensors: dict[str, bool] | None,
) -> bool:
    """Whether ``tensor`` travels as slices gathered over the all-gather ``group`` (a
    GroupCoordinator; None: no such group), as vLLM decides."""
    use = group is not None and tensor.numel() % group.world_size == 0
    if all_gather_tensors:
        use = all_gather_tensors.get(key, use)
    if use and group is None:
        raise ValueError(f"all_gather_tensors asks for {key!r} but no all_gather_group is given")
    return use


def own_slice(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of ``tensor`` when it travels gathered over ``group``."""
    return tensor.reshape(group.world_size, -1)[group.rank_in_group]


class TensorWire:
    """Tensors of one group's dictionaries: each on the CPU group or the device group."""

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device_group: ProcessGroup,
        ranks: Sequence[int],
        device: torch.device,
        where: str = "",
    ) -> None:
        """``where`` names this rank and its group in a timeout (``groups.work.finish``)."""
        self._where = where or f"rank {cpu_group.rank()} of its group"
        self._cpu_group = cpu_group
        self._device_group = device_group
        self._ranks = list(ranks)
        self._device = device

    def empty_like(self, meta: TensorMetadata) -> torch.Tensor:
        """A tensor to receive what ``meta`` describes (on this rank's device of its type)."""
        device = self._device if meta.device == self._device.type else torch.device(meta.device)
        return torch.empty(meta.size, dtype=meta.dtype, device=device)

    def _group(self, tensor: torch.Tensor) -> ProcessGroup:
        return self._cpu_group if tensor.is_cpu else self._device_group

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcast every non-empty tensor of ``tensors`` from group rank ``src`` (all
        started, then all waited for)."""
        pending = []
        for tensor in tensors:
            if tensor.numel() == 0:
                continue
            group = self._group(tensor)
            wire, _ = for_transport(tensor, str(dist.get_backend(group)))
            if wire.data_ptr() != tensor.data_ptr() and not tensor.is_contiguous():
                raise ValueError("broadcast_tensor_dict needs contiguous tensors")
            work = dist.broadcast(wire, src=self._ranks[src], group=group, async_op=True)
            pending.append((work, tensor.is_cpu))
        for work, cpu in pending:
            finish(work, "broadcast_tensor_dict", self._where, bounded=cpu, group=self._cpu_group)

    def isend(self, tensor: torch.Tensor, peer: int) -> PendingWork:
        """Post the send of ``tensor`` to group rank ``peer``; the handle keeps it (or its
        wire copy) alive until sent."""
        group = self._group(tensor)
        refuse_if_unusable(self._cpu_group, "send_tensor_dict", self._where)
        wire, _ = for_transport(tensor, str(dist.get_backend(group)))
        work = dist.isend(wire, dst=self._ranks[peer], group=group)
        if wire.is_cuda:  # its memory is not reused before the send has read it
            wire.record_stream(torch.cuda.current_stream(wire.device))
        return self._pending(work, "send_tensor_dict", tensor, keep=(tensor, wire))

    def irecv(self, tensor: torch.Tensor, peer: int) -> PendingWork:
        """Post the receive into ``tensor`` from group rank ``peer``; ``tensor`` holds what
        came once the handle has been waited for."""
        group = self._group(tensor)
        refuse_if_unusable(self._cpu_group, "recv_tensor_dict", self._where)
        wire, restore = for_transport(tensor, str(dist.get_backend(group)))
        work = dist.irecv(wire, src=self._ranks[peer], group=group)

        def copy_out() -> None:  # received into a copy of another dtype or layout
            tensor.copy_(restore(wire).reshape(tensor.shape))

        then = copy_out if wire.data_ptr() != tensor.data_ptr() else None
        return self._pending(work, "recv_tensor_dict", tensor, keep=(wire,), then=then)

    def _pending(self, work: Any, op: str, tensor: torch.Tensor, **kwargs: Any) -> PendingWork:
        # A CPU tensor's wait is bounded by the caller's deadline; see groups.work.finish.
        return PendingWork(
            [work], op, self._where, group=self._cpu_group, bounded=tensor.is_cpu, **kwargs
        )

    def receive_broadcast(self, metadata_list: list[tuple[str, Any]], src: int) -> dict[str, Any]:
        """The dictionary ``src`` broadcasts, from its metadata and then its tensors."""
        received = {
            key: self.empty_like(value) if isinstance(value, TensorMetadata) else value
            for key, value in metadata_list
        }
        tensors = [
            received[key] for key, value in metadata_list if isinstance(value, TensorMetadata)
        ]
        self.broadcast(tensors, src)
        return received
