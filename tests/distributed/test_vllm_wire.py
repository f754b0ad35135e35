"""Groups of bridge_py ranks and vLLM's own ranks on vLLM's wire (``wire="vllm"``).

The vLLM ranks run the StatelessProcessGroup of vLLM's released wheels (0.33.0 and 0.34.0,
``vllm_release``); the others run ours. Every operation goes from every source, with vLLM
serving the store and with us serving it, and every rank checks what it received.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp, TCPStore

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.errors import (
    AuthenticationError,
    BarrierTimeout,
    GroupTimeout,
    ObjectLoadError,
)
from bridge_py.distributed.vllm_pickle import ncclUniqueId
from tests.distributed import vllm_release
from tests.distributed.harness import free_port, run_ranks

HOST = "127.0.0.1"


def _group(rank: int, role: str, port: int, world_size: int, version: str) -> Any:
    """Rank ``rank`` of a group, made by vLLM's class (``role`` "vllm") or ours."""
    if role == "vllm":
        utils = vllm_release.install(version)
        return utils.StatelessProcessGroup.create(HOST, port, rank, world_size, store_timeout=60)
    return StatelessProcessGroup.create(HOST, port, rank, world_size, store_timeout=60, wire="vllm")


def _object(rank: int) -> Any:
    return {"rank": rank, "items": [rank, "x" * rank, (1.5, None)], "set": {rank}, b"k": b"v"}


def _tensor(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)


def _unique_id(rank: int, role: str, version: str) -> Any:
    """An ncclUniqueId of this rank's side (vLLM's class or ours), its bytes set by rank."""
    cls = vllm_release.install(version).ncclUniqueId if role == "vllm" else ncclUniqueId
    return cls.from_buffer_copy(bytes((rank * 7 + i) % 256 for i in range(128)))


def _every_operation(rank: int, roles: list[str], port: int, version: str) -> dict[str, Any]:
    """Every operation from every source, checked here; returns the counters and types."""
    world_size, role = len(roles), roles[rank]
    group = _group(rank, role, port, world_size, version)
    seen: dict[str, Any] = {}
    for src in range(world_size):  # objects, tensors and NCCL ids from every source
        got = group.broadcast_obj(_object(rank) if rank == src else None, src=src)
        assert got == _object(src), (src, got)
        got = group.broadcast(_tensor(src) if rank == src else torch.empty(2, 3), src=src)
        assert torch.equal(got, _tensor(src)), (src, got)
        got = group.broadcast_obj(_unique_id(rank, role, version) if rank == src else None, src)
        assert bytes(got.internal) == bytes(_unique_id(src, role, version).internal)
        seen[f"id_from_{src}"] = f"{type(got).__module__}.{type(got).__name__}"
    assert group.all_gather_obj(_object(rank)) == [_object(r) for r in range(world_size)]
    # Point to point around the ring, objects then tensors (one sender per receiver:
    # vLLM's keys name the receiver and the sender's count, not the sender).
    after, before = (rank + 1) % world_size, (rank - 1) % world_size
    group.send_obj(_object(rank), dst=after)
    group.send(_tensor(rank), dst=after)
    assert group.recv_obj(before) == _object(before)
    into = torch.zeros(2, 3)
    assert group.recv(into, before) is into and torch.equal(into, _tensor(before))
    expected = sum(_tensor(r) for r in range(world_size))
    assert torch.equal(group.all_reduce(_tensor(rank)), expected)
    maximum = group.all_reduce(_tensor(rank), op=ReduceOp.MAX)
    assert torch.equal(maximum, _tensor(world_size - 1))
    group.barrier()
    group.barrier(timeout=10)
    seen["counters"] = (
        dict(group.send_dst_counter),
        dict(group.recv_src_counter),
        group.broadcast_send_counter,
        dict(group.broadcast_recv_src_counter),
    )
    group.barrier()  # no rank leaves (rank 0: stops serving) before all are done
    return seen


ROLES = {
    "vllm_serves": ["vllm", "bridge", "bridge"],
    "bridge_serves": ["bridge", "vllm", "bridge"],
}


