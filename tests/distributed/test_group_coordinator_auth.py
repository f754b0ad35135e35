"""GroupCoordinator's object paths with an auth key: sealed on the wire, checked before unpickling.

Real gloo ranks (``harness.run_ranks``). With ``VLLM_BRIDGE_AUTH_KEY`` set on every rank, the
existing GroupCoordinator scenarios (objects, tensor dicts, message queues, TP x PP layouts)
run unchanged. Then one rank plays an attacker on the same gloo group: where the other rank
waits for an object (``recv_object``, ``broadcast_object``) it sends, with plain tensor
operations, a pickle whose unpickling would create a marker file: unsealed, sealed with
another key, or a genuine sealed value replayed at a later position. Each is refused with
AuthenticationError naming what was refused, the marker never appears, and the group goes on.
The agreement that precedes collectives shares a rank's complaint with the others as text,
so a pickle injected there is never unpickled either (with or without a key); and a
MessageQueue made with a key over a torch group seals the objects of its set-up too.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bridge_py.distributed import auth
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.device_communicators.agreement import CHECK_ENV, Signature
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.device_communicators.shm_collectives import ENABLE_ENV
from bridge_py.distributed.device_communicators.torch_compat import all_gather_into
from bridge_py.distributed.errors import DistributedError
from bridge_py.distributed.parallel_state import GroupCoordinator, in_the_same_node_as
from tests.distributed import test_group_coordinator_mq, test_group_coordinator_p2p
from tests.distributed.harness import free_port, join_gloo, run_ranks

pytestmark = pytest.mark.timeout(120)

KEY = "group-coordinator-key"
OTHER_KEY = b"someone-elses-key"


class Evil:
    """Unpickling this creates ``path``: proof that code from the wire ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _keyed(rank: int, port: int, scenario: Any) -> Any:
    """Run an existing two-or-more-rank scenario with the key in this rank's environment."""
    os.environ[auth.ENV_VAR] = KEY
    return scenario(rank, port)


def test_object_paths_work_with_a_key() -> None:
    p2p = test_group_coordinator_p2p._p2p
    assert run_ranks(_keyed, 4, free_port(), p2p, timeout=90) == ["ok"] * 4
    queues = test_group_coordinator_mq._queues
    assert run_ranks(_keyed, 3, free_port(), queues, timeout=90) == ["ok"] * 3


def _context(g: GroupCoordinator, tail: str) -> str:
    """What a sealed object of ``g`` is bound to (see groups.objects)."""
    ranks = ",".join(map(str, g.ranks))
    return f"gc/{g.cpu_group.group_name}/{ranks}/objects/{tail}"


def _raw_send(g: GroupCoordinator, data: bytes, dst: int) -> None:
    """Size, then bytes, to group rank ``dst`` on ``g``'s gloo group: plain tensor sends."""
    peer, group = g.ranks[dst], g.cpu_group
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=peer, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=peer, group=group)


def _raw_recv(g: GroupCoordinator, src: int) -> bytes:
    """What group rank ``src`` sent on ``g``'s gloo group, as the wire carries it."""
    peer, group = g.ranks[src], g.cpu_group
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=peer, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=peer, group=group)
    return data.numpy().tobytes()


def _raw_broadcast(g: GroupCoordinator, data: bytes, src: int) -> None:
    root, group = g.ranks[src], g.cpu_group
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=root, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=root, group=group)


def _refused(call: Any, *fragments: str) -> str:
    try:
        call()
    except AuthenticationError as exc:
        message = str(exc)
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        return message
    raise AssertionError(f"not refused: expected AuthenticationError with {fragments}")


def _attacked(rank: int, port: int, marker: str) -> list[str]:
    """Rank 1 injects into rank 0's object paths on their gloo group."""
    os.environ[auth.ENV_VAR] = KEY
    os.environ[CHECK_ENV] = "0"  # no agreement round: the attacker need not play along
    join_gloo(rank, port)
    # The world group's gloo group is the one the coordinator's objects travel on.
    g = GroupCoordinator([[0, 1]], rank, "gloo", False, group_name="keyed")
    evil = pickle.dumps(Evil(marker))
    seen: list[str] = []
    if rank == 1:
        # Genuine objects are sealed on the wire.
        assert _raw_recv(g, 0).startswith(auth.MAGIC)
        g.send_object("one", dst=0)
        # The attacks on recv_object (positions 1, 2, 3 of the pair 1 -> 0).
        _raw_send(g, evil, 0)
        _raw_send(g, auth.sign(OTHER_KEY, _context(g, "p2p/1/0/2"), evil), 0)
        replayed = auth.sign(
            KEY.encode(), _context(g, "p2p/1/0/0"), pickle.dumps("one", pickle.HIGHEST_PROTOCOL)
        )
        _raw_send(g, replayed, 0)
        # The attacks on broadcast_object (broadcasts 0 and 1 of the group).
        _raw_broadcast(g, evil, 1)
        _raw_broadcast(g, auth.sign(OTHER_KEY, _context(g, "bcast/1/1"), evil), 1)
    else:
        g.send_object({"sealed": True}, dst=1)
        assert g.recv_object(src=1) == "one"
        for n, why in ((1, "not authenticated"), (2, "HMAC does not match"), (3, "HMAC")):
            seen.append(_refused(lambda: g.recv_object(src=1), f"object {n} from rank 1", why))
        for n in (0, 1):
            seen.append(_refused(lambda: g.broadcast_object(None, 1), f"broadcast {n} from rank 1"))
    # Nothing was left in flight: the group still works (tensors, and sealed objects on a
    # channel of its own: the attacker did not advance its sequence numbers on this one).
    assert g.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
    assert in_the_same_node_as(g.cpu_group, source_rank=0) == [True, True]
    g.destroy()
    dist.destroy_process_group()
    return seen


