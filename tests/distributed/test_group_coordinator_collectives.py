"""GroupCoordinator collectives on 2 and 4 gloo processes, checked against plain torch.

Every rank builds every rank's input itself (they are deterministic), so each result is
compared exactly with the same computation done locally, for every dtype, dims 0 and -1,
uneven sizes for the v-variants, and empty tensors. One spawned run per world size checks
everything: process start-up dominates the cost.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bridge_py.distributed.device_communicators import CollectiveMismatchError
from bridge_py.distributed.parallel_state import GroupCoordinator
from tests.distributed.harness import free_port, join_gloo, run_ranks

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _init(rank: int, port: int, world_size: int) -> GroupCoordinator:
    join_gloo(rank, port, world_size)
    return GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="tp")


def make(rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank ``rank``'s input: small values whose sums are exact in every dtype."""
    base = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64).reshape(shape)
    if dtype == torch.bool:
        return (base + rank) % 3 == 0
    values = (base * 3 + rank * 7) % 11
    if dtype != torch.uint8:
        values = values - 5
    return values.to(dtype)


def total(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``tensors`` in their dtype; a logical OR for bool (the documented rule)."""
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        return torch.stack(tensors).any(dim=0)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    return torch.stack([t.to(wide) for t in tensors]).sum(dim=0).to(dtype)


def same(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    assert actual is not None, what
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


def _check_dtype(g: GroupCoordinator, dtype: torch.dtype) -> None:
    rank, ws = g.rank_in_group, g.world_size
    shape = (4, 8)
    inputs = [make(r, dtype, shape) for r in range(ws)]
    mine = inputs[rank]

    given = mine.clone()
    summed = g.all_reduce(given)
    same(summed, total(inputs), f"all_reduce {dtype}")
    # into the input, but for a dtype summed in a wider one (whose input is left alone)
    widened = dtype in (torch.bool, torch.int16)
    assert (summed is given) != widened, f"all_reduce {dtype}: in place is {not widened}"
    if widened:
        assert torch.equal(given, mine), f"all_reduce {dtype}: the input was modified"
    # a view that is not contiguous gets a new tensor and keeps its values
    view = mine.clone().t()
    same(g.all_reduce(view), total(inputs).t(), f"all_reduce {dtype} (a transposed view)")
    assert torch.equal(view, mine.t()), f"all_reduce {dtype}: the view was modified"
    for dim in (0, -1):
        label = f"{dtype} dim={dim}"
        same(g.all_gather(mine, dim), torch.cat(inputs, dim), f"all_gather {label}")
        chunks = total(inputs).chunk(ws, dim)
        same(g.reduce_scatter(mine, dim), chunks[rank], f"reduce_scatter {label}")
        for dst in (0, ws - 1):
            out = g.gather(mine, dst, dim)
            if rank == dst:
                same(out, torch.cat(inputs, dim), f"gather {label} dst={dst}")
            else:
                assert out is None

    # Uneven sizes, rank 0 contributing nothing: along dim 0 and along the last dim.
    sizes = [0, 2, 1, 3][:ws]
    for dim in (0, -1):
        label = f"{dtype} dim={dim}"
        pieces = [make(r, dtype, (sizes[r], 3) if dim == 0 else (3, sizes[r])) for r in range(ws)]
        same(
            g.all_gatherv(pieces[rank], dim, sizes), torch.cat(pieces, dim), f"all_gatherv {label}"
        )
        full = [make(r, dtype, (sum(sizes), 3) if dim == 0 else (3, sum(sizes))) for r in range(ws)]
        expected = total(full).split(sizes, dim)[rank]
        same(g.reduce_scatterv(full[rank], dim, sizes), expected, f"reduce_scatterv {label}")
    # A list of tensors shares one sizes list (how dispatch gathers tokens and logits).
    rows = [make(r, dtype, (sizes[r], 2)) for r in range(ws)]
    cols = [make(r + 5, dtype, (sizes[r], 5)) for r in range(ws)]
    got = g.all_gatherv([rows[rank], cols[rank]], 0, sizes)
    assert isinstance(got, list) and len(got) == 2
    same(got[0], torch.cat(rows), f"all_gatherv list {dtype}")
    same(got[1], torch.cat(cols), f"all_gatherv list {dtype}")
    # sizes=None: equal sizes, like all_gather.
    same(g.all_gatherv(mine, 0), torch.cat(inputs, 0), f"all_gatherv equal {dtype}")

    for src in (0, ws - 1):
        target = mine.clone()
        assert g.broadcast(target, src) is target
        same(target, inputs[src], f"broadcast {dtype} src={src}")


def _check_layouts(g: GroupCoordinator) -> None:
    rank, ws = g.rank_in_group, g.world_size
    # Non-contiguous inputs (a transposed view) and a 3-D tensor along a middle dim.
    inputs = [make(r, torch.float32, (8, 4)).t() for r in range(ws)]
    same(g.all_reduce(inputs[rank]), total([t.contiguous() for t in inputs]), "all_reduce .t()")
    same(g.all_gather(inputs[rank], 0), torch.cat(inputs, 0), "all_gather .t()")
    target = inputs[rank].clone().t().contiguous().t()  # non-contiguous buffer
    g.broadcast(target, 0)
    same(target, inputs[0], "broadcast into a non-contiguous tensor")
    cubes = [make(r, torch.int32, (2, 4, 3)) for r in range(ws)]
    same(g.all_gather(cubes[rank], 1), torch.cat(cubes, 1), "all_gather dim=1 of 3-D")
    same(g.reduce_scatter(cubes[rank], 1), total(cubes).chunk(ws, 1)[rank], "reduce_scatter dim=1")
    # Scalars (0-dim) reduce and broadcast.
    scalar = torch.tensor(float(rank + 1))
    same(g.all_reduce(scalar), torch.tensor(float(sum(range(1, ws + 1)))), "all_reduce 0-dim")
    # Complex sums (carried as real pairs).
    z = torch.tensor([1 + 2j, rank - 1j], dtype=torch.complex64)
    expected_z = torch.tensor([ws * (1 + 2j), sum(range(ws)) - ws * 1j], dtype=torch.complex64)
    same(g.all_reduce(z), expected_z, "all_reduce complex64")
    # bool all-reduce is a logical OR, not a count.
    flags = torch.tensor([True, rank == 0, False])
    same(g.all_reduce(flags), torch.tensor([True, True, False]), "all_reduce bool is OR")


def _check_empty(g: GroupCoordinator) -> None:
    rank, ws = g.rank_in_group, g.world_size
    empty = torch.empty(0, 8)
    same(g.all_reduce(empty), torch.empty(0, 8), "all_reduce empty")
    same(g.all_gather(empty, 0), torch.empty(0, 8), "all_gather empty dim 0")
    same(g.all_gather(empty, -1), torch.empty(0, 8 * ws), "all_gather empty dim -1")
    same(g.reduce_scatter(empty, -1), torch.empty(0, 8 // ws), "reduce_scatter empty")
    same(g.all_gatherv(empty, 0, [0] * ws), torch.empty(0, 8), "all_gatherv all empty")
    same(g.reduce_scatterv(empty, 0, [0] * ws), torch.empty(0, 8), "reduce_scatterv empty")
    out = g.gather(empty, 0, 0)
    if rank == 0:
        same(out, torch.empty(0, 8), "gather empty")
    assert g.broadcast(empty, 0) is empty


def _collectives(rank: int, port: int, world_size: int) -> str:
    g = _init(rank, port, world_size)
    assert g.device_communicator is not None
    assert type(g.device_communicator).__name__ == "CpuCommunicator"
    for dtype in DTYPES:
        _check_dtype(g, dtype)
    _check_layouts(g)
    _check_empty(g)
    g.barrier()
    g.destroy()
    g.destroy()  # idempotent
    dist.destroy_process_group()
    return "ok"


def test_collectives_two_ranks() -> None:
    assert run_ranks(_collectives, 2, free_port(), 2, timeout=90) == ["ok"] * 2


def test_collectives_four_ranks() -> None:
    assert run_ranks(_collectives, 4, free_port(), 4, timeout=90) == ["ok"] * 4


def _undense_dicts(rank: int, port: int) -> list[str]:
    g = _init(rank, port, 2)
    got = []
    if rank == 0:
        for bad in (torch.arange(4.0).to_sparse(), torch.nested.nested_tensor([torch.ones(2)])):
            for send in (
                lambda d: g.broadcast_tensor_dict(d, src=0),
                lambda d: g.send_tensor_dict(d, dst=1),
            ):
                try:
                    send({"x": bad, "step": 1})
                except TypeError as exc:
                    got.append(str(exc))
        g.broadcast_tensor_dict({"x": torch.arange(3.0), "step": 2}, src=0)
        g.send_tensor_dict({"x": torch.arange(2.0), "step": 3}, dst=1)
    else:
        # every rank hears of a refused broadcast; nothing of the refused dictionaries was
        # sent: the next ones are the first heard
        for _ in range(2):
            try:
                g.broadcast_tensor_dict(src=0)
            except CollectiveMismatchError as exc:
                got.append("refused: " + str(exc).split(": ", 1)[1])
        for received in (g.broadcast_tensor_dict(src=0), g.recv_tensor_dict(src=0)):
            assert received is not None
            got.append(f"{received['step']} {received['x'].tolist()}")
    g.destroy()
    dist.destroy_process_group()
    return got


def test_a_tensor_dict_with_a_tensor_that_is_not_dense_is_refused_before_it_is_sent() -> None:
    sender, receiver = run_ranks(_undense_dicts, 2, free_port(), timeout=60)
    where = "broadcast_tensor_dict on rank 0 (global 0) of group 'tp:0' (global ranks [0, 1])"
    sparse, nested = (
        f"tensor_dict['x'] is a {kind} tensor: only dense ones travel"
        for kind in ("sparse_coo", "nested")
    )
    assert sender == [f"{where}: {sparse}", sparse, f"{where}: {nested}", nested]
    assert receiver == [
        f"refused: rank 0 (global 0): {where}: {sparse}",
        f"refused: rank 0 (global 0): {where}: {nested}",
        "2 [0.0, 1.0, 2.0]",
        "3 [0.0, 1.0]",
    ]
