"""Exit when the process that started the worker is gone.

A worker serving a port normally exits when its stdin closes, and its parent's exit
closes it. That is not enough: stdin can stay open after the parent is gone (a child
process holds a copy of the pipe), and a worker can be stuck where it no longer reads
it. So a thread watches the parent's process id: when the worker is orphaned (it is
handed to init or a subreaper, and ``os.getppid()`` changes), it calls ``on_orphaned``,
whatever the rest of the worker is doing. The thread needs the GIL for a moment every
``interval`` seconds, which a Python call blocked in a wait, a lock or a loop leaves free.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL = 0.1  # seconds between looks at the parent


def watch_parent(
    on_orphaned: Callable[[], None], interval: float = DEFAULT_INTERVAL
) -> threading.Thread | None:
    """Start a daemon thread that calls ``on_orphaned()`` once the parent process is gone.

    Returns the thread, or None when there is no parent to watch (started by init).
    """
    parent = os.getppid()
    if parent <= 1:
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        on_orphaned()

    thread = threading.Thread(target=watch, name="bridge-parent-watch", daemon=True)
    thread.start()
    return thread
