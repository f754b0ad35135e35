"""Fixtures: real worker subprocesses, always stopped after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.worker.port_client import PortClient

SAMPLE = "tests.worker.sample_exports:table"


@pytest.fixture(scope="module")
def worker() -> Iterator[PortClient]:
    """A worker serving the sample export table, shared by the tests of a module."""
    client = PortClient(exports=SAMPLE)
    yield client
    client.close()
