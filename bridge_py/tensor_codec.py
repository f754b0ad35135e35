"""The one tensor codec: a tensor as its dtype, shape and raw bytes, checked, never a pickle.

Every tensor that leaves a process travels as the same *payload*: msgpack extension 1
between Elixir and a worker (``docs/protocol.md``), and, after a tag that tells it from a
pickle (``bridge_py.distributed.spg.tensors``), the tensors of a StatelessProcessGroup and
of ModelOpt's gathers between ranks::

    kind (u8, an ASCII letter) || bits (u8) || ndim (u8) || ndim x dim (u64 big-endian)
        || the elements, row-major, little-endian

``(kind, bits)`` names the dtype, from one table: :data:`BRIDGE` holds the types the Elixir
side speaks (Nx's), :data:`ALL` adds the float8 and float4 types, which travel between ranks
only. The module imports nothing of the package, so the worker uses it without loading
``bridge_py.distributed``, and any layer of that may use it.

An encoder refuses what is not a dense tensor with elements (:func:`checked`) and copies
what is not plain contiguous CPU memory (a strided, conjugate or negative view, a tensor off
the CPU). A decoder builds a tensor from the bytes alone, after checking them: a known type,
a shape torch can hold (every dimension, and the product of those that are not 0, below
2^63), exactly as many bytes as they say, and, when it receives into a tensor, that tensor's
dtype and shape. Anything else is one error that says what is wrong, of the class the caller
names (the worker's ``CodecError``, ``CollectiveMismatchError`` between ranks).
"""

from __future__ import annotations

import struct
import sys
import warnings
from typing import Any

import torch

__all__ = [
    "ALL",
    "BRIDGE",
    "Dtypes",
    "Payload",
    "checked",
    "decode",
    "header_size",
    "joined",
    "non_dense",
    "on_cpu",
    "overlapping",
    "pieces",
    "plain",
]


class Dtypes:
    """The dtypes a payload may name, each under its ``(kind, bits)``; ``refusal`` ends the
    message that refuses to encode any other ("tensors of dtype X " + refusal)."""

    __slots__ = ("by_code", "codes", "refusal")

    def __init__(self, rows: tuple[tuple[str, str, int], ...], refusal: str) -> None:
        found = [(getattr(torch, name, None), kind, bits) for name, kind, bits in rows]
        known = [(d, ord(kind), bits) for d, kind, bits in found if type(d) is torch.dtype]
        # dtype -> the payload's first two bytes; those bytes as a u16 -> (dtype, itemsize)
        self.codes: dict[torch.dtype, bytes] = {d: bytes((k, b)) for d, k, b in known}
        self.by_code: dict[int, tuple[torch.dtype, int]] = {
            k << 8 | b: (d, d.itemsize) for d, k, b in known
        }
        self.refusal = refusal


# The one dtype table (docs/protocol.md): torch's name, the kind letter, the bits.
_BRIDGE_ROWS = (
    ("float16", "f", 16),
    ("bfloat16", "b", 16),
    ("float32", "f", 32),
    ("float64", "f", 64),
    ("complex64", "c", 64),
    ("complex128", "c", 128),
    ("int8", "s", 8),
    ("int16", "s", 16),
    ("int32", "s", 32),
    ("int64", "s", 64),
    ("uint8", "u", 8),
    ("uint16", "u", 16),
    ("uint32", "u", 32),
    ("uint64", "u", 64),
    ("bool", "p", 8),
)
# Between ranks only (Elixir has no such types): lower case the "fn" formats, upper case
# their "fnuz" twins; float4_e2m1fn_x2 is two 4-bit floats in each byte.
_RANK_ROWS = (
    ("float8_e4m3fn", "e", 8),
    ("float8_e4m3fnuz", "E", 8),
    ("float8_e5m2", "m", 8),
    ("float8_e5m2fnuz", "M", 8),
    ("float8_e8m0fnu", "x", 8),
    ("float4_e2m1fn_x2", "q", 8),
)
BRIDGE = Dtypes(_BRIDGE_ROWS, "cannot cross the bridge")
"""The dtypes between Elixir and a worker."""
ALL = Dtypes(_BRIDGE_ROWS + _RANK_ROWS, "cannot be sent between ranks")
"""The dtypes between ranks: :data:`BRIDGE`'s and the float8 and float4 types."""

