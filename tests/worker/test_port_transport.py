"""PortTransport in process: takeovers racing the ends of the calls they take over from."""

from __future__ import annotations

import os
import random
import struct
import tempfile
import threading
import time

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.dispatcher import Dispatcher
from bridge_py.worker.transports.frames import FrameReader
from bridge_py.worker.transports.port import PortTransport
from tests.worker.sample_exports import table


class _Watched:
    """A byte source that counts reads made while another is under way, or after the end."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "rb")
        self._inside = 0
        self.overlaps = 0
        self.after_end = 0
        self._ended = False

    def _read(self, how: str, arg: object) -> object:
        self._inside += 1
        self.overlaps += self._inside > 1
        self.after_end += self._ended
        try:
            got = getattr(self._file, how)(arg)
        finally:
            self._inside -= 1
        self._ended = self._ended or not got
        return got

    def read1(self, size: int) -> bytes:
        return self._read("read1", size)  # type: ignore[return-value]

    def read(self, size: int) -> bytes:
        return self._read("read", size)  # type: ignore[return-value]

    def readinto(self, buffer: memoryview) -> int:
        return self._read("readinto", buffer)  # type: ignore[return-value]


def test_takeovers_at_the_end_of_a_call_keep_one_reader_and_one_reply_each() -> None:
    # Calls that last about one takeover period, so a standby often claims a call just
    # as it ends: exactly one of the two reads on, or frames would be lost or torn.
    dispatcher = Dispatcher(table())
    created = dispatcher.dispatch(pb.Request(id=1, op=pb.CreateInstance("Counter")))
    counter = PLAIN.decode(created.value)
    rng = random.Random(17)
    requests = {}
    for rid in range(2, 402):
        if rid % 2:
            op: pb.Operation = pb.CallMethod(counter.handle, "incr")
        else:
            op = pb.CallFunction("sleep", PLAIN.encode([rng.uniform(0, 0.004)]))
        requests[rid] = op
    frames = [
        struct.pack(">I", len(f)) + f
        for f in (pb.encode_request(pb.Request(id=rid, op=op)) for rid, op in requests.items())
    ]
    r, w = os.pipe()

    def write() -> None:  # in pieces, so that readers wait in the source's read
        for frame in frames:
            os.write(w, frame)
            if rng.random() < 0.2:
                time.sleep(0.001)
        os.close(w)

    writer = threading.Thread(target=write)
    infile = _Watched(r)
    with tempfile.TemporaryFile() as out:
        writer.start()
        PortTransport(dispatcher, infile, out.fileno(), max_threads=4, takeover_after=0.002).serve()
        writer.join(10)
        # The last calls may still be running when the input ends: wait for their replies.
        replies: dict[int, pb.Reply] = {}
        for _ in range(500):
            out.seek(0)
            reader = FrameReader(out, 1 << 20)
            replies = {}
            while (frame := reader.read()) is not None:
                reply = pb.decode_reply(frame)
                assert reply.id not in replies, f"two replies to request {reply.id}"
                replies[reply.id] = reply
            if len(replies) == len(requests):
                break
            threading.Event().wait(0.01)
    assert set(replies) == set(requests)
    assert infile.overlaps == 0 and infile.after_end == 0  # one reader at a time, to the end
    count = 0
    for rid, op in requests.items():  # in arrival order
        reply = replies[rid]
        if reply.error is not None:
            assert reply.error.category == "busy", reply.error  # all threads taken: not run
            continue
        if isinstance(op, pb.CallMethod):  # calls on one object ran in arrival order
            count += 1
            assert PLAIN.decode(reply.value) == count
