"""Coverage-guided fuzzing of what the worker does with a request frame (atheris).

Each input is one frame's payload, handed to the dispatcher exactly as both transports
hand one over (``Dispatcher.admit`` then ``run``), with a dispatcher serving a small
export table of harmless calls. The input's length picks the transport's gate: none (a
port with a standby thread), one that refuses every request (a port with none left
refuses calls that may block that way), or one that raises (as gRPC's does for a wrong
op or session), after which the frame is admitted again without a gate and run.
Properties, for every input:

* the frame gets exactly one reply, which decodes, and whose id is the request's;
* a request the gate refuses is answered with the gate's error and not run;
* a gate that raises leaves nothing taken: admitting the same frame again and running
  it answers (a turn taken and never used would block it, and libFuzzer's -timeout
  would report the input);
* the value codec, given the same bytes, returns a value or raises ``CodecError`` (or
  ``HandleNotFound`` for a ref it does not hold), never anything else; a value it returns
  encodes and decodes back to itself.

A property that fails, or a crash, stops the run with the input saved by libFuzzer.
Run it as a script with libFuzzer's flags, for example
``python tests/fuzz/fuzz_frames.py -runs=100000 -seed=1 CORPUS_DIR``
(``tests/fuzz/test_fuzz_frames.py`` does, with a seed corpus it writes first).
"""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Any

import atheris
import torch  # imported before instrumenting: only our own code is instrumented

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["bridge_py"]):
    from bridge_py.worker import envelope as pb
    from bridge_py.worker.codec import PLAIN, Codec, CodecError
    from bridge_py.worker.dispatcher import Dispatcher
    from bridge_py.worker.exports import ExportedClass, ExportedFunction, ExportTable
    from bridge_py.worker.registry import HandleNotFound, SessionResolver


class Counter:
    """A small stateful object, so calls on handles have something to reach."""

    def __init__(self, start: int = 0) -> None:
        self.value = start

    def incr(self, by: int = 1) -> int:
        """Add ``by``."""
        self.value += by
        return self.value

    def fail(self, message: str) -> None:
        """Raise ValueError."""
        raise ValueError(message)


def echo(value: object) -> object:
    """The value itself."""
    return value


def leave(code: int) -> None:
    """Raise SystemExit."""
    raise SystemExit(code)


def lock() -> object:
    """An object with no value encoding (a ref comes back)."""
    return threading.Lock()


def table() -> ExportTable:
    """Calls that return quickly whatever their arguments."""
    return ExportTable.build(
        classes=[
            ExportedClass(
                name="Counter",
                cls=Counter,
                elixir_module="Fuzz.Counter",
                methods=("incr", "fail"),
                attributes=("value",),
            )
        ],
        functions=[
            ExportedFunction("echo", echo, "Fuzz"),
            ExportedFunction("leave", leave, "Fuzz"),
            ExportedFunction("lock", lock, "Fuzz"),
        ],
    )


DISPATCHER = Dispatcher(table())
REFUSAL = pb.Error(category="busy", message="refused by the gate")


def refuse(op: type[pb.Operation] | None, session: str) -> pb.Error:
    """A gate that refuses every request it is shown."""
    return REFUSAL


class GateRaised(Exception):
    """What the raising gate raises."""


def raise_(op: type[pb.Operation] | None, session: str) -> None:
    """A gate that raises, as gRPC's ``context.abort`` does."""
    raise GateRaised


CODEC = Codec(SessionResolver(DISPATCHER.registry, "default", DISPATCHER.exports.class_name))


def _same(a: Any, b: Any) -> bool:
    """Equal as values of the protocol (tensors by dtype, shape and bits; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bytes(_raw(a)) == bytes(_raw(b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            _same(ka, kb) and _same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return bool(a == b)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def check_frame(data: bytes) -> None:
    """The properties of one input (see the module docstring)."""
    try:
        request_id: int | None = pb.decode_request(data).id
    except pb.EnvelopeError:
        request_id = None
    mode = len(data) % 3
    if mode == 1:
        job = DISPATCHER.admit(data, refuse)
    elif mode == 2:
        try:
            job = DISPATCHER.admit(data, raise_)
        except GateRaised:
            pass
        else:
            if request_id is not None:
                raise AssertionError("a Request passed a gate that raises")
        job = DISPATCHER.admit(data)
    else:
        job = DISPATCHER.admit(data)
    reply = pb.decode_reply(b"".join(bytes(piece) for piece in DISPATCHER.run(job)))
    if reply.id not in (request_id, pb.peek_request_id(data)):
        raise AssertionError(f"reply id {reply.id} for request id {request_id}")
    if (reply.error is None) == (reply.value is None):
        raise AssertionError("a reply must hold a value or an error")
    if mode == 1 and request_id is not None and reply.error != REFUSAL:
        raise AssertionError(f"a refused request was answered {reply!r}")

    for codec in (PLAIN, CODEC):
        try:
            value = codec.decode(data)
        except (CodecError, HandleNotFound):
            continue
        again = codec.decode(codec.encode(value))
        if not _same(value, again):
            raise AssertionError(f"{value!r} decoded back as {again!r}")


def main() -> None:
    """libFuzzer's command line (``-runs``, ``-seed``, corpus directories, ...)."""
    atheris.Setup(sys.argv, check_frame)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
