"""NCCL's C API through ctypes, at vLLM's module path, for communicators that pair with vLLM's.

vLLM's ``PyNcclCommunicator`` calls NCCL itself: rank 0 makes an ``ncclUniqueId``, every rank
builds its communicator from it with ``ncclCommInitRank``, and each collective is one NCCL
call on the caller's stream. A rank of ours that is to take part in those collectives (a
trainer pushing weights into ``vllm serve``) must make the same calls in the same order,
which torch's NCCL backend (with its own rendezvous and its own streams) does not.
:class:`NCCLLibrary` binds the functions that needs, from NCCL's documented C API (``nccl.h``),
in the library that torch's CUDA wheels install (``nvidia-nccl-cu*``), or the one named by
``$VLLM_NCCL_SO_PATH`` (vLLM's variable) or ``library_path``.

Names follow vLLM's wrapper (``ncclUniqueId``, ``ncclDataTypeEnum``, ``ncclRedOpTypeEnum``,
``NCCLLibrary`` and its methods), so code written against it runs on this module. Every
failed call raises :class:`NcclError` with NCCL's own description of the result. Unlike
vLLM's, a ``library_path`` that names another file than the operator's is refused: loading
a library runs its code, and a worker's callers reach that parameter.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ReduceOp

from bridge_py.distributed.errors import DistributedError, StateError
from bridge_py.distributed.vllm_pickle import UNIQUE_ID_BYTES, ncclUniqueId

__all__ = [
    "NCCL_SUSPEND_MEM",
    "NCCL_UNIQUE_ID_BYTES",
    "NCCLLibrary",
    "NcclError",
    "buffer_type",
    "cudaStream_t",
    "find_nccl_library",
    "ncclComm_t",
    "ncclDataTypeEnum",
    "ncclRedOpTypeEnum",
    "ncclResult_t",
    "ncclUniqueId",
    "operator_library",
]

NCCL_UNIQUE_ID_BYTES = UNIQUE_ID_BYTES
ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p
_size_t = ctypes.c_size_t
_int = ctypes.c_int


class NcclError(DistributedError):
    """An NCCL call failed; the message names the call and NCCL's description."""


class ncclDataTypeEnum:
    """``ncclDataType_t``'s values, and the one for a torch dtype."""

    ncclInt8 = 0
    ncclChar = 0
    ncclUint8 = 1
    ncclInt32 = 2
    ncclInt = 2
    ncclUint32 = 3
    ncclInt64 = 4
    ncclUint64 = 5
    ncclFloat16 = 6
    ncclHalf = 6
    ncclFloat32 = 7
    ncclFloat = 7
    ncclFloat64 = 8
    ncclDouble = 8
    ncclBfloat16 = 9
    ncclFloat8e4m3 = 10
    ncclFloat8e5m2 = 11

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> int:
        """The NCCL type of ``dtype``; ValueError for one NCCL has none for."""
        found = _DTYPES.get(dtype)
        if found is None:
            raise ValueError(f"NCCL has no data type for torch {dtype}")
        return found


_DTYPES = {
    torch.int8: ncclDataTypeEnum.ncclInt8,
    torch.uint8: ncclDataTypeEnum.ncclUint8,
    torch.bool: ncclDataTypeEnum.ncclUint8,
    torch.int32: ncclDataTypeEnum.ncclInt32,
    torch.int64: ncclDataTypeEnum.ncclInt64,
    torch.float16: ncclDataTypeEnum.ncclFloat16,
    torch.float32: ncclDataTypeEnum.ncclFloat32,
    torch.float64: ncclDataTypeEnum.ncclFloat64,
    torch.bfloat16: ncclDataTypeEnum.ncclBfloat16,
    torch.float8_e4m3fn: ncclDataTypeEnum.ncclFloat8e4m3,
    torch.float8_e5m2: ncclDataTypeEnum.ncclFloat8e5m2,
}


class ncclRedOpTypeEnum:
    """``ncclRedOp_t``'s values, and the one for a torch ReduceOp."""

    ncclSum = 0
    ncclProd = 1
    ncclMax = 2
    ncclMin = 3
    ncclAvg = 4

    @classmethod
    def from_torch(cls, op: Any) -> int:
        """The NCCL op of ``op`` (SUM, PRODUCT, MAX, MIN or AVG); ValueError otherwise."""
        for torch_op, value in (
            (ReduceOp.SUM, cls.ncclSum),
            (ReduceOp.PRODUCT, cls.ncclProd),
            (ReduceOp.MAX, cls.ncclMax),
            (ReduceOp.MIN, cls.ncclMin),
            (ReduceOp.AVG, cls.ncclAvg),
        ):
            if op == torch_op:
                return value
        raise ValueError(f"NCCL has no reduction for {op!r}")