Payload = bytes | bytearray | memoryview
_HEAD = struct.Struct(">HB")  # kind and bits (one u16), ndim
_MAX_EXTENT = 2**63 - 1  # torch's sizes and strides are signed 64-bit
# A new tensor of fewer bytes of elements is a bytearray's copy; from it, it may share a
# frame's memory (see decode).
_SHARE_FROM = 1 << 18
# From this many bytes, a new tensor is filled by torch, in parallel and without the GIL:
# its fresh memory's page faults are most of the work. Below it (and into a tensor that
# already has its memory) one memcpy costs less than waking torch's threads.
_PARALLEL_FROM = 1 << 24
# The elements are torch's memory as it is; the wire's order is little-endian.
_SWAP = sys.byteorder != "little"


def non_dense(tensor: torch.Tensor) -> str | None:
    """What kind of tensor ``tensor`` is when it is not dense ("sparse_coo", "nested"...),
    which nothing moves; None for a dense one."""
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


def header_size(ndim: int) -> int:
    """The bytes of a payload before its elements: kind, bits, ndim and the dimensions."""
    return 3 + 8 * ndim


def pieces(tensor: torch.Tensor, dtypes: Dtypes = ALL) -> tuple[bytes, memoryview | None]:
    """The payload of ``tensor`` in two pieces: the header, and a byte view of the elements
    (None when there are none), not a copy when ``tensor`` is a contiguous CPU tensor (the
    view keeps it alive). TypeError for what cannot travel: not a dense tensor (see
    :func:`checked`), or of a dtype that ``dtypes`` lacks.
    """
    # The usual tensor takes the fast path, where torch itself refuses what its memory
    # cannot give as it is (not dense, meta, a conjugate or negative bit: numpy() and
    # view() refuse those); such a tensor is then checked, and made plain, once.
    try:
        return _pieces(tensor, dtypes.codes[tensor.dtype])
    except Exception:
        pass
    checked(tensor)
    code = dtypes.codes.get(tensor.dtype)
    if code is None:
        raise TypeError(f"tensors of dtype {tensor.dtype} {dtypes.refusal}")
    return _pieces(plain(tensor), code)


def _pieces(tensor: torch.Tensor, code: bytes) -> tuple[bytes, memoryview | None]:
    # (each torch call costs a few hundred ns: only those a tensor needs are made)
    t = tensor.detach() if tensor.requires_grad else tensor
    if not t.is_cpu:
        t = t.cpu()
    t = t.contiguous()
    ndim = t.dim()
    header = _header_struct(ndim).pack(code, ndim, *t.shape)
    if t.numel() == 0:
        return header, None
    flat = t if ndim == 1 else t.reshape(-1)
    if _SWAP:
        flat = _swapped(flat)
    elements: Any = flat.view(torch.uint8).numpy()  # numpy's stubs: no Buffer
    return header, memoryview(elements).cast("B")


# The header of a payload, per number of dimensions (made once each).
_HEADERS: dict[int, struct.Struct] = {}


def _header_struct(ndim: int) -> struct.Struct:
    header = _HEADERS.get(ndim)
    if header is None:
        header = _HEADERS[ndim] = struct.Struct(f">2sB{ndim}Q")
    return header


def joined(header: bytes, data: memoryview | None) -> bytes:
    """The payload that :func:`pieces` gave in pieces, in one bytes object."""
    return header if data is None else b"".join((header, data))


