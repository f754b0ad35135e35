"""Values built to break the worker, sent over gRPC: an error reply each, no crash."""

from __future__ import annotations

import pytest

from bridge_py.client import BridgeError
from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import MAX_DEPTH
from tests.grpc.conftest import GrpcWorker
from tests.worker.test_hostile_values import _huge_empty_tensor, _tuples

pytestmark = pytest.mark.timeout(120)


def test_a_deep_tuple_and_an_impossible_tensor_are_refused_and_the_worker_serves(
    grpc_worker: GrpcWorker,
) -> None:
    with grpc_worker.connect() as client:
        counter = client.create("Counter")
        for payload, says in (
            (_tuples(300), f"nested deeper than {MAX_DEPTH}"),
            (_huge_empty_tensor(), "is too large"),
        ):
            with pytest.raises(BridgeError) as info:
                client._request(pb.Ping(payload))
            assert info.value.category == "bad_args" and says in info.value.message
        assert grpc_worker.proc.poll() is None
        assert counter.incr() == 1
        assert client.ping("still here") == "still here"
