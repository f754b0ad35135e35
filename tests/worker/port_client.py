"""A minimal client for the worker's port transport, used by the tests.

It starts ``python -m bridge_py.worker`` as a real subprocess and speaks the real
framing over its stdin/stdout, exactly as the Elixir runtime does.
"""

from __future__ import annotations

import itertools
import os
import select
import struct
import subprocess
import tempfile
import time
from typing import Any

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN, RefValue
from tests.worker.processes import start_worker


class WorkerError(Exception):
    """An error reply."""

    def __init__(self, error: pb.Error) -> None:
        super().__init__(f"[{error.category}] {error.message}")
        self.error = error


class PortClient:
    """One worker subprocess and the frames to and from it."""

    def __init__(
        self,
        *extra_args: str,
        exports: str | None = None,
        proc: subprocess.Popen | None = None,
    ) -> None:
        self._ids = itertools.count(1)
        self._buf = b""
        self._early: dict[int, pb.Reply] = {}
        self.outputs: list[pb.Output] = []  # frames of --output frames, as they came
        if proc is not None:  # speak to a worker someone else started with pipes
            self.proc = proc
            self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
            return
        # stderr to a file: a pipe nobody reads would fill up and block the worker.
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = start_worker(*extra_args, exports=exports, stderr=self.stderr)

    # -- frames ---------------------------------------------------------------------

    def send_raw(self, payload: bytes) -> None:
        """Write one frame."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(payload)) + payload)
        self.proc.stdin.flush()

    def read_frame(self, timeout: float = 30.0) -> bytes:
        """Read one frame, failing after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while True:
            if len(self._buf) >= 4:
                (size,) = struct.unpack(">I", self._buf[:4])
                if len(self._buf) >= 4 + size:
                    frame, self._buf = self._buf[4 : 4 + size], self._buf[4 + size :]
                    return frame
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply frame from the worker")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError("the worker closed its stdout")
                self._buf += chunk

    def send(self, op: pb.Operation, session: str = "", req_id: int | None = None) -> int:
        """Send a request; return its id."""
        rid = next(self._ids) if req_id is None else req_id
        self.send_raw(pb.encode_request(pb.Request(id=rid, session=session, op=op)))
        return rid

    def reply(self, rid: int, timeout: float = 30.0) -> pb.Reply:
        """The reply to request ``rid`` (others that arrive first are kept)."""
        while rid not in self._early:
            r = pb.decode_reply(self.read_frame(timeout))
            if r.output is not None:
                self.outputs.append(r.output)
                continue
            self._early[r.id] = r
        return self._early.pop(rid)

    # -- operations -----------------------------------------------------------------

    def request(self, op: pb.Operation, session: str = "", timeout: float = 30.0) -> Any:
        """Send ``op`` and return the decoded value, raising WorkerError on an error reply."""
        r = self.reply(self.send(op, session), timeout)
        if r.error is not None:
            raise WorkerError(r.error)
        return PLAIN.decode(r.value or b"\xc0")

    def create(self, cls: str, *args: Any, session: str = "", **kwargs: Any) -> RefValue:
        """Construct an exported class."""
        return self.request(pb.CreateInstance(cls, _enc(args), _enc(kwargs)), session)

    def call(self, ref: RefValue, method: str, *args: Any, session: str = "", **kw: Any) -> Any:
        """Call a method on a ref."""
        return self.request(pb.CallMethod(ref.handle, method, _enc(args), _enc(kw)), session)

    def function(self, name: str, *args: Any, session: str = "", **kw: Any) -> Any:
        """Call an exported function."""
        return self.request(pb.CallFunction(name, _enc(args), _enc(kw)), session)

    def close(self, timeout: float = 10.0) -> int:
        """Close stdin and wait for the worker to exit (killing it if it does not)."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout:
                self.proc.stdout.close()
            self.stderr.close()


def _enc(value: Any) -> bytes:
    if isinstance(value, tuple):
        value = list(value)
    return PLAIN.encode(value) if value else b""
