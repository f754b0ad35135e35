"""What every PyNcclCommunicator operation shares: its checks and how its data moves.

``PyNcclCommunicator`` (``pynccl``) is built in three layers, one module each:
:class:`PyNcclCore` here (the state, the argument checks, the agreement of the ranks on
them, and the reductions and gathers over shared memory, gloo or NCCL), the operations
made of sends and receives (``pynccl_p2p``), and the constructor, the collectives and
the communicator's life (``pynccl``). See ``pynccl``'s docstring for the behaviour.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from bridge_py.distributed.device_communicators.agreement import Judge, Signature
from bridge_py.distributed.device_communicators.checks import CommunicatorChecks
from bridge_py.distributed.device_communicators.nccl_group import NcclGroup
from bridge_py.distributed.device_communicators.shm_collectives import ShmCollectives
from bridge_py.distributed.device_communicators.wire_dtypes import for_reduction, reducible
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.spg.group import StatelessProcessGroup

__all__ = ["PyNcclCore", "flat_bytes"]

_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
# An operation over shared memory (given the agreement row and its judge), or on the group.
ShmRun = Callable[[ShmCollectives, bytes, Judge], None]
Run = Callable[[], Any]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (exact for every dtype, on every backend)."""
    return tensor.reshape(-1).view(torch.uint8)