def decode(
    payload: Payload,
    like: torch.Tensor | None = None,
    *,
    what: str | None = None,
    share: bool = False,
    dtypes: Dtypes = ALL,
    error: type[Exception] = ValueError,
) -> torch.Tensor:
    """A CPU tensor holding ``payload``'s elements, which must fit ``like`` (its dtype and
    shape; None: any).

    That is ``like`` itself, written in one copy, when it is a contiguous CPU tensor (what
    ``recv`` and ``broadcast`` fill); else, with ``share``, a view of ``payload``'s memory
    when that is a writable memoryview whose elements start on an address aligned for
    their type (a large argument decoded straight from the frame it came in: the tensor
    keeps the frame alive, and nothing else writes it); else a tensor of its own, aligned
    and writable (a ``like`` on the meta device only describes one). Nothing is written
    unless everything fits; what does not raises ``error``, whose message says what is
    wrong, after "``what`` is ..." when ``what`` names the payload.
    """
    dtype, itemsize, shape, start, size = _header(payload, dtypes, what, error)
    if like is not None and (dtype != like.dtype or shape != like.shape):
        differs = " and ".join(
            aspect
            for aspect, same in (("dtype", dtype == like.dtype), ("shape", shape == like.shape))
            if not same
        )
        raise error(
            f"{what} is a {dtype} tensor of shape {shape}, but the tensor to receive it is "
            f"a {like.dtype} one of shape {tuple(like.shape)} (different {differs})"
        )
    if len(payload) - start != size:
        kind, bits = chr(payload[0]), payload[1]
        raise _malformed(
            error,
            what,
            f"tensor of shape {shape} and type {kind}{bits} needs {size} bytes of data, "
            f"got {len(payload) - start}",
        )
    if like is not None and _writable(like):
        out = like
    elif size == 0:
        return torch.empty(shape, dtype=dtype)
    elif size < _SHARE_FROM:
        # A copy in a bytearray of its own (writable, so frombuffer does not warn; CPython
        # aligns it for every dtype, which is checked all the same).
        copy = torch.frombuffer(bytearray(memoryview(payload)[start:]), dtype=dtype)
        if copy.data_ptr() % itemsize == 0:
            if _SWAP:
                _swap_in_place(copy)
            return copy.view(shape)
        out = torch.empty(shape, dtype=dtype)
    elif share and type(payload) is memoryview and not payload.readonly:
        src = torch.frombuffer(payload, dtype=torch.uint8, offset=start, count=size)
        if src.data_ptr() % itemsize == 0:
            if _SWAP:
                _swap_in_place(src.view(dtype))
            return src.view(dtype).view(shape)
        out = torch.empty(shape, dtype=dtype)
    else:
        out = torch.empty(shape, dtype=dtype)
    if size:
        raw = out.detach() if out.requires_grad else out
        _fill(raw, payload, start, size, parallel=out is not like and size >= _PARALLEL_FROM)
        if _SWAP:
            _swap_in_place(raw)
    return out


def _header(
    payload: Payload, dtypes: Dtypes, what: str | None, error: type[Exception]
) -> tuple[torch.dtype, int, tuple[int, ...], int, int]:
    """``(dtype, itemsize, shape, where the elements start, their bytes)`` of a payload."""
    try:
        code, ndim = _HEAD.unpack_from(payload)
    except struct.error:
        raise _malformed(error, what, "tensor payload shorter than its header") from None
    found = dtypes.by_code.get(code)
    if found is None:
        raise _malformed(error, what, f"unknown tensor type {chr(code >> 8)!r}{code & 0xFF}")
    start = 3 + 8 * ndim
    if len(payload) < start:
        raise _malformed(error, what, "tensor payload shorter than its shape")
    shape = struct.unpack_from(f">{ndim}Q", payload, 3)
    numel = 1
    extent = 1  # what torch's strides must hold: the product of the dims that are not 0
    for d in shape:
        numel *= d
        extent *= d or 1
    if extent > _MAX_EXTENT:
        raise _malformed(
            error,
            what,
            f"tensor shape {shape} is too large: torch's sizes and strides are signed "
            "64-bit (the product of the dimensions that are not 0 must be below 2^63)",
        )
    dtype, itemsize = found
    return dtype, itemsize, shape, start, numel * itemsize


def _malformed(error: type[Exception], what: str | None, reason: str) -> Exception:
    return error(reason if what is None else f"{what} is a malformed tensor: {reason}")


def _fill(out: torch.Tensor, payload: Any, start: int, size: int, *, parallel: bool) -> None:
    """Copy the ``size`` bytes of elements at ``start`` of ``payload`` into ``out`` (a
    contiguous CPU tensor of that many bytes): one memcpy, or torch's copy."""
    raw = out.reshape(-1).view(torch.uint8)
    if not parallel:
        elements: Any = raw.numpy()
        memoryview(elements)[:] = memoryview(payload)[start:]
        return
    with warnings.catch_warnings():
        # frombuffer warns that bytes are read-only; they are only read.
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(payload, dtype=torch.uint8, offset=start, count=size)
    raw.copy_(src)  # torch copies in parallel


def _writable(tensor: torch.Tensor) -> bool:
    """Whether the bytes of ``tensor`` can be written as they are (one copy, no torch op)."""
    return tensor.is_cpu and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg())


def _swapped(flat: torch.Tensor) -> torch.Tensor:
    """A copy of the flat ``flat`` with each number's bytes reversed (a complex number's
    two parts each): little-endian to the host's big-endian order, and back."""
    width = flat.element_size() // (2 if flat.is_complex() else 1)
    if width == 1:
        return flat
    return flat.view(torch.uint8).view(-1, width).flip(1).reshape(-1).view(flat.dtype)


def _swap_in_place(tensor: torch.Tensor) -> None:
    """Put the contiguous ``tensor``, decoded in the wire's byte order, in the host's."""
    flat = tensor.view(-1)
    flat.copy_(_swapped(flat))
