"""Handles: the worker's table of live objects, each owned by one session.

A client never holds a Python object, only a handle (an integer) that names it in
one worker. Handles belong to the session that created them; a session may use only
its own handles, and releasing a session releases all of them at once.

Each time a reply hands a handle out (an object made, or returned again: the same
object keeps its handle within a session) the handle's count goes up by one; each
occurrence of the handle in a release takes one away, and the object is forgotten when
none is left. So two callers given the same object (``get_world_group()`` twice) each
release their own, and the object lives until both have.
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
    # How many hand-outs of the handle are not yet released.
    count: int = 1


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
        """Hold ``obj`` for ``session`` once more (one hand-out); return its handle
        (never 0).

        An object this session already holds keeps its handle, and its count goes up.
        """
        with self._lock:
            known = self._by_object.get((session, id(obj)))
            if known is not None:
                self._entries[known].count += 1
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
        """Release one hand-out of ``session``'s handle per occurrence in ``handles``
        (others' and unknown handles are ignored); return how many objects that freed
        (those whose last hand-out it was)."""
        freed = 0
        with self._lock:
            owned = self._sessions.get(session, set())
            for handle in handles:
                if handle in owned:
                    entry = self._entries[handle]
                    entry.count -= 1
                    if entry.count > 0:
                        continue
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