# name -> (argument types, result type); from nccl.h.
_FUNCTIONS: dict[str, tuple[list[Any], Any]] = {
    "ncclGetErrorString": ([ncclResult_t], ctypes.c_char_p),
    "ncclGetVersion": ([ctypes.POINTER(_int)], ncclResult_t),
    "ncclGetUniqueId": ([ctypes.POINTER(ncclUniqueId)], ncclResult_t),
    "ncclCommInitRank": ([ctypes.POINTER(ncclComm_t), _int, ncclUniqueId, _int], ncclResult_t),
    "ncclAllReduce": (
        [buffer_type, buffer_type, _size_t, _int, _int, ncclComm_t, cudaStream_t],
        ncclResult_t,
    ),
    "ncclReduce": (
        [buffer_type, buffer_type, _size_t, _int, _int, _int, ncclComm_t, cudaStream_t],
        ncclResult_t,
    ),
    "ncclReduceScatter": (
        [buffer_type, buffer_type, _size_t, _int, _int, ncclComm_t, cudaStream_t],
        ncclResult_t,
    ),
    "ncclAllGather": (
        [buffer_type, buffer_type, _size_t, _int, ncclComm_t, cudaStream_t],
        ncclResult_t,
    ),
    "ncclBroadcast": (
        [buffer_type, buffer_type, _size_t, _int, _int, ncclComm_t, cudaStream_t],
        ncclResult_t,
    ),
    "ncclSend": ([buffer_type, _size_t, _int, _int, ncclComm_t, cudaStream_t], ncclResult_t),
    "ncclRecv": ([buffer_type, _size_t, _int, _int, ncclComm_t, cudaStream_t], ncclResult_t),
    "ncclGroupStart": ([], ncclResult_t),
    "ncclGroupEnd": ([], ncclResult_t),
    "ncclCommDestroy": ([ncclComm_t], ncclResult_t),
    "ncclCommAbort": ([ncclComm_t], ncclResult_t),
}
# Bound where the library has them (NCCL 2.29.7 and later): see NCCLLibrary.has_symbol.
_OPTIONAL: dict[str, tuple[list[Any], Any]] = {
    "ncclCommSuspend": ([ncclComm_t, _int], ncclResult_t),  # (comm, flags)
    "ncclCommResume": ([ncclComm_t], ncclResult_t),
}
NCCL_SUSPEND_MEM = 0x01  # ncclCommSuspend's flag: release the communicator's memory


def find_nccl_library() -> str:
    """Where NCCL is: ``$VLLM_NCCL_SO_PATH``, else the library of the ``nvidia.nccl``
    package that torch's CUDA wheels install, else ``libnccl.so.2`` for the loader."""
    named = os.environ.get("VLLM_NCCL_SO_PATH")
    if named:
        return named
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:  # no nvidia package at all
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        found = sorted(glob.glob(str(Path(folder) / "lib" / "libnccl.so*")))
        if found:
            return found[0]
    return "libnccl.so.2"


def operator_library(so_file: str | None) -> str:
    """:func:`find_nccl_library`'s file; ValueError when ``so_file`` names another one."""
    path = find_nccl_library()
    if so_file is not None and os.path.realpath(so_file) != os.path.realpath(path):
        raise ValueError(
            f"library_path {so_file!r} is not the NCCL library of this process ({path!r}): "
            "the operator chooses another one with VLLM_NCCL_SO_PATH"
        )
    return path


