"""How configs and tensors travel in a gather: plain data, never arbitrary pickles.

A gather moves a value as a :class:`Codec` says: a JSON header and a body of bytes, the same
for every carrier (a shared-memory segment or a workspace file).

* A config is ``None`` or a dict with str keys whose values are ``None``, bools, ints,
  floats, strs, lists, tuples, dicts of the same, and tensors. Its body is the file that
  ``torch.save`` writes for it, read back with ``torch.load(weights_only=True)``, which
  rebuilds exactly those types and executes no pickled code. It is checked before it is
  saved, so that the rank whose config is not plain data is the one that fails.
* A tensor's body is its raw bytes, behind a header with its dtype and shape.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["CONFIGS", "TENSORS", "Codec"]


class Codec(NamedTuple):
    """How one kind of value travels through a carrier.

    ``encode(value)`` gives a JSON-compatible header and a bytes-like body;
    ``decode(header, view)`` gives a new value that copies what it keeps of ``view``.
    """

    encode: Callable[[Any], tuple[dict[str, Any], Any]]
    decode: Callable[[Mapping[str, Any], memoryview], Any]


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, detached, and owning exactly its bytes (torch.save saves the
    whole storage of a view)."""
    tensor = tensor.detach().cpu()
    if (
        not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.untyped_storage().nbytes() != tensor.nbytes
    ):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _plain(value: Any, path: str) -> Any:
    """A copy of ``value`` (dicts as dicts, tensors standalone), or TypeError naming the path
    (dotted keys, ``"layers.0.weight"``) of what is not plain data."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return _standalone(value)
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"config key {key!r} at {path or '<root>'} is not a str")
        return {key: _plain(item, f"{path}.{key}" if path else key) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    raise TypeError(
        f"config value at {path or '<root>'} has type {type(value).__name__}: only None, "
        "bool, int, float, str, list, tuple, dict and torch.Tensor can be gathered"
    )


def _config_to_bytes(config: Mapping[str, Any] | None) -> tuple[dict[str, Any], bytes]:
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"a config must be a dict or None, got {type(config).__name__}")
    buffer = io.BytesIO()
    torch.save(_plain(config, ""), buffer)
    return {}, buffer.getvalue()


def _config_from_bytes(header: Mapping[str, Any], view: memoryview) -> Any:
    return torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)


def _tensor_to_bytes(tensor: torch.Tensor) -> tuple[dict[str, Any], Any]:
    # The body is a buffer over the tensor's bytes, not a copy.
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    header = {"dtype": str(flat.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    return header, flat.view(torch.uint8).numpy()


def _tensor_from_bytes(header: Mapping[str, Any], view: memoryview) -> torch.Tensor:
    dtype = getattr(torch, str(header["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"unknown dtype {header['dtype']!r} in a gathered tensor")
    raw = torch.empty(view.nbytes, dtype=torch.uint8)
    raw.numpy().data[:] = view
    return raw.view(dtype).reshape(header["shape"])


#: A config (``None`` or plain data): no header; the body is its torch.save file.
CONFIGS = Codec(_config_to_bytes, _config_from_bytes)
#: A tensor: its dtype and shape in the header, its raw bytes as the body (read into a new
#: CPU tensor).
TENSORS = Codec(_tensor_to_bytes, _tensor_from_bytes)
