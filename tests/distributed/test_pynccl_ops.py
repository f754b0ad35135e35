"""PyNcclCommunicator's reduce, scatter, all_to_all_single, batch_isend_irecv, suspend and
resume (vLLM 0.34's) in real processes: on CPU at 2 and 3 ranks, over shared memory and
over gloo, compared with torch's own computation; ranks that disagree on the arguments all
raise, naming who passed what; a suspended communicator refuses work until it is resumed.
The CUDA test runs where two GPUs are and is skipped elsewhere.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.device_communicators import CollectiveMismatchError
from bridge_py.distributed.device_communicators.pynccl import PyNcclCommunicator
from bridge_py.distributed.errors import StateError
from tests.distributed.harness import free_port, run_ranks
from tests.distributed.test_pynccl import (  # noqa: F401  (no_segment_left: autouse)
    _both,
    _group,
    _inputs,
    _raises,
    no_segment_left,
)

pytestmark = pytest.mark.timeout(150)


def _p2p(source: str) -> Any:
    """How a test makes a P2POp: torch's own in torch's world group, else a look-alike."""
    if source == "torch":
        return lambda op, tensor, peer: dist.P2POp(op, tensor, group_peer=peer)
    return lambda op, tensor, peer: SimpleNamespace(op=op, tensor=tensor, group_peer=peer)


def _rows(sender: int, receiver: int, n: int) -> torch.Tensor:
    """The `n` rows `sender` sends `receiver` in the all-to-all: (sender, receiver, k)."""
    return torch.tensor([[sender, receiver, k] for k in range(n)], dtype=torch.int32).view(n, 3)


def _ops(rank: int, port: int, world: int, source: str) -> str:
    torch.set_num_threads(1)
    group = _group(rank, world, port, source)
    root, p2p_op = world - 1, _p2p(source)
    for transport, comm in _both(group).items():
        what = f"{transport} ({source}, {world} ranks)"

        # reduce: into the root's output; the others' stays as it was
        for seed, (dtype, op, reference) in enumerate(
            (
                (torch.float32, ReduceOp.SUM, lambda s: s.sum(0)),
                (torch.float32, ReduceOp.AVG, lambda s: s.sum(0) / world),
                (torch.int64, ReduceOp.MAX, lambda s: s.max(0).values),
                (torch.int16, ReduceOp.PRODUCT, lambda s: s.prod(0)),
                (torch.bool, ReduceOp.SUM, lambda s: s.any(0)),
            )
        ):
            xs = _inputs(world, (3, 4), dtype, seed)
            mine, out = xs[rank].clone(), torch.ones(3, 4).to(dtype)
            assert comm.reduce(out, mine, root, op=op) is out
            expected = reference(torch.stack(xs)).to(dtype) if rank == root else torch.ones(3, 4)
            assert torch.equal(out, expected.to(dtype)), f"{what} {op} {dtype}"
            assert torch.equal(mine, xs[rank]), f"{what}: the input was modified"
        big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)
        assert comm.reduce(big, big, 0) is big  # in place, over shared memory in steps
        factor = sum(r + 1 for r in range(world)) if rank == 0 else rank + 1
        assert torch.equal(big, torch.arange(300_000, dtype=torch.float32) * factor), what

        # scatter: rows of the root's tensor, none for rank 1; others' input is not read
        sizes = [2, 0, 3][:world]
        whole = torch.arange(sum(sizes) * 2, dtype=torch.float64).view(-1, 2)
        out = torch.empty(sizes[rank], 2, dtype=torch.float64)
        assert comm.scatter(out, whole if rank == root else torch.empty(0), sizes, root) is out
        start = sum(sizes[:rank])
        assert torch.equal(out, whole[start : start + sizes[rank]]), what
        flat = torch.arange(world * 3).bfloat16()
        piece = torch.empty(3, dtype=torch.bfloat16)
        assert torch.equal(comm.scatter(piece, flat, [3] * world), flat[3 * rank : 3 * rank + 3])

        # all_to_all_single: rank i sends rank j (i + j) % 3 rows
        to = [(rank + j) % 3 for j in range(world)]
        frm = [(i + rank) % 3 for i in range(world)]
        inp = torch.cat([_rows(rank, j, n) for j, n in enumerate(to)])
        expected = torch.cat([_rows(i, rank, n) for i, n in enumerate(frm)])
        out = torch.empty_like(expected)
        assert comm.all_to_all_single(out, inp, frm, to) is out
        assert torch.equal(out, expected), what

        # batch_isend_irecv: a ring both ways, as one group
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        from_prev, from_next = torch.empty(4), torch.empty(4)
        got = comm.batch_isend_irecv(
            [
                p2p_op(dist.isend, torch.full((4,), float(rank)), nxt),
                p2p_op(dist.irecv, from_prev, prv),
                p2p_op(dist.isend, torch.full((4,), 10.0 + rank), prv),
                p2p_op(dist.irecv, from_next, nxt),
            ]
        )
        assert got is not None and got[0] is from_prev and got[1] is from_next, what
        assert from_prev.tolist() == [float(prv)] * 4 and from_next.tolist() == [10.0 + nxt] * 4
    return "ok"


@pytest.mark.parametrize(("world", "source"), [(2, "spg"), (3, "torch")])
def test_reduce_scatter_all_to_all_and_batches_match_torch(world: int, source: str) -> None:
    assert run_ranks(_ops, world, free_port(), world, source, timeout=140) == ["ok"] * world


# ------------------------------------------------------------------- disagreement


def _disagree(rank: int, port: int) -> str:
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60)
    for comm in _both(pg).values():
        x = torch.zeros(2)
        with _raises(CollectiveMismatchError, "reduce", "root", "rank 0 .* passed 0", "passed 1"):
            comm.reduce(x, x, rank)
        # a wrong output on the root only: the root says what is wrong, rank 0 who and what
        kind = ValueError if rank == 1 else CollectiveMismatchError
        with _raises(kind, "reduce", "rank 1", "output_tensor has 3 elements"):
            comm.reduce(torch.zeros(3), x, 1)
        with _raises(CollectiveMismatchError, "scatter", "disagree on sizes", "rank 0", "rank 1"):
            comm.scatter(torch.empty(1), torch.zeros(3), [1, 2] if rank == 0 else [2, 1])
        kind = ValueError if rank == 1 else CollectiveMismatchError
        with _raises(kind, "scatter", "rank 1", r"output_tensor has shape \(2,\), not \(1,\)"):
            comm.scatter(torch.empty(1 + rank), torch.zeros(2), [1, 1])
        # rank 0 sends rank 1 two rows; rank 1 expects one: both say so before data moves
        with _raises(
            CollectiveMismatchError,
            "all_to_all_single",
            r"rank 0 \(global 0\) sends 2 rows to rank 1 \(global 1\), which expects 1",
        ):
            sent = [1, 2] if rank == 0 else [1, 1]
            comm.all_to_all_single(torch.empty(2), torch.zeros(sum(sent)), [1, 1], sent)
        with _raises(ValueError, "all_to_all_single", "input_tensor has shape", "(3,)"):
            comm.all_to_all_single(torch.empty(2), torch.zeros(2), [1, 1], [1, 2])
        # batch_isend_irecv checks every operation before it posts one
        ok = SimpleNamespace(op=dist.isend, tensor=torch.ones(1), group_peer=1 - rank)
        bad = SimpleNamespace(op=dist.send, tensor=torch.ones(1), group_peer=1 - rank)
        with _raises(TypeError, "batch_isend_irecv", f"rank {rank}", r"p2p_ops\[1\]\.op"):
            comm.batch_isend_irecv([ok, bad])
        itself = SimpleNamespace(op=dist.irecv, tensor=torch.ones(1), group_peer=rank)
        with _raises(ValueError, r"p2p_ops\[0\]\.group_peer \(\d\) is this rank itself"):
            comm.batch_isend_irecv([itself])
        # a receive of another size: the receiver reports it, the pair stays in step
        if rank == 0:
            big = SimpleNamespace(op=dist.isend, tensor=torch.arange(4.0), group_peer=1)
            assert comm.batch_isend_irecv([big]) == []
        else:
            small = SimpleNamespace(op=dist.irecv, tensor=torch.empty(2), group_peer=0)
            with _raises(ValueError, "recv on rank 1", r"expected shape \(2,\)", r"\(4,\)"):
                comm.batch_isend_irecv([small])
        assert comm.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]  # and the group goes on
    return "ok"


def test_ranks_that_disagree_all_raise_and_the_group_goes_on() -> None:
    assert run_ranks(_disagree, 2, free_port(), timeout=140) == ["ok"] * 2


# --------------------------------------------------------------- suspend and resume


def _suspend(rank: int, port: int) -> str:
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60)
    for transport, comm in _both(pg).items():
        assert comm.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
        comm.suspend()
        comm.suspend()  # (idempotent)
        assert comm._pg is None and comm._shm is None, "the group and its memory are released"
        with _raises(StateError, "all_reduce", f"rank {rank}", "suspended", r"resume\(\)"):
            comm.all_reduce(torch.ones(2))
        with _raises(StateError, "send", "suspended"):
            comm.send(torch.ones(1), 1 - rank)
        with _raises(StateError, "scatter", "suspended"):
            comm.scatter(torch.empty(1), torch.zeros(2), [1, 1])
        comm.resume()
        comm.resume()  # (nothing to do)
        assert (comm._shm is not None) == (transport == "shm")
        assert comm.all_reduce(torch.full((3,), float(rank))).tolist() == [1.0] * 3
        got = comm.batch_isend_irecv(
            [
                SimpleNamespace(
                    op=dist.isend, tensor=torch.full((2,), rank + 5), group_peer=1 - rank
                ),
                SimpleNamespace(
                    op=dist.irecv, tensor=torch.empty(2, dtype=torch.int64), group_peer=1 - rank
                ),
            ]
        )
        assert got is not None and got[0].tolist() == [6 - rank] * 2
        # one rank suspends while the other reduces: both are told, neither is suspended
        with _raises(CollectiveMismatchError, "different collectives"):
            comm.suspend() if rank == 0 else comm.all_reduce(torch.ones(2))
        assert comm.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
        comm.suspend()
        comm.destroy()  # (a suspended communicator can be destroyed)
        assert comm.disabled and comm.all_reduce(torch.ones(1)) is None
    return "ok"


def test_a_suspended_communicator_refuses_work_until_resumed() -> None:
    assert run_ranks(_suspend, 2, free_port(), timeout=140) == ["ok"] * 2


# -------------------------------------------------------------------- CUDA


def _cuda(rank: int, port: int, wire: str) -> str:
    torch.cuda.set_device(rank)
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60, wire=wire)
    comm = PyNcclCommunicator(pg, device=rank)
    dev = comm.device
    x = torch.full((4,), float(rank + 1), device=dev)
    out = torch.zeros(4, device=dev)
    comm.reduce(out, x, 1)
    assert out.cpu().tolist() == ([3.0] * 4 if rank == 1 else [0.0] * 4)
    rows = torch.empty(rank + 1, 2, device=dev)
    comm.scatter(rows, torch.arange(6.0, device=dev).view(3, 2), [1, 2], root=0)
    assert rows.cpu().tolist() == ([[0.0, 1.0]] if rank == 0 else [[2.0, 3.0], [4.0, 5.0]])
    inp = torch.full((3,), float(rank), device=dev)  # one row to rank 0, two to rank 1
    got = torch.empty(2 if rank == 0 else 4, device=dev)
    comm.all_to_all_single(got, inp, [1, 1] if rank == 0 else [2, 2], [1, 2])
    assert got.cpu().tolist() == ([0.0, 1.0] if rank == 0 else [0.0, 0.0, 1.0, 1.0])
    back = torch.empty(4, device=dev)
    peer = 1 - rank
    send = SimpleNamespace(op=dist.isend, tensor=x, group_peer=peer)
    comm.batch_isend_irecv([send, SimpleNamespace(op=dist.irecv, tensor=back, group_peer=peer)])
    assert back.cpu().tolist() == [float(2 - rank)] * 4
    comm.suspend()
    comm.resume()
    assert comm.all_reduce(x).cpu().tolist() == [3.0] * 4
    torch.cuda.synchronize()
    pg.barrier()
    comm.destroy()
    return "ok"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("wire", ["bridge", "vllm"])
def test_cuda_operations_on_two_gpus(wire: str) -> None:
    """On vLLM's wire the communicator calls NCCL itself, as vLLM's does."""
    assert run_ranks(_cuda, 2, free_port(), wire, timeout=140) == ["ok"] * 2
