"""Instructions the worker spends per request, counted by valgrind: a figure that holds still.

Wall-clock time on a shared virtual machine moves by up to 10x between runs (see
bench/README.md), so changes to the worker's call path are measured here instead: a
script serves N copies of one request through ``PortTransport.serve`` (frames read
from memory, replies written to /dev/null, no other process involved) under
``valgrind --tool=callgrind``, and the same script with N = 0 is subtracted, which
leaves the instructions of the read, decode, dispatch, encode and write of one request.

    python bench/python/serve_instructions.py [--op OP ...] [--requests 2000]

OP is one shape of call (``all``, the default, measures each): ``incr`` (a method
without arguments), ``incr1`` (one positional argument), ``incr_by`` (one keyword
argument), ``value`` (an attribute, as the generated getters read one), ``echo`` (a
module function with one argument) and ``ping``. ``--deadline-ms N`` sends every request
with that ``deadline_ms``, as the Elixir runtime does (its default timeout: 120000).

Needs ``valgrind`` on PATH (``apt-get install valgrind``); not part of ``make bench``.
It takes a minute or two (the interpreter and torch start twice under valgrind).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVE = """
import io, os, struct, sys
sys.path.insert(0, {root!r})
from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.dispatcher import Dispatcher
from bridge_py.worker.transports.port import PortTransport
from tests.worker.sample_exports import table

dispatcher = Dispatcher(table())
created = dispatcher.dispatch(pb.Request(id=1, op=pb.CreateInstance("Counter")))
counter = PLAIN.decode(created.value)
one = PLAIN.encode([1])
OPS = {{
    "incr": pb.CallMethod(counter.handle, "incr"),
    "incr1": pb.CallMethod(counter.handle, "incr", args=one),
    "incr_by": pb.CallMethod(counter.handle, "incr", kwargs=PLAIN.encode({{"by": 1}})),
    "value": pb.GetAttribute(counter.handle, "value"),
    "echo": pb.CallFunction("echo", args=one),
    "ping": pb.Ping(),
}}
op = OPS[{op!r}]
frame = pb.encode_request(pb.Request(id=7, op=op, deadline_ms={deadline_ms}))
data = (struct.pack(">I", len(frame)) + frame) * {requests}
out = os.open(os.devnull, os.O_WRONLY)
PortTransport(dispatcher, io.BufferedReader(io.BytesIO(data)), out).serve()
"""


# Each shape of call, as the rows print it.
SHAPES = {
    "incr": "Counter.incr()",
    "incr1": "Counter.incr(1)",
    "incr_by": "Counter.incr(by: 1)",
    "value": "Counter.value (an attribute)",
    "echo": "echo(1) (a module function)",
    "ping": "Ping",
}


def instructions(op: str, requests: int, deadline_ms: int = 0) -> int:
    """Instructions callgrind counts for the whole script serving ``requests`` requests."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(
            SERVE.format(root=str(ROOT), op=op, requests=requests, deadline_ms=deadline_ms)
        )
    try:
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             script.name],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dict layouts every run
            timeout=900,
        )  # fmt: skip
    finally:
        Path(script.name).unlink()
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"the script failed under valgrind:\n{run.stderr[-3000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--op", choices=[*SHAPES, "all"], default="all", nargs="+")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--deadline-ms",
        type=int,
        default=0,
        help="send each request with this deadline_ms, as the Elixir runtime does (0: none)",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH (apt-get install valgrind)")
    ops = list(SHAPES) if "all" in args.op else args.op
    base = instructions("ping", 0)  # the script without requests: the same for every op
    for op in ops:
        total = instructions(op, args.requests, args.deadline_ms)
        per_request = (total - base) / args.requests
        print(f"{SHAPES[op]:<34} {per_request:>9,.0f} instructions per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
