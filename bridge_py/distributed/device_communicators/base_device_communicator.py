"""DeviceCommunicatorBase: the collectives of one group, over torch.distributed.

Same names, signatures and results as vLLM's ``DeviceCommunicatorBase``, with these
differences, all in the caller's favour:

* every documented method works on any backend: ``all_gatherv`` and ``reduce_scatterv``
  (uneven sizes, any dim) are implemented instead of raising NotImplementedError, and
  dtypes the backend lacks (``int16`` on gloo, ``bool`` sums) are adapted
  (see ``wire_dtypes``);
* arguments are validated, and with checks on (the default on CPU, see ``agreement``) all
  ranks agree on them before any data moves, so bad input raises a clear error on every
  rank instead of aborting the process or hanging, and the group keeps working;
* a missing ``device_group`` means the ``cpu_group`` (vLLM would silently use the world).

Collectives go through ``self.dist_module`` (``torch.distributed``, as vLLM's attribute);
the all-gather and reduce-scatter steps go through two methods (``_all_gather_wire``,
``_reduce_scatter_wire``), the hooks where a device-specific transport such as the CPU
communicator's shared memory plugs in. Each collective that blocks the CPU (gloo's) runs
with ``async_op=True`` and waits in :meth:`DeviceCommunicatorBase._finish`, within the
caller's deadline when there is one (``groups.work``): it then raises CollectiveTimeout
instead of blocking until the group's timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.agreement import (
    Agreement,
    Signature,
    checks_enabled,
    dtype_code,
    hash_ints,
)
from bridge_py.distributed.device_communicators.all2all_base import (
    All2AllManagerBase,
    Dispatched,
    DispatchedTopk,
)
from bridge_py.distributed.device_communicators.checks import CommunicatorChecks
from bridge_py.distributed.device_communicators.p2p_batch import run_batch
from bridge_py.distributed.device_communicators.torch_compat import (
    all_gather_into,
    reduce_scatter_into,
)
from bridge_py.distributed.device_communicators.wire_dtypes import for_reduction, for_transport

__all__ = ["All2AllManagerBase", "DeviceCommunicatorBase", "Dispatched", "DispatchedTopk"]


def pad_rows(rows: torch.Tensor, longest: int) -> torch.Tensor:
    """``rows`` (along dim 0) with rows of zeros after them, up to ``longest``."""
    if rows.shape[0] >= longest:
        return rows
    return torch.cat([rows, rows.new_zeros((longest - rows.shape[0], *rows.shape[1:]))])


def spread_rows(rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``rows`` cut into pieces of ``sizes`` rows, each padded to the longest piece: the
    input of a reduce-scatter whose rank ``r`` keeps ``sizes[r]`` rows."""
    return torch.stack([pad_rows(piece, max(sizes)) for piece in rows.split(sizes)])


