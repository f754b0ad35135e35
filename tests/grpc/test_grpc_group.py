"""A 2-rank StatelessProcessGroup driven entirely over gRPC from one test process.

Two workers serve the shipped export table, one rank each; this process is only the
client of both, as a remote controller on another host would be.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bridge_py.client import BridgeError
from bridge_py.distributed import GroupTimeout
from tests.distributed.harness import free_port
from tests.grpc.conftest import GrpcWorker

pytestmark = pytest.mark.timeout(180)


def test_two_rank_group_over_grpc() -> None:
    workers = [GrpcWorker(exports=None), GrpcWorker(exports=None)]
    clients = [w.connect() for w in workers]
    try:
        port = free_port()
        with ThreadPoolExecutor(2) as pool:

            def on_both(fn):
                return list(pool.map(fn, range(2)))

            groups = on_both(
                lambda r: clients[r].call_function(
                    "StatelessProcessGroup.create", "127.0.0.1", port, r, 2, store_timeout=60
                )
            )
            assert [g.rank for g in groups] == [0, 1]
            assert [g.world_size for g in groups] == [2, 2]

            payload = {"weights": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 3}
            got = on_both(lambda r: groups[r].broadcast_obj(payload if r == 0 else None, 0))
            for value in got:
                assert value["step"] == 3 and torch.equal(value["weights"], payload["weights"])

            assert (
                on_both(lambda r: groups[r].all_gather_obj(f"rank{r}")) == [["rank0", "rank1"]] * 2
            )
            assert on_both(lambda r: groups[r].barrier(10.0)) == [None, None]

            receiving = pool.submit(groups[1].recv_obj, 0)
            groups[0].send_obj(("tuple", 1), 1)
            assert receiving.result(timeout=30) == ("tuple", 1)
            assert groups[0].send_dst_counter == {0: 0, 1: 1}

        # Errors come back as data, and the group keeps working.
        with pytest.raises(BridgeError) as info:
            groups[0].broadcast_obj(1, 5)
        assert info.value.category == "python" and info.value.python_type == "ValueError"
        assert isinstance(info.value, ValueError)  # caught as it would be in-process
        with pytest.raises(GroupTimeout) as timed_out:  # the package's classes too
            groups[1].recv_obj(0, timeout=0.5)
        assert isinstance(timed_out.value, BridgeError) and "rank 1" in str(timed_out.value)
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda r: groups[r].all_gather_obj(r), range(2))) == [[0, 1]] * 2
    finally:
        for client in clients:
            client.close()
        for worker in workers:
            worker.stop()
