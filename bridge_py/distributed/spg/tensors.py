"""Tensors as values of a StatelessProcessGroup: the codec's payload, and the group's side.

``send``, ``recv``, ``broadcast`` and ``all_reduce`` move a tensor as the payload of the one
tensor codec (``bridge_py.distributed.tensor_codec``: dtype, shape and raw bytes, never a
pickle). ``values.Values`` handles it as it handles a pickle: sealed for its name (with the
group's key, an HMAC checked before anything is read), in a shared-memory segment when large
and every reader shares the node. No pickle starts with a NUL byte and a segment's descriptor
has its own magic, so the first bytes tell the three apart. This module holds what only the
group needs around the codec: a payload to send as it is (:class:`Encoded`), the tensor that
describes what to receive, filling the caller's tensor, and all_reduce's folds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ReduceOp

from bridge_py.distributed.tensor_codec import encode

__all__ = ["Encoded", "fill", "reduce", "reducer", "spec"]

Fold = Callable[[torch.Tensor, torch.Tensor], Any]
# all_reduce's ops: how each folds the next rank's tensor into the running result.
_FOLDS: dict[str, tuple[Any, Fold]] = {
    "sum": (ReduceOp.SUM, lambda acc, t: acc.add_(t)),
    "product": (ReduceOp.PRODUCT, lambda acc, t: acc.mul_(t)),
    "max": (ReduceOp.MAX, lambda acc, t: torch.maximum(acc, t, out=acc)),
    "min": (ReduceOp.MIN, lambda acc, t: torch.minimum(acc, t, out=acc)),
}


class Encoded:
    """A tensor's payload (``tensor_codec.encode``), which ``Values.pack`` sends as it is
    instead of pickling it."""

    __slots__ = ("payload",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.payload = encode(tensor)


def spec(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of ``tensor``'s dtype and shape, without memory: a ``like`` that
    ``tensor_codec.decode`` does not write into."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def fill(tensor: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """``tensor`` (any device, any strides; autograd does not record it) holding
    ``received`` (which ``tensor_codec.decode`` may have written into ``tensor`` already)."""
    if received is not tensor:
        tensor.detach().copy_(received)
    return tensor


def reducer(op: Any) -> Fold:
    """How all_reduce folds a tensor into the result for ``op`` (a ReduceOp, or its name
    in any case: "sum", "product", "max", "min"); ValueError for any other op."""
    for name, (reduce_op, fold) in _FOLDS.items():
        if isinstance(op, str) and op.lower() == name:
            return fold
        if isinstance(op, (ReduceOp, ReduceOp.RedOpType)) and op == reduce_op:
            return fold
    raise ValueError(
        f"all_reduce takes ReduceOp.SUM, PRODUCT, MAX or MIN (or their names), got {op!r}"
    )


def reduce(tensors: list[torch.Tensor], fold: Fold) -> torch.Tensor:
    """A new tensor: ``tensors`` folded in their order (rank order: every rank that folds
    the same tensors gets the same bits, floating-point sums included)."""
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        fold(result, tensor)
    return result
