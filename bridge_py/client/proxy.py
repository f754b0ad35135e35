"""Proxies: remote objects that look local (methods call through, attributes read through).

A proxy needs only a few things of the connection it came from, named by
:class:`ObjectHost`; ``connection.Client`` provides them. So this module does not
import the connection (the connection imports it, to make proxies).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol


class ObjectHost(Protocol):
    """What a proxy asks of its connection: the calls that reach through it."""

    target: str  # where the worker is, for repr

    def call_method(self, obj: RemoteObject, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an exported method of ``obj`` in the worker."""
        ...

    def get_attr(self, obj: RemoteObject, name: str) -> Any:
        """Read an exported attribute of ``obj`` in the worker."""
        ...

    def _members_of(self, class_name: str) -> tuple[set[str], set[str]]:
        """(methods, attributes) that the worker exports for ``class_name``."""
        ...

    def _release_handle(self, handle: int, holds: list[int]) -> None:
        """Release ``handle`` ``holds[0]`` times (the proxy is being collected); must
        never raise."""
        ...


class RemoteObject:
    """An object held by a worker; exported methods and attributes reach through.

    ``proxy.method(*args, **kwargs)`` calls the method in the worker;
    ``proxy.attribute`` reads an exported attribute. The handle is released when the
    proxy is garbage-collected (or with ``client.release(proxy)``).

    The worker counts each time it hands a handle out (the same object returned by two
    calls comes back under the same handle, and one proxy stands for both); ``_holds``
    counts them here, and the release gives back as many, so that nothing else's hold
    on the object is taken away and none of this proxy's is left behind.
    """

    __slots__ = ("__weakref__", "_class_name", "_client", "_handle", "_holds")

    def __init__(self, client: ObjectHost, handle: int, class_name: str) -> None:
        holds = [1]
        object.__setattr__(self, "_client", client)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_class_name", class_name)
        object.__setattr__(self, "_holds", holds)
        weakref.finalize(self, client._release_handle, handle, holds)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        methods, attributes = self._client._members_of(self._class_name)
        if name in attributes:
            return self._client.get_attr(self, name)
        if name in methods or not (methods or attributes):

            def call(*args: Any, **kwargs: Any) -> Any:
                return self._client.call_method(self, name, *args, **kwargs)

            call.__name__ = name
            return call
        raise AttributeError(f"{self._class_name} exports no method or attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("remote objects are read-only")

    def __repr__(self) -> str:
        return f"<RemoteObject {self._class_name} handle={self._handle} at {self._client.target}>"
