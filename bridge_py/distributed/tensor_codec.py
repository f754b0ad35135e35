"""The one tensor codec between ranks: dtype, shape and raw bytes, checked, never a pickle.

A tensor travels as this payload (a StatelessProcessGroup's ``send``, ``recv``,
``broadcast`` and ``all_reduce``; ModelOpt's ``get_tensors_parallel``)::

    MAGIC (b"\\x00VBT1") || u8 n || dtype name (n ASCII bytes: b"bfloat16") || u8 ndim
        || u64be size (ndim times) || the elements, row-major, in torch's byte order

No pickle starts with a NUL byte, so the first bytes tell a tensor from a pickle. A
receiver builds a tensor from the bytes alone, after checking them (a known dtype, a shape
torch can hold, exactly as many bytes as they say, and, when it receives into a tensor, that
tensor's dtype and shape): a pickle where a tensor is expected is refused, never unpickled.
What does not add up is a :class:`~bridge_py.distributed.errors.CollectiveMismatchError`
(a ValueError and a RuntimeError) naming the value. Sealing and carrying the payload are the
carriers' business (``spg.values``, ``distribute``), not this module's.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from bridge_py.distributed.errors import CollectiveMismatchError

__all__ = [
    "MAGIC",
    "checked",
    "decode",
    "encode",
    "is_tensor",
    "non_dense",
    "on_cpu",
    "overlapping",
    "parts",
    "plain",
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
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


def non_dense(tensor: torch.Tensor) -> str | None:
    """What kind of tensor ``tensor`` is when it is not dense ("sparse_coo", "nested"...),
    which no collective moves; None for a dense one."""
    if tensor.is_nested:
        return "nested"
    return None if tensor.layout == torch.strided else str(tensor.layout).removeprefix("torch.")


def overlapping(tensor: torch.Tensor) -> bool:
    """Whether elements of the dense ``tensor`` share memory (a stride of 0 over more than
    one element, as after ``expand()``), so that it cannot be written element by element."""
    return any(s == 0 and n > 1 for s, n in zip(tensor.stride(), tensor.shape, strict=True))


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` out of autograd's sight (as c10d's collectives see it), or a copy of its
    values where it is a conjugate or negative view (``z.conj()``, ``z.conj().imag``),
    whose memory does not hold its values."""
    return tensor.detach().resolve_conj().resolve_neg()


def checked(tensor: torch.Tensor, *, into: bool = False) -> torch.Tensor:
    """``tensor``, if it is a dense tensor with elements to send (``into``: a tensor to
    receive into, whose elements do not share memory): TypeError before anything is sent
    or received otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    use = "received into" if into else "sent"
    kind = non_dense(tensor)
    if kind is not None:
        raise TypeError(f"a {kind} tensor cannot be {use}: only dense tensors travel")
    if not into and tensor.is_meta:
        raise TypeError("a meta tensor cannot be sent: it has no elements")
    if into and overlapping(tensor):
        raise TypeError(
            f"a tensor whose elements share memory (a stride of 0, as after expand()) cannot "
            f"be {use}: pass a tensor of its own"
        )
    return tensor


def on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a contiguous CPU tensor (``tensor`` itself when it is one)."""
    return plain(checked(tensor)).to("cpu").contiguous()


def parts(tensor: torch.Tensor) -> tuple[bytes, Any]:
    """The payload of ``tensor`` (see the module docstring) in two parts: the header, and a
    bytes-like view of the elements (not a copy, when ``tensor`` is a contiguous CPU one);
    TypeError for a dtype the codec does not carry."""
    name = str(checked(tensor).dtype).removeprefix("torch.")
    if _DTYPES.get(name) != tensor.dtype:
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be sent: {list(_DTYPES)} can")
    flat = on_cpu(tensor).reshape(-1)
    layout = f">{len(MAGIC)}sB{len(name)}sB{tensor.dim()}Q"
    head = struct.pack(layout, MAGIC, len(name), name.encode(), tensor.dim(), *tensor.shape)
    if not flat.numel():
        return head, b""
    elements: Any = flat.view(torch.uint8).numpy()  # numpy's stubs: no Buffer
    return head, memoryview(elements)


def encode(tensor: torch.Tensor) -> bytes:
    """The payload of ``tensor`` as one bytes object (see :func:`parts`)."""
    head, elements = parts(tensor)
    return head + elements


def is_tensor(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a payload holds a tensor (else: a pickle, or nothing this codec reads)."""
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
    describes one); it never shares memory with ``payload``. Nothing is written unless
    everything fits: CollectiveMismatchError (a ValueError) names ``what`` (the value, its
    sender and its receiver) and what does not match, or says that ``payload`` is no tensor
    (a pickle, which is never unpickled).
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