@pytest.mark.parametrize("version", vllm_release.VERSIONS)
@pytest.mark.parametrize("serving", sorted(ROLES))
def test_mixed_group_runs_every_operation_from_every_source(version: str, serving: str) -> None:
    vllm_release.wheel(version)  # (downloaded here, not in every rank)
    roles = ROLES[serving]
    results = run_ranks(_every_operation, 3, roles, free_port(), version, timeout=120)
    vllm_id = "vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId"
    ours = f"{ncclUniqueId.__module__}.ncclUniqueId"
    for rank, seen in enumerate(results):
        # An NCCL id loads as each side's own class, whichever side sent it.
        for src in range(3):
            assert seen[f"id_from_{src}"] == (vllm_id if roles[rank] == "vllm" else ours)
        # The counters advance alike on both sides: per source, 3 broadcasts, the
        # all_gather's, the two all_reduces', and rank 0's two barrier ids so far.
        sent, received, broadcasts, broadcasts_received = seen["counters"]
        assert sent == {r: 2 if r == (rank + 1) % 3 else 0 for r in range(3)}
        assert received == {r: 2 if r == (rank - 1) % 3 else 0 for r in range(3)}
        own = 6 + (2 if rank == 0 else 0)
        assert broadcasts == own, seen
        for src in range(3):
            expected = 0 if src == rank else 6 + (2 if src == 0 else 0)
            assert broadcasts_received[src] == expected, (rank, src, seen)


def _pickled_rce(marker: str) -> bytes:
    """What an attacker with access to the store writes: a pickle that runs a command."""

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Exploit())


def _attacked_receiver(rank: int, port: int, marker: str, version: str) -> str:
    """Rank 1 (ours) receives from rank 0 (vLLM's) after an attacker overwrote the value."""
    group = _group(rank, "vllm" if rank == 0 else "bridge", port, 2, version)
    if rank == 0:
        group.send_obj("first", dst=1)
        group.barrier()
        group.send_obj("second", dst=1)
        group.barrier()
        group.barrier()  # rank 0 serves the store until rank 1 has received
        return ""
    group.barrier()
    attacker = TCPStore(HOST, port, None, False, wait_for_workers=False)
    attacker.set("send_to/1/0", _pickled_rce(marker))  # replaces "first"
    with pytest.raises(ObjectLoadError) as refused:
        group.recv_obj(0)
    group.barrier()
    assert group.recv_obj(0) == "second"  # the group goes on, in step
    group.barrier()
    return str(refused.value)


def test_a_malicious_value_from_the_store_is_refused_not_run(tmp_path: Path) -> None:
    marker = str(tmp_path / "ran")
    version = vllm_release.VERSIONS[-1]
    vllm_release.wheel(version)
    message = run_ranks(_attacked_receiver, 2, free_port(), marker, version, timeout=60)[1]
    assert not os.path.exists(marker)
    assert "posix.system" in message and "'send_to/1/0' from rank 0" in message, message