def _forward(name: str) -> Callable[..., None]:
    """A method calling NCCL's ``name`` with its arguments as they are."""

    def call(self: NCCLLibrary, *args: Any) -> None:
        self._call(name, *args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"NCCL's ``{name}`` (nccl.h), its arguments in NCCL's order."
    return call


class NCCLLibrary:
    """The NCCL functions a communicator calls, bound from one shared library."""

    def __init__(self, so_file: str | None = None) -> None:
        """Load NCCL from :func:`find_nccl_library`'s file; StateError names the file and
        why when it cannot be loaded or lacks a function.

        Loading a library runs its code, so the file is the operator's choice
        (``$VLLM_NCCL_SO_PATH``), not a caller's: ``so_file`` (vLLM's ``library_path``) must
        name that same file, else ValueError."""
        path = operator_library(so_file)
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as exc:
            raise StateError(
                f"cannot load NCCL from {path!r} (set VLLM_NCCL_SO_PATH, or install torch's "
                f"CUDA build, which brings NCCL): {exc}"
            ) from exc
        self.path = path
        self._fn: dict[str, Any] = {}
        for name, (argtypes, restype) in {**_FUNCTIONS, **_OPTIONAL}.items():
            try:
                fn = getattr(self.lib, name)
            except AttributeError as exc:
                if name in _OPTIONAL:
                    continue
                raise StateError(f"{path} has no {name}: not an NCCL library") from exc
            fn.argtypes, fn.restype = argtypes, restype
            self._fn[name] = fn

    def has_symbol(self, name: str) -> bool:
        """Whether the library has NCCL's function ``name`` (bound by this class)."""
        return name in self._fn

    def _call(self, name: str, *args: Any) -> None:
        if name not in self._fn:
            raise StateError(f"{self.path} has no {name} (NCCL 2.29.7 and later have it)")
        result = self._fn[name](*args)
        if result != 0:
            raise NcclError(f"{name} failed: {self.ncclGetErrorString(result)} ({result})")

    def ncclGetErrorString(self, result: int) -> str:
        """NCCL's description of result code ``result``."""
        text = self._fn["ncclGetErrorString"](result)
        return text.decode() if text else f"NCCL error {result}"

    def ncclGetRawVersion(self) -> int:
        """NCCL's version as one number (``major * 10000 + minor * 100 + patch`` since 2.9)."""
        version = _int()
        self._call("ncclGetVersion", ctypes.byref(version))
        return version.value

    def ncclGetVersion(self) -> str:
        """NCCL's version as ``"major.minor.patch"``."""
        raw = str(self.ncclGetRawVersion())
        major, minor, patch = raw[0], raw[1:3].lstrip("0") or "0", raw[3:].lstrip("0") or "0"
        return f"{major}.{minor}.{patch}"

    def ncclGetUniqueId(self) -> ncclUniqueId:
        """A new unique id, for rank 0 to hand to every rank of a communicator."""
        unique_id = ncclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(unique_id))
        return unique_id

    def unique_id_from_bytes(self, data: bytes) -> ncclUniqueId:
        """The unique id of ``data`` (its 128 bytes); ValueError for another length."""
        if len(data) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(
                f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)} bytes"
            )
        return ncclUniqueId.from_buffer_copy(data)

    def ncclCommInitRank(self, world_size: int, unique_id: ncclUniqueId, rank: int) -> Any:
        """Join the communicator of ``unique_id`` as ``rank`` of ``world_size`` (every rank
        must call it; it returns once all have)."""
        comm = ncclComm_t()
        self._call("ncclCommInitRank", ctypes.byref(comm), world_size, unique_id, rank)
        return comm

    # The calls whose arguments go to NCCL as they are, in nccl.h's order.
    ncclAllReduce = _forward("ncclAllReduce")  # (send, recv, count, dtype, op, comm, stream)
    ncclReduce = _forward("ncclReduce")  # (send, recv, count, dtype, op, root, comm, stream)
    ncclReduceScatter = _forward("ncclReduceScatter")  # (send, recv, count, dtype, op, ...)
    ncclAllGather = _forward("ncclAllGather")  # (send, recv, sendcount, dtype, comm, stream)
    ncclBroadcast = _forward("ncclBroadcast")  # (send, recv, count, dtype, root, comm, stream)
    ncclSend = _forward("ncclSend")  # (send, count, dtype, peer, comm, stream)
    ncclRecv = _forward("ncclRecv")  # (recv, count, dtype, peer, comm, stream)
    ncclGroupStart = _forward("ncclGroupStart")  # the calls up to ncclGroupEnd go together
    ncclGroupEnd = _forward("ncclGroupEnd")
    ncclCommDestroy = _forward("ncclCommDestroy")  # (comm), once its work has run
    ncclCommAbort = _forward("ncclCommAbort")  # (comm), its work cancelled
    ncclCommSuspend = _forward("ncclCommSuspend")  # (comm, flags): where has_symbol says
    ncclCommResume = _forward("ncclCommResume")  # (comm), after ncclCommSuspend
