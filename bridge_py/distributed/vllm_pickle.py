"""Values as vLLM's ranks write them to the store: pickles, read back through an allow-list.

vLLM's ``StatelessProcessGroup`` pickles every value it stores (objects, and tensors as
``pickle.dumps(tensor)``) and unpickles whatever it finds: whoever can write to the store can
run code in every rank (vLLM issue 29565). A rank of ours on vLLM's wire writes the same
pickles (:func:`dumps`) and reads them with :func:`loads`, which builds only

* Python's plain values: None, bools, numbers, str, bytes, bytearray, lists, tuples, dicts,
  sets, frozensets, complex numbers, slices, ranges and OrderedDicts;
* torch tensors and parameters (their storage read by this module, never by torch's full
  unpickler, and no larger than the bytes that came), dtypes, ``torch.Size`` and devices;
* NCCL's unique id, :class:`ncclUniqueId`, under vLLM's module path or ours.

Any other class is refused before it is imported, with ObjectLoadError naming it. The
operator, not a caller, may allow full pickle for a process: ``VLLM_BRIDGE_ALLOW_PICKLE=1``.
"""

from __future__ import annotations

import collections
import ctypes
import io
import pickle
import struct
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from bridge_py.distributed.auth import switched_on
from bridge_py.distributed.errors import ObjectLoadError

__all__ = [
    "ALLOW_PICKLE_ENV_VAR",
    "VLLM_NCCL_MODULE",
    "dumps",
    "loads",
    "ncclUniqueId",
    "pickle_allowed",
]

ALLOW_PICKLE_ENV_VAR = "VLLM_BRIDGE_ALLOW_PICKLE"
VLLM_NCCL_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"


