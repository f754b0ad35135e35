"""What torch's stores do at runtime that their type stubs leave out, typed in one place.

torch's pybind classes have more than ``torch/_C/_distributed_c10d.pyi`` declares (torch
2.13): every ``Store`` has a ``timeout`` property and ``clone()``, a ``TCPStore`` says whether
its server runs on libuv (``libuvBackend``), and ``Store.set`` takes bytes as well as str.
The package reaches them through these functions, so that the type checker's exceptions sit
here (and ``warn_unused_ignores`` reports them once a torch release declares the names).
"""

from __future__ import annotations

import datetime

from torch.distributed import Store, TCPStore

__all__ = ["clone", "compare_set_bytes", "set_bytes", "timeout_of", "uses_libuv"]


def timeout_of(store: Store) -> datetime.timedelta:
    """The default timeout of ``store``'s blocking requests."""
    return store.timeout  # type: ignore[attr-defined]  # a property the stub omits


def clone(store: Store) -> Store:
    """A new client of ``store``'s server (AttributeError or NotImplementedError for a store
    that cannot make one)."""
    return store.clone()  # type: ignore[attr-defined]  # omitted by the stub


def uses_libuv(store: TCPStore) -> bool:
    """Whether ``store``'s server runs on libuv (a new client must match it)."""
    return bool(store.libuvBackend)  # type: ignore[attr-defined]  # omitted by the stub


def set_bytes(store: Store, key: str, value: bytes) -> None:
    """``store[key] = value``."""
    store.set(key, value)  # type: ignore[arg-type]  # the stub says str; bytes are accepted


def compare_set_bytes(store: Store, key: str, expected: bytes, desired: bytes) -> bytes:
    """``store.compare_set`` with byte values: the value of ``key`` afterwards."""
    return store.compare_set(key, expected, desired)  # type: ignore[arg-type]  # as set_bytes
