"""Handles: the worker's table of live objects, each owned by one session.

A client never holds a Python object, only a handle (an integer) that names it in
one worker. Handles belong to the session that created them; a session may use only
its own handles, and releasing a session releases all of them at once.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from bridge_py.worker.sequencer import Sequencer, Turn


class HandleNotFound(LookupError):
    """A handle that is unknown, released, or owned by another session."""


class Lifetime:
    """Whether something the registry held has been released: an object (its handle), or
    a session as a whole. What was worked out from it (a call plan) checks this before
    it is used again."""

    __slots__ = ("__weakref__", "released")

    def __init__(self) -> None:
        self.released = False


@dataclass(slots=True)
class _Entry:
    obj: Any
    session: str
    class_name: str
    # Method calls on this object run one at a time, in arrival order.
    sequencer: Sequencer = field(default_factory=Sequencer)
    lifetime: Lifetime = field(default_factory=Lifetime)


class HandleRegistry:
    """Thread-safe map of handle -> object, grouped by session."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._sessions: dict[str, set[int]] = {}
        # (session, id(obj)) -> handle: an object already held comes back under the
        # same handle instead of piling up new ones (entries keep obj alive, so its id
        # cannot be reused while it is here).
        self._by_object: dict[tuple[str, int], int] = {}
        self._ids = itertools.count(1)
        # Held only as long as something (a plan) holds them: session names are the
        # client's, and many may come and go without a release.
        self._session_lifetimes: weakref.WeakValueDictionary[str, Lifetime] = (
            weakref.WeakValueDictionary()
        )

    def register(self, obj: Any, session: str, class_name: str) -> int:
        """Hold ``obj`` for ``session``; return its handle (never 0).

        An object this session already holds keeps its handle.
        """
        known = self._by_object.get((session, id(obj)))  # (one dict read: no lock)
        if known is not None:
            return known
        with self._lock:
            known = self._by_object.get((session, id(obj)))
            if known is not None:
                return known
            handle = next(self._ids)
            self._entries[handle] = _Entry(obj, session, class_name)
            self._sessions.setdefault(session, set()).add(handle)
            self._by_object[(session, id(obj))] = handle
            return handle

    def _forget(self, handle: int) -> None:
        entry = self._entries.pop(handle)
        entry.lifetime.released = True
        self._by_object.pop((entry.session, id(entry.obj)), None)

    def _entry(self, handle: int, session: str) -> _Entry:
        # No lock: one dict lookup is atomic, and an entry never changes once stored.
        # One answer whether the handle is free or another session's: a caller learns
        # nothing of other sessions' objects (not that they exist, nor their classes).
        entry = self._entries.get(handle)
        if entry is None or entry.session != session:
            raise HandleNotFound(
                f"no object with handle {handle} in session {session!r} (never created, "
                "released, or another session's)"
            )
        return entry

    def get(self, handle: int, session: str) -> Any:
        """The object behind ``handle``, if ``session`` owns it."""
        entry = self._entries.get(handle)
        if entry is None or entry.session != session:
            entry = self._entry(handle, session)  # raises
        return entry.obj

    def turn(self, handle: int, session: str) -> Turn:
        """The next turn to call a method of ``handle`` (see :mod:`sequencer`)."""
        return self.sequencer(handle, session).turn()

    def lifetime(self, handle: int, session: str) -> Lifetime:
        """Whether ``handle`` has been released since (raises if it already is)."""
        entry = self._entries.get(handle)
        if entry is None or entry.session != session:
            entry = self._entry(handle, session)  # raises
        return entry.lifetime

    def session_lifetime(self, session: str) -> Lifetime:
        """Whether ``session`` has been released as a whole since this call."""
        with self._lock:
            lifetime = self._session_lifetimes.get(session)
            if lifetime is None:
                lifetime = self._session_lifetimes[session] = Lifetime()
            return lifetime

    def sequencer(self, handle: int, session: str) -> Sequencer:
        """What hands out the turns of ``handle``'s method calls (see :mod:`sequencer`)."""
        entry = self._entries.get(handle)
        if entry is None or entry.session != session:
            entry = self._entry(handle, session)  # raises
        return entry.sequencer

    def release(self, handles: list[int], session: str) -> int:
        """Forget the given handles of ``session``; return how many were held."""
        freed = 0
        with self._lock:
            owned = self._sessions.get(session, set())
            for handle in handles:
                if handle in owned:
                    owned.discard(handle)
                    self._forget(handle)
                    freed += 1
            if not owned:
                self._sessions.pop(session, None)
        return freed

    def release_session(self, session: str) -> int:
        """Forget every handle of ``session``; return how many there were."""
        with self._lock:
            handles = self._sessions.pop(session, set())
            for handle in handles:
                self._forget(handle)
            gone = self._session_lifetimes.pop(session, None)
            if gone is not None:
                gone.released = True  # the session's codec goes too
        return len(handles)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class SessionResolver:
    """The codec's view of the registry for one request: resolve and register refs."""

    __slots__ = ("_names", "_registry", "_session")

    def __init__(self, registry: HandleRegistry, session: str, class_names: Any) -> None:
        self._registry = registry
        self._session = session
        self._names = class_names

    def resolve(self, ref: Any) -> Any:
        """The object behind a ref argument (a codec ``RefValue``)."""
        return self._registry.get(ref.handle, self._session)

    def register(self, obj: Any) -> tuple[int, str]:
        """Hold a result that cannot be encoded as a value; return its handle and class."""
        class_name = self._names(type(obj))
        return self._registry.register(obj, self._session, class_name), class_name
