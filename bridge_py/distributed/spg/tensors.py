"""Tensors as values between ranks: the one codec's payload, tagged, and the group's side.

A StatelessProcessGroup's ``send``, ``recv``, ``broadcast`` and ``all_reduce`` and ModelOpt's
gathers (``distribute``) move a tensor as the payload of the one tensor codec
(``bridge_py.tensor_codec``: dtype, shape and raw bytes, the bytes of msgpack extension 1,
never a pickle), after a tag::

    MAGIC (b"\\x00VBT2") || payload

since such a value may also be a pickle: no pickle starts with a NUL byte, and a segment's
descriptor has its own magic, so the first bytes tell the three apart. ``values.Values``
handles a tagged payload as it handles a pickle: sealed for its name (with the group's key,
an HMAC checked before anything is read), in a shared-memory segment when large and every
reader shares the node. A receiver decodes it after checking it (see
``tensor_codec.decode``): what does not add up, or a pickle where a tensor is expected
(never unpickled), is a CollectiveMismatchError (a ValueError and a RuntimeError) naming
the value. This module also holds what only the group needs around the codec: a payload
to send as it is (:class:`Encoded`), the tensor that describes what to receive, filling the
caller's tensor, and all_reduce's folds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ReduceOp

from bridge_py import tensor_codec
from bridge_py.distributed.errors import CollectiveMismatchError

__all__ = [
    "MAGIC",
    "Encoded",
    "decode",
    "encode",
    "fill",
    "is_tensor",
    "parts",
    "reduce",
    "reducer",
    "spec",
]

MAGIC = b"\x00VBT2"  # 2: the payload of extension 1 (VBT1 named the dtype in ASCII)


def parts(tensor: torch.Tensor) -> tuple[bytes, Any]:
    """The tagged payload of ``tensor`` in two parts: the tag and header, and a bytes-like
    view of the elements (not a copy, when ``tensor`` is a contiguous CPU one); TypeError
    for what cannot be sent (``tensor_codec.pieces``)."""
    header, elements = tensor_codec.pieces(tensor)
    return MAGIC + header, b"" if elements is None else elements


def encode(tensor: torch.Tensor) -> bytes:
    """The tagged payload of ``tensor`` as one bytes object (see :func:`parts`)."""
    header, elements = tensor_codec.pieces(tensor)
    return MAGIC + header if elements is None else b"".join((MAGIC, header, elements))


def is_tensor(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a value holds a tensor (else: a pickle, or nothing this module reads)."""
    return bytes(payload[: len(MAGIC)]) == MAGIC


def decode(
    payload: bytes | bytearray | memoryview, like: torch.Tensor | None, what: str
) -> torch.Tensor:
    """The tensor in a tagged payload, which must fit ``like`` (its dtype and shape; None:
    any): ``like`` itself, written in one copy, when it is a contiguous CPU tensor (what
    ``recv`` and ``broadcast`` fill), else a new CPU tensor; it never shares memory with
    ``payload``. Nothing is written unless everything fits: CollectiveMismatchError names
    ``what`` (the value, its sender and its receiver) and what does not match, or says that
    ``payload`` is no tensor (a pickle, which is never unpickled)."""
    view = memoryview(payload)
    if not is_tensor(view):
        raise CollectiveMismatchError(
            f"refused {what}: a tensor was expected, but it is none (a pickled object, sent "
            "with send_obj or broadcast_obj?), and it was not unpickled"
        )
    return tensor_codec.decode(view[len(MAGIC) :], like, what=what, error=CollectiveMismatchError)


Fold = Callable[[torch.Tensor, torch.Tensor], Any]
# all_reduce's ops: how each folds the next rank's tensor into the running result.
_FOLDS: dict[str, tuple[Any, Fold]] = {
    "sum": (ReduceOp.SUM, lambda acc, t: acc.add_(t)),
    "product": (ReduceOp.PRODUCT, lambda acc, t: acc.mul_(t)),
    "max": (ReduceOp.MAX, lambda acc, t: torch.maximum(acc, t, out=acc)),
    "min": (ReduceOp.MIN, lambda acc, t: torch.minimum(acc, t, out=acc)),
}


class Encoded:
    """A tensor's tagged payload (:func:`encode`), which ``Values.pack`` sends as it is
    instead of pickling it."""

    __slots__ = ("payload",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.payload = encode(tensor)


def spec(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of ``tensor``'s dtype and shape, without memory: a ``like`` that
    :func:`decode` does not write into."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def fill(tensor: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """``tensor`` (any device, any strides; autograd does not record it) holding
    ``received`` (which :func:`decode` may have written into ``tensor`` already)."""
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
