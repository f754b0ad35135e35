"""Orphan cleanup skips what it must not or cannot remove, and never fails a group.

``spg_segments.remove_orphans`` runs in the first all_gather or barrier of every same-node
group (and when a group is released). Names under ``/dev/shm`` that look like a dead rank's
segment but are not this user's regular file or FIFO are left alone, as are those whose
removal fails; the real orphans next to them are still removed, and the group goes on.

The strays are built for real: a directory (EISDIR), a symbolic link, a file owned by
another user (needs root, to chown it) and an immutable file (needs CAP_LINUX_IMMUTABLE and
a tmpfs that takes the flag: unlink then fails with EPERM even for root). What this host
cannot build is skipped and reported by the test's skip reason; EACCES (removing from a
directory without write permission) cannot be built in ``/dev/shm``, whose permissions a
test must not change, and follows the same path as EPERM.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.shm import segments as spg_segments
from bridge_py.distributed.shm.wait import pid_namespace, process_alive
from tests.distributed.harness import free_port, run_ranks

pytestmark = pytest.mark.timeout(60)

SHM = Path(spg_segments.SHM_DIR)
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10
OTHER_UID = 65534  # nobody


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    assert not process_alive(child.pid)
    return child.pid


def _set_immutable(path: Path, on: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        value = flags[0] | _FS_IMMUTABLE_FL if on else flags[0] & ~_FS_IMMUTABLE_FL
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, array.array("i", [value]))
    finally:
        os.close(fd)


class Strays:
    """Names of a dead creator under /dev/shm: ``orphans`` to go, ``strays`` to stay."""

    def __init__(self) -> None:
        self.pid = _dead_pid()
        self.token = secrets.token_hex(4)
        self.orphans: list[Path] = []
        self.strays: dict[str, Path] = {}
        self.missing: list[str] = []
        self._immutable: Path | None = None
        self._outside = Path(os.environ.get("TMPDIR", "/tmp")) / f"vbspg_target_{self.token}"

    def name(self, n: int) -> Path:
        return SHM / f"{spg_segments.NAME_PREFIX}{pid_namespace()}_{self.pid}_{self.token}_{n}"

    def build(self) -> None:
        # Orphans first and last: listing order must not matter.
        self._orphan(0)
        directory = self.name(1)
        directory.mkdir()
        (directory / "inside").write_bytes(b"x")
        self.strays["directory"] = directory
        self._outside.write_bytes(b"not a segment")
        link = self.name(2)
        link.symlink_to(self._outside)
        self.strays["symlink"] = link
        other = self.name(3)
        other.write_bytes(b"someone else's")
        try:
            os.chown(other, OTHER_UID, OTHER_UID)
            self.strays["another user's file"] = other
        except PermissionError:
            other.unlink()
            self.missing.append("another user's file (chown needs root)")
        immutable = self.name(4)
        immutable.write_bytes(b"cannot be removed")
        try:
            _set_immutable(immutable, True)
            self._immutable = immutable
            self.strays["immutable file (EPERM)"] = immutable
        except OSError as exc:
            immutable.unlink()
            self.missing.append(f"an immutable file (FS_IMMUTABLE_FL: {exc.strerror})")
        self._orphan(5)
        fifo = self.name(6)
        os.mkfifo(fifo, 0o600)  # a doorbell: an orphan too
        self.orphans.append(fifo)

    def _orphan(self, n: int) -> None:
        path = self.name(n)
        path.write_bytes(b"VBSG")
        path.chmod(0o600)
        self.orphans.append(path)

    def check(self) -> None:
        left = [str(p) for p in self.orphans if os.path.lexists(p)]
        assert left == [], "real orphans must still be removed"
        gone = [what for what, p in self.strays.items() if not os.path.lexists(p)]
        assert gone == [], "names that are not ours to remove must be left alone"
        assert self._outside.read_bytes() == b"not a segment"

    def clean(self) -> None:
        if self._immutable is not None:
            with contextlib.suppress(OSError):
                _set_immutable(self._immutable, False)
        for path in [*self.orphans, *self.strays.values()]:
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        with contextlib.suppress(OSError):
            self._outside.unlink()


@pytest.fixture
def strays() -> Iterator[Strays]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    made = Strays()
    try:
        made.build()
        yield made
    finally:
        made.clean()


def test_remove_orphans_skips_what_it_must_not_remove(strays: Strays) -> None:
    removed = spg_segments.remove_orphans()
    assert {str(SHM / name) for name in removed} >= {str(p) for p in strays.orphans}
    strays.check()
    assert [name for name in spg_segments.remove_orphans() if strays.token in name] == []
    if strays.missing:
        pytest.skip("could not build on this host: " + "; ".join(strays.missing))


def _gather(rank: int, port: int) -> list[int]:
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=30)
    first = group.all_gather_obj(rank)  # learns the node: looks for orphans
    group.barrier(timeout=10)
    return first + group.all_gather_obj(rank * 10)


def test_a_group_goes_on_when_orphan_cleanup_meets_strays(strays: Strays) -> None:
    results = run_ranks(_gather, 2, free_port(), timeout=60)
    assert results == [[0, 1, 0, 10], [0, 1, 0, 10]]
    strays.check()
