"""A communicator's ``batch_isend_irecv``: sends and receives posted together, then awaited.

vLLM runs such a batch inside one NCCL group call (pynccl); here each message is its own
``torch.distributed`` send or receive on the communicator's device group, preceded (with
checks on) by the header that ``recv`` compares (see ``checks``). All sends are posted
first, so two ranks that send to each other in one batch do not wait on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.checks import CommunicatorChecks
from bridge_py.distributed.device_communicators.wire_dtypes import for_transport

__all__ = ["run_batch"]

_OP = "batch_isend_irecv"


def run_batch(
    comm: CommunicatorChecks,
    p2p_ops: list[Any],
    ranks: list[int],
    cpu_group: ProcessGroup,
    device_group: ProcessGroup,
) -> None:
    """Run ``p2p_ops`` for ``comm``, whose group has the global ``ranks``: headers on
    ``cpu_group``, data on ``device_group`` (``DeviceCommunicatorBase.batch_isend_irecv``)."""
    plan = [_planned(comm, ranks, i, entry) for i, entry in enumerate(p2p_ops)]
    works: list[tuple[Any, bool]] = []  # (work, whether it runs on the CPU group)
    for is_send, tensor, peer in plan:
        if is_send:
            wire, _ = for_transport(tensor, comm.backend)
            if comm.agreement.enabled:
                header = comm._header(tensor, wire)
                works.append((dist.isend(header, ranks[peer], cpu_group), True))
            if wire.numel() > 0:
                works.append((dist.isend(wire, ranks[peer], device_group), False))
    received: list[tuple[torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]] = []
    mismatch: Exception | None = None
    for is_send, tensor, peer in plan:
        if is_send:
            continue
        wire, restore = for_transport(tensor, comm.backend)
        source = ranks[peer]
        if comm.agreement.enabled:

            def receive(buffer: torch.Tensor, header: bool, source: int = source) -> Any:
                group = cpu_group if header else device_group
                return dist.irecv(buffer, source, group)

            try:
                comm._expect(comm._header(tensor, wire), peer, receive)
            except ValueError as exc:  # the message was received and dropped
                mismatch = mismatch or exc
                continue
        if wire.numel() > 0:
            works.append((dist.irecv(wire, source, device_group), False))
            received.append((tensor, wire, restore))
    for work, on_cpu_group in works:
        comm._finish(work, _OP, on_cpu_group)
    for tensor, wire, restore in received:
        if wire.data_ptr() != tensor.data_ptr():  # received into a copy
            tensor.copy_(restore(wire).reshape(tensor.shape))
    if mismatch is not None:
        raise mismatch


def _planned(
    comm: CommunicatorChecks, ranks: list[int], i: int, entry: Any
) -> tuple[bool, torch.Tensor, int]:
    """(whether it sends, its tensor, the peer's rank in the group) of ``p2p_ops[i]``;
    TypeError or ValueError, naming the entry, for one that is not a valid operation."""
    kind = getattr(entry, "op", None)
    if kind is not dist.isend and kind is not dist.irecv:
        raise comm._error(
            _OP,
            f"p2p_ops[{i}].op must be torch.distributed.isend or irecv, got {kind!r}",
            TypeError,
        )
    is_send = kind is dist.isend
    tensor: Any = getattr(entry, "tensor", None)  # (a tensor once checked)
    comm._check_tensor(_OP, tensor, name=f"p2p_ops[{i}].tensor", written=not is_send)
    peer = getattr(entry, "group_peer", None)
    if peer is None and getattr(entry, "peer", None) in ranks:
        peer = ranks.index(entry.peer)
    return is_send, tensor, comm._check_peer(_OP, f"p2p_ops[{i}].group_peer", peer, False)
