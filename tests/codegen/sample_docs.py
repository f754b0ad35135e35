"""An export table whose docstrings use every construct of the project's dialect.

The code generator's tests turn it into Elixir and check what an Elixir user reads.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field

from bridge_py.worker.exports import ExportedClass, ExportedFunction, ExportTable


class Queue:
    """A queue; readers call :meth:`~pkg.mod.Queue.get` and writers :meth:`put`.

    See :class:`Board` and :func:`make_queue`; :class:`Hidden` is not exported.

    Args:
        size: how many items fit.
        name: what the queue is called,
            across two lines.

    Implementation:
        The items sit on a ring in ``/dev/shm``.
    """

    def __init__(self, size: int, name: str = "q") -> None:
        self.size = size
        self.name = name

    def put(self, item: object, timeout: float | None = None) -> bool:
        """Add ``item``.

        Implementation: rings the doorbell of every reader.

        Waits at most ``timeout`` seconds (None: forever)::

            q.put(1, timeout=2.0)

        Args:
            item: what to add.
            timeout: seconds to wait.
            spare: not a parameter of put.

        Returns:
            Whether ``item`` was added.

        Raises:
            TimeoutError: when the queue stays full
                for ``timeout`` seconds.
        """
        return True

    def get(self) -> object:
        """Take the oldest item, as :attr:`size` allows (see :meth:`Board.post`).

        .. note:: Blocks while the queue is empty.
        """
        return None


class Board:
    """A board."""

    def post(self, value: int) -> None:
        """Post ``value``.

        It goes in a slot of the shared-memory board.
        """


@dataclass
class Record:
    counts: dict[int, int] = field(default_factory=dict)
    flag: bool = False


Pair = namedtuple("Pair", ["left", "right"])


def make_queue(size: int) -> Queue:
    """A :class:`Queue` of ``size`` items (:func:`bridge_py.other.helper` helps)."""
    return Queue(size)


def table() -> ExportTable:
    """The sample table: two classes under Sample.Docs, a dataclass, a namedtuple."""
    return ExportTable.build(
        classes=[
            ExportedClass(
                "Queue",
                Queue,
                "Sample.Docs.Queue",
                methods=("put", "get"),
                attributes=("size",),
            ),
            ExportedClass("Board", Board, "Sample.Docs.Board", methods=("post",)),
            ExportedClass("Record", Record, "Sample.Docs.Record", attributes=("flag",)),
            ExportedClass("Pair", Pair, "Sample.Docs.Pair", attributes=("left",)),
        ],
        functions=[ExportedFunction("make_queue", make_queue, "Sample.Docs")],
        module_docs={"Sample.Docs": "Sample functions; see :class:`Queue`."},
    )
