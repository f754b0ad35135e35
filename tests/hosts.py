"""Hosts for one test: namespaces the test makes itself, joined by one network link.

``with hosts(2) as (a, b):`` makes two "hosts" on this machine, each a set of namespaces
held by a process of its own (its init): a network namespace whose only addresses are its
loopback and its end of a veth link to the other host (``a.address``, ``b.address``, in a
private /24 chosen at random, on that link only), its own host name (UTS), its own mount
namespace with a private, empty ``/dev/shm``, and its own PID namespace. So two ranks on
different hosts share no shared memory, no host name and no PIDs, as on two machines.

``host.start(target, *args)`` runs ``target(*args)`` (a module-level function, arguments
and result JSON) in a fresh Python process inside every namespace of the host; ``.result()``
waits for it (``host.run(argv, name)``: any command). ``host.leftovers()`` lists the
processes and /dev/shm files still on the host, for tests that check a failure left none.
``host.set_link(False)`` cuts the link at that host's end (``True``: restores it);
``host.remove()`` makes the host vanish. On leaving the block every process is killed and
the namespaces are deleted; nothing the test made stays.

Where the machine cannot make namespaces (not root, no ``ip`` or ``unshare``), tests that
use this are skipped with one line saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["Host", "Process", "hosts", "why_no_hosts"]


def why_no_hosts() -> str:
    """Why this machine cannot make hosts (empty: it can)."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"making hosts needs {tool!r}, which this machine lacks"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class Process:
    """A Python process running one target on a host."""

    def __init__(self, popen: subprocess.Popen[str], name: str) -> None:
        self.popen = popen
        self.name = name

    def result(self, timeout: float, parse: Callable[[str], Any] = json.loads) -> Any:
        """The target's result, its last line of output read by ``parse`` (JSON);
        AssertionError with its output when it failed or did not finish within
        ``timeout`` seconds (then it is killed)."""
        try:
            out, _ = self.popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, _ = self.popen.communicate()
            message = f"{self.name} did not finish in {timeout:g} s:\n{out[-4000:]}"
            raise AssertionError(message) from None
        if self.popen.returncode != 0:
            raise AssertionError(f"{self.name} exited {self.popen.returncode}:\n{out[-4000:]}")
        return parse(out.strip().splitlines()[-1])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)


class Host:
    """One host: its namespaces, held by its init process."""

    def __init__(self, name: str, netns: str, interface: str, address: str) -> None:
        self.name = name
        self.netns = netns
        self.interface = interface
        self.address = address
        self.processes: list[Process] = []
        # The host's init (PID 1 of its PID namespace) reaps the processes orphaned
        # there, as an init does, so that an exited one is not listed as left over.
        reap = "import os, time\nwhile True:\n try: os.wait()\n except OSError: time.sleep(0.2)"
        script = (
            f"hostname {name} && mount -t tmpfs -o size=512m tmpfs /dev/shm && "
            f"echo ready && exec {sys.executable} -c '{reap}'"
        )
        unshare = ["unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc"]
        self._init = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns,
                *unshare,
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self._init.stdout is not None
        assert self._init.stdout.readline().strip() == "ready", f"host {name} did not start"
        self.pid = self._inner_pid()

    def _inner_pid(self) -> int:
        """The PID (here) of the host's init: unshare's child, inside the namespaces."""
        for _ in range(100):
            for task in Path(f"/proc/{self._init.pid}/task").iterdir():
                children = (task / "children").read_text().split()
                if children:
                    return int(children[0])
            time.sleep(0.01)
        raise AssertionError(f"host {self.name}: no init process")

    def start(self, target: Callable[..., Any], *args: Any) -> Process:
        """Run ``target(*args)`` in a new Python process on this host."""
        script = (
            "import json, sys\n"
            f"from {target.__module__} import {target.__name__} as target\n"
            "print(json.dumps(target(*json.loads(sys.argv[1]))), flush=True)\n"
        )
        argv = [sys.executable, "-c", script, json.dumps(args)]
        return self.run(argv, f"{target.__name__}{tuple(args)!r}")

    def run(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> Process:
        """Run ``argv`` (in the repository's root, with ``env`` added to this environment)
        in every namespace of this host; its last line of output is its JSON result."""
        command = ["nsenter", "-t", str(self.pid), "--net", "--uts", "--mount", "--pid", "--"]
        popen = subprocess.Popen(
            [*command, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            start_new_session=True,
        )
        process = Process(popen, f"{name} on {self.name}")
        self.processes.append(process)
        return process

    def leftovers(self, within: float = 5.0, daemons: tuple[str, ...] = ()) -> list[str]:
        """What is left on the host besides its init and its ``daemons`` (programs that
        stay by design, such as ``epmd``): its processes (``pid command``) and the files
        in its /dev/shm. A host whose work ended cleanly has none, once the processes
        that were exiting (a helper whose parent just exited) are gone: asked again for
        up to ``within`` seconds until none is left."""
        until = time.monotonic() + within
        while (left := self._left(daemons)) and time.monotonic() < until:
            time.sleep(0.1)
        return left

    def _left(self, daemons: tuple[str, ...]) -> list[str]:
        root = Path(f"/proc/{self.pid}/root")
        left = [f"/dev/shm/{f.name}" for f in (root / "dev/shm").iterdir()]
        for entry in (root / "proc").iterdir():
            if entry.name.isdigit() and entry.name != "1":
                with contextlib.suppress(OSError):
                    if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                        continue  # exited; the init reaps it (its orphans: within 0.2 s)
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                    text = command.decode(errors="replace")
                    if daemons and text.split(" ")[0].endswith(daemons):
                        continue
                    left.append(f"{entry.name} {text[:200]}")
        return left

    def ip(self, *args: str) -> None:
        """Run ``ip args`` in this host's network namespace (raises if it fails)."""
        _ip("-n", self.netns, *args)

    def set_link(self, up: bool) -> None:
        """Bring this host's end of the link up or down."""
        self.ip("link", "set", self.interface, "up" if up else "down")

    def remove(self) -> None:
        """The host vanishes: its processes are killed and its network namespace deleted
        (with its end of the link, and so the other end)."""
        self.close()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", self.netns)

    def close(self) -> None:
        """Kill every process of the host, then its init; its namespaces go with them."""
        for process in self.processes:
            process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._init.pid, signal.SIGKILL)
        self._init.wait(10)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(10)


@contextlib.contextmanager
def hosts(count: int = 2) -> Iterator[tuple[Host, ...]]:
    """``count`` (2) hosts joined by one veth link; removed on leaving (see the module)."""
    import pytest  # (imported by tests only)

    why = why_no_hosts()
    if why:
        pytest.skip(why)
    assert count == 2, "one link joins two hosts"
    tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
    subnet = f"10.231.{random.randrange(1, 255)}"
    netns = [f"vbh{tag}{i}" for i in range(count)]
    interfaces = [f"vbh{tag}{i}" for i in range(count)]
    made: list[Host] = []
    try:
        for name in netns:
            _ip("netns", "add", name)
        _ip("link", "add", interfaces[0], "type", "veth", "peer", "name", interfaces[1])
        for i, (ns, interface) in enumerate(zip(netns, interfaces, strict=True)):
            _ip("link", "set", interface, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", interface)
            _ip("-n", ns, "link", "set", interface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        for i, (ns, interface) in enumerate(zip(netns, interfaces, strict=True)):
            made.append(Host(f"host{i}", ns, interface, f"{subnet}.{i + 1}"))
        yield tuple(made)
    finally:
        for host in made:
            host.close()
        for name in netns:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", name)
