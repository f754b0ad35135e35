"""How configs and tensors travel in a gather: plain data, never arbitrary pickles.

A config is ``None`` or a dict with str keys whose values are ``None``, bools, ints, floats,
strs, lists, tuples, dicts of the same, and tensors. :func:`split_config` turns it into what
``NFSWorkspace.write_configs_and_weights`` takes, like ModelOpt's ``split_config_and_weights``:
a JSON-compatible ``config_json`` in which each tensor is replaced by ``{"__tensor__": name}``
(and each tuple by ``{"__tuple__": [...]}``) plus ``weights``, a state dict from those names
to the tensors. Both are saved with ``torch.save`` and read back with
``torch.load(weights_only=True)``, so reading executes no pickled code.

A gather moves a value as a :class:`Codec` says: a JSON header and a body of bytes, the same
for every carrier. A config's body is its state file; a tensor's is its raw bytes, behind a
header with its dtype and shape.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["CONFIGS", "TENSORS", "Codec", "join_config", "load_state", "save_state", "split_config"]

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_RESERVED = (_TENSOR, _TUPLE)


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


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split ``config`` into its JSON-compatible part and a state dict of its tensors.

    Tensor names are the dotted paths of their keys (``"layers.0.weight"``). Raises TypeError
    naming the path of a value that is not plain data, or ValueError for a reserved key.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"a config must be a dict or None, got {type(config).__name__}")
    weights: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            name = path if path not in weights else f"{path}#{len(weights)}"
            weights[name] = _standalone(value)
            return {_TENSOR: name}
        if isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(f"config key {key!r} at {path or '<root>'} is not a str")
                if key in _RESERVED:
                    raise ValueError(f"config key {key!r} at {path or '<root>'} is reserved")
                out[key] = walk(item, f"{path}.{key}" if path else key)
            return out
        if isinstance(value, (list, tuple)):
            items = [walk(item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value)]
            return {_TUPLE: items} if isinstance(value, tuple) else items
        raise TypeError(
            f"config value at {path or '<root>'} has type {type(value).__name__}: only None, "
            "bool, int, float, str, list, tuple, dict and torch.Tensor can be gathered"
        )

    return walk(config, ""), weights


def join_config(config_json: Any, weights: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_config`: put the tensors (and tuples) back in place."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if len(value) == 1 and _TENSOR in value:
                return weights[value[_TENSOR]]
            if len(value) == 1 and _TUPLE in value:
                return tuple(walk(item) for item in value[_TUPLE])
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value

    return walk(config_json)


def save_state(config_json: Mapping[str, Any], weights: Mapping[str, Any], file: Any) -> None:
    """Write one state (``{"config": ..., "weight": ...}``) to ``file`` with torch.save."""
    torch.save({"config": dict(config_json), "weight": dict(weights)}, file)


def load_state(file: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read one state written by :func:`save_state`, executing no pickled code."""
    state = torch.load(file, map_location="cpu", weights_only=True)
    return state["config"], state["weight"]


class Codec(NamedTuple):
    """How one kind of value travels through a carrier (a segment or a workspace file).

    ``encode(value)`` gives a JSON-compatible header and a bytes-like body;
    ``decode(header, view)`` gives a new value that copies what it keeps of ``view``.
    """

    encode: Callable[[Any], tuple[dict[str, Any], Any]]
    decode: Callable[[Mapping[str, Any], memoryview], Any]


def _config_to_bytes(config: Mapping[str, Any] | None) -> tuple[dict[str, Any], bytes]:
    # No header: the body is a whole state file, empty for ``None``.
    if config is None:
        return {}, b""
    buffer = io.BytesIO()
    save_state(*split_config(config), buffer)
    return {}, buffer.getvalue()


def _config_from_bytes(header: Mapping[str, Any], view: memoryview) -> Any:
    if not view.nbytes:
        return None
    return join_config(*load_state(io.BytesIO(bytes(view))))


def _tensor_to_bytes(tensor: torch.Tensor) -> tuple[dict[str, Any], Any]:
    # The header says dtype and shape; the body is the raw bytes (a buffer, not a copy).
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


#: A config (``None`` or plain data): no header, the body is its state file (empty for None).
CONFIGS = Codec(_config_to_bytes, _config_from_bytes)
#: A tensor: its dtype and shape in the header, its raw bytes as the body (read into a new
#: CPU tensor).
TENSORS = Codec(_tensor_to_bytes, _tensor_from_bytes)
