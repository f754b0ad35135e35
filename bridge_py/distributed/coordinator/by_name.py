"""Every GroupCoordinator of this process by its unique name, as vLLM's ``_groups``, and
the collectives that find their group there.

vLLM runs a group's collectives as torch custom ops, which cannot take the coordinator
itself, so they take its ``unique_name`` (``"tp:0"``) and look it up; the bodies of those
ops (``all_reduce``, ``all_gather``, ``reduce_scatter``, which ``parallel_state`` exports)
and their ``*_fake`` shape functions are here, without registering any op.
``parallel_state``'s ``suspend_device_comms`` & co. walk every live group. The registry
holds weak references: it keeps no group alive.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = [
    "all_gather",
    "all_gather_fake",
    "all_reduce",
    "all_reduce_fake",
    "find_group",
    "live_groups",
    "reduce_scatter",
    "reduce_scatter_fake",
    "register_group",
]

_groups: dict[str, weakref.ref[Any]] = {}


def register_group(group: Any) -> None:
    """Record ``group`` (a GroupCoordinator) under its ``unique_name``."""
    _groups[group.unique_name] = weakref.ref(group)


def _alive(group: Any) -> bool:
    """Whether ``group`` is there and not destroyed (``destroy`` drops its groups)."""
    return group is not None and hasattr(group, "cpu_group")


def find_group(group_name: str) -> Any:
    """The live GroupCoordinator named ``group_name``.

    Raises:
        TypeError: ``group_name`` is not a str.
        ValueError: no group has that name, or that group was destroyed or collected.
    """
    if not isinstance(group_name, str):
        raise TypeError(f"group_name must be a str, got {type(group_name).__name__}")
    ref = _groups.get(group_name)
    if ref is None:
        known = sorted(name for name, ref in _groups.items() if _alive(ref()))
        raise ValueError(f"group_name {group_name!r} names no group; live groups: {known}")
    group = ref()
    if not _alive(group):
        raise ValueError(f"group_name {group_name!r} names a group that was destroyed")
    return group


def live_groups() -> list[Any]:
    """Every registered GroupCoordinator not yet destroyed or collected, oldest first."""
    for name in [name for name, ref in _groups.items() if ref() is None]:
        del _groups[name]  # collected: nothing to keep its name for
    return [group for ref in _groups.values() if _alive(group := ref())]


def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``tensor`` over the group whose ``unique_name`` is ``group_name``
    (``"tp:0"``): the body vLLM registers as the custom op ``vllm.all_reduce`` (a
    custom op cannot take the coordinator itself; no op is registered here). As
    ``GroupCoordinator.all_reduce`` it may sum into ``tensor``: use the result.

    Raises:
        TypeError: ``group_name`` is not a str (and the group's own errors for ``tensor``).
        ValueError: no live group has that name.
    """
    return find_group(group_name)._all_reduce_out_place(tensor)


def all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """What :func:`all_reduce` returns, without communicating: an empty tensor like
    ``tensor`` (the shape function of vLLM's custom op, for tracing)."""
    return torch.empty_like(_checked(tensor))


def reduce_scatter(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    """Sum ``tensor`` over the group named ``group_name`` and keep this rank's equal slice
    along ``dim`` (vLLM's custom op ``vllm.reduce_scatter``; ``world_size`` is the group's
    size, which the op's shape function needs).

    Raises:
        TypeError: ``group_name`` is not a str.
        ValueError: no live group has that name, or ``world_size`` is not its size.
    """
    return _sized_group(group_name, world_size)._reduce_scatter_out_place(tensor, dim)


def reduce_scatter_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    """An empty tensor shaped as :func:`reduce_scatter`'s result: ``tensor``'s shape with
    dimension ``dim`` divided by ``world_size``.

    Raises:
        ValueError: ``dim`` is not a dimension of ``tensor``, ``world_size`` is not a
            positive int, or it does not divide that dimension.
    """
    return _resized(tensor, dim, world_size, gathered=False)


def all_gather(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Every rank's ``tensor`` of the group named ``group_name``, concatenated along
    ``dim`` in rank order (vLLM's custom op ``vllm.all_gather``; ``world_size`` is the
    group's size).

    Raises:
        TypeError: ``group_name`` is not a str.
        ValueError: no live group has that name, or ``world_size`` is not its size.
    """
    return _sized_group(group_name, world_size)._all_gather_out_place(tensor, dim)


def all_gather_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    """An empty tensor shaped as :func:`all_gather`'s result: ``tensor``'s shape with
    dimension ``dim`` multiplied by ``world_size``.

    Raises:
        ValueError: ``dim`` is not a dimension of ``tensor``, or ``world_size`` is not a
            positive int.
    """
    return _resized(tensor, dim, world_size, gathered=True)


def _checked(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _positive(world_size: int) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _sized_group(group_name: str, world_size: int) -> Any:
    group = find_group(group_name)
    if _positive(world_size) != group.world_size:
        raise ValueError(
            f"world_size is {world_size}, but group {group_name!r} has {group.world_size} ranks"
        )
    return group


def _resized(tensor: torch.Tensor, dim: int, world_size: int, *, gathered: bool) -> torch.Tensor:
    shape = list(_checked(tensor).shape)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim {dim!r} is not a dimension of a {len(shape)}-d tensor")
    if gathered:
        shape[dim] *= _positive(world_size)
    elif shape[dim] % _positive(world_size):
        raise ValueError(f"world_size {world_size} does not divide dimension {dim} ({shape[dim]})")
    else:
        shape[dim] //= world_size
    return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