class PyNcclCore(CommunicatorChecks):
    """The state and plumbing of a PyNcclCommunicator (see the module docstring)."""

    group: ProcessGroup | StatelessProcessGroup
    rank: int
    world_size: int
    device: torch.device
    available: bool
    disabled: bool
    label: str
    _shm: ShmCollectives | None
    _pg: ProcessGroup | NcclGroup | None
    _depth: int  # group_start nesting
    _suspended: bool

    @property
    def _group(self) -> ProcessGroup:
        if self._pg is None:
            raise StateError(f"{self.label} was {'suspended' if self._suspended else 'destroyed'}")
        return cast(ProcessGroup, self._pg)  # an NcclGroup answers the calls made of it

    def _live(self, op: str) -> None:
        """StateError while the communicator is suspended (``suspend``)."""
        if self._suspended:
            raise StateError(
                f"{op} on {self.agreement.where}: the communicator is suspended; "
                "call resume() on every rank first"
            )

    def _check(self, op: str, name: str, tensor: Any, like: torch.Tensor | None = None) -> None:
        """The shared tensor check, strict: the memory is read as it is, so `tensor` must
        be contiguous and on this very device (and of `like`'s dtype)."""
        self._check_tensor(op, tensor, name=name, like=like, strict=True)

    def _check_numel(self, op: str, name: str, tensor: torch.Tensor, numel: int, how: str) -> None:
        if tensor.numel() != numel:
            shape = tuple(tensor.shape)
            raise self._error(
                op, f"{name} has {tensor.numel()} elements (shape {shape}), {how} = {numel}"
            )

    def _check_shape(
        self, op: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...]
    ) -> None:
        if tensor.dim() == 0 or tuple(tensor.shape) != shape:
            raise self._error(op, f"{name} has shape {tuple(tensor.shape)}, not {shape}")

    def _check_rows(self, op: str, output: Any, inp: Any, sizes: Any, scatter: bool) -> list[int]:
        """The checks of `all_gatherv` and (`scatter`) `reduce_scatterv`: `sizes` rows."""
        self._check(op, "input_tensor", inp)
        self._check(op, "output_tensor", output, inp)
        counts, rest = self._check_sizes(op, sizes), tuple(inp.shape[1:])
        rows = (sum(counts), counts[self.rank]) if scatter else (counts[self.rank], sum(counts))
        for name, tensor, n in zip(
            ("input_tensor", "output_tensor"), (inp, output), rows, strict=True
        ):
            if tensor.dim() == 0 or tuple(tensor.shape) != (n, *rest):
                shape = tuple(tensor.shape)
                raise self._error(op, f"{name} has shape {shape}, not {(n, *rest)} ({sizes=})")
        return counts

    def _check_op(self, op: str, reduce_op: Any, dtype: torch.dtype) -> int:
        if reduce_op not in _OPS:
            raise self._error(
                op,
                f"op must be ReduceOp.SUM, AVG, PRODUCT, MIN or MAX, not {reduce_op!r}",
                TypeError,
            )
        # Sums work for every dtype (bool: a logical OR), averages for floating types; the
        # others are not defined for complex numbers, nor MIN and MAX for uint64 (which
        # travels as int64 bits).
        defined = reducible(dtype, self.backend)
        if reduce_op == ReduceOp.AVG:
            defined = defined and (dtype.is_floating_point or dtype.is_complex)
        elif reduce_op != ReduceOp.SUM:
            order = reduce_op == ReduceOp.PRODUCT or dtype != torch.uint64
            defined = defined and not dtype.is_complex and order
        if not defined:
            raise self._error(op, f"op={reduce_op!r} is not defined for dtype {dtype}", TypeError)
        return int(reduce_op)

    def _signed(self, op: str, check: Callable[[], Signature]) -> Signature:
        """`check()`: the arguments every rank must share; a TypeError or ValueError it raises
        about this rank's arguments is raised on every rank (with checks on)."""
        self._live(op)
        signature, error = self._validated(check)
        if error is not None:
            self.agreement.check(Signature(op), error)  # raises, here and on every rank
        assert signature is not None
        return signature

    def _move(self, signature: Signature, shm_run: ShmRun | None, run: Run) -> None:
        """Over shared memory when there is some and `shm_run` is given (its first step
        carries the agreement row), else `run()` on the group after agreeing."""
        if self._shm is not None and shm_run is not None:
            shm_run(self._shm, *self.agreement.step(signature))
            return
        self.agreement.check(signature)
        work = run()
        # On CUDA inside group_start/group_end, group_end waits for the coalesced work.
        if work is not None and not (self._depth and self.device.type == "cuda"):
            self._finish(work, signature.op)

    def _on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda" and stream is not None:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def _reduce(
        self,
        signature: Signature,
        kind: str,
        out: torch.Tensor,
        inp: torch.Tensor,
        op: Any,
        root: int | None = None,
    ) -> None:
        """All-reduce (`kind` "all_reduce"), reduce to `root` ("reduce": `out` is written
        on `root` only) or reduce-scatter (else) of `inp` into `out`."""
        group = self._group
        wire, restore = for_reduction(inp, self.backend)
        wire = wire.reshape(-1)
        whole = kind in ("all_reduce", "reduce")
        n = wire.numel() if whole else wire.numel() // self.world_size
        keep = root is None or root == self.rank  # this rank receives a result
        same = keep and out.dtype == wire.dtype  # else: narrowed back into out below
        target = out.view(-1) if same else torch.empty(n, dtype=wire.dtype, device=wire.device)
        # gloo has no average: a sum, divided here. NCCL averages itself (and must, to
        # pair with vLLM's ranks, which ask NCCL for an average).
        divide = op == ReduceOp.AVG and self.backend == "gloo"
        total = ReduceOp.SUM if divide else op

        def shm_run(shm: ShmCollectives, row: bytes, judge: Judge) -> None:
            if whole:  # (a reduce is an all-reduce whose result only the root keeps)
                shm.all_reduce(wire, target, row, judge)
            else:
                shm.reduce_scatter(target, wire, row, judge)

        def run() -> Any:
            if wire.numel() == 0:
                return None
            if not whole:
                scatter = dist.ReduceScatterOptions()
                scatter.reduceOp = ReduceOp(total)
                return group._reduce_scatter_base(target, wire, scatter)
            if target.data_ptr() != wire.data_ptr():
                target.copy_(wire)  # (reduced in place: the input stays as it is)
            if kind == "all_reduce":
                options = dist.AllreduceOptions()
                options.reduceOp = ReduceOp(total)
                return group.allreduce([target], options)
            to_root = dist.ReduceOptions()
            to_root.reduceOp, to_root.rootRank = ReduceOp(total), cast(int, root)
            return group.reduce([target], to_root)

        self._move(signature, shm_run if total == ReduceOp.SUM else None, run)
        if not keep:
            return
        if divide:
            target.div_(self.world_size)
        if not same:
            out.copy_(restore(target).reshape(out.shape))

    def _gather(self, signature: Signature, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every rank's `inp` into `out`, rank after rank, as bytes."""
        out_bytes, in_bytes = flat_bytes(out), flat_bytes(inp)

        self._move(
            signature,
            lambda shm, row, judge: shm.all_gather(out_bytes, in_bytes, row, judge),
            lambda: self._group._allgather_base(out_bytes, in_bytes) if inp.numel() else None,
        )
