"""Where the worker's time goes for each shape of call: its stages timed in one process.

A planned request (one the worker has seen before, see bridge_py/worker/call_plans.py)
goes through three stages in the dispatcher: ``call_plans.split_call`` (its id, deadline
and argument bytes sliced out, the rest is the plan's key), the plan's ``run`` (the
arguments decoded and checked, the call made) and the result's encoding; admit + run is
all of it, with the dictionary lookup, the turn on the object and the reply's framing.
Each stage runs 20,000 times per repeat, and the best of 5 repeats is printed (the
figure least moved by other work on a shared machine), in microseconds.

    python bench/python/call_stages.py [--calls 20000] [--repeats 5]

Not part of ``make bench`` (it has no peer: it says which part of our own figure is
which); bench/README.md ("Where the time goes today") sets its figures beside the
end-to-end rows of RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from report import cpu_model  # noqa: E402  (this folder is on the path: a script)

from bridge_py.worker import envelope as pb  # noqa: E402
from bridge_py.worker.call_plans import CallPlan, split_call  # noqa: E402
from bridge_py.worker.codec import PLAIN  # noqa: E402
from bridge_py.worker.dispatcher import Dispatcher  # noqa: E402
from tests.worker.sample_exports import table  # noqa: E402


def shapes(dispatcher: Dispatcher) -> dict[str, pb.Operation]:
    """One request of each shape, on a Counter of the sample export table."""
    created = dispatcher.dispatch(pb.Request(id=1, op=pb.CreateInstance("Counter")))
    counter = PLAIN.decode(created.value)
    one = PLAIN.encode([1])
    return {
        "incr() (method, no arguments)": pb.CallMethod(counter.handle, "incr"),
        "incr(1) (method, one argument)": pb.CallMethod(counter.handle, "incr", args=one),
        "incr(by: 1) (method, keyword)": pb.CallMethod(
            counter.handle, "incr", kwargs=PLAIN.encode({"by": 1})
        ),
        "value (getter)": pb.GetAttribute(counter.handle, "value"),
        "echo(1) (function)": pb.CallFunction("echo", args=one),
        "open_gate(<ref>) (function, a ref argument)": pb.CallFunction(
            "open_gate", args=PLAIN.encode([counter])
        ),
        "echo(<ref>) (function, a ref argument and result)": pb.CallFunction(
            "echo", args=PLAIN.encode([counter])
        ),
    }


def best(fn: Any, calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn``, the best of ``repeats`` runs of ``calls``."""
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6


def stages(dispatcher: Dispatcher, name: str, op: pb.Operation, calls: int, repeats: int) -> str:
    """The table row of one shape: each stage's microseconds per call."""
    frame = pb.encode_request(pb.Request(id=7, op=op, deadline_ms=120_000))
    for _ in range(2):  # the first call goes the full way and teaches the plan
        dispatcher.run(dispatcher.admit(frame))
    job = dispatcher.admit(frame)
    plan = job[0]
    assert type(plan) is CallPlan, f"{name}: no plan was learnt"
    args, kwargs = job[5], job[6]
    dispatcher.run(job)  # gives its turn back
    value = plan.run(args, kwargs)

    def whole() -> None:
        dispatcher.run(dispatcher.admit(frame))

    split = best(lambda: split_call(frame), calls, repeats)
    run = best(lambda: plan.run(args, kwargs), calls, repeats)
    encode = best(lambda: plan.codec.encode_pieces(value), calls, repeats)
    total = best(whole, calls, repeats)
    return f"| {name} | {split:.2f} | {run:.2f} | {encode:.2f} | {total:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    dispatcher = Dispatcher(table())
    print(f"# {cpu_model()}, Python {platform.python_version()}")
    print("| shape | split_call | plan.run | encode | admit + run (all) |")
    print("|---|---|---|---|---|")
    for name, op in shapes(dispatcher).items():
        print(stages(dispatcher, name, op, opts.calls, opts.repeats))


if __name__ == "__main__":
    main()
