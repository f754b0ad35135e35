"""Shared memory of a worker killed with its objects goes when the next worker starts
(issue 40: nothing of theirs stays, /dev/shm files included)."""

from __future__ import annotations

import os
import signal

import pytest

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from tests.worker.port_client import PortClient

pytestmark = pytest.mark.timeout(120)


def _queues() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.endswith("_mq")}


def test_the_next_worker_removes_the_shared_memory_of_a_killed_one() -> None:
    before = _queues()
    killed = PortClient()  # the default export table: vLLM's objects
    try:
        queue = killed.request(pb.CreateInstance("MessageQueue", PLAIN.encode([1, 1])))
        assert queue.handle > 0
        ring = _queues() - before
        assert len(ring) == 1, ring  # the queue's ring, named after its writer's pid
        assert str(killed.proc.pid) in next(iter(ring))
        # as the pool's health check and a killed BEAM's orphan watch do: the worker's
        # whole process group, multiprocessing's resource tracker included (which would
        # otherwise unlink what the worker registered with it); no atexit hook runs
        os.killpg(killed.proc.pid, signal.SIGKILL)
        killed.proc.wait(30)
    finally:
        killed.close()
    assert ring <= _queues()  # left behind
    following = PortClient()
    try:
        assert following.request(pb.Ping(PLAIN.encode("up"))) == "up"
        assert not ring & _queues()
    finally:
        following.close()