def _late_sender(rank: int, port: int, version: str) -> list[str]:
    """A receive that times out leaves its counter: the next one gets the same value."""
    group = _group(rank, "vllm" if rank == 0 else "bridge", port, 2, version)
    if rank == 0:
        group.barrier()
        group.send_obj("late", dst=1)
        group.barrier()
        return []
    errors = []
    start = time.monotonic()
    with pytest.raises(GroupTimeout) as waited:
        group.recv_obj(0, timeout=0.5)
    assert time.monotonic() - start < 5
    errors.append(str(waited.value))
    group.barrier()
    assert group.recv_obj(0, timeout=30) == "late"
    assert group.recv_src_counter[0] == 1
    # vLLM's receiver leaves the value in the store for an hour; ours deletes it.
    deadline = time.monotonic() + 10
    while group.store.check(["send_to/1/0"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not group.store.check(["send_to/1/0"])
    group.barrier()
    return errors


def test_a_timed_out_receive_keeps_the_counters_in_step_and_the_store_clean() -> None:
    version = vllm_release.VERSIONS[-1]
    vllm_release.wheel(version)
    message = run_ranks(_late_sender, 2, free_port(), version, timeout=60)[1][0]
    assert "recv_obj on rank 1" in message and "'send_to/1/0'" in message, message
    assert "rank 0" in message, message


def _absent_rank(rank: int, port: int) -> str:
    group = StatelessProcessGroup.create(HOST, port, rank, 2, store_timeout=30, wire="vllm")
    if rank == 1:
        return ""
    with pytest.raises(BarrierTimeout) as failed:
        group.barrier(timeout=1)
    return str(failed.value)


def test_a_barrier_names_the_ranks_that_did_not_come() -> None:
    message = run_ranks(_absent_rank, 2, free_port(), timeout=60)[0]
    assert "barrier on rank 0" in message and "rank 1" in message, message


def test_the_wire_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import HashStore

    monkeypatch.setenv("VLLM_BRIDGE_WIRE", "vllm")
    assert StatelessProcessGroup(0, 1, HashStore(), None).wire == "vllm"
    monkeypatch.setenv("VLLM_BRIDGE_WIRE", "grpc")
    with pytest.raises(ValueError, match=r"\$VLLM_BRIDGE_WIRE must be 'bridge' or 'vllm'"):
        StatelessProcessGroup(0, 1, HashStore(), None)
    monkeypatch.delenv("VLLM_BRIDGE_WIRE")
    assert StatelessProcessGroup(0, 1, HashStore(), None).wire == "bridge"


def test_the_operator_policy_on_keys_refuses_the_vllm_wire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    with pytest.raises(ValueError, match="auth_key cannot be used with wire='vllm'"):
        StatelessProcessGroup.create(HOST, port, 0, 1, auth_key=b"k", wire="vllm")
    for name, value in (("VLLM_BRIDGE_AUTH_KEY", "k"), ("VLLM_BRIDGE_REQUIRE_AUTH_KEY", "1")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(AuthenticationError, match="VLLM_BRIDGE_ALLOW_VLLM_WIRE=1"):
                StatelessProcessGroup.create(HOST, port, 0, 1, wire="vllm")
            env.setenv("VLLM_BRIDGE_ALLOW_VLLM_WIRE", "1")
            group = StatelessProcessGroup.create(HOST, port, 0, 1, wire="vllm")
            assert group.wire == "vllm" and group.auth_key is None
            del group


def _weights_pushed(rank: int, port: int) -> list[float]:
    """The RL weight sync on CPU: a vLLM-wire group, a communicator, a state dict."""
    from bridge_py.distributed.device_communicators.pynccl import PyNcclCommunicator

    group = StatelessProcessGroup.create(HOST, port, rank, 2, store_timeout=60, wire="vllm")
    comm = PyNcclCommunicator(group, device="cpu")
    weights = {"w": torch.arange(4.0), "b": torch.ones(2)}
    received = {name: torch.zeros_like(t) for name, t in weights.items()}
    for name in weights:
        comm.broadcast(weights[name] if rank == 0 else received[name], src=0)
    group.barrier()
    comm.destroy()
    return [*received["w"].tolist(), *received["b"].tolist()] if rank else []


def test_a_communicator_on_a_vllm_wire_group_pushes_weights_on_cpu() -> None:
    assert run_ranks(_weights_pushed, 2, free_port(), timeout=60)[1] == [0, 1, 2, 3, 1, 1]


def test_expire_data_deletes_what_this_rank_wrote_as_vllms_does() -> None:
    group = StatelessProcessGroup.create(HOST, free_port(), 0, 1, 0, 30, wire="vllm")
    group.send_obj("old", dst=0)
    assert group.store.check(["send_to/0/0"]) and len(group.entries) == 1
    time.sleep(0.01)  # older than data_expiration_seconds (0)
    group.send_obj("new", dst=0)  # expires what is due first, as vLLM's send_obj does
    assert not group.store.check(["send_to/0/0"]) and group.store.check(["send_to/0/1"])
    time.sleep(0.01)
    group.expire_data()
    assert not group.entries and not group.store.check(["send_to/0/1"])


def _exit_right_after_a_barrier(rank: int, port: int) -> None:
    group = StatelessProcessGroup.create(HOST, port, rank, 4, store_timeout=30, wire="vllm")
    for src in range(4):
        group.broadcast_obj(src if rank == src else None, src)
    group.send_obj(rank, (rank + 1) % 4)
    assert group.recv_obj((rank - 1) % 4) == (rank - 1) % 4
    group.all_reduce(torch.ones(3))
    group.barrier()
    group.barrier()


def test_ranks_exit_cleanly_right_after_a_barrier() -> None:
    """Rank 0 serves the store and leaves at once after the last barrier, as a trainer
    does; its interpreter's exit must not abort (it did, in 5 of 12 runs, while a thread
    of ours was still deleting the barrier's keys). Plain processes: a forkserver child
    leaves without the interpreter's exit."""
    name = _exit_right_after_a_barrier.__name__
    script = f"import sys; from {__name__} import {name}; {name}(*map(int, sys.argv[1:]))"
    root = str(Path(__file__).resolve().parents[2])
    for _ in range(5):
        port = free_port()
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(rank), str(port)],
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(4)
        ]
        try:
            outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
        assert [rank.returncode for rank in ranks] == [0] * 4, outputs
