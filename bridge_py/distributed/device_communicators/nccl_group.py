"""One NCCL communicator behind the few ProcessGroup calls that PyNcclCommunicator makes.

``PyNcclCommunicator`` runs its CUDA operations on a torch ProcessGroup (``allreduce``,
``broadcast``, ``_allgather_base``, ``send``...). To pair with vLLM's ranks it must instead
call NCCL as vLLM's communicator does: on a communicator made from rank 0's
``ncclUniqueId``, one call per operation, on the current stream. :class:`NcclGroup` is that
communicator with the same calls, so that the communicator's operations, checks and
shapes stay one code path whichever runs them. Each call is enqueued on the current
CUDA stream and returns no work to wait for (as vLLM's: the stream orders it).
"""

from __future__ import annotations

from typing import Any

import torch

from bridge_py.distributed.device_communicators.pynccl_wrapper import (
    NCCL_SUSPEND_MEM,
    NCCL_UNIQUE_ID_BYTES,
    NCCLLibrary,
    buffer_type,
    cudaStream_t,
    ncclDataTypeEnum,
    ncclRedOpTypeEnum,
    ncclUniqueId,
)
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.spg.group import StatelessProcessGroup

__all__ = ["NcclGroup", "check_unique_id_bytes"]


def check_unique_id_bytes(data: Any) -> None:
    """TypeError or ValueError unless ``data`` is an NCCL unique id's 128 bytes."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"unique_id_bytes must be bytes, got {type(data).__name__}")
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(
            f"expected a {NCCL_UNIQUE_ID_BYTES}-byte NCCL unique id, got {len(data)} bytes"
        )


def _pointer(tensor: torch.Tensor) -> buffer_type:
    return buffer_type(tensor.data_ptr())


def _stream() -> cudaStream_t:
    return cudaStream_t(torch.cuda.current_stream().cuda_stream)


class NcclGroup:
    """A communicator of ``world_size`` ranks made from ``unique_id`` on ``device``."""

    def __init__(
        self,
        library: NCCLLibrary,
        unique_id: ncclUniqueId,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        """Join the communicator (a collective: every rank must make its own at once)."""
        self.nccl = library
        self.version = library.ncclGetRawVersion()
        self.rank_in_group = rank
        self.world_size = world_size
        self.device = device
        self.suspended = False  # (by ncclCommSuspend)
        with torch.cuda.device(device):
            self.comm = library.ncclCommInitRank(world_size, unique_id, rank)

    @classmethod
    def join(
        cls,
        group: StatelessProcessGroup | None,
        rank: int,
        world_size: int,
        device: torch.device,
        library_path: str | None,
        unique_id_bytes: bytes | None,
    ) -> NcclGroup:
        """vLLM's set-up: rank 0 makes the unique id and sends it to every rank with the
        group's ``broadcast_obj`` (unless all were given its bytes), and each joins."""
        library = NCCLLibrary(library_path)
        if unique_id_bytes is not None:
            unique_id = library.unique_id_from_bytes(unique_id_bytes)
        else:
            assert group is not None
            mine = library.ncclGetUniqueId() if rank == 0 else ncclUniqueId()
            unique_id = group.broadcast_obj(mine, src=0)
            if not isinstance(unique_id, ncclUniqueId):
                raise StateError(
                    f"PyNcclCommunicator on rank {rank}: rank 0 broadcast "
                    f"{type(unique_id).__name__} where its ncclUniqueId was expected"
                )
        return cls(library, unique_id, rank, world_size, device)

    def rank(self) -> int:
        """This rank's number in the communicator."""
        return self.rank_in_group

    def size(self) -> int:
        """The number of ranks."""
        return self.world_size

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> None:
        """``tensors[0]`` reduced in place with ``options.reduceOp``."""
        (tensor,) = tensors
        self.nccl.ncclAllReduce(
            _pointer(tensor),
            _pointer(tensor),
            tensor.numel(),
            ncclDataTypeEnum.from_torch(tensor.dtype),
            ncclRedOpTypeEnum.from_torch(options.reduceOp),
            self.comm,
            _stream(),
        )

    def reduce(self, tensors: list[torch.Tensor], options: Any) -> None:
        """``tensors[0]`` reduced in place into rank ``options.rootRank``'s."""
        (tensor,) = tensors
        self.nccl.ncclReduce(
            _pointer(tensor),
            _pointer(tensor),
            tensor.numel(),
            ncclDataTypeEnum.from_torch(tensor.dtype),
            ncclRedOpTypeEnum.from_torch(options.reduceOp),
            options.rootRank,
            self.comm,
            _stream(),
        )

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, options: Any) -> None:
        self.nccl.ncclReduceScatter(
            _pointer(inp),
            _pointer(out),
            out.numel(),
            ncclDataTypeEnum.from_torch(inp.dtype),
            ncclRedOpTypeEnum.from_torch(options.reduceOp),
            self.comm,
            _stream(),
        )

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.nccl.ncclAllGather(
            _pointer(inp),
            _pointer(out),
            inp.numel(),
            ncclDataTypeEnum.from_torch(inp.dtype),
            self.comm,
            _stream(),
        )

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``tensor`` into every rank's."""
        self.nccl.ncclBroadcast(
            _pointer(tensor),
            _pointer(tensor),
            tensor.numel(),
            ncclDataTypeEnum.from_torch(tensor.dtype),
            src,
            self.comm,
            _stream(),
        )

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> None:
        """``tensors[0]`` to ``peer`` (``tag`` is not NCCL's: ignored)."""
        (tensor,) = tensors
        dtype = ncclDataTypeEnum.from_torch(tensor.dtype)
        self.nccl.ncclSend(_pointer(tensor), tensor.numel(), dtype, peer, self.comm, _stream())

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> None:
        """Into ``tensors[0]`` from ``peer``."""
        (tensor,) = tensors
        dtype = ncclDataTypeEnum.from_torch(tensor.dtype)
        self.nccl.ncclRecv(_pointer(tensor), tensor.numel(), dtype, peer, self.comm, _stream())

    def _start_coalescing(self, device: torch.device) -> None:
        self.nccl.ncclGroupStart()

    def _end_coalescing(self, device: torch.device) -> None:
        self.nccl.ncclGroupEnd()

    def suspend(self) -> None:
        """Free the communicator's memory, keeping it (a collective), as vLLM's
        ``suspend``: where NCCL lacks ``ncclCommSuspend`` nothing is freed, as there."""
        if self.nccl.has_symbol("ncclCommSuspend"):
            with torch.cuda.device(self.device):
                self.nccl.ncclCommSuspend(self.comm, NCCL_SUSPEND_MEM)
            self.suspended = True

    def resume(self) -> None:
        """Restore what ``suspend`` freed (a collective)."""
        if self.suspended:
            with torch.cuda.device(self.device):
                self.nccl.ncclCommResume(self.comm)
            self.suspended = False

    def destroy(self) -> None:
        """Free the communicator (once its queued work has run)."""
        if self.comm is not None:
            with torch.cuda.device(self.device):
                self.nccl.ncclCommDestroy(self.comm)
            self.comm = None
