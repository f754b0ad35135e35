"""A real torch ProcessGroup (gloo, or nccl on CUDA) that leaves torch.distributed's globals alone.

``torch.distributed.init_process_group`` can be called once per process and registers a
global default group. Here the group is assembled from its parts instead: the same store as
StatelessProcessGroup (rank 0 serves it on the given interface, all ranks join it with clear
errors), a ``ProcessGroup`` object, and one backend registered on it for its device. The
result supports collectives called on the object itself (``pg.allreduce([t]).wait()``,
``pg.broadcast``, ``pg.allgather``, ...) with group ranks; it is not known to the
``torch.distributed.*`` free functions, and ``torch.distributed.is_initialized()`` stays False.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
import traceback
from typing import Any, cast

import torch
from torch._C._distributed_c10d import _register_process_group, _resolve_process_group
from torch.distributed import Backend, PrefixStore, ProcessGroup, Store, TCPStore
from torch.distributed.distributed_c10d import _get_default_timeout, is_nccl_available

from bridge_py.distributed.errors import StateError
from bridge_py.distributed.spg.group import validate_rank
from bridge_py.distributed.store import format_address, join_group, open_store

__all__ = [
    "cpu_all_reduce_",
    "default_group_timeout",
    "forget_rendezvous",
    "init_gloo_process_group",
    "set_gloo_backend_timeout",
    "stateless_destroy_torch_distributed_process_group",
    "stateless_init_torch_distributed_process_group",
    "store_of",
]


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout torch.distributed's default group was made with (``init_process_group``'s
    ``timeout``), for the groups made after it; None when it cannot be read.

    torch's ``new_group`` gives a group without a timeout of its own the backend's default
    instead (gloo: 30 minutes), so a GroupCoordinator's groups would wait that long for a
    rank that is gone, and a process whose collective was abandoned could not exit until
    then (its destructor waits for gloo's thread), whatever the caller asked for.
    """
    world = torch.distributed.group.WORLD
    if world is None:
        return None
    try:
        timeout = world._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # another backend, or a torch that says otherwise
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def set_gloo_backend_timeout(group: ProcessGroup, timeout: datetime.timedelta) -> None:
    """Make ``timeout`` the default of the gloo backend of ``group`` (a CPU group): its
    collectives from now on give up after it."""
    group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)


def _as_timedelta(
    timeout: datetime.timedelta | float | None, backend: Backend
) -> datetime.timedelta:
    if timeout is None:
        return _get_default_timeout(backend)
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def _make_backend(
    backend: Backend, store: Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> tuple[torch._C._distributed_c10d.Backend, ProcessGroup.BackendType, torch.device]:
    """The backend object for ``backend``, its type tag and the device it serves."""
    if backend == Backend.GLOO:
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        gloo = ProcessGroupGloo(store, rank, world_size, timeout)
        return gloo, ProcessGroup.BackendType.GLOO, torch.device("cpu")
    if backend == Backend.NCCL:
        if not (torch.cuda.is_available() and is_nccl_available()):
            raise StateError("backend 'nccl' needs CUDA and a torch build with NCCL")
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = ProcessGroupNCCL(store, rank, world_size, options)
        return nccl, ProcessGroup.BackendType.NCCL, torch.device("cuda")
    raise ValueError(f"unsupported backend {str(backend)!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")


def _assemble(
    store: TCPStore, rank: int, world_size: int, backend: Backend, timeout: datetime.timedelta
) -> ProcessGroup:
    """A ProcessGroup over ``store`` with one backend registered for its device."""
    # The backend's keys get their own prefix, apart from the join keys.
    return _on_store(PrefixStore("pg/", store), rank, world_size, backend, timeout)


def _on_store(
    prefix_store: Store, rank: int, world_size: int, backend: Backend, timeout: datetime.timedelta
) -> ProcessGroup:
    pg = ProcessGroup(prefix_store, rank, world_size)
    backend_obj, backend_type, device = _make_backend(
        backend, prefix_store, rank, world_size, timeout
    )
    pg._set_default_backend(backend_type)
    backend_obj._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, backend_obj)
    return pg


