"""Bad input gives a clear error on every rank, naming the rank and the group, and the
group keeps working: after each bad call the ranks run a collective that must succeed.

Without the pre-collective agreement, a shape mismatch aborts gloo processes and a rank that
rejects its own arguments leaves the others blocked; a hang here fails the run's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bridge_py.distributed.device_communicators import CollectiveMismatchError
from bridge_py.distributed.parallel_state import GroupCoordinator
from tests.distributed.harness import free_port, join_gloo, run_ranks

GROUP = "group 'tp:0' (global ranks [0, 1])"


def _init(rank: int, port: int) -> GroupCoordinator:
    join_gloo(rank, port)
    return GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="tp")


def expect(call: Callable[[], Any], kind: type[Exception], *fragments: str) -> str:
    try:
        call()
    except kind as exc:
        message = str(exc)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"
        return message
    raise AssertionError(f"expected {kind.__name__} with {fragments}")


def still_works(g: GroupCoordinator) -> None:
    out = g.all_reduce(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0)), out


def _errors(rank: int, port: int) -> list[str]:
    g = _init(rank, port)
    other = 1 - rank
    messages = []

    # Shapes differ between ranks.
    messages.append(
        expect(
            lambda: g.all_reduce(torch.ones(4 + rank)),
            CollectiveMismatchError,
            "all_reduce in " + GROUP,
            "rank 0 (global 0) has shape (4,) torch.float32",
            "rank 1 (global 1) has shape (5,) torch.float32",
        )
    )
    still_works(g)

    # dtypes differ between ranks.
    dtype = torch.float32 if rank == 0 else torch.float64
    expect(lambda: g.all_gather(torch.ones(2, dtype=dtype)), CollectiveMismatchError, "float64")
    still_works(g)

    # dst out of range on rank 1 only: rank 1 names its own error, rank 0 learns of it.
    dst = 0 if rank == 0 else 5
    if rank == 1:
        expect(lambda: g.gather(torch.ones(2), dst), ValueError, "invalid dst rank (5)", GROUP)
    else:
        expect(
            lambda: g.gather(torch.ones(2), dst),
            CollectiveMismatchError,
            "rank 1 (global 1)",
            "invalid dst rank (5)",
        )
    still_works(g)

    # The ranks agree on nothing but a different root.
    expect(lambda: g.broadcast(torch.ones(2), src=rank), CollectiveMismatchError, "disagree on src")
    still_works(g)

    # Not divisible for reduce_scatter (detected locally, everywhere).
    expect(
        lambda: g.reduce_scatter(torch.ones(3, 4), dim=0),
        ValueError,
        "not divisible by the group size (2)",
        f"rank {rank} (global {rank})",
        GROUP,
    )
    still_works(g)

    # all_gatherv: rank 1's tensor does not match its entry of sizes.
    rows = 2 if rank == 0 else 1
    expect(lambda: g.all_gatherv(torch.ones(rows, 2), 0, [2, 3]), ValueError, "sizes[")
    # reduce_scatterv: sizes that do not add up; sizes lists that differ.
    expect(lambda: g.reduce_scatterv(torch.ones(4), 0, [1, 2]), ValueError, "sum(sizes) = 3")
    sizes = [1, 3] if rank == 0 else [2, 2]
    expect(lambda: g.reduce_scatterv(torch.ones(4), 0, sizes), CollectiveMismatchError, "sizes")
    still_works(g)

    # A dim out of range, not a tensor.
    expect(lambda: g.all_gather(torch.ones(2, 2), dim=3), ValueError, "invalid dim (3)")
    expect(lambda: g.all_reduce([1.0, 2.0]), TypeError, "expected a torch.Tensor")  # type: ignore[arg-type]
    still_works(g)

    # Ranks that call different collectives at the same point.
    call = g.all_reduce if rank == 0 else (lambda t: g.all_gather(t, 0))
    expect(lambda: call(torch.ones(2)), CollectiveMismatchError, "different collectives")
    still_works(g)

    # Point to point: a receiver expecting another shape drops the message, and the pair
    # stays in step for the next one.
    if rank == 0:
        g.send(torch.arange(4.0), dst=1)
        g.send(torch.arange(3.0), dst=1)
    else:
        expect(
            lambda: g.recv(torch.Size([5]), torch.float32, src=0),
            ValueError,
            "expected shape (5,) torch.float32",
            "it sent shape (4,) torch.float32",
            "rank 0 (global 0)",
        )
        assert torch.equal(g.recv(torch.Size([3]), torch.float32, src=0), torch.arange(3.0))
    expect(lambda: g.send(torch.ones(1), dst=rank), ValueError, "is this rank itself")
    expect(lambda: g.send(torch.ones(1), dst=7), ValueError, "invalid dst rank (7)")
    expect(lambda: g.recv(torch.Size([1]), "float", src=other), TypeError, "torch.dtype")  # type: ignore[arg-type]
    expect(lambda: g.send_object("x", dst=9), ValueError, "invalid dst rank (9)", GROUP)
    still_works(g)

    # Object and tensor-dict broadcasts check the root the same way.
    expect(lambda: g.broadcast_object("x", src=rank), CollectiveMismatchError, "src")
    bad_src = 0 if rank == 0 else 4
    expect(lambda: g.broadcast_object_list([None], src=bad_src), ValueError, "invalid src rank")
    payload = "not a dict" if rank == 0 else None
    expect(
        lambda: g.broadcast_tensor_dict(payload, src=0),  # type: ignore[arg-type]
        TypeError if rank == 0 else CollectiveMismatchError,
        "expecting a dictionary",
    )
    still_works(g)

    g.destroy()
    dist.destroy_process_group()
    return messages


def test_bad_input_errors_and_the_group_keeps_working() -> None:
    results = run_ranks(_errors, 2, free_port(), timeout=90)
    # Both ranks raise the same message for a cross-rank mismatch.
    assert results[0][0] == results[1][0]
