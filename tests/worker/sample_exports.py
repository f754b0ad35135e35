"""A small export table for the worker's own tests: blocking, printing, raising objects.

Served with ``python -m bridge_py.worker --exports tests.worker.sample_exports:table``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import threading
import time
import weakref

import torch

from bridge_py.worker.exports import ExportedClass, ExportedFunction, ExportTable


class Counter:
    """A counter with a gate that blocks callers until it is opened."""

    def __init__(self, start: int = 0, *, step: int = 1) -> None:
        self.value = start
        self.step = step
        self._gate = threading.Event()
        _LIVE.add(self)

    def incr(self, by: int | None = None) -> int:
        """Add ``by`` (default: step) and return the new value."""
        self.value += self.step if by is None else by
        return self.value

    def wait_gate(self, timeout: float = 10.0) -> bool:
        """Block until ``open_gate`` is called (True) or ``timeout`` passes (False)."""
        return self._gate.wait(timeout)

    def fail(self, message: str) -> None:
        """Raise ValueError(message)."""
        raise ValueError(message)

    def noisy(self, nbytes: int) -> int:
        """Print ``nbytes`` to stdout from Python and from C (fd 1); return nbytes."""
        print("p" * nbytes, flush=True)
        libc = ctypes.CDLL(None)
        libc.write(1, b"c" * nbytes, nbytes)
        os.write(1, b"\n")
        return nbytes

    def secret(self) -> str:
        """Not exported: must be unreachable."""
        return "secret"


_LIVE: weakref.WeakSet[Counter] = weakref.WeakSet()


def live_counters() -> int:
    """How many Counters exist in this worker: the ones still held, once the garbage is
    collected."""
    gc.collect()
    return len(_LIVE)


def counter_after(seconds: float, start: int = 0) -> Counter:
    """A new Counter, returned ``seconds`` after it was made (a call that returns an object
    late; :func:`live_counters` shows it has started)."""
    counter = Counter(start)
    time.sleep(seconds)
    return counter


def open_gate(counter: Counter) -> None:
    """Release every caller blocked in ``counter.wait_gate`` (a function: no handle lock)."""
    counter._gate.set()


def double(x: torch.Tensor | float) -> torch.Tensor | float:
    """Twice x (a tensor or a number)."""
    return x * 2


def echo(value: object) -> object:
    """Return the value unchanged (round-trips any value)."""
    return value


def zeros(shape: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of zeros: ``dtype`` may arrive as {:f, 32} or "float32"."""
    return torch.zeros(shape, dtype=dtype)


def dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """The dtype of a tensor (comes back as an Nx-style type tuple)."""
    return tensor.dtype


def sleep(seconds: float) -> float:
    """Sleep, then return the seconds slept."""
    time.sleep(seconds)
    return seconds


def spawn_descendants() -> list[int]:
    """Start a child (``sleep``) and a grandchild (another ``sleep``, the child's); their
    pids. Neither is waited for: they must go when the worker goes."""
    child = subprocess.Popen(
        ["sh", "-c", "sleep 600 & echo $!; exec sleep 600"], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    return [child.pid, int(child.stdout.readline())]


def make_unencodable() -> object:
    """An object with no value encoding: comes back as a ref."""
    return threading.Lock()


def leave(code: int) -> None:
    """Raise SystemExit: a call that would end a careless worker."""
    raise SystemExit(code)


def nested(depth: int, cyclic: bool = False) -> object:
    """A list nested ``depth`` deep (``[[...[0]...]]``), or one that contains itself."""
    if cyclic:
        loop: list[object] = []
        loop.append(loop)
        return loop
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def table() -> ExportTable:
    """The sample table."""
    return ExportTable.build(
        classes=[
            ExportedClass(
                name="Counter",
                cls=Counter,
                elixir_module="Sample.Counter",
                methods=("incr", "wait_gate", "fail", "noisy"),
                attributes=("value", "step"),
            )
        ],
        functions=[
            ExportedFunction("open_gate", open_gate, "Sample"),
            ExportedFunction("live_counters", live_counters, "Sample"),
            ExportedFunction("counter_after", counter_after, "Sample"),
            ExportedFunction("double", double, "Sample"),
            ExportedFunction("echo", echo, "Sample"),
            ExportedFunction("sleep", sleep, "Sample"),
            ExportedFunction("zeros", zeros, "Sample"),
            ExportedFunction("dtype_of", dtype_of, "Sample"),
            ExportedFunction("make_unencodable", make_unencodable, "Sample"),
            ExportedFunction("spawn_descendants", spawn_descendants, "Sample"),
            ExportedFunction("leave", leave, "Sample"),
            ExportedFunction("nested", nested, "Sample"),
        ],
    )