def init_gloo_process_group(
    prefix_store: Store, group_rank: int, group_size: int, timeout: datetime.timedelta
) -> ProcessGroup:
    """A gloo ProcessGroup of ``group_size`` ranks whose rendezvous runs over
    ``prefix_store``, without torch.distributed's global state (vLLM's building block of
    its stateless groups).

    Every rank calls it with its ``group_rank`` and the same store (a ``PrefixStore`` that
    no other group uses, over a store every rank reaches); it returns once all have joined.
    ``timeout`` (a positive timedelta) bounds the rendezvous and every collective. The
    group answers collectives called on it (``pg.allreduce([t]).wait()``), with group ranks.

    Raises:
        TypeError: ``prefix_store`` is not a torch Store, ``timeout`` not a timedelta, or
            ``group_rank``/``group_size`` not ints.
        ValueError: ``group_size`` below 1, ``group_rank`` outside ``[0, group_size)``, or
            ``timeout`` not positive.
    """
    if not isinstance(prefix_store, Store):
        raise TypeError(f"prefix_store must be a torch Store, got {type(prefix_store).__name__}")
    for name, value in (("group_size", group_size), ("group_rank", group_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    validate_rank(group_rank, group_size, "group_rank")
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return _on_store(prefix_store, group_rank, group_size, Backend(Backend.GLOO), timeout)


def store_of(group: Any) -> Store:
    """The store behind ``group``: a StatelessProcessGroup's own, or the one a torch
    ProcessGroup was made on (ValueError when this torch cannot tell)."""
    if not isinstance(group, ProcessGroup):
        return cast(Store, group.store)
    get = getattr(group, "get_group_store", None)
    if get is not None:
        return cast(Store, get())
    from torch.distributed.distributed_c10d import _world  # torch before get_group_store

    if group in _world.pg_map:
        return _world.pg_map[group][1]
    raise ValueError("this torch cannot tell the store of a group it did not register")


def forget_rendezvous(store: Store, rank: int) -> None:
    """Delete the address ``rank`` published in ``store`` for the gloo rendezvous of a group
    :func:`_assemble` made over it (gloo keeps one key per rank, under its device's index).

    Only once every rank of the group is known to have joined it (a collective over all of
    them has completed): a rank still joining reads the others' addresses. A group over a
    store that outlives it (PyNcclCommunicator's, over a StatelessProcessGroup's store)
    then leaves no keys behind. A key already gone is no error.
    """
    PrefixStore("pg/", store).delete_key(f"0/{rank}")


def stateless_init_torch_distributed_process_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str | None = None,
    return_store: bool = False,
    listen_socket: socket.socket | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> ProcessGroup | tuple[ProcessGroup, Store]:
    """A replacement for `torch.distributed.init_process_group` that does not
    pollute the global state.

    The created ProcessGroup object can be used for operations called on it, such as
    ``pg.allreduce([tensor]).wait()``, with ranks of this group. Rank 0 serves the group's
    store on ``host:port`` (or on ``listen_socket``, already bound); every rank returns once
    all ``world_size`` ranks have joined, or raises ``StoreError`` (a RuntimeError) saying
    why not. ``timeout`` (a timedelta or seconds; torch's default for the backend when None)
    bounds joining and every collective. With ``group_name`` the group takes that name and
    is registered under it in this process (as torch's named groups are, so that
    torch's functional collectives find it; ValueError if the name is taken). With
    ``return_store`` it returns ``(pg, store)``: the group's store (its keys live under a
    prefix there), for the caller's own keys. Release the group with
    :func:`stateless_destroy_torch_distributed_process_group`.
    """
    validate_rank(rank, world_size)
    if group_name is not None and _registered(group_name):
        raise ValueError(f"a process group named {group_name!r} exists in this process already")
    backend_name = Backend(backend)
    delta = _as_timedelta(timeout, backend_name)
    seconds = delta.total_seconds()
    deadline = time.monotonic() + seconds
    store, sock = open_store(host, port, rank, seconds, listen_socket=listen_socket)
    try:
        address = format_address(host, sock.getsockname()[1] if sock is not None else port)
        join_group(store, rank, world_size, address, seconds, deadline)
        pg = _assemble(store, rank, world_size, backend_name, delta)
        if group_name is not None:
            name: Any = group_name  # a GroupName (a NewType of str) in newer torch
            pg._set_group_name(name)
            _register_process_group(name, pg)
    except BaseException as exc:
        # Let rank 0's store server stop now rather than when the traceback is collected.
        del store
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        # The store server serves a duplicate descriptor and the group holds the store, so
        # our socket is no longer needed (a caller's listen_socket stays the caller's).
        if listen_socket is None and sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
    return (pg, store) if return_store else pg


def _registered(group_name: Any) -> bool:  # a GroupName (a NewType of str) in newer torch
    try:
        _resolve_process_group(group_name)
    except RuntimeError:
        return False
    return True


def stateless_destroy_torch_distributed_process_group(pg: ProcessGroup) -> None:
    """Destroy ProcessGroup returned by
    stateless_init_torch_distributed_process_group().

    Shuts its backend down; the store (rank 0: its server) goes when the last reference to
    ``pg`` does.
    """
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # torch < 2.7
        from torch.distributed import distributed_c10d

        distributed_c10d._shutdown_backend(pg)  # type: ignore[attr-defined]  # gone in 2.7
    if pg.group_name:  # only groups registered by name are in torch's registry
        from torch.distributed.distributed_c10d import _unregister_process_group

        _unregister_process_group(pg.group_name)


def cpu_all_reduce_(
    tensor: torch.Tensor, group: ProcessGroup, timeout: datetime.timedelta | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over the gloo process ``group`` into ``tensor`` (returned), every rank
    getting the same bits. ``group`` may be a group of torch.distributed's world or a
    stateless one (``stateless_init_torch_distributed_process_group``): the call goes to
    the group itself. ``timeout`` bounds the wait (None: the group's own); a tensor that
    is not contiguous is summed through a contiguous copy."""
    if group.size() == 1:
        return tensor
    data = tensor if tensor.is_contiguous() else tensor.contiguous()
    work = group.allreduce([data])
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
    if data is not tensor:
        tensor.copy_(data)
    return tensor
