"""Tensors as values of a StatelessProcessGroup: dtype, shape and raw bytes, never a pickle.

``send``, ``recv``, ``broadcast`` and ``all_reduce`` move a tensor as this payload::

    MAGIC (b"\\x00VBT1") || u8 n || dtype name (n ASCII bytes: b"bfloat16") || u8 ndim
        || u64be size (ndim times) || the elements, row-major, in torch's byte order

``values.Values`` handles it as it handles a pickle: sealed for its name (with the group's
key, an HMAC checked before anything is read), in a shared-memory segment when large and
every reader shares the node. No pickle starts with a NUL byte and a segment's descriptor
has its own magic, so the first bytes tell the three apart. A receiver builds a tensor
from the bytes alone, after checking them against the tensor it receives into: a pickle
where a tensor is expected is refused, never unpickled.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ReduceOp

from bridge_py.distributed.errors import CollectiveMismatchError

__all__ = [
    "MAGIC",
    "Encoded",
    "checked",
    "decode",
    "encode",
    "fill",
    "is_tensor",
    "on_cpu",
    "reduce",
    "reducer",
    "spec",
]

MAGIC = b"\x00VBT1"
# The dtypes a payload may name (any other name is refused before torch sees it).
_DTYPES = {
    name: dtype
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
Fold = Callable[[torch.Tensor, torch.Tensor], Any]
# all_reduce's ops: how each folds the next rank's tensor into the running result.
_FOLDS: dict[str, tuple[Any, Fold]] = {
    "sum": (ReduceOp.SUM, lambda acc, t: acc.add_(t)),
    "product": (ReduceOp.PRODUCT, lambda acc, t: acc.mul_(t)),
    "max": (ReduceOp.MAX, lambda acc, t: torch.maximum(acc, t, out=acc)),
    "min": (ReduceOp.MIN, lambda acc, t: torch.minimum(acc, t, out=acc)),
}


def checked(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, if it is one: TypeError before anything is sent or received otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a contiguous CPU tensor (``tensor`` itself when it is one)."""
    return checked(tensor).detach().to("cpu").resolve_conj().resolve_neg().contiguous()


def encode(tensor: torch.Tensor) -> bytes:
    """The payload of ``tensor`` (see the module docstring); TypeError for other dtypes."""
    name = str(checked(tensor).dtype).removeprefix("torch.")
    if _DTYPES.get(name) != tensor.dtype:
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be sent: {list(_DTYPES)} can")
    flat = on_cpu(tensor).reshape(-1)
    layout = f">{len(MAGIC)}sB{len(name)}sB{tensor.dim()}Q"
    head = struct.pack(layout, MAGIC, len(name), name.encode(), tensor.dim(), *tensor.shape)
    if not flat.numel():
        return head
    elements: Any = flat.view(torch.uint8).numpy()  # numpy's stubs: no Buffer
    return b"".join((head, memoryview(elements)))


class Encoded:
    """A tensor's payload, which ``Values.pack`` sends as it is instead of pickling it."""

    __slots__ = ("payload",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.payload = encode(tensor)


def is_tensor(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a checked payload holds a tensor (else: a pickle)."""
    return bytes(payload[: len(MAGIC)]) == MAGIC


def _header(payload: memoryview, what: str) -> tuple[torch.dtype, tuple[int, ...], int]:
    """``(dtype, shape, where the elements start)`` of a tensor payload."""
    try:
        at = len(MAGIC)
        name = bytes(payload[at + 1 : at + 1 + payload[at]]).decode("ascii")
        at += 1 + payload[at]
        ndim = payload[at]
        shape = struct.unpack_from(f">{ndim}Q", payload, at + 1)
    except (IndexError, UnicodeDecodeError, struct.error):
        raise CollectiveMismatchError(f"{what} is a malformed tensor") from None
    if name not in _DTYPES or math.prod(size or 1 for size in shape) >= 1 << 63:
        raise CollectiveMismatchError(f"{what} is a tensor of unknown dtype or shape")
    return _DTYPES[name], shape, at + 1 + 8 * ndim


def decode(
    payload: bytes | bytearray | memoryview, like: torch.Tensor | None, what: str
) -> torch.Tensor:
    """A CPU tensor holding ``payload``'s elements, which must fit ``like`` (its dtype
    and shape; None: any) and be exactly as many bytes as they say.

    That is ``like`` itself, written in one copy, when it is a contiguous CPU tensor (what
    ``recv`` and ``broadcast`` fill), else a new tensor (a ``like`` on the meta device only
    describes one). Nothing is written unless everything fits: CollectiveMismatchError (a
    ValueError) names ``what`` (the value, its sender and its receiver) and what does not
    match, or says that ``payload`` is no tensor (a pickle, which is never unpickled).
    """
    view = memoryview(payload)
    if not is_tensor(view):
        raise CollectiveMismatchError(
            f"refused {what}: a tensor was expected, but it is none (a pickled object, sent "
            "with send_obj or broadcast_obj?), and it was not unpickled"
        )
    dtype, shape, start = _header(view, what)
    if like is not None and (dtype, shape) != (like.dtype, tuple(like.shape)):
        differs = " and ".join(
            aspect
            for aspect, same in (("dtype", dtype == like.dtype), ("shape", shape == like.shape))
            if not same
        )
        raise CollectiveMismatchError(
            f"{what} is a {dtype} tensor of shape {shape}, but the tensor to receive it is "
            f"a {like.dtype} one of shape {tuple(like.shape)} (different {differs})"
        )
    size = math.prod(shape) * dtype.itemsize
    if len(view) - start != size:
        raise CollectiveMismatchError(
            f"{what} is a {dtype} tensor of shape {shape}, which takes {size} bytes, but it "
            f"holds {len(view) - start}"
        )
    out = like if like is not None and _writable(like) else torch.empty(shape, dtype=dtype)
    if size:
        elements: Any = out.detach().reshape(-1).view(torch.uint8).numpy()
        memoryview(elements)[:] = view[start:]  # one copy, into aligned memory
    return out


def _writable(tensor: torch.Tensor) -> bool:
    """Whether the bytes of ``tensor`` can be written as they are (one copy, no torch op)."""
    return tensor.is_cpu and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg())


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
