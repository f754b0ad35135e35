"""How configs and tensors travel in a gather: plain data, never arbitrary pickles.

A gather moves a value as a :class:`Codec` says: as bytes, the same for every carrier (a
shared-memory segment or a workspace file).

* A config is ``None`` or a dict with str keys whose values are ``None``, bools, ints,
  floats, strs, lists, tuples, dicts of the same, and tensors. Its body is the file that
  ``torch.save`` writes for it, read back with ``torch.load(weights_only=True)``, which
  rebuilds exactly those types and executes no pickled code. It is checked before it is
  saved, so that the rank whose config is not plain data is the one that fails.
* A tensor is the payload of the one tensor codec (``bridge_py.distributed.tensor_codec``, as
  between the ranks of a StatelessProcessGroup): its dtype, shape and raw bytes.

Bytes that are not what they should be (say, a segment that another process wrote) are a
:class:`~bridge_py.distributed.errors.CollectiveMismatchError` naming the value; nothing in
them is unpickled but by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from bridge_py.distributed import tensor_codec
from bridge_py.distributed.errors import CollectiveMismatchError

__all__ = ["CONFIGS", "TENSORS", "Codec"]


class Codec(NamedTuple):
    """How one kind of value travels through a carrier.

    ``encode(value)`` gives the value's bytes as bytes-like parts, to be written one after
    the other; ``decode(view, what)`` gives a new value that copies what it keeps of
    ``view`` (those bytes), or raises CollectiveMismatchError naming ``what`` (the value and
    where it was) when they hold none.
    """

    encode: Callable[[Any], Sequence[Any]]
    decode: Callable[[memoryview, str], Any]


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


_SCALARS = (bool, int, float, str)


def _plain(value: Any, path: str) -> Any:
    """A copy of ``value`` (dicts as dicts, tensors standalone), or TypeError naming the path
    (dotted keys, ``"layers.0.weight"``) of what is not plain data."""
    if value is None or type(value) in _SCALARS:
        return value
    for scalar in _SCALARS:  # a subclass (an IntEnum, numpy's float64) as its base type:
        if isinstance(value, scalar):  # torch.load(weights_only=True) loads no other
            return scalar(value)
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


def _config_to_bytes(config: Mapping[str, Any] | None) -> tuple[bytes]:
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"a config must be a dict or None, got {type(config).__name__}")
    buffer = io.BytesIO()
    torch.save(_plain(config, ""), buffer)
    return (buffer.getvalue(),)


def _config_from_bytes(view: memoryview, what: str) -> Any:
    try:
        config = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
        # What torch.load may rebuild is more than a config holds (a list at the root, a
        # set, keys that are not strs, tensors sharing memory): the writer's check again.
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"it holds a {type(config).__name__}, not a dict or None")
        return _plain(config, "")
    except Exception as exc:  # torch.load's (a refused global, a broken archive, ...), _plain's
        raise CollectiveMismatchError(f"{what} is not a gathered config: {exc}") from exc


#: A config (``None`` or plain data): its torch.save file.
CONFIGS = Codec(_config_to_bytes, _config_from_bytes)
#: A tensor: the tensor codec's payload (read into a new CPU tensor).
TENSORS = Codec(tensor_codec.parts, lambda view, what: tensor_codec.decode(view, None, what))