def unpad_rows(stacked: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The first ``sizes[r]`` rows of every ``stacked[r]`` (rank-major padded pieces),
    concatenated: what :func:`pad_rows` padded, all-gathered, unpadded."""
    return torch.cat([stacked[r, :n] for r, n in enumerate(sizes)])


def _registered(group: ProcessGroup) -> bool:
    """Whether torch.distributed's world knows ``group`` (made by ``new_group`` or the
    default group), as opposed to a stateless group made outside it."""
    from torch.distributed.distributed_c10d import _world

    return group in _world.pg_map


class DeviceCommunicatorBase(CommunicatorChecks):
    """
    Base class for device-specific communicator.
    It can use the `cpu_group` to initialize the communicator.
    If the device has PyTorch integration (PyTorch can recognize its
    communication backend), the `device_group` will also be given.
    """

    # Whether all_reduce sums into its input where it can hold the sum: vLLM's base and
    # CPU communicators do; its CUDA one (pynccl, custom kernels) returns a new tensor.
    sums_in_place = True

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        global_ranks: list[int] | None = None,
        global_world_size: int | None = None,
        use_all2all: bool = False,
    ) -> None:
        """Initialize self. See help(type(self)) for accurate signature.

        ``use_all2all`` asks subclasses for an all-to-all manager so that
        ``dispatch``/``combine`` move tokens; GroupCoordinator passes its own
        ``use_all2all`` (vLLM's rule: an expert-parallel group while data parallelism is on).
        ``global_ranks`` and ``global_world_size`` are vLLM's, for a stateless
        ``cpu_group`` (one torch.distributed's world does not know); such a group is refused
        here (NotImplementedError), and for the groups of the world they are not needed
        (the world says them) and are ignored, as in vLLM.
        """
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cpu_group = cpu_group
        self.device_group = device_group if device_group is not None else cpu_group
        self.unique_name = unique_name
        if not _registered(cpu_group):
            raise NotImplementedError(
                f"{type(self).__name__}: cpu_group is not a group of torch.distributed's world "
                "(a stateless group, as stateless_init_torch_distributed_process_group makes): "
                "this communicator runs its collectives through torch.distributed, which cannot "
                "reach such a group; make the group with torch.distributed.new_group"
            )
        self.rank = dist.get_rank(cpu_group)
        self.world_size = dist.get_world_size(cpu_group)
        self.ranks = dist.get_process_group_ranks(cpu_group)
        self.global_rank = dist.get_rank()
        self.global_world_size = dist.get_world_size()
        self.rank_in_group = dist.get_group_rank(cpu_group, self.global_rank)
        self.backend = str(dist.get_backend(self.device_group))
        self.dist_module: Any = dist
        self.use_all2all = bool(use_all2all)
        self.all2all_manager: All2AllManagerBase | None = None
        name = f"group {unique_name!r}" if unique_name else "group"
        self.agreement = Agreement(
            cpu_group,
            self.rank_in_group,
            self.ranks,
            f"{name} (global ranks {self.ranks})",
            checks_enabled(self.device),
        )
        # Only a gloo device group blocks the CPU while it waits (NCCL's wait orders a
        # stream), so only its waits keep to the caller's deadline.
        self._device_blocks = self.backend == "gloo"

    # ------------------------------------------------------------- validation, agreement

    def _check_dim(self, op: str, tensor: torch.Tensor, dim: Any) -> int:
        """``dim`` as a non-negative dim of ``tensor``."""
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise self._error(op, f"dim must be an int, got {dim!r}", TypeError)
        if not -tensor.dim() <= dim < tensor.dim():
            raise self._error(
                op, f"invalid dim ({dim}) for input tensor with shape {tuple(tensor.shape)}"
            )
        return dim % tensor.dim()

    def _agree(
        self,
        op: str,
        tensor: Any,
        check: Callable[[], tuple[int, ...]] | None = None,
        names: tuple[str, ...] = (),
        reduce: bool = False,
        name: str = "input_",
        written: bool = False,
    ) -> tuple[int, ...]:
        """Validate this rank's arguments, then agree on them with the other ranks.

        ``tensor`` (the parameter ``name``) is checked first (a dense tensor of this
        device, summable with ``reduce``, writable with ``written``);
        then ``check`` returns the parameters (named by ``names``) that every rank must
        pass alike, raising TypeError/ValueError for bad ones. Every rank raises unless all
        ranks passed valid, matching arguments; returns the parameters.
        """

        def validate() -> tuple[int, ...]:
            self._check_tensor(op, tensor, reduce, name=name, written=written)
            return () if check is None else check()

        params, error = self._validated(validate)
        self.agreement.check(self._signature(op, tensor, params or (), names), error)
        assert params is not None  # (an error raised above)
        return params

    @staticmethod
    def _signature(
        op: str,
        tensor: Any,
        params: tuple[int, ...] = (),
        names: tuple[str, ...] = (),
        shape: tuple[int, ...] | None = None,
    ) -> Signature:
        if not isinstance(tensor, torch.Tensor) or tensor.is_nested:  # (no one shape)
            return Signature(op, None, None, params, names)
        return Signature(op, tensor.dtype, shape or tuple(tensor.shape), params, names)

    # ------------------------------------------------------- transport (the device hooks)

    def _all_gather_wire(self, out: torch.Tensor, wire: torch.Tensor) -> None:
        """Every rank's flat ``wire`` into ``out``, rank-major (same dtype)."""
        self._finish(all_gather_into(out, wire, self.device_group, async_op=True), "all_gather")

    def _reduce_scatter_wire(self, out: torch.Tensor, wire: torch.Tensor) -> None:
        """Sum ``wire`` (rows) over the group and keep this rank's rank-major piece."""
        work = reduce_scatter_into(out, wire, self.device_group, async_op=True)
        self._finish(work, "reduce_scatter")

    # --------------------------------------------------------------------- collectives

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum ``input_`` over the group, into ``input_`` where it can hold the sum.

        As vLLM's: a contiguous ``input_`` whose dtype the backend sums as it is gets the
        sum and is returned; any other (``bool``, a dtype widened for the backend, a
        non-contiguous view) gets a new tensor and is left unchanged. Use the result.
        (The CUDA communicator always returns a new tensor, as vLLM's does.) ``bool``
        tensors come back as the logical OR over the ranks.
        """
        self._agree("all_reduce", input_, reduce=True)
        if input_.numel() == 0:
            return input_.clone()
        wire, restore = for_reduction(input_, self.backend)
        if not self.sums_in_place and wire.data_ptr() == input_.data_ptr():
            wire = wire.clone()
        self._finish(
            self.dist_module.all_reduce(wire, group=self.device_group, async_op=True), "all_reduce"
        )
        if wire.data_ptr() == input_.data_ptr():
            return input_  # summed into it, as vLLM's
        return restore(wire).reshape(input_.shape)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim``, in rank order."""
        op = "all_gather"
        (dim_n,) = self._agree(op, input_, lambda: (self._check_dim(op, input_, dim),), ("dim",))
        shape = tuple(input_.shape)
        out_shape = (*shape[:dim_n], self.world_size * shape[dim_n], *shape[dim_n + 1 :])
        if input_.numel() == 0:
            return torch.empty(out_shape, dtype=input_.dtype, device=input_.device)
        stacked = self._gather_flat(input_).reshape((self.world_size, *shape))
        return stacked.movedim(0, dim_n).reshape(out_shape)

    def _gather_flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same size everywhere), flat and in rank order."""
        wire, restore = for_transport(tensor, self.backend)
        out = torch.empty(self.world_size * wire.numel(), dtype=wire.dtype, device=wire.device)
        self._all_gather_wire(out, wire)
        return restore(out)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather where rank ``r`` contributes ``sizes[r]`` entries along ``dim``.

        ``input_`` may be a list of tensors (each gathered with the same ``sizes``; a list
        comes back). ``sizes=None`` means every rank has the same size. vLLM supports only
        ``dim=0``; any dim works here.
        """
        op = "all_gatherv"
        single = isinstance(input_, torch.Tensor)
        tensors: list[Any] = [input_] if isinstance(input_, torch.Tensor) else list(input_)

        def validate() -> list[int]:
            if not tensors:
                raise self._error(op, "no tensors to gather")
            dims = []
            for tensor in tensors:
                self._check_tensor(op, tensor)
                dims.append(self._check_dim(op, tensor, dim))
            if sizes is not None:
                mine = self._check_sizes(op, sizes)[self.rank_in_group]
                for tensor, d in zip(tensors, dims, strict=True):
                    if tensor.shape[d] != mine:
                        raise self._error(
                            op,
                            f"the tensor has {tensor.shape[d]} entries along dim {dim} but "
                            f"sizes[{self.rank_in_group}] is {mine} (sizes={list(sizes)})",
                        )
            return dims

        dims, error = self._validated(validate)
        params: tuple[int, ...] = ()
        masked = None
        if dims is not None:
            # What every rank must share: each tensor's dtype and shape, but for the gathered
            # dim when sizes are given (-2: may differ).
            shapes = [
                tuple(-2 if (sizes is not None and i == d) else n for i, n in enumerate(t.shape))
                for t, d in zip(tensors, dims, strict=True)
            ]
            masked = shapes[0]
            layout = [dtype_code(t.dtype) for t in tensors] + [len(shape) for shape in shapes]
            layout += [n for shape in shapes for n in shape]
            params = (dims[0], hash_ints(sizes), len(tensors), hash_ints(layout))
        names = ("dim", "sizes#", "number of tensors", "tensor shapes or dtypes#")
        first = tensors[0] if dims is not None else None
        signature = self._signature(op, first, params, names, masked)
        self.agreement.check(signature, error)
        assert dims is not None
        results = [self._gather_uneven(t, d, sizes) for t, d in zip(tensors, dims, strict=True)]
        return results[0] if single else results

    def _gather_uneven(
        self, tensor: torch.Tensor, dim: int, sizes: list[int] | None
    ) -> torch.Tensor:
        if sizes is None:
            sizes = [tensor.shape[dim]] * self.world_size
        rows = tensor.movedim(dim, 0)
        rest = tuple(rows.shape[1:])
        longest = max(sizes)
        out_shape = (*tensor.shape[:dim], sum(sizes), *tensor.shape[dim + 1 :])
        if longest == 0 or math.prod(rest) == 0:
            return torch.empty(out_shape, dtype=tensor.dtype, device=tensor.device)
        stacked = self._gather_flat(pad_rows(rows, longest)).reshape((-1, longest, *rest))
        return unpad_rows(stacked, sizes).movedim(0, dim).contiguous()

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum ``input_`` over the group and keep this rank's equal slice along ``dim``."""
        op = "reduce_scatter"

        def check() -> tuple[int]:
            dim_n = self._check_dim(op, input_, dim)
            if input_.shape[dim_n] % self.world_size != 0:
                raise self._error(
                    op,
                    f"the size along dim {dim} ({input_.shape[dim_n]}) is not divisible by "
                    f"the group size ({self.world_size})",
                )
            return (dim_n,)

        (dim_n,) = self._agree(op, input_, check, ("dim",), reduce=True)
        chunk = input_.shape[dim_n] // self.world_size
        return self._reduce_rows(input_, dim_n, [chunk] * self.world_size)

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """Reduce-scatter where rank ``r`` keeps ``sizes[r]`` entries along ``dim``.

        ``input_`` has ``sum(sizes)`` entries along ``dim`` on every rank; ``sizes=None``
        means equal slices (as :meth:`reduce_scatter`).
        """
        if sizes is None:
            return self.reduce_scatter(input_, dim)
        op = "reduce_scatterv"

        def check() -> tuple[int, int]:
            dim_n = self._check_dim(op, input_, dim)
            total = sum(self._check_sizes(op, sizes))
            if total != input_.shape[dim_n]:
                raise self._error(
                    op,
                    f"sum(sizes) = {total} but the tensor has {input_.shape[dim_n]} entries "
                    f"along dim {dim} (sizes={list(sizes)})",
                )
            return dim_n, hash_ints(sizes)

        dim_n, _ = self._agree(op, input_, check, ("dim", "sizes#"), reduce=True)
        return self._reduce_rows(input_, dim_n, list(sizes))

    def reduce_scatterv_into_output(
        self,
        input_: torch.Tensor,
        output: torch.Tensor,
        dim: int = -1,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce_scatterv`, with this rank's part written into ``output`` (a tensor
        of that part's shape and a dtype it can be copied into); returns ``output``."""
        return self._into(
            "reduce_scatterv_into_output", output, self.reduce_scatterv(input_, dim, sizes)
        )

    def _into(self, op: str, output: Any, result: torch.Tensor) -> torch.Tensor:
        """``result`` copied into ``output`` (the parameter of ``op``), which is returned.
        Called after the collective, so that a bad ``output`` leaves the group in step."""
        if not isinstance(output, torch.Tensor):
            kind = type(output).__name__
            raise self._error(op, f"output: expected a torch.Tensor, got {kind}", TypeError)
        if output.shape != result.shape:
            raise self._error(
                op,
                f"output has shape {tuple(output.shape)} but the result has shape "
                f"{tuple(result.shape)}",
            )
        return output.copy_(result)

    def _reduce_rows(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        rows = tensor.movedim(dim, 0)
        rest = tuple(rows.shape[1:])
        longest = max(sizes)
        mine = sizes[self.rank_in_group]
        if longest == 0 or rows.numel() == 0:
            out = torch.zeros((mine, *rest), dtype=tensor.dtype, device=tensor.device)
            return out.movedim(0, dim).contiguous()
        if any(s != longest for s in sizes):
            rows = spread_rows(rows, sizes).reshape((self.world_size * longest, *rest))
        wire, restore = for_reduction(rows.contiguous(), self.backend)
        out = torch.empty((longest, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
        self._reduce_scatter_wire(out, wire)
        return restore(out)[:mine].movedim(0, dim).contiguous()

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Gather every rank's ``input_`` on rank ``dst``, concatenated along ``dim``.

        NOTE: We assume that the input tensor is on the same device across
        all the ranks.
        NOTE: `dst` is the local rank of the destination rank.

        Returns the concatenation (in rank order) on ``dst`` and None on the other ranks.
        """
        op = "gather"

        def check() -> tuple[int, int]:
            return self._check_peer(op, "dst", dst, True), self._check_dim(op, input_, dim)

        _, dim_n = self._agree(op, input_, check, ("dst", "dim"))
        is_dst = self.rank_in_group == dst
        if input_.numel() == 0:
            if not is_dst:
                return None
            return torch.cat([input_] * self.world_size, dim=dim_n)
        wire, restore = for_transport(input_, self.backend)
        gather_list = [torch.empty_like(wire) for _ in range(self.world_size)] if is_dst else None
        work = self.dist_module.gather(
            wire, gather_list, dst=self.ranks[dst], group=self.device_group, async_op=True
        )
        self._finish(work, op)
        if gather_list is None:
            return None
        parts = [restore(part).reshape(input_.shape) for part in gather_list]
        return torch.cat(parts, dim=dim_n)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``tensor`` from the group's rank ``src`` into every rank's ``tensor``.

        Shares the checks and dtype handling of the other collectives. Returns ``tensor``.
        """
        self._agree(
            "broadcast",
            tensor,
            lambda: (self._check_peer("broadcast", "src", src, True),),
            ("src",),
            written=True,
        )
        if tensor.numel() == 0:
            return tensor
        wire, restore = for_transport(tensor, self.backend)
        work = self.dist_module.broadcast(
            wire, src=self.ranks[src], group=self.device_group, async_op=True
        )
        self._finish(work, "broadcast")
        if self.rank_in_group != src and wire.data_ptr() != tensor.data_ptr():
            tensor.copy_(restore(wire).reshape(tensor.shape))  # (received into a copy)
        return tensor

    # ------------------------------------------------------------------ memory

    def checkpoint_prepare(self) -> None:
        """Prepare reclaimable communicator state for a checkpoint (here: nothing to do)."""

    def checkpoint_restore(self) -> None:
        """Restore communicator state after a checkpoint (here: nothing to do)."""

    def get_symmetric_memory_buffer(
        self,
        role: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor | None:
        """A symmetric-memory tensor for ``role`` (vLLM's NCCL windows), or None: there is
        no symmetric memory here, so callers allocate ordinary tensors."""
        return None

    def suspend(self) -> None:
        """Release reclaimable communicator memory (here: none is held)."""

    def resume(self) -> None:
        """Restore memory released by ``suspend`` (here: none was)."""

    # ------------------------------------------------------------------ point to point

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Sends a tensor to the destination rank in a blocking way

        NOTE: `dst` is the local rank of the destination rank (default: the next rank).

        Implementation: with checks on, the tensor is preceded by a header (its agreement
        row) on the CPU group, which :meth:`recv` compares with what it expects.
        """
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self._check_tensor("send", tensor, name="tensor")
        peer = self.ranks[self._check_peer("send", "dst", dst, False)]
        wire, _ = for_transport(tensor, self.backend)
        if self.agreement.enabled:
            header = self._header(tensor, wire)
            self._finish(self.dist_module.isend(header, peer, group=self.cpu_group), "send", True)
        if wire.numel() > 0:
            self._finish(self.dist_module.isend(wire, peer, group=self.device_group), "send")

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receives a tensor from the source rank.

        NOTE: `src` is the local rank of the source rank (default: the previous rank).
        With checks on, a tensor whose shape or dtype differs from ``size``/``dtype`` is
        received, dropped, and reported with a ValueError (the pair stays in step).
        """
        op = "recv"
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        peer = self.ranks[self._check_peer(op, "src", src, False)]
        if not isinstance(dtype, torch.dtype):
            raise self._error(op, f"dtype must be a torch.dtype, got {dtype!r}", TypeError)
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        wire, _ = for_transport(tensor, self.backend)
        if self.agreement.enabled:

            def receive(buffer: torch.Tensor, header: bool) -> Any:
                group = self.cpu_group if header else self.device_group
                return self.dist_module.irecv(buffer, peer, group=group)

            self._expect(self._header(tensor, wire), src, receive)
        if wire.numel() > 0:  # the wire views ``tensor`` (torch.empty is contiguous)
            self._finish(self.dist_module.irecv(wire, peer, group=self.device_group), op)
        return tensor

    def batch_isend_irecv(self, p2p_ops: list[Any]) -> None:
        """Run a batch of sends and receives together; returns once all have completed.

        Each of ``p2p_ops`` is a ``torch.distributed.P2POp`` or an object with its fields
        (as vLLM builds them): ``op`` (``torch.distributed.isend`` or ``irecv``),
        ``tensor``, and ``group_peer``, the peer's rank in this group (else ``peer``, its
        global rank). Every send is posted before any receive waits, so ranks may send to
        each other in one batch; two ranks list their messages to each other in the same
        order, as with NCCL. With checks on, a message whose shape or dtype differs from
        the receiving tensor's is received and dropped, and a ValueError raised once the
        batch is done.
        """
        run_batch(self, p2p_ops, self.ranks, self.cpu_group, self.device_group)

    # ----------------------------------------------------------------- model & all2all

    def destroy(self) -> None:
        """Release what the communicator holds (its all-to-all manager); groups stay."""
        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
            self.all2all_manager = None

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """
        Prepare the communication buffer for the model.
        """
        if self.all2all_manager is not None:
            self.all2all_manager.prepare_communication_buffer_for_model(model)

    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Dispatched:
        """
        Dispatch the hidden states and router logits to the appropriate device.
        Without an all-to-all manager (always, in the base class) this is a no-op.

        Returns ``(hidden_states, router_logits)``, plus ``extra_tensors`` when given.
        """
        if self.all2all_manager is not None:
            return self.all2all_manager.dispatch_router_logits(
                hidden_states, router_logits, is_sequence_parallel, extra_tensors
            )
        if extra_tensors is not None:
            return hidden_states, router_logits, extra_tensors
        return hidden_states, router_logits

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> DispatchedTopk:
        """
        Dispatch the hidden states and topk weights/ids to the appropriate device.
        Without an all-to-all manager (always, in the base class) this is a no-op.

        The tokens are routed already: ``topk_weights`` and ``topk_ids`` hold each token's
        experts and their weights, a row per token. Returns ``(hidden_states, topk_weights,
        topk_ids)``, plus ``extra_tensors`` when given.
        """
        if self.all2all_manager is not None:
            return self.all2all_manager.dispatch(
                hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors
            )
        if extra_tensors is not None:
            return hidden_states, topk_weights, topk_ids, extra_tensors
        return hidden_states, topk_weights, topk_ids

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """
        Combine the hidden states and router logits from the appropriate device.
        Without an all-to-all manager (always, in the base class) this is a no-op.
        """
        if self.all2all_manager is not None:
            return self.all2all_manager.combine(hidden_states, is_sequence_parallel)
        return hidden_states

    def allocate_combine_input(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor | None:
        """A buffer for :meth:`combine`'s input that the transport reads directly, from the
        all-to-all manager; None (always, here): allocate an ordinary tensor."""
        if self.all2all_manager is None:
            return None
        return self.all2all_manager.allocate_combine_input(
            shape, dtype, device, is_sequence_parallel
        )

    def combine_into_output(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor:
        """:meth:`combine`, with the result written into ``output``; returns ``output``."""
        if self.all2all_manager is not None:
            return self.all2all_manager.combine_into_output(
                hidden_states, output, is_sequence_parallel
            )
        return self._into(
            "combine_into_output", output, self.combine(hidden_states, is_sequence_parallel)
        )
