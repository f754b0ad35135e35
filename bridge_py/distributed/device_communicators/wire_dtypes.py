"""Carry every dtype over backends that natively move only some of them.

gloo refuses ``int16`` (and the unsigned and float8 types) in every collective, and no
backend has a meaningful sum for ``bool``. Two adapters close the gaps:

* :func:`for_transport` (gather, all-gather, broadcast, send/recv): a dtype the backend
  cannot move travels as its raw bytes (a ``uint8`` view), which is exact for every dtype.
* :func:`for_reduction` (all-reduce, reduce-scatter): a dtype the backend cannot add is
  widened to one it can, and narrowed back afterwards. The narrowing wraps exactly as
  arithmetic in the original integer type would. ``bool`` is summed as ``int32`` and turned
  back into ``bool`` with ``!= 0``, so an all-reduce of ``bool`` tensors is a logical OR
  (True where any rank has True), whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bridge_py.tensor_codec import plain

__all__ = ["for_reduction", "for_transport", "reducible", "supported_reduction"]

Restore = Callable[[torch.Tensor], torch.Tensor]

_GLOO = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    }
)
_NCCL = _GLOO - {torch.bool}

# dtype -> the dtype it is added in when the backend cannot add it natively.
_WIDER: dict[torch.dtype, torch.dtype] = {
    torch.bool: torch.int32,
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    torch.uint64: torch.int64,  # same width: the bits are reinterpreted, sums wrap alike
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _WIDER[getattr(torch, _name)] = torch.float32


def _native(backend: str) -> frozenset[torch.dtype]:
    return _NCCL if backend == "nccl" else _GLOO


def supported_reduction(dtype: torch.dtype) -> bool:
    """Whether :func:`for_reduction` can sum tensors of ``dtype`` on some backend."""
    return dtype in _GLOO or dtype in _WIDER or dtype.is_complex


def reducible(dtype: torch.dtype, backend: str) -> bool:
    """Whether ``dtype`` can be summed on ``backend`` once adapted (see :func:`for_reduction`)."""
    return dtype in _native(backend) or dtype in _WIDER or dtype.is_complex


def for_transport(tensor: torch.Tensor, backend: str) -> tuple[torch.Tensor, Restore]:
    """A flat, contiguous tensor the backend can move, and how to read moved data back.

    The wire tensor is ``tensor`` flattened, or its raw bytes (``uint8``) for a dtype the
    backend cannot move; a copy where ``tensor`` is not contiguous or not
    ``tensor_codec.plain``.
    ``restore`` takes a flat wire tensor holding any number of such payloads and returns
    them as a flat tensor of ``tensor``'s dtype; the caller reshapes.
    """
    flat = plain(tensor).contiguous().reshape(-1)
    if tensor.dtype in _native(backend):
        return flat, lambda wire: wire
    dtype = tensor.dtype
    return flat.view(torch.uint8), lambda wire: wire.view(dtype)


def for_reduction(tensor: torch.Tensor, backend: str) -> tuple[torch.Tensor, Restore]:
    """A tensor the backend can sum (a widened copy where needed) and how to narrow it back.

    Raises TypeError for a dtype that cannot be summed at all.
    """
    tensor = plain(tensor)
    dtype = tensor.dtype
    if dtype in _native(backend) and dtype != torch.bool:
        return tensor.contiguous(), lambda wire: wire
    if dtype == torch.bool:
        return _contiguous(tensor, torch.int32), lambda wire: wire != 0
    if dtype in _WIDER:
        wide = _WIDER[dtype]
        if wide.itemsize == dtype.itemsize:
            return tensor.contiguous().view(wide), lambda wire: wire.view(dtype)
        return _contiguous(tensor, wide), lambda wire: wire.to(dtype)
    if dtype.is_complex:
        return torch.view_as_real(tensor.contiguous()), torch.view_as_complex
    raise TypeError(f"dtype {dtype} cannot be summed across ranks")


def _contiguous(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` converted to ``dtype``, contiguous (``to`` keeps a view's strides, and
    the wire is read and written flat)."""
    return tensor.to(dtype, memory_format=torch.contiguous_format)
