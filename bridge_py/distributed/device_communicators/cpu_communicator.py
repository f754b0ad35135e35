"""CpuCommunicator: collectives of a CPU group, over shared memory on one node, else gloo.

When every rank of the group can map one shared-memory segment (probed once, collectively,
at construction; see ``shm_collectives``), ``self.shm`` holds the group's
:class:`~bridge_py.distributed.device_communicators.shm_collectives.ShmCollectives` (like
vLLM's ``_CPUSHMDistributed``): all-reduce, all-gather, reduce-scatter and broadcast go
through shared memory, everything else through ``torch.distributed`` on the gloo group;
the pre-collective argument check (``agreement``) exchanges its table through shared memory
too, and :meth:`CpuCommunicator.all_reduce` and :meth:`CpuCommunicator.broadcast` fold that
check into their data step, so a small all-reduce costs one shared-memory phase. Otherwise
(ranks on several nodes, no usable ``/dev/shm``, ``VLLM_BRIDGE_CPU_SHM=0``) everything is
gloo.

Both transports give the same results: integer sums exactly, floating-point sums of two
ranks bit for bit; with more ranks the shared-memory sum is the rank-ordered one (the same
on every rank and every run) while gloo's ring may round differently in the last bits.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.agreement import Judge, Signature
from bridge_py.distributed.device_communicators.all2all import NaiveAll2AllManager
from bridge_py.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from bridge_py.distributed.device_communicators.shm_collectives import ShmCollectives
from bridge_py.distributed.device_communicators.wire_dtypes import for_reduction
from bridge_py.tensor_codec import plain

__all__ = ["CpuCommunicator"]


class CpuCommunicator(DeviceCommunicatorBase):
    """Device communicator for CPU tensors (shared memory or gloo), with all-to-all support
    for EP groups.

    ``shm`` is the group's :class:`ShmCollectives` (None when gloo carries everything);
    its ``calls`` count the collectives it ran, by name.
    """

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        use_all2all: bool = False,
        *,
        use_shm: bool | None = None,
    ) -> None:
        """Initialize self. See help(type(self)) for accurate signature.

        ``use_shm`` (not in vLLM) offers the shared-memory transport (True), declines it
        (False) or leaves it to the environment (None, ``VLLM_BRIDGE_CPU_SHM``); it is used
        only when every rank of the group offers it and can map the segment. Construction
        is a collective on ``cpu_group`` (a broadcast, an all-reduce, a barrier).
        """
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        self.shm: ShmCollectives | None = None
        if self.world_size > 1:  # every rank takes part in the probe, even one declining
            self.shm = ShmCollectives.create(
                cpu_group, self.rank_in_group, self.ranks, self.agreement.label, enabled=use_shm
            )
        if self.shm is not None:
            self.agreement.carrier = self.shm.exchange
        if self.use_all2all:
            self.all2all_manager = NaiveAll2AllManager(self.cpu_group, communicator=self)

    def _step(self, op: str, wire: torch.Tensor) -> tuple[bytes, Judge]:
        """The agreement row and judge of a shared-memory step of ``op`` on ``wire``."""
        return self.agreement.step(Signature(op, wire.dtype, (wire.numel(),)))

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum ``input_`` over the group, into ``input_`` where it can hold the sum.

        As vLLM's CPU communicator: a contiguous ``input_`` whose dtype is summed as it is
        gets the sum and is returned; any other gets a new tensor and is left unchanged.
        ``bool`` tensors come back as the logical OR over the ranks. Over shared memory, the
        argument check travels in the data step itself (one phase for a small tensor).
        """
        shm = self.shm
        if shm is None:
            return super().all_reduce(input_)
        op = "all_reduce"
        _, error = self._validated(lambda: self._check_tensor(op, input_, reduce=True))
        signature = self._signature(op, input_)
        if error is not None or input_.numel() == 0:
            self.agreement.check(signature, error)  # raises on every rank if anyone failed
            return input_.clone()
        wire, restore = for_reduction(input_, self.backend)
        # Into ``input_`` where the wire is its memory: a new 4 MiB result faulted its
        # pages in whenever malloc mapped it anew (~1 ms on this VM).
        in_place = self.sums_in_place and wire.data_ptr() == input_.data_ptr()
        out = wire if in_place else torch.empty_like(wire)
        shm.all_reduce(wire.reshape(-1), out.view(-1), *self.agreement.step(signature))
        return input_ if in_place else restore(out).reshape(input_.shape)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``tensor`` from the group's rank ``src`` into every rank's ``tensor``;
        returns ``tensor``. Over shared memory, the argument check travels in the data step."""
        shm = self.shm
        if shm is None:
            return super().broadcast(tensor, src)
        op = "broadcast"

        def check() -> tuple[int]:
            self._check_tensor(op, tensor, written=True)
            return (self._check_peer(op, "src", src, True),)

        params, error = self._validated(check)
        signature = self._signature(op, tensor, params or (), ("src",))
        if error is not None or tensor.numel() == 0:
            self.agreement.check(signature, error)  # raises on every rank if anyone failed
            return tensor
        data = plain(tensor).contiguous()
        shm.broadcast(data.view(-1).view(torch.uint8), src, *self.agreement.step(signature))
        if data.data_ptr() != tensor.data_ptr():
            tensor.copy_(data)
        return tensor

    def _all_gather_wire(self, out: torch.Tensor, wire: torch.Tensor) -> None:
        if self.shm is None:
            super()._all_gather_wire(out, wire)
        else:
            self.shm.all_gather(out, wire, *self._step("all_gather", wire))

    def _reduce_scatter_wire(self, out: torch.Tensor, wire: torch.Tensor) -> None:
        if self.shm is None:
            super()._reduce_scatter_wire(out, wire)
        else:
            flat = wire.view(-1)
            self.shm.reduce_scatter(out.view(-1), flat, *self._step("reduce_scatter", flat))

    def send_tensor_dict(self, tensor_dict: dict[str, torch.Tensor | Any], dst: int) -> None:
        """Send a dictionary of tensors to the group's rank ``dst`` (blocking), for
        :meth:`recv_tensor_dict` there.

        As vLLM's CPU communicator, every value must be a tensor (RuntimeError otherwise,
        before anything is sent). vLLM offers this only over its shared-memory extension;
        here the keys, dtypes and shapes travel first (as JSON, never a pickle), then each
        tensor, over the point-to-point path of :meth:`send`.
        """
        op = "send_tensor_dict"
        if not isinstance(tensor_dict, dict):
            kind = type(tensor_dict).__name__
            raise self._error(op, f"tensor_dict: expected a dict, got {kind}", TypeError)
        self._check_peer(op, "dst", dst, False)
        entries = []
        for key, value in tensor_dict.items():
            if not isinstance(value, torch.Tensor):
                kind = type(value).__name__
                raise self._error(
                    op, f"tensor_dict[{key!r}] is a {kind}: only tensors are sent", RuntimeError
                )
            if not isinstance(key, str):
                raise self._error(op, f"tensor_dict key {key!r} is not a str", TypeError)
            self._check_tensor(op, value, name=f"tensor_dict[{key!r}]")
            entries.append([key, str(value.dtype).removeprefix("torch."), list(value.shape)])
        header = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
        self.send(torch.tensor([header.numel()], dtype=torch.int64), dst)
        self.send(header, dst)
        for value in tensor_dict.values():
            self.send(value, dst)

    def recv_tensor_dict(self, src: int) -> dict[str, torch.Tensor | Any]:
        """Receive the dictionary of tensors that the group's rank ``src`` sent with
        :meth:`send_tensor_dict`: the same keys, in the same order, each with a new tensor
        of the dtype and shape sent."""
        op = "recv_tensor_dict"
        self._check_peer(op, "src", src, False)
        (length,) = self.recv(torch.Size([1]), torch.int64, src).tolist()
        raw = self.recv(torch.Size([length]), torch.uint8, src)
        received: dict[str, torch.Tensor | Any] = {}
        for key, name, shape in json.loads(raw.numpy().tobytes()):
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise self._error(op, f"{self.agreement.who(src)} sent an unknown dtype {name!r}")
            received[key] = self.recv(torch.Size(shape), dtype, src)
        return received

    def destroy(self) -> None:
        """Release the all-to-all manager and unmap the shared memory; groups stay."""
        super().destroy()
        if self.shm is not None:
            self.shm.close()
