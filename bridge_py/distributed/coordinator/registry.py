"""Every GroupCoordinator of this process by its unique name, as vLLM's ``_groups``.

vLLM runs a group's collectives as torch custom ops, which cannot take the coordinator
itself, so they take its ``unique_name`` (``"tp:0"``) and look it up here;
``parallel_state``'s module-level ``all_reduce``/``all_gather``/``reduce_scatter`` do the
same, and its ``suspend_device_comms`` & co. walk every live group. The registry holds weak
references: it keeps no group alive.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["find_group", "live_groups", "register_group"]

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
