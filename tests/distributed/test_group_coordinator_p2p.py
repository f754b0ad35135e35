"""GroupCoordinator on 4 gloo processes: ranks, point to point, objects, tensor dicts.

The 4 ranks form vLLM's layout for TP 2 x PP 2: TP groups [0, 1] and [2, 3], PP groups
[0, 2] and [1, 3], plus a world group. One spawned run checks everything.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bridge_py.distributed.parallel_state import (
    GraphCaptureContext,
    GroupCoordinator,
    TensorMetadata,
)
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


def _init(rank: int, port: int) -> tuple[GroupCoordinator, GroupCoordinator, GroupCoordinator]:
    join_gloo(rank, port, 4)
    world = GroupCoordinator([[0, 1, 2, 3]], rank, "gloo", False, group_name="world")
    tp = GroupCoordinator([[0, 1], [2, 3]], rank, "gloo", True, group_name="tp")
    pp = GroupCoordinator([[0, 2], [1, 3]], rank, "gloo", True, group_name="pp")
    return world, tp, pp


def value(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    base = torch.arange(int(torch.Size(shape).numel())).reshape(shape) + seed
    if dtype == torch.bool:
        return base % 2 == 0
    return (base % 100).to(dtype)


def _check_ranks(
    rank: int, world: GroupCoordinator, tp: GroupCoordinator, pp: GroupCoordinator
) -> None:
    assert (world.rank, world.ranks, world.world_size, world.rank_in_group) == (
        rank,
        [0, 1, 2, 3],
        4,
        rank,
    )
    assert world.device_communicator is None  # as vLLM: the world group has none...
    assert world.all_reduce(torch.ones(1)).item() == 4.0  # ...yet its collectives work
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3])
    assert pp.ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert tp.unique_name == "tp:0" and pp.unique_name == "pp:0" and world.unique_name == "world:0"
    assert tp.local_rank == rank and tp.device == torch.device("cpu")
    assert tp.first_rank == tp.ranks[0] and tp.last_rank == tp.ranks[-1]
    assert tp.is_first_rank == (rank % 2 == 0) and tp.is_last_rank == (rank % 2 == 1)
    assert pp.next_rank == pp.ranks[(pp.rank_in_group + 1) % 2]
    assert pp.prev_rank == pp.ranks[(pp.rank_in_group - 1) % 2]
    assert world.next_rank == (rank + 1) % 4 and world.prev_rank == (rank - 1) % 4
    assert isinstance(tp.cpu_group, dist.ProcessGroup) and isinstance(
        tp.device_group, dist.ProcessGroup
    )
    assert tp.mq_broadcaster is None
    with tp.graph_capture() as context:
        assert isinstance(context, GraphCaptureContext) and context.stream is None
    given = GraphCaptureContext(stream=None)
    with tp.graph_capture(given) as context:
        assert context is given


def _check_send_recv(pp: GroupCoordinator) -> None:
    first = pp.rank_in_group == 0
    shapes = [(3, 5), (0, 4), ()]
    for dtype in DTYPES:
        for shape in shapes:
            expected = value(dtype, shape, seed=pp.ranks[0])
            if first:
                pp.send(expected)  # dst defaults to the next rank
            else:
                got = pp.recv(torch.Size(shape), dtype)  # src defaults to the previous rank
                assert got.dtype == dtype and torch.equal(got, expected), (dtype, shape)
    obj = {"step": 3, "names": ["a", "b"], "nested": {"t": torch.arange(3)}, "none": None}
    if first:
        pp.send_object(obj, dst=1)
        assert pp.recv_object(src=1) == "thanks"
    else:
        got = pp.recv_object(src=0)
        assert got["names"] == ["a", "b"] and torch.equal(got["nested"]["t"], torch.arange(3))
        pp.send_object("thanks", dst=0)


def _sample_dict(seed: int) -> dict:
    return {
        "hidden": value(torch.float32, (4, 6), seed),
        "ids": value(torch.int16, (5,), seed),
        "mask": value(torch.bool, (2, 3), seed),
        "odd": value(torch.bfloat16, (3,), seed),  # 3 elements: not divisible by TP 2
        "empty": torch.empty(0, 7, dtype=torch.float64),
        "meta": {"step": seed, "tags": ("x", "y"), "inner": [1, {"deep": None}]},
        "text": "hello",
        "none": None,
    }


def _same_dict(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
        else:
            assert got[key] == want, key


def _check_tensor_dicts(
    rank: int, world: GroupCoordinator, tp: GroupCoordinator, pp: GroupCoordinator
) -> None:
    first_stage = pp.rank_in_group == 0
    # Plain send/recv of a dict with nested metadata.
    if first_stage:
        assert pp.send_tensor_dict(_sample_dict(rank)) is None
    else:
        _same_dict(pp.recv_tensor_dict(), _sample_dict(pp.ranks[0]))

    # The all-gather optimisation: each TP rank of stage 0 sends a slice of the replicated
    # tensors, each TP rank of stage 1 receives its slice and all-gathers over TP.
    # "residual" differs per TP rank (not replicated), so it is sent whole (override).
    replicated = _sample_dict(100)
    residual = value(torch.float32, (2, 4), seed=rank)
    overrides = {"residual": False}
    if first_stage:
        pp.send_tensor_dict(
            {**replicated, "residual": residual}, all_gather_group=tp, all_gather_tensors=overrides
        )
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp, all_gather_tensors=overrides)
        sender_residual = value(torch.float32, (2, 4), seed=pp.ranks[0])
        _same_dict(got, {**replicated, "residual": sender_residual})

    # Broadcasts from the first and from the last rank of the world.
    for src in (0, 3):
        sent = _sample_dict(src) if rank == src else None
        got = world.broadcast_tensor_dict(sent, src=src)
        _same_dict(got, _sample_dict(src))
    # And on the TP group (src is a rank of the group).
    got = tp.broadcast_tensor_dict(
        _sample_dict(tp.ranks[1]) if tp.rank_in_group == 1 else None, src=1
    )
    _same_dict(got, _sample_dict(tp.ranks[1]))
    meta = TensorMetadata("cpu", torch.float32, torch.Size([2]))
    assert (meta.device, meta.dtype, meta.size) == ("cpu", torch.float32, torch.Size([2]))


def _check_objects(rank: int, world: GroupCoordinator, tp: GroupCoordinator) -> None:
    assert world.broadcast_object({"from": rank} if rank == 2 else None, src=2) == {"from": 2}
    assert tp.broadcast_object(f"tp-{rank}", src=0) == f"tp-{tp.ranks[0]}"
    boxes = [rank, "x"] if rank == 1 else [None, None]
    assert world.broadcast_object_list(boxes, src=1) == [1, "x"]
    world.barrier()
    tp.barrier()


def _check_model_hooks(tp: GroupCoordinator) -> None:
    hidden, logits = torch.ones(2, 4), torch.zeros(2, 3)
    out = tp.dispatch_router_logits(hidden, logits)  # no all-to-all manager on a TP group: no-op
    assert out[0] is hidden and out[1] is logits and len(out) == 2
    extra = [torch.ones(2)]
    out = tp.dispatch_router_logits(hidden, logits, False, extra)
    assert len(out) == 3 and out[2] is extra
    assert tp.combine(hidden) is hidden
    tp.prepare_communication_buffer_for_model(torch.nn.Linear(2, 2))


def _p2p(rank: int, port: int) -> str:
    world, tp, pp = _init(rank, port)
    _check_ranks(rank, world, tp, pp)
    _check_send_recv(pp)
    _check_tensor_dicts(rank, world, tp, pp)
    _check_objects(rank, world, tp)
    _check_model_hooks(tp)
    world.barrier()
    for group in (pp, tp, world):
        group.destroy()
    dist.destroy_process_group()
    return "ok"


def test_ranks_p2p_objects_and_tensor_dicts() -> None:
    assert run_ranks(_p2p, 4, free_port(), timeout=90) == ["ok"] * 4