class ncclUniqueId(ctypes.Structure):
    """NCCL's ``ncclUniqueId``: 128 opaque bytes that rank 0 makes and every rank needs to
    join one NCCL communicator. Pickled under vLLM's module path, so that a vLLM rank loads
    it as its own class (and one from a vLLM rank loads as this one)."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


UNIQUE_ID_BYTES = ctypes.sizeof(ncclUniqueId)


def pickle_allowed() -> bool:
    """Whether the operator allows full pickle (``$VLLM_BRIDGE_ALLOW_PICKLE``, read now)."""
    return switched_on(ALLOW_PICKLE_ENV_VAR)


# --- writing ------------------------------------------------------------------------------


class _NamesVllmClass(Exception):
    """A value holds an ncclUniqueId, which the C pickler would name by our module."""


class _FastPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is ncclUniqueId:
            raise _NamesVllmClass
        return NotImplemented


class _VllmPickler(pickle._Pickler):  # the Python pickler: its save_global can be replaced
    def save_global(self, obj: Any, name: str | None = None) -> None:
        writer: Any = self  # (typeshed leaves the Python pickler's own methods out)
        if obj is not ncclUniqueId:
            pickle._Pickler.save_global(writer, obj, name)  # type: ignore[attr-defined]
            return
        writer.save(VLLM_NCCL_MODULE)
        writer.save("ncclUniqueId")
        writer.write(pickle.STACK_GLOBAL)
        writer.memoize(obj)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as vLLM's ``pickle.dumps(obj)`` would (default protocol), with any
    :class:`ncclUniqueId` in it named by vLLM's module."""
    buffer = io.BytesIO()
    try:
        _FastPickler(buffer).dump(obj)
    except _NamesVllmClass:
        buffer = io.BytesIO()
        _VllmPickler(buffer, pickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


# --- reading ------------------------------------------------------------------------------

_STORAGE_DTYPES = {
    "BFloat16Storage": torch.bfloat16,
    "BoolStorage": torch.bool,
    "ByteStorage": torch.uint8,
    "CharStorage": torch.int8,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "IntStorage": torch.int32,
    "LongStorage": torch.int64,
    "ShortStorage": torch.int16,
}
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_VERSION = 1001


class _Refused(pickle.UnpicklingError):
    """A value names something the allow-list does not build."""


class _Storage(NamedTuple):
    """A tensor's storage as :func:`_storage` read it."""

    untyped: torch.UntypedStorage
    dtype: torch.dtype
    numel: int


def _storage(data: Any) -> _Storage:
    """The storage that ``torch.storage._load_from_bytes(data)`` would make, read here.

    ``data`` is torch's legacy serialisation of one storage (what pickling a tensor embeds):
    three header pickles, a pickle naming the storage by a persistent id (``("storage",
    dtype, key, location, numel, None)``), the list of keys,
    then the element count and the raw bytes. The count must match the bytes that are
    there, so a value cannot make this rank allocate more than it sent."""
    if not isinstance(data, bytes):
        raise _Refused(f"a tensor's storage must be bytes, got {type(data).__name__}")
    stream = io.BytesIO(data)
    header = [_Plain(stream).load() for _ in range(3)]
    if header[0] != _LEGACY_MAGIC or header[1] != _LEGACY_VERSION:
        raise _Refused("a tensor's storage is not in torch's legacy format")
    if not isinstance(header[2], dict) or header[2].get("little_endian") is not True:
        raise _Refused("a tensor's storage is not little-endian")
    record: list[tuple[torch.dtype, str, str, int]] = []
    _StorageRecord(stream, record).load()
    keys = _Plain(stream).load()
    if len(record) != 1 or keys != [record[0][1]]:
        raise _Refused("a tensor's storage must hold exactly one storage")
    dtype, _key, location, numel = record[0]
    count = stream.read(8)
    raw = stream.read()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if len(count) != 8 or struct.unpack("<q", count)[0] != numel or len(raw) != nbytes:
        raise _Refused(f"a tensor's storage claims {numel} elements but holds {len(raw)} bytes")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    untyped = flat.untyped_storage()
    if location != "cpu":
        device = torch.device(location)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise _Refused(f"a tensor on {location}, which this process cannot hold")
        untyped = cast(torch.UntypedStorage, untyped.cuda(device))
    return _Storage(untyped, dtype, numel)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2``, for the storage :func:`_storage` read: the view
    must lie in it and hold no more elements than it (no view that multiplies memory)."""
    if not isinstance(storage, _Storage):
        raise _Refused("a tensor without a storage")
    if backward_hooks or not isinstance(requires_grad, bool) or metadata not in (None, {}):
        raise _Refused("a tensor with hooks or metadata")
    if not all(type(v) is int for v in (storage_offset, *size, *stride)):
        raise _Refused("a tensor whose sizes are not integers")
    elements = 1
    for dim in size:
        elements *= dim
    if elements > storage.numel:
        raise _Refused(f"a tensor of {elements} elements over a storage of {storage.numel}")
    empty = torch.empty((0,), dtype=storage.dtype, device=storage.untyped.device)
    tensor = empty.set_(storage.untyped, storage_offset, tuple(size), tuple(stride))
    tensor.requires_grad = requires_grad
    return tensor


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> torch.Tensor:
    """``torch._utils._rebuild_parameter`` for a tensor this module rebuilt."""
    if not isinstance(data, torch.Tensor) or backward_hooks or not isinstance(requires_grad, bool):
        raise _Refused("a parameter without a plain tensor")
    return torch.nn.Parameter(data, requires_grad)


def _bytearray(data: Any = b"") -> bytearray:
    """``bytearray(data)`` for bytes only (``bytearray(n)`` would allocate ``n``)."""
    if not isinstance(data, bytes):
        raise _Refused("a bytearray must be made from bytes")
    return bytearray(data)


def _unpickle_ctypes(cls: Any, state: Any) -> ncclUniqueId:
    """``_ctypes._unpickle``, for :class:`ncclUniqueId` only, from its 128 bytes."""
    if cls is not ncclUniqueId or not isinstance(state, tuple) or len(state) != 2:
        raise _Refused("a ctypes value other than ncclUniqueId")
    attributes, raw = state
    if attributes != {} or not isinstance(raw, bytes) or len(raw) != UNIQUE_ID_BYTES:
        raise _Refused(f"an ncclUniqueId must be {UNIQUE_ID_BYTES} bytes")
    return ncclUniqueId.from_buffer_copy(raw)


def _torch_size(dims: Any = ()) -> torch.Size:
    return torch.Size(tuple(dims))


_ALLOWED: dict[tuple[str, str], Callable[..., Any] | type] = {
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "complex"): complex,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "range"): range,
    ("builtins", "set"): set,
    ("builtins", "slice"): slice,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): _torch_size,
    ("torch", "device"): torch.device,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): _storage,
    ("_ctypes", "_unpickle"): _unpickle_ctypes,
    (VLLM_NCCL_MODULE, "ncclUniqueId"): ncclUniqueId,
    ("bridge_py.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId"): ncclUniqueId,
    (__name__, "ncclUniqueId"): ncclUniqueId,
}
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if type(d) is torch.dtype}


class _AllowList(pickle.Unpickler):
    """Builds only what the module docstring lists."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise _Refused(f"class {module}.{name} is not on the allow-list")


class _Plain(pickle.Unpickler):
    """Plain values only (the headers of a storage)."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"class {module}.{name} in a tensor's storage header")


class _StorageRecord(pickle.Unpickler):
    """The pickle naming a storage: records ``(dtype, key, location, numel)``."""

    def __init__(self, stream: io.BytesIO, record: list[tuple[torch.dtype, str, str, int]]):
        super().__init__(stream)
        self._record = record

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _Refused(f"storage class {module}.{name} is not on the allow-list")

    def persistent_load(self, pid: Any) -> Any:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 6
            or pid[0] != "storage"
            or pid[5] is not None
            or type(pid[1]) is not torch.dtype
            or not all(isinstance(v, str) for v in pid[2:4])
            or type(pid[4]) is not int
            or pid[4] < 0
        ):
            raise _Refused("a tensor's storage is named by an unknown persistent id")
        self._record.append(pid[1:5])
        return None


def loads(data: bytes | bytearray | memoryview, what: str) -> Any:
    """The value vLLM's rank pickled in ``data``, built by the allow-list (or, when the
    operator allows it, by full pickle). ObjectLoadError names ``what`` and, for a refused
    value, the class or shape that was refused."""
    try:
        if pickle_allowed():
            return pickle.loads(data)
        return _AllowList(io.BytesIO(data)).load()
    except _Refused as exc:
        raise ObjectLoadError(
            f"{what} was refused: {exc}; a vLLM-wire rank loads only plain values, tensors "
            f"and NCCL unique ids (the operator may allow any class with "
            f"{ALLOW_PICKLE_ENV_VAR}=1)"
        ) from None
    except Exception as exc:
        raise ObjectLoadError(f"{what} does not unpickle: {type(exc).__name__}: {exc}") from exc