def test_tampered_objects_are_refused_before_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Evil(str(probe)))).close()
    assert probe.exists(), "the attack payload must really run code when unpickled"
    seen, attacker = run_ranks(_attacked, 2, free_port(), str(marker), timeout=90)
    assert attacker == []
    assert len(seen) == 5
    assert not marker.exists(), "a rank unpickled an injected object"


def _complaint_attacked(rank: int, port: int, marker: str) -> str:
    """Rank 0 rejects its arguments; rank 1 answers the complaint exchange with a pickle."""
    os.environ[ENABLE_ENV] = "0"  # the agreement's table over gloo too, not shared memory
    join_gloo(rank, port)
    g = GroupCoordinator([[0, 1]], rank, "gloo", False, group_name="complaints")
    if rank == 0:
        try:
            g.gather(torch.ones(2), dst=5)  # invalid: rank 0 shares its complaint
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError("the invalid dst was accepted")
    else:
        # One row of the agreement table, flagged as rejected, then the "complaint": sizes
        # and bytes as torch's all_gather_object would send them, holding a pickle.
        row = Signature("gather").encode(True)
        all_gather_into(torch.empty(2 * row.numel(), dtype=torch.int64), row, g.cpu_group)
        evil = pickle.dumps(Evil(marker))
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(sizes, torch.tensor([len(evil)], dtype=torch.int64), group=g.cpu_group)
        longest = int(max(size.item() for size in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(evil)] = torch.frombuffer(bytearray(evil), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(2)]
        dist.all_gather(parts, mine, group=g.cpu_group)
        message = ""
    assert g.all_reduce(torch.ones(1)).item() == 2.0
    g.destroy()
    dist.destroy_process_group()
    return message


def test_the_agreements_complaint_exchange_unpickles_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    first, _ = run_ranks(_complaint_attacked, 2, free_port(), str(marker), timeout=90)
    assert "invalid dst rank (5)" in first
    assert not marker.exists(), "a rank unpickled an injected complaint"


def _queue_probe_attacked(rank: int, port: int, marker: str) -> str:
    """Rank 1 makes a keyed queue over a torch group; rank 0 answers its probe with a pickle."""
    join_gloo(rank, port)
    pg = dist.new_group([0, 1], backend="gloo")
    message = ""
    if rank == 0:  # what the queue's writer would broadcast first: its probe's name
        _raw_broadcast_pg(pg, pickle.dumps(Evil(marker)), 0)
    else:
        try:
            MessageQueue.create_from_process_group(pg, 4096, 2, writer_rank=0, auth_key=KEY)
        except Exception as exc:  # whichever way it fails, the marker tells what ran
            message = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return message


def _raw_broadcast_pg(pg: dist.ProcessGroup, data: bytes, src: int) -> None:
    """Size, then bytes, broadcast with the group's own methods (group rank ``src``)."""
    pg.broadcast(torch.tensor([len(data)], dtype=torch.int64), src).wait()
    pg.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src).wait()


def test_a_keyed_queue_over_a_torch_group_refuses_an_injected_probe(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _, message = run_ranks(_queue_probe_attacked, 2, free_port(), str(marker), timeout=90)
    assert not marker.exists(), "the queue's probe unpickled an injected object"
    assert message.startswith("AuthenticationError: refused broadcast 0 from rank 0"), message
    assert "not authenticated" in message, message


def _negative_size(rank: int, port: int) -> str:
    """Rank 1 announces an object of size -5 where rank 0 waits for one (no key)."""
    os.environ.pop(auth.ENV_VAR, None)
    os.environ[CHECK_ENV] = "0"
    join_gloo(rank, port)
    g = GroupCoordinator([[0, 1]], rank, "gloo", False, group_name="sizes")
    message = ""
    if rank == 1:
        dist.send(torch.tensor([-5], dtype=torch.int64), dst=0, group=g.cpu_group)
    else:
        try:
            g.recv_object(src=1)
        except DistributedError as exc:
            message = f"{type(exc).__name__}: {exc}"
    assert g.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]  # the group goes on
    g.destroy()
    dist.destroy_process_group()
    return message


def test_a_negative_object_size_is_a_distributed_error() -> None:
    message, _ = run_ranks(_negative_size, 2, free_port(), timeout=90)
    assert message.startswith("DistributedError: refused the object from rank 1 on gc/"), message
    assert "its size -5 is negative" in message, message
