"""Sessions a gRPC server issued, each bound to the credential that opened it.

Over the port the BEAM (trusted) names its sessions. Over gRPC a client could name
any string, and handles are small integers counted from 1, so a client naming
another's session would reach its objects. So gRPC clients do not name sessions:
the server issues them (``OpenSession``), as ``grpc-`` and 256 random bits, and
serves a request only in a session it issued to the request's credential. The
registry then keeps each session's handles to itself (``registry.py``).

A session's requests may run in several of the server's threads at once, and a
``ReleaseSession`` can end it while others are still running: an object such a
request returns after the release would be held in a session nobody can name any
more. So the table also counts each session's requests in flight (:meth:`enter`,
:meth:`leave`), and tells the last ones out of a closed session to release it
again. The count lasts only while requests are in flight: nothing builds up.

A client that is killed never sends its ``ReleaseSession``. So a session with no
request for ``idle`` seconds (600 by default; ``--session-idle-s``) expires, and is
released like one closed (:meth:`expired`, which a thread of the server asks every
quarter of that time). A request in flight keeps its session from expiring however
long it runs, and a client that stays idle longer keeps its session by pinging: the
server tells each client the time when it opens a session (``bridge_py.client`` pings
every third of it).
"""

from __future__ import annotations

import secrets
import threading
import time

SESSION_PREFIX = "grpc-"
DEFAULT_MAX_SESSIONS = 65536
DEFAULT_SESSION_IDLE = 600.0  # seconds without a request after which a session expires


class TooManySessions(RuntimeError):
    """The server holds its limit of open sessions."""


class SessionTable:
    """Session id -> the credential it was issued to; thread-safe.

    ``credential`` is any hashable that names who authenticated (the token's
    identity, or the socket); two different credentials never share a session.
    """

    __slots__ = ("_idle", "_in_flight", "_limit", "_lock", "_owners", "_since")

    def __init__(
        self, limit: int = DEFAULT_MAX_SESSIONS, idle: float = DEFAULT_SESSION_IDLE
    ) -> None:
        if not idle >= 0:  # also refuses nan
            raise ValueError(f"a session's idle time must be >= 0 seconds, got {idle}")
        self._owners: dict[str, object] = {}
        self._in_flight: dict[str, int] = {}  # session -> its requests running now
        self._since: dict[str, float] = {}  # session with none running -> when it went idle
        self._lock = threading.Lock()
        self._limit = limit
        self._idle = idle

    @property
    def idle(self) -> float:
        """Seconds without a request after which a session expires (0: never)."""
        return self._idle

    def open(self, credential: object) -> str:
        """Issue a new session to ``credential`` and return its id.

        Ids start with ``grpc-`` so that they never equal a port session by
        accident (the BEAM names those); 256 random bits make them unguessable.
        """
        with self._lock:
            if len(self._owners) >= self._limit:
                raise TooManySessions(
                    f"this server has {self._limit} open sessions, its limit: close "
                    f"clients (ReleaseSession) before opening more"
                )
            session = SESSION_PREFIX + secrets.token_hex(32)
            self._owners[session] = credential
            self._since[session] = time.monotonic()
            return session

    def allows(self, session: str, credential: object) -> bool:
        """Whether ``session`` was issued to ``credential`` and is still open."""
        owner = self._owners.get(session)  # one dict lookup: atomic, no lock needed
        return owner is not None and owner == credential

    def enter(self, session: str, credential: object) -> bool:
        """Count a request in ``session`` as running, if ``credential`` may make it
        (:meth:`allows`); return whether it may. Each True needs a :meth:`leave`."""
        with self._lock:
            if not self.allows(session, credential):
                return False
            self._in_flight[session] = self._in_flight.get(session, 0) + 1
            self._since.pop(session, None)  # busy: not idle
            return True

    def leave(self, session: str) -> bool:
        """Count a request of :meth:`enter` as done; return whether ``session`` was
        closed meanwhile, so that what the request left in it is to be released."""
        with self._lock:
            left = self._in_flight[session] - 1
            closed = session not in self._owners
            if left:
                self._in_flight[session] = left
            else:
                del self._in_flight[session]
                if not closed:
                    self._since[session] = time.monotonic()
            return closed

    def close(self, session: str, credential: object) -> bool:
        """End ``session`` if ``credential`` holds it; return whether it did. From then
        on no request of it is admitted; those in flight learn it when they leave."""
        with self._lock:
            if self.allows(session, credential):
                del self._owners[session]
                self._since.pop(session, None)
                return True
            return False

    def expired(self) -> list[str]:
        """Close the sessions that have had no request for :attr:`idle` seconds and
        return them, to be released (none while :attr:`idle` is 0)."""
        if not self._idle:
            return []
        now = time.monotonic()
        with self._lock:
            gone = [s for s, since in self._since.items() if now - since >= self._idle]
            for session in gone:
                del self._since[session], self._owners[session]
            return gone

    def __len__(self) -> int:
        return len(self._owners)
