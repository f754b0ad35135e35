"""GroupCoordinator's point to point of objects and tensor dictionaries (vLLM 0.34).

``isend_object``, ``isend_tensor_dict`` and ``irecv_tensor_dict`` post their transfers and
return handles (:class:`~bridge_py.distributed.groups.work.PendingWork`, vLLM's ``Handle``:
``wait()`` and ``is_completed()``), so that a pipeline stage can compute while its
activations travel. ``send_tensor_dict``/``recv_tensor_dict`` (in ``group.py``, whose
signatures name GroupCoordinator) are these waited for, as in vLLM.

A dictionary goes as its metadata (one object, on the CPU group, received blocking: the
receiver needs it to allocate), then each non-empty top-level tensor (``tensor_dicts``).

Sends a caller does not wait for are still kept alive: the coordinator holds the last
:data:`MAX_PENDING_SENDS` dictionaries' handles (and so their tensors) until they are done,
as vLLM's ``_pending_isends`` does. gloo reports a send done only once it is waited for, so
when that many are pending the next ``isend_tensor_dict`` first waits for the oldest: a
receiver that falls that far behind slows the sender instead of letting it hold every
dictionary it ever sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bridge_py.distributed.coordinator.tensor_dicts import (
    TensorMetadata,
    TensorWire,
    own_slice,
    split_tensor_dict,
    use_all_gather,
)
from bridge_py.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from bridge_py.distributed.groups.objects import ObjectChannel
from bridge_py.distributed.groups.work import PendingWork

__all__ = ["MAX_PENDING_SENDS", "AllGatherGroup", "PointToPoint"]

# Dictionaries sent with isend_tensor_dict whose handles the coordinator keeps (see above).
MAX_PENDING_SENDS = 32


class AllGatherGroup(Protocol):
    """What the all-gather of a dictionary's tensors uses of its group (a
    GroupCoordinator, typically the tensor-parallel one)."""

    world_size: int
    rank_in_group: int

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


class PointToPoint:
    """The point-to-point dictionary and object methods of GroupCoordinator (a mixin: it
    uses the coordinator's groups, communicator and object channel)."""

    world_size: int
    rank_in_group: int
    _comm: DeviceCommunicatorBase
    _objects: ObjectChannel
    _tensors: TensorWire
    _pending_sends: deque[list[PendingWork]]

    def isend_object(self, obj: Any, dst: int) -> PendingWork:
        """Non-blocking ``send_object``: post the object's sends to group rank ``dst`` on
        the CPU group and return a handle (``wait()``, ``is_completed()``) that keeps the
        serialized object until it is sent. The receiver calls ``recv_object``.

        Raises:
            TypeError: ``dst`` is not an int.
            ValueError: ``dst`` is not another rank of the group.
        """
        self._comm._check_peer("isend_object", "dst", dst, False)
        return self._objects.isend(obj, dst)

    def send_object(self, obj: Any, dst: int) -> None:
        """Send the input object list to the destination rank.

        NOTE: `dst` is the local rank of the destination rank.
        """
        self._comm._check_peer("send_object", "dst", dst, False)
        self._objects.send(obj, dst)

    def recv_object(self, src: int) -> Any:
        """Receive the input object list from the source rank.

        NOTE: `src` is the local rank of the source rank.
        """
        self._comm._check_peer("recv_object", "src", src, False)
        return self._objects.recv(src)

    def isend_tensor_dict(
        self,
        tensor_dict: dict[str, Any],
        dst: int | None = None,
        all_gather_group: AllGatherGroup | None = None,
        all_gather_tensors: dict[str, bool] | None = None,
    ) -> list[PendingWork]:
        """Send the input tensor dictionary asynchronously (``send_tensor_dict``'s
        arguments, and its checks; the receiver calls ``recv_tensor_dict`` or
        ``irecv_tensor_dict``).

        Returns the handles of its sends: the metadata's first, then one per non-empty
        tensor sent, in the dictionary's order; an empty list in a group of one. Wait for
        them (``handle.wait()``) before changing the tensors sent. Dropping them is safe:
        the coordinator keeps them, and with them the tensors, until they are done (see
        the module docstring: past :data:`MAX_PENDING_SENDS` unwaited dictionaries this
        call first waits for the oldest).

        Raises:
            TypeError: ``tensor_dict`` is not a dict, or holds a tensor that is not dense;
                ``all_gather_group`` is not a GroupCoordinator, or ``all_gather_tensors``
                not a dict.
            ValueError: ``dst`` is not another rank of the group, or
                ``all_gather_tensors`` asks for the all-gather without an
                ``all_gather_group``.
        """
        if self.world_size <= 1:
            return []
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self._comm._check_peer("isend_tensor_dict", "dst", dst, False)
        _check_all_gather(all_gather_group, all_gather_tensors)
        if not isinstance(tensor_dict, dict):
            raise TypeError(f"Expecting a dictionary, got {type(tensor_dict)}")
        metadata, _ = split_tensor_dict(tensor_dict)
        tensors = []  # what goes on the wire: each tensor, or its slice to be gathered
        for key, value in tensor_dict.items():
            if isinstance(value, torch.Tensor) and value.numel():
                if use_all_gather(key, value, all_gather_group, all_gather_tensors):
                    value = own_slice(value, all_gather_group)
                tensors.append(value)
        pending = self._keep_pending()
        handles = [self._objects.isend(metadata, dst)]
        handles += [self._tensors.isend(tensor, dst) for tensor in tensors]
        pending.append(handles)
        return handles

    def _keep_pending(self) -> deque[list[PendingWork]]:
        """The dictionaries still kept: those done are let go, and the oldest waited for
        while :data:`MAX_PENDING_SENDS` are pending."""
        pending = self.__dict__.setdefault("_pending_sends", deque())
        while pending and all(handle.is_completed() for handle in pending[0]):
            pending.popleft()
        while len(pending) >= MAX_PENDING_SENDS:
            for handle in pending.popleft():
                handle.wait()
        return pending

    def _wait_all(self, handles: list[PendingWork], postprocess: list[Callable[[], None]]) -> None:
        """The blocking forms: wait for every handle, then run every step; the handles
        of a send are no longer kept."""
        for handle in handles:
            handle.wait()
        for step in postprocess:
            step()
        pending = getattr(self, "_pending_sends", None)
        if pending and pending[-1] is handles:
            pending.pop()

    def irecv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: AllGatherGroup | None = None,
        all_gather_tensors: dict[str, bool] | None = None,
    ) -> tuple[dict[str, Any] | None, list[PendingWork], list[Callable[[], None]]]:
        """Receive a tensor dictionary asynchronously (``recv_tensor_dict``'s arguments).

        Waits for the metadata (to allocate the tensors), posts the receive of every
        tensor and returns ``(tensor_dict, handles, postprocess)``, as vLLM's. Once every
        handle has been waited for, the tensors of ``tensor_dict`` hold what was sent,
        except those sent as slices for the all-gather: until the caller has run every
        function of ``postprocess`` (each an all-gather over ``all_gather_group``, so a
        collective: every rank of that group runs its own), such a key holds this rank's
        slice. ``(None, [], [])`` in a group of one, or when torch.distributed is not
        initialized.

        Raises:
            TypeError: ``all_gather_group`` is not a GroupCoordinator, or
                ``all_gather_tensors`` not a dict.
            ValueError: ``src`` is not another rank of the group, or
                ``all_gather_tensors`` asks for the all-gather without an
                ``all_gather_group``.
        """
        if not dist.is_initialized() or self.world_size == 1:
            return None, [], []
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        self._comm._check_peer("irecv_tensor_dict", "src", src, False)
        _check_all_gather(all_gather_group, all_gather_tensors)
        received: dict[str, Any] = {}
        handles: list[PendingWork] = []
        postprocess: list[Callable[[], None]] = []
        for key, value in self._objects.recv(src):
            if not isinstance(value, TensorMetadata):
                received[key] = value
                continue
            tensor = self._tensors.empty_like(value)
            received[key] = tensor
            if not tensor.numel():
                continue
            if use_all_gather(key, tensor, all_gather_group, all_gather_tensors):
                assert all_gather_group is not None
                part = own_slice(tensor, all_gather_group)
                received[key] = part
                postprocess.append(_gather_into(received, key, part, all_gather_group, tensor))
                tensor = part
            handles.append(self._tensors.irecv(tensor, src))
        return received, handles, postprocess


def _check_all_gather(group: Any, tensors: Any) -> None:
    """TypeError unless ``group`` is a group to gather over (or None) and ``tensors`` a
    dict of key -> bool (or None)."""
    if group is not None and not all(
        hasattr(group, name) for name in ("world_size", "rank_in_group", "all_gather")
    ):
        raise TypeError(f"all_gather_group must be a GroupCoordinator, got {type(group).__name__}")
    if tensors is not None and not isinstance(tensors, dict):
        raise TypeError(f"all_gather_tensors must be a dict, got {type(tensors).__name__}")


def _gather_into(
    received: dict[str, Any],
    key: str,
    part: torch.Tensor,
    group: AllGatherGroup,
    like: torch.Tensor,
) -> Callable[[], None]:
    """The step that puts the whole of ``key`` (every rank's ``part``, gathered over
    ``group``, in the shape of ``like``) into ``received``."""

    def gather() -> None:
        received[key] = group.all_gather(part, dim=0).reshape(like.shape)

    return gather
