"""The PyNcclCommunicator operations made of sends and receives.

`send` and `recv`, their groups (`group_start`/`group_end`, `batch_isend_irecv`), and the
two collectives that vLLM 0.34 builds from a group of sends and receives, `scatter` and
`all_to_all_single`: built the same way here, they make the same NCCL calls on vLLM's
wire, and on CPU go through gloo's sends and receives (after the ranks agree on them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from bridge_py.distributed.device_communicators.agreement import ANY_DIM, Signature, hash_ints
from bridge_py.distributed.device_communicators.pynccl_core import PyNcclCore, flat_bytes
from bridge_py.distributed.errors import CollectiveMismatchError, StateError

__all__ = ["PyNcclPointToPoint"]

Pairs = list[tuple[torch.Tensor, int]]  # (tensor, peer) of each send or receive


class PyNcclPointToPoint(PyNcclCore):
    """Sends, receives and the operations made of them (see the module docstring)."""

    _sends: list[Any]  # CPU, inside a group: posted sends, waited by group_end
    _recvs: Pairs  # ... and receives, run by group_end

    def send(self, tensor: torch.Tensor, dst: int, stream: torch.cuda.Stream | None = None) -> None:
        """Send `tensor` to rank `dst`, which receives it with `recv`.

        Inside `group_start`/`group_end` the send is posted at once and completes by
        `group_end`; on CPU with checks on, a small header goes first and `recv` compares it
        with what it expects.
        """
        if self.disabled:
            return
        self._live("send")
        self._check("send", "tensor", tensor)
        peer = self._check_peer("send", "dst", dst, False)
        group, works, data = self._group, [], flat_bytes(tensor)
        with self._on(stream):
            if self.agreement.enabled:
                works.append(group.send([self._header(tensor, data, (tensor.numel(),))], peer, 0))
            if tensor.numel():
                works.append(group.send([data], peer, 0))
        if self._depth and self.device.type == "cpu":
            self._sends.extend(works)
        elif not self._depth:
            for work in works:
                self._finish(work, "send")

    def recv(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None
    ) -> torch.Tensor | None:
        """Receive into `tensor` what rank `src` sends; returns `tensor`.

        Inside `group_start`/`group_end` it is filled by `group_end`. With checks on (CPU),
        a message of another dtype or size is received, dropped and reported (ValueError),
        and the pair stays in step.
        """
        if self.disabled:
            return None
        self._live("recv")
        self._check("recv", "tensor", tensor)
        peer = self._check_peer("recv", "src", src, False)
        if self._depth and self.device.type == "cpu":
            self._recvs.append((tensor, peer))
            return tensor
        with self._on(stream):
            self._receive(tensor, peer)
        return tensor

    def _receive(self, tensor: torch.Tensor, peer: int) -> None:
        group, data = self._group, flat_bytes(tensor)
        if self.agreement.enabled:
            header = self._header(tensor, data, (tensor.numel(),))
            self._expect(header, peer, lambda buffer, _: group.recv([buffer], peer, 0))
        if tensor.numel():
            work = group.recv([data], peer, 0)
            if not self._depth:
                self._finish(work, "recv")

    def group_start(self) -> None:
        """Start a group of operations (as `ncclGroupStart`): sends and receives inside it
        complete together at `group_end`, so that two ranks may send to each other."""
        if self.disabled:
            return
        self._live("group_start")
        if self._depth == 0 and self.device.type == "cuda":
            self._group._start_coalescing(self.device)
        self._depth += 1

    def group_end(self) -> None:
        """End the group that `group_start` began: its operations have then completed (on
        CUDA: are queued, ordered on the current stream)."""
        if self.disabled:
            return
        if self._depth == 0:
            raise StateError(f"group_end on rank {self.rank} of {self.label}: no group_start")
        self._depth -= 1
        if self._depth:
            return
        if self.device.type == "cuda":
            work = self._group._end_coalescing(self.device)
            if work is not None:
                work.wait()
            return
        recvs, self._recvs = self._recvs, []
        sends, self._sends = self._sends, []
        for tensor, peer in recvs:
            self._receive(tensor, peer)
        for work in sends:
            self._finish(work, "send")

    def _grouped(self, sends: Pairs, recvs: Pairs) -> None:
        """The `sends` and the receives `recvs` as one group."""
        self.group_start()
        for tensor, peer in sends:
            self.send(tensor, peer)
        for tensor, peer in recvs:
            self.recv(tensor, peer)
        self.group_end()

    def batch_isend_irecv(
        self, p2p_ops: list[Any], stream: torch.cuda.Stream | None = None
    ) -> list[torch.Tensor] | None:
        """Run the sends and receives of `p2p_ops` as one group, and return the tensors
        received (in the order of their operations).

        Each operation is a `torch.distributed.P2POp`, or any object with its `op`
        (`torch.distributed.isend` or `irecv`), `tensor` and `group_peer` (the peer's rank
        in this group). All are checked before any is posted; vLLM's skips an unknown `op`.
        """
        if self.disabled:
            return None
        name = "batch_isend_irecv"
        self._live(name)
        if not isinstance(p2p_ops, Sequence) or isinstance(p2p_ops, (str, bytes)):
            kind = type(p2p_ops).__name__
            raise self._error(name, f"p2p_ops must be a list of P2POps, got {kind}", TypeError)
        sends: Pairs = []
        recvs: Pairs = []
        for i, p2p in enumerate(p2p_ops):
            what, op = f"p2p_ops[{i}]", getattr(p2p, "op", None)
            if op is not dist.isend and op is not dist.irecv:
                raise self._error(
                    name,
                    f"{what}.op must be torch.distributed.isend or irecv, not {op!r}",
                    TypeError,
                )
            tensor: Any = getattr(p2p, "tensor", None)
            self._check(name, f"{what}.tensor", tensor)
            peer = self._check_peer(
                name, f"{what}.group_peer", getattr(p2p, "group_peer", None), False
            )
            (sends if op is dist.isend else recvs).append((tensor, peer))
        with self._on(stream):
            self._grouped(sends, recvs)
        return [tensor for tensor, _ in recvs]

    # ---------------------------------------------------- collectives of sends and receives

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: list[int],
        root: int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """Rank `root`'s `input_tensor`, cut along dim 0 into `sizes[r]` rows for each rank
        `r`, into every rank's `output_tensor` (`sizes[rank]` rows, shaped like the input
        otherwise); returns `output_tensor`. `input_tensor` is read on `root` only."""
        if self.disabled:
            return None
        name = "scatter"

        def check() -> Signature:
            self._check(name, "output_tensor", output_tensor)
            counts = self._check_sizes(name, sizes)
            source = self._check_peer(name, "root", root, True)
            rest = tuple(output_tensor.shape[1:])
            self._check_shape(name, "output_tensor", output_tensor, (counts[self.rank], *rest))
            whole = (sum(counts), *rest)
            if self.rank == source:
                self._check(name, "input_tensor", input_tensor, output_tensor)
                self._check_shape(name, "input_tensor", input_tensor, whole)
            params = (source, hash_ints(counts))
            return Signature(name, output_tensor.dtype, whole, params, ("root", "sizes#"))

        self.agreement.check(self._signed(name, check))
        sends: Pairs = []
        with self._on(stream):
            if self.rank == root:
                for dst, piece in enumerate(input_tensor.split(sizes)):
                    if dst == root:
                        output_tensor.copy_(piece)
                    elif len(piece):
                        sends.append((piece, dst))
            self._grouped(
                sends, [(output_tensor, root)] if self.rank != root and sizes[self.rank] else []
            )
        return output_tensor

    def all_to_all_single(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """All-to-all along dim 0, as `torch.distributed.all_to_all_single`: the next
        `input_split_sizes[r]` rows of `input_tensor` go to rank `r`, and the next
        `output_split_sizes[r]` rows of `output_tensor` come from it; returns
        `output_tensor`. With checks on, the ranks also agree that each receives from
        every other as many rows as that one sends it."""
        if self.disabled:
            return None
        name = "all_to_all_single"

        def check() -> Signature:
            self._check(name, "input_tensor", input_tensor)
            self._check(name, "output_tensor", output_tensor, input_tensor)
            sent = self._check_sizes(name, input_split_sizes, "input_split_sizes")
            got = self._check_sizes(name, output_split_sizes, "output_split_sizes")
            rest = tuple(input_tensor.shape[1:])
            self._check_shape(name, "input_tensor", input_tensor, (sum(sent), *rest))
            self._check_shape(name, "output_tensor", output_tensor, (sum(got), *rest))
            if sent[self.rank] != got[self.rank]:
                raise self._error(
                    name,
                    f"this rank sends itself {sent[self.rank]} rows (input_split_sizes) but "
                    f"receives {got[self.rank]} (output_split_sizes)",
                )
            return Signature(name, input_tensor.dtype, (ANY_DIM, *rest))

        self.agreement.check(self._signed(name, check))
        if self.agreement.enabled:
            self._agree_splits(name, input_split_sizes, output_split_sizes)
        sends: Pairs = []
        recvs: Pairs = []
        pieces = input_tensor.split(input_split_sizes)
        slots = output_tensor.split(output_split_sizes)
        with self._on(stream):
            for peer, (piece, slot) in enumerate(zip(pieces, slots, strict=True)):
                if peer == self.rank:
                    slot.copy_(piece)
                    continue
                if len(piece):
                    sends.append((piece, peer))
                if len(slot):
                    recvs.append((slot, peer))
            self._grouped(sends, recvs)
        return output_tensor

    def _agree_splits(self, op: str, sent: list[int], got: list[int]) -> None:
        """Raise on every rank unless each rank expects from every other the rows that one
        sends it: every rank's split sizes, gathered on the (gloo) group."""
        world = self.world_size
        mine = torch.tensor([*sent, *got], dtype=torch.int64)
        table = torch.empty(world * 2 * world, dtype=torch.int64)
        self._finish(self._group._allgather_base(table, mine), op, True)
        rows = table.view(world, 2 * world).tolist()
        for i in range(world):
            for j in range(world):
                if rows[i][j] != rows[j][world + i]:
                    raise CollectiveMismatchError(
                        f"{op} in {self.label}: {self.agreement.who(i)} sends "
                        f"{rows[i][j]} rows to {self.agreement.who(j)}, which expects "
                        f"{rows[j][world + i]} from it (input_split_sizes against "
                        "output_split_sizes)"
                    )
