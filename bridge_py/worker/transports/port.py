"""The port transport: Request/Reply frames over stdin/stdout.

The transport is a loop: read a frame (``frames.FrameReader``), hand it to the
dispatcher (``Dispatcher.admit``, which works out what it is and takes its turn, then
``Dispatcher.run``, which answers it), write the reply (``frames.FrameWriter``). What is
its own is the threads: the thread that reads a request runs it; a call that blocks (a
barrier, a recv) is noticed within milliseconds and another thread reads on, so it
never holds up the requests behind it (see PortTransport). Replies are written whole
under a lock, in whatever order the calls finish.
"""

from __future__ import annotations

import threading

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import tensor_data_at
from bridge_py.worker.dispatcher import Dispatcher, protocol_error
from bridge_py.worker.transports.frames import ByteSource, FrameReader, FrameTooLarge, FrameWriter

__all__ = ["DEFAULT_MAX_FRAME", "DEFAULT_MAX_THREADS", "PortTransport"]

DEFAULT_MAX_FRAME = 1 << 31  # 2 GiB
DEFAULT_MAX_THREADS = 256
# Operations that run exported code, which may block (a barrier, a recv).
_MAY_BLOCK: frozenset[type[pb.Operation]] = frozenset(
    (pb.CallMethod, pb.CallFunction, pb.CreateInstance)
)


class PortTransport:
    """Serves one dispatcher over a pair of byte streams until the input ends.

    The loop: read a frame, ``Dispatcher.admit`` it (which fixes its place in line on
    its object), ``Dispatcher.run`` it, write the reply. One thread, the leader, reads
    requests and runs each one itself, so a reply never waits for a hand-off between
    threads. A standby thread checks every ``takeover_after`` seconds whether the
    leader has been inside the same request since its last look; if so (a barrier, a
    recv), it becomes the leader and reads on, a new standby takes its place, and the
    old leader ends when its call returns. Calls on one object still run in arrival
    order: each takes its turn as the leader admits it.

    At most ``max_threads`` threads serve, the leader included. When all the others
    are blocked in calls, no standby is left to take over from the leader, so the
    leader runs no call that could block: it refuses calls, functions and constructors
    with a ``busy`` error (the gate it gives ``admit`` then) and still answers
    everything else (a ping, a release), until a blocked call returns and gives its
    thread back.

    Exactly one thread reads at a time: the leader and a standby that would take over
    both claim the request the leader is in, and only one claim succeeds (see _lead).
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        infile: ByteSource,
        out: int | FrameWriter,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_threads: int = DEFAULT_MAX_THREADS,
        takeover_after: float = 0.01,
    ) -> None:
        self._dispatcher = dispatcher
        # A large frame lands where its first tensor's elements are aligned: decoded as
        # a view of the frame, not copied (codec.decode_tensor).
        self._reader = FrameReader(infile, max_frame, tensor_data_at)
        # a writer shared with other senders of frames (--output frames), or an fd
        self._out = out if isinstance(out, FrameWriter) else FrameWriter(out)
        self._max_threads = max_threads
        self._takeover_after = takeover_after
        self._lock = threading.Lock()  # guards _threads and _spare
        # The request the leader is in: a fresh one-item list per request, emptied by
        # whoever claims its end (empty while the leader waits for input).
        self._request: list[bool] = []
        self._threads = 0
        # Whether a standby stands behind the leader: not when max_threads are taken, and
        # then the leader runs no call that may block (see _refuse_blocking).
        self._spare = True
        self._done = threading.Event()
        self._busy = pb.Error(
            category="busy",
            message=f"the worker has {max_threads - 1} calls blocked (its limit, --max-threads "
            f"{max_threads}); this call was not run: try again once one returns",
        )

    def serve(self) -> None:
        """Serve until end of input; each request gets exactly one reply."""
        with self._lock:
            self._threads += 2
        threading.Thread(target=self._lead, name="bridge-leader", daemon=True).start()
        threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()
        self._done.wait()

    def _lead(self) -> None:
        admit, run, write = self._dispatcher.admit, self._dispatcher.run, self._out.write
        read = self._reader.read
        try:
            while True:
                if not self._spare:
                    self._rehire()
                try:
                    frame = read()
                except FrameTooLarge as exc:
                    write(pb.encode_reply(protocol_error(0, str(exc))))
                    continue
                if frame is None:
                    self._done.set()
                    return
                job = admit(frame, None if self._spare else self._refuse_blocking)
                # Only the leader stores this; list.pop is atomic, so of the leader
                # (done) and a standby (taking over) exactly one empties it.
                self._request = request = [True]
                write(run(job))
                try:
                    request.pop()
                except IndexError:  # a standby took over while this call blocked
                    return
        except (BrokenPipeError, ConnectionResetError):
            # The reader of our replies is gone (the BEAM closed the port): nobody can
            # hear us any more, so stop serving, quietly.
            self._done.set()
        except BaseException:
            # Anything else here is a bug of ours (admit and run answer every request):
            # stop serving, and let it be seen.
            self._done.set()
            raise
        finally:
            with self._lock:
                self._threads -= 1

    def _stand_by(self) -> None:
        seen: list[bool] | None = None
        while not self._done.wait(self._takeover_after):
            request = self._request
            if request is not seen or not request:
                seen = request  # a new request: give it its time (or none is running)
                continue
            # The leader has been in one request for a whole period: take over, unless
            # it has just finished it.
            try:
                request.pop()
            except IndexError:
                continue
            with self._lock:
                hire = self._spare = self._threads < self._max_threads
                if hire:
                    self._threads += 1
            if hire:
                threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()
            self._lead()
            return

    def _rehire(self) -> None:
        """Put a standby behind the leader again once a blocked call has given its thread
        back; runs as the leader."""
        with self._lock:
            hire = self._spare = self._threads < self._max_threads
            if hire:
                self._threads += 1
        if hire:
            threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()

    def _refuse_blocking(self, op: type[pb.Operation] | None, session: str) -> pb.Error | None:
        """The gate while no standby is left: a call that may block is refused as
        ``busy`` (it is not run); anything else is admitted."""
        return self._busy if op in _MAY_BLOCK else None
