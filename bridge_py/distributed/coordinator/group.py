"""GroupCoordinator: a group of processes and its collectives, as vLLM's.

The class ``vllm.distributed.parallel_state.GroupCoordinator`` (``parallel_state``
re-exports it): a device group and a gloo CPU group per list of ranks, a device
communicator that runs every collective, and the object paths between ranks (sealed with
the operator's auth key when there is one, see ``groups.objects``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Backend, ProcessGroup

from bridge_py.distributed.auth import resolve_key
from bridge_py.distributed.coordinator.by_name import register_group
from bridge_py.distributed.coordinator.experts import ExpertExchange
from bridge_py.distributed.coordinator.layout import (
    check_group_ranks,
    communicator_class,
    device_for,
    unique_name,
)
from bridge_py.distributed.coordinator.p2p import PointToPoint
from bridge_py.distributed.coordinator.queues import CHUNK_BYTES, CHUNKS
from bridge_py.distributed.coordinator.tensor_dicts import (
    TensorMetadata,
    TensorWire,
    split_tensor_dict,
)
from bridge_py.distributed.device_communicators.agreement import Signature
from bridge_py.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from bridge_py.distributed.device_communicators.shm_broadcast import Handle, MessageQueue
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.groups.objects import ObjectChannel
from bridge_py.distributed.groups.torch_group import cpu_all_reduce_, default_group_timeout

__all__ = ["GraphCaptureContext", "GroupCoordinator", "TensorMetadata"]


@dataclass
class GraphCaptureContext:
    """The stream a CUDA graph is captured on (None on CPU, where nothing is captured)."""

    stream: Any


class GroupCoordinator(ExpertExchange, PointToPoint):
    """
    PyTorch ProcessGroup wrapper for a group of processes.
    PyTorch ProcessGroup is bound to one specific communication backend,
        e.g. NCCL, Gloo, MPI, etc.
    GroupCoordinator takes charge of all the communication operations among
        the processes in the group. It manages both CPU and device
        communication.
    """

    # available attributes:
    rank: int  # global rank
    ranks: list[int]  # global ranks in the group
    world_size: int  # size of the group
    local_rank: int  # local rank used to assign devices
    rank_in_group: int  # rank inside the group
    cpu_group: ProcessGroup  # group for CPU communication
    device_group: ProcessGroup  # group for device communication
    device_communicator: DeviceCommunicatorBase | None
    mq_broadcaster: MessageQueue | None  # shared memory broadcaster

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str | Backend,
        use_device_communicator: bool,
        use_message_queue_broadcaster: bool = False,
        group_name: str | None = None,
        use_all2all: bool = False,
    ) -> None:
        """Initialize self. See help(type(self)) for accurate signature.

        ``use_all2all``: the device communicator moves tokens between experts
        (``dispatch``/``combine``); vLLM sets it for expert-parallel groups while data
        parallelism is on.

        Every rank of the world must call this with the same ``group_ranks``: each list
        becomes a device group (``torch_distributed_backend``) and a gloo CPU group, created
        in the same order everywhere; this rank keeps the pair it belongs to.
        """
        if not dist.is_initialized():
            raise StateError(
                "GroupCoordinator needs torch.distributed to be initialized "
                "(call init_distributed_environment first)"
            )
        # The operator's key (None: objects are plain pickles, as in vLLM); read before any
        # collective, so that a refusal (VLLM_BRIDGE_REQUIRE_AUTH_KEY) leaves nothing behind.
        self._auth_key = resolve_key(None)
        self.unique_name = unique_name(group_name or "anonymous")
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        check_group_ranks(group_ranks)

        own_device_group: ProcessGroup | None = None
        own_cpu_group: ProcessGroup | None = None
        timeout = default_group_timeout()  # init's, not torch's 30 minutes (see there)
        self.group_ranks = [[int(r) for r in ranks] for ranks in group_ranks]
        self.torch_distributed_backend = torch_distributed_backend
        self.cpu_timeout = timeout
        for ranks in group_ranks:
            ranks = [int(r) for r in ranks]
            device_group = dist.new_group(ranks, backend=torch_distributed_backend, timeout=timeout)
            # A gloo group, so that processes can also coordinate through the CPU.
            cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if self.rank in ranks:
                self.ranks = ranks
                self.world_size = len(ranks)
                self.rank_in_group = ranks.index(self.rank)
                own_device_group, own_cpu_group = device_group, cpu_group
        if own_device_group is None or own_cpu_group is None:
            raise ValueError(
                f"global rank {self.rank} is in none of the group_ranks {group_ranks} "
                f"of group {self.unique_name!r}"
            )
        self.cpu_group = own_cpu_group
        self.device_group = own_device_group
        # Objects between ranks travel on the CPU group, sealed when there is a key.
        self._objects = ObjectChannel(self.cpu_group, self._auth_key, ranks=self.ranks)
        self.device = device_for(str(torch_distributed_backend), local_rank)

        # Every collective goes through a communicator. vLLM exposes one only when asked
        # for (and the group has several ranks); the others get a plain torch.distributed
        # one, kept private, instead of vLLM's "No device communicator found".
        self.use_device_communicator = use_device_communicator
        exposed = use_device_communicator and self.world_size > 1
        self._comm = communicator_class(self.device)(
            cpu_group=self.cpu_group,
            device=self.device,
            device_group=self.device_group,
            unique_name=self.unique_name,
            use_all2all=use_all2all and exposed,
        )
        where = self._comm.agreement.where
        self._tensors = TensorWire(
            self.cpu_group, self.device_group, self.ranks, self.device, where
        )
        self.device_communicator: DeviceCommunicatorBase | None = self._comm if exposed else None

        self.mq_broadcaster: MessageQueue | None = None
        if use_message_queue_broadcaster and self.world_size > 1:
            self.mq_broadcaster = self.create_mq_broadcaster()
        register_group(self)  # found by unique_name (parallel_state.all_reduce & co.)

    def _check_peer(self, op: str, name: str, peer: Any, allow_self: bool = True) -> None:
        """Raise (TypeError, ValueError) unless ``peer`` is a rank of the group."""
        self._comm._check_peer(op, name, peer, allow_self)

    # ------------------------------------------------------------ message queues

    def create_mq_broadcaster(
        self,
        writer_rank: int = 0,
        external_writer_handle: Handle | None = None,
        blocking: bool = True,
    ) -> MessageQueue:
        """A shared-memory ``MessageQueue`` over this group's CPU group (a collective).

        ``writer_rank`` is the group rank that writes, every other rank reads; with
        ``blocking`` every rank waits until the queue is connected. With
        ``external_writer_handle`` (the handle of a queue written by a process outside the
        group, such as vLLM's executor, with one reader per group rank) group rank
        ``writer_rank`` passes that handle to the others and every rank reads that queue as
        reader number ``rank_in_group``; the outside writer joins ``wait_until_ready``, so
        such callers pass ``blocking=False`` and call ``wait_until_ready`` on the queue later.
        """
        self._check_peer("create_mq_broadcaster", "writer", writer_rank)
        return MessageQueue.create_from_process_group(
            self.cpu_group,
            CHUNK_BYTES,
            CHUNKS,
            writer_rank,
            external_writer_handle,
            blocking,
            auth_key=self._auth_key,
        )

    def create_single_reader_mq_broadcasters(
        self, reader_rank_in_group: int = 0, blocking: bool = False
    ) -> tuple[MessageQueue, list[Handle]]:
        """One queue per rank, all read by the rank ``reader_rank_in_group`` (a collective).

        Through ``MessageQueue.create_from_process_group_single_reader``, as vLLM: every rank
        (the reader too) gets a queue that it writes and that only the reader reads; the
        queues' handles are gathered on the reader. Returns ``(queue, handles)``:
        ``handles`` lists every rank's handle (in group rank order) on the reader and is
        empty elsewhere; the reader opens them with
        ``MessageQueue.create_from_handle(handle, 0)``. With ``blocking`` the other ranks
        wait until the reader has opened their queue; the reader cannot wait on its own
        queue before opening it, so it returns at once and calls ``wait_until_ready`` on
        its queue after opening the handles.
        """
        self._check_peer("create_single_reader_mq_broadcasters", "reader", reader_rank_in_group)
        return MessageQueue.create_from_process_group_single_reader(
            self.cpu_group,
            CHUNK_BYTES,
            CHUNKS,
            reader_rank=self.ranks[reader_rank_in_group],
            blocking=blocking,
            auth_key=self._auth_key,
        )

    # ------------------------------------------------------------------- ranks

    @property
    def first_rank(self) -> int:
        """Return the global rank of the first process in the group"""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Return the global rank of the last process in the group"""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """Return whether the caller is the first process in the group"""
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        """Return whether the caller is the last process in the group"""
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """Return the global rank of the process that follows the caller"""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Return the global rank of the process that precedes the caller"""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @contextmanager
    def graph_capture(
        self, graph_capture_context: GraphCaptureContext | None = None
    ) -> Iterator[GraphCaptureContext]:
        """Context for capturing a CUDA graph on a side stream; a plain context on CPU.

        On CUDA the capture stream (a new one unless ``graph_capture_context`` gives it)
        first waits for the current stream, then becomes current inside the block.
        """
        if self.device.type != "cuda":
            yield graph_capture_context or GraphCaptureContext(stream=None)
            return
        if graph_capture_context is None:
            graph_capture_context = GraphCaptureContext(torch.cuda.Stream(device=self.device))
        stream = graph_capture_context.stream
        current = torch.cuda.current_stream(self.device)
        if current != stream:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            yield graph_capture_context

    # -------------------------------------------------------------- collectives

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """
        User-facing all-reduce function before we actually call the
        all-reduce operation.

        Returns the sum of every rank's ``input_``. As vLLM's, it may be summed into
        ``input_``: always use the result, and assume ``input_`` changed. On CPU a
        contiguous ``input_`` whose dtype is summed as it is gets the sum and is returned
        (as vLLM's CPU communicator does); any other, and any on CUDA, gets a new tensor.
        In a group of one it returns ``input_`` itself. ``bool`` tensors sum to the
        logical OR.

        Raises:
            TypeError: ``input_`` is not a tensor, or its dtype cannot be summed.
            ValueError: ``input_`` is not on this group's device.
            CollectiveMismatchError: another rank passed a different dtype or shape, or
                bad arguments (with argument checks on, the default on CPU: then every
                rank raises, before any data moves).
        """
        # vLLM's is out of place on CUDA because it runs as a torch custom op, which may not
        # both mutate and return (Dynamo cannot pass ``self`` to a custom op, hence vLLM's
        # lookup by group name); its CPU communicator sums in place, and so does ours: a
        # new result would land on fresh pages whenever malloc maps it anew.
        if self.world_size == 1:
            return input_
        return self._all_reduce_out_place(input_)

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of ``input_`` over the group, by the device communicator (on CPU, into
        ``input_`` where it can hold it)."""
        return self._comm.all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim``, in rank order."""
        if self.world_size == 1:
            return input_
        return self._all_gather_out_place(input_, dim)

    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather along ``dim`` into a new tensor."""
        return self._comm.all_gather(input_, dim)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather with ``sizes[r]`` entries from rank ``r`` along ``dim``.

        ``input_`` may be a list of tensors sharing ``sizes``; ``sizes=None`` means equal.
        """
        return self._comm.all_gatherv(input_, dim, sizes)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group, then keep this rank's equal slice along ``dim``."""
        if self.world_size == 1:
            return input_
        return self._reduce_scatter_out_place(input_, dim)

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """Sum over the group, then keep this rank's ``sizes[rank]`` entries along ``dim``."""
        return self._comm.reduce_scatterv(input_, dim, sizes)

    def _reduce_scatter_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        """Reduce-scatter along ``dim`` into a new tensor."""
        return self._comm.reduce_scatter(input_, dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Gather every rank's ``input_`` on rank ``dst``, concatenated along ``dim``.

        NOTE: We assume that the input tensor is on the same device across
        all the ranks.
        NOTE: `dst` is the local rank of the destination rank.

        Returns the concatenation (in rank order) on ``dst`` and None elsewhere; in a
        group of one, ``input_`` itself.
        """
        if self.world_size == 1:
            return input_
        return self._comm.gather(input_, dst, dim)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast the input tensor.
        NOTE: `src` is the local rank of the source rank.

        In place: every rank's ``input_`` ends up holding ``src``'s; returns ``input_``.
        """
        if self.world_size == 1:
            self._check_peer("broadcast", "src", src)
            return input_
        return self._comm.broadcast(input_, src)

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any:
        """Broadcast the input object.
        NOTE: `src` is the local rank of the source rank.

        Returns ``obj`` on ``src`` and ``src``'s object on the other ranks. Objects are
        pickled, as in vLLM: use groups of trusted processes only, or give every rank the
        same ``VLLM_BRIDGE_AUTH_KEY``, so that every receiver authenticates an object
        before it unpickles it. A group made with ``use_message_queue_broadcaster``
        broadcasts through its message queue, from ``src=0`` only.

        Raises:
            ValueError: ``src`` is not a rank of the group (on every rank, with argument
                checks on), or is not 0 in a group with a message queue.
            AuthenticationError: with an auth key, an object that fails authentication
                (nothing is unpickled).
        """
        self._agree_on_root("broadcast_object", "src", src)
        if self.world_size == 1:
            return obj
        return self._broadcast_object(obj, src)

    def _agree_on_root(self, op: str, name: str, root: Any, error: Exception | None = None) -> None:
        """Check ``root`` locally, then (with checks on) that every rank passed the same one
        and no rank has an ``error``, so that a rank with bad input cannot leave the others
        blocked."""
        checked, own = self._comm._validated(lambda: self._comm._check_peer(op, name, root, True))
        error = error or own
        code = checked if checked is not None and error is None else -1
        self._comm.agreement.check(Signature(op, params=(code,), param_names=(name,)), error)

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        if self.mq_broadcaster is not None:
            if src != 0:
                raise self._comm._error(
                    "broadcast_object",
                    f"the message queue broadcaster only supports src=0, got {src}",
                )
            return self.mq_broadcaster.broadcast_object(obj)
        return self._objects.broadcast(obj, src)

    def broadcast_object_list(
        self, obj_list: list[Any], src: int = 0, group: ProcessGroup | None = None
    ) -> list[Any]:
        """Broadcast the input object list.
        NOTE: `src` is the local rank of the source rank.

        In place: ``obj_list`` (the same length on every rank) ends up holding ``src``'s
        objects; returns it. ``group`` is accepted for vLLM's signature and ignored. With
        an auth key the objects are authenticated as by :meth:`broadcast_object`.

        Raises:
            ValueError: ``src`` is not a rank of the group, or ``obj_list`` has another
                length than on ``src``.

        Implementation: the objects travel as one pickled list on the group's CPU group
            (vLLM's go over the device group), through ``groups.objects``.
        """
        self._agree_on_root("broadcast_object_list", "src", src)
        if self.world_size == 1:
            return obj_list
        got = self._objects.broadcast(list(obj_list), src)
        if len(got) != len(obj_list):
            raise self._comm._error(
                "broadcast_object_list",
                f"rank {src} sent {len(got)} objects, this rank's obj_list holds {len(obj_list)}",
            )
        obj_list[:] = got
        return obj_list

    def broadcast_tensor_dict(
        self,
        tensor_dict: dict[str, Any] | None = None,
        src: int = 0,
        group: ProcessGroup | None = None,
        metadata_group: ProcessGroup | None = None,
    ) -> dict[str, Any] | None:
        """Broadcast the input tensor dictionary.
        NOTE: `src` is the local rank of the source rank.

        Returns ``tensor_dict`` on ``src``; on the other ranks a new dictionary with
        ``src``'s keys, its top-level tensors received into new tensors (device tensors on
        this group's device, CPU tensors on the CPU) and its other values as ``src`` had
        them (pickled, and authenticated as by :meth:`broadcast_object`). A group of one,
        or torch.distributed not initialized, returns ``tensor_dict``.
        ``group``/``metadata_group`` are accepted for vLLM's signature and, as in vLLM,
        unused.

        Raises:
            TypeError: ``tensor_dict`` on ``src`` is not a dict (on every rank).
            ValueError: ``src`` is not a rank of the group.

        Implementation: the metadata (keys, non-tensor values, tensor shapes) goes as one
            object; then each non-empty tensor is broadcast, CPU tensors on the CPU group
            and device tensors on the device group.
        """
        if not dist.is_initialized() or self.world_size == 1:
            return tensor_dict
        error = None
        if self.rank_in_group == src:
            try:  # (every rank hears of a dictionary that cannot be sent)
                if not isinstance(tensor_dict, dict):
                    raise TypeError(f"expecting a dictionary, got {type(tensor_dict)}")
                metadata_list, tensor_list = split_tensor_dict(tensor_dict)
            except TypeError as exc:
                error = self._comm._error("broadcast_tensor_dict", str(exc), TypeError)
        self._agree_on_root("broadcast_tensor_dict", "src", src, error)
        if self.rank_in_group == src:
            assert isinstance(tensor_dict, dict)
            self._broadcast_object(metadata_list, src=src)
            self._tensors.broadcast(tensor_list, src)
            return tensor_dict
        return self._tensors.receive_broadcast(self._broadcast_object(None, src=src), src)

    def send_tensor_dict(
        self,
        tensor_dict: dict[str, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: dict[str, bool] | None = None,
    ) -> dict[str, Any] | None:
        """Send the input tensor dictionary.
        NOTE: `dst` is the local rank of the destination rank.

        Args:
            tensor_dict: the dictionary to send: its top-level tensors travel as tensors,
                its other values pickled.
            dst: the group rank to send to (default: the next rank).
            all_gather_group: The group for the all-gather operation. If provided,
                an optimization is enabled where each rank in the group sends a
                slice of a tensor and the receiver reconstructs it using an
                all-gather, which can improve performance. This is typically the
                tensor-parallel group.
            all_gather_tensors: A dictionary to specify which tensors should use
                the all-gather optimization, which is only effective when
                `all_gather_group` is provided. By default, this optimization is
                on for any tensor whose size is divisible by the
                `all_gather_group`'s world size. However, it should be disabled
                for tensors that are not fully replicated across the group (e.g.,
                the residual tensor when sequence parallelism is enabled). This
                dictionary allows overriding the default behavior on a per-tensor
                basis.

        Returns:
            None (``tensor_dict`` itself in a group of one, or when torch.distributed is
            not initialized).

        Raises:
            TypeError: ``tensor_dict`` is not a dict.
            ValueError: ``dst`` is not another rank of the group, or
                ``all_gather_tensors`` asks for the all-gather without an
                ``all_gather_group``.
        """
        if not dist.is_initialized() or self.world_size == 1:
            return tensor_dict
        self._wait_all(
            self.isend_tensor_dict(tensor_dict, dst, all_gather_group, all_gather_tensors), []
        )
        return None

    def recv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: dict[str, bool] | None = None,
    ) -> dict[str, Any] | None:
        """Recv the input tensor dictionary.
        NOTE: `src` is the local rank of the source rank.

        Args:
            src: the group rank to receive from (default: the previous rank).
            all_gather_group: The group for the all-gather operation. If provided,
                an optimization is enabled where each rank in the group sends a
                slice of a tensor and the receiver reconstructs it using an
                all-gather, which can improve performance. This is typically the
                tensor-parallel group.
            all_gather_tensors: A dictionary to specify which tensors should use
                the all-gather optimization, which is only effective when
                `all_gather_group` is provided. By default, this optimization is
                on for any tensor whose size is divisible by the
                `all_gather_group`'s world size. However, it should be disabled
                for tensors that are not fully replicated across the group (e.g.,
                the residual tensor when sequence parallelism is enabled). This
                dictionary allows overriding the default behavior on a per-tensor
                basis.

        Returns:
            The dictionary ``src`` sent: its tensors in new tensors (device tensors on this
            group's device), its other values as sent. None in a group of one, or when
            torch.distributed is not initialized.

        Raises:
            ValueError: ``src`` is not another rank of the group, or
                ``all_gather_tensors`` asks for the all-gather without an
                ``all_gather_group``.
        """
        received, handles, postprocess = self.irecv_tensor_dict(
            src, all_gather_group, all_gather_tensors
        )
        self._wait_all(handles, postprocess)
        return received

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place SUM all-reduce of a small CPU tensor over ``cpu_group``, within the
        group's timeout (``utils.cpu_all_reduce_``, which is ``groups.torch_group``'s)."""
        return cpu_all_reduce_(tensor, self.cpu_group, self.cpu_timeout)

    def make_sibling_device_group(self, group_desc: str | None = None) -> ProcessGroup:
        """A new device-side group with the members of ``device_group`` but a communicator
        of its own, for work that may run beside the group's. A collective of the whole
        world: every rank calls it (each group of ``group_ranks`` is made anew)."""
        sibling: ProcessGroup | None = None
        for ranks in self.group_ranks:
            group = dist.new_group(
                ranks,
                backend=self.torch_distributed_backend,
                timeout=self.cpu_timeout,
                group_desc=group_desc,
            )
            if self.rank in ranks:
                sibling = group
        if sibling is None:  # (the constructor found this rank in group_ranks)
            raise StateError(f"rank {self.rank} is in none of {self.group_ranks}")
        return sibling

    def barrier(self) -> None:
        """Barrier synchronization among the group.

        Returns once every rank of the group has called it; it leaves the current CUDA
        device and stream alone, on any backend.
        """
        # As vLLM: "don't use `device_group` here! `barrier` in NCCL is terrible because it
        # is internally a broadcast operation with secretly created GPU tensors. It is easy
        # to mess up the current device. Use the CPU group instead."
        self._comm._finish(dist.barrier(group=self.cpu_group, async_op=True), "barrier", True)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Sends a tensor to the destination rank in a blocking way

        NOTE: `dst` is the local rank of the destination rank (default: the next rank).
        """
        self._comm.send(tensor, dst)

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receives a tensor from the source rank.

        NOTE: `src` is the local rank of the source rank (default: the previous rank).
        """
        return self._comm.recv(size, dtype, src)

    def destroy(self) -> None:
        """Destroy the group's process groups, communicator and message queue (idempotent)."""
        if hasattr(self, "device_group"):
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.device_group)
            del self.device_group
        if hasattr(self, "cpu_group"):
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.cpu_group)
            del self.cpu_group
        comm = getattr(self, "_comm", None)
        if comm is not None:
            comm.destroy()
        queue, self.mq_broadcaster = getattr(self, "mq_broadcaster", None), None
        close = getattr(queue, "close", None)
        if close is not None:  # release the shared memory now rather than at collection
            with contextlib.suppress(Exception):
                close()

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Let the device communicator size its buffers for ``model`` (a no-op without one)."""
        self._comm.prepare_communication_buffer_for_model(model)
