"""How configs and tensors travel in a gather: plain data, never arbitrary pickles.

A gather moves a value as a :class:`GatherCodec` says: as bytes, the same for every carrier (a
shared-memory segment or a workspace file).

* A config is ``None`` or a dict with str keys whose values are ``None``, bools, ints,
  floats, strs, lists, tuples, dicts of the same, and tensors. Its body is the file that
  ``torch.save`` writes for it, read back with ``torch.load(weights_only=True)``, which
  rebuilds exactly those types and executes no pickled code. It is checked before it is
  saved, so that the rank whose config is not plain data is the one that fails.
* A tensor is the tagged payload of the one tensor codec (``bridge_py.tensor_codec``, as
  between the ranks of a StatelessProcessGroup: ``spg.tensors``): its dtype, shape and raw
  bytes.

Bytes that are not what they should be (say, a segment that another process wrote) are a
:class:`~bridge_py.distributed.errors.CollectiveMismatchError` naming the value; nothing in
them is unpickled but by ``torch.load(weights_only=True)`` (:func:`load_saved`). Nor do
they take more memory than they are long: ``torch.save`` stores its archive's members
uncompressed, so a compressed member is refused before anything is loaded (a 200 KB file
with a deflated pickle became a 200 MB str), and a config that would take more than its
file to copy is refused before it is copied (one list named a million times, a 4-byte
tensor viewed as a billion elements).
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from bridge_py.distributed.errors import CollectiveMismatchError
from bridge_py.distributed.spg import tensors

__all__ = ["CONFIGS", "TENSORS", "GatherCodec", "load_saved"]


class GatherCodec(NamedTuple):
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


def load_saved(data: bytes | memoryview) -> Any:
    """What ``torch.load(weights_only=True)`` makes of a ``torch.save`` file that another
    process wrote, once its archive is known to hold no more than ``data``: every member
    stored as it is (as ``torch.save`` writes them), and no more bytes in all than the
    file's. Raises ValueError, zipfile.BadZipFile or what torch.load raises."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED:
            raise ValueError(
                f"its member {member.filename!r} is compressed, which torch.save never does"
            )
    if sum(member.file_size for member in members) > len(data):
        raise ValueError(f"its members claim more bytes than its {len(data)}")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _within(config: Any, limit: int) -> None:
    """Raise TypeError if copying ``config`` (as torch.load rebuilt it) could take more than
    ``limit`` bytes of tensors, or more steps than it has objects: a file can name one
    container many times, and ``_plain`` would copy it each time."""
    seen: set[int] = set()
    left = [config]
    tensor_bytes = 0
    while left:
        value = left.pop()
        if isinstance(value, torch.Tensor):
            tensor_bytes += value.nbytes
            if tensor_bytes > limit:
                raise TypeError(f"its tensors hold more than the {limit} bytes of its file")
        elif isinstance(value, (dict, list, tuple)) and value:  # () is one shared object
            if id(value) in seen:
                raise TypeError(f"it names one {type(value).__name__} more than once")
            seen.add(id(value))
            left.extend(value.values() if isinstance(value, dict) else value)


def _config_from_bytes(view: memoryview, what: str) -> Any:
    try:
        config = load_saved(view)
        # What torch.load may rebuild is more than a config holds (a list at the root, a
        # set, keys that are not strs, tensors sharing memory): the writer's check again.
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"it holds a {type(config).__name__}, not a dict or None")
        _within(config, len(view))
        return _plain(config, "")
    except Exception as exc:  # torch.load's (a refused global, a broken archive, ...), _plain's
        raise CollectiveMismatchError(f"{what} is not a gathered config: {exc}") from exc


#: A config (``None`` or plain data): its torch.save file.
CONFIGS = GatherCodec(_config_to_bytes, _config_from_bytes)
#: A tensor: the tensor codec's payload (read into a new CPU tensor).
TENSORS = GatherCodec(tensors.parts, lambda view, what: tensors.decode(view, None, what))
