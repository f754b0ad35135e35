"""How a CpuCommunicator runs on ShmCollectives: a stand-in for torch.distributed, and the
argument checks in shared memory.

:class:`ShmDistModule` answers the collectives ShmCollectives does (for this communicator's
groups) and hands everything else to ``torch.distributed``; :class:`ShmAgreement` runs the
communicator's pre-collective argument checks as one shared-memory exchange instead of a
gloo all-gather.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.agreement import Agreement, Signature
from bridge_py.distributed.device_communicators.shm_allreduce import ShmCollectives
from bridge_py.distributed.errors import CollectiveMismatchError

__all__ = ["ShmAgreement", "ShmDistModule"]


class ShmDistModule:
    """``torch.distributed`` for one communicator, with its collectives over shared memory.

    ``all_reduce`` (SUM), ``all_gather_single``/``all_gather_into_tensor`` and
    ``reduce_scatter_single``/``reduce_scatter_tensor`` (SUM) on the communicator's groups
    and contiguous CPU tensors run on :class:`ShmCollectives`; everything else (other ops,
    other groups, ``async_op``) and every other function is ``torch.distributed``'s.
    """

    def __init__(self, shm: ShmCollectives, groups: tuple[ProcessGroup, ...]) -> None:
        self.shm = shm
        self._groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _ours(self, group: Any, async_op: bool, *tensors: torch.Tensor) -> bool:
        return (
            not async_op
            and any(group is g for g in self._groups)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Sum ``tensor`` over the group, in place (as ``torch.distributed.all_reduce``)."""
        if op == dist.ReduceOp.SUM and self._ours(group, async_op, tensor):
            flat = tensor.view(-1)
            self.shm.all_reduce(flat, flat)
            return None
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Every rank's ``input_`` into ``output``, rank-major."""
        if self._ours(group, async_op, output, input_) and output.dtype == input_.dtype:
            self.shm.all_gather(output.view(-1), input_.view(-1))
            return None
        return _torch_all_gather(output, input_, group, async_op)

    all_gather_into_tensor = all_gather_single

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input_: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        """Sum ``input_`` over the group and keep this rank's rank-major piece."""
        if (
            op == dist.ReduceOp.SUM
            and self._ours(group, async_op, output, input_)
            and output.dtype == input_.dtype
        ):
            self.shm.reduce_scatter(output.view(-1), input_.view(-1))
            return None
        return _torch_reduce_scatter(output, input_, op, group, async_op)

    reduce_scatter_tensor = reduce_scatter_single


def _torch_all_gather(
    output: torch.Tensor, input_: torch.Tensor, group: Any, async_op: bool
) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input_, group=group, async_op=async_op)


def _torch_reduce_scatter(
    output: torch.Tensor, input_: torch.Tensor, op: Any, group: Any, async_op: bool
) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input_, op=op, group=group, async_op=async_op)


class ShmAgreement(Agreement):
    """The pre-collective argument check, with its table exchanged through shared memory.

    Same verdicts and messages as :class:`Agreement` (whose gloo all-gather costs as much
    as a small all-reduce); :meth:`judge` also serves collectives that carry their rows in
    their own first data step.
    """

    def __init__(self, base: Agreement, shm: ShmCollectives) -> None:
        super().__init__(base.cpu_group, base.rank_in_group, base.ranks, base.label, base.enabled)
        self.shm = shm

    def check(self, signature: Signature, error: Exception | None = None) -> None:
        """Raise on every rank unless all ranks passed valid, matching arguments."""
        if not self.enabled or self.world_size == 1:
            if error is not None:
                raise error
            return
        row = signature.encode(error is not None).numpy().tobytes()
        self.shm.exchange(row, lambda rows: self.judge(signature, rows, error))

    def judge(self, signature: Signature, rows: list[bytes], error: Exception | None) -> None:
        """The verdict on a table of encoded rows: return, or raise on every rank."""
        first = rows[0]
        if error is None and first[8:16] == bytes(8) and all(row == first for row in rows):
            return  # the common case, decided without decoding
        table = [list(struct.unpack(f"<{len(row) // 8}q", row)) for row in rows]
        if any(r[1] for r in table):
            self._raise_rejected(signature, table, error)
        mismatch = self._first_mismatch(signature, table)
        if mismatch is not None:
            raise CollectiveMismatchError(mismatch)
