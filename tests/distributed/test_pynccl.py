"""PyNcclCommunicator in real processes: on CPU, every method at 2 and 3 ranks, built from a
StatelessProcessGroup and from gloo ProcessGroups (torch's world group, and one made without
torch's global state), each over shared memory and over gloo, compared with torch's own
computation of the result; a state dict broadcast as trainers sync weights; errors that
name the rank and the parameter, after which the group still works; a group of one. CUDA
tests run where GPUs are (two for the collectives) and are skipped elsewhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from bridge_py.distributed import (
    StatelessProcessGroup,
    stateless_init_torch_distributed_process_group,
)
from bridge_py.distributed.device_communicators import CollectiveMismatchError
from bridge_py.distributed.device_communicators.pynccl import PyNcclCommunicator
from bridge_py.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
from bridge_py.distributed.device_communicators.shm_collectives import (
    BYTES_ENV,
    ENABLE_ENV,
    NAME_PREFIX,
)
from tests.distributed.harness import free_port, join_gloo, run_ranks

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    """No shared-memory segment of ours outlives a test."""

    def ours() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)}

    before = ours() if os.path.isdir("/dev/shm") else set()
    yield
    assert (ours() if os.path.isdir("/dev/shm") else set()) - before == set()


def _group(rank: int, world: int, port: int, source: str) -> Any:
    if source == "spg":
        return StatelessProcessGroup.create("127.0.0.1", port, rank, world, store_timeout=60)
    if source == "torch":  # torch's world group, registered in its global state
        join_gloo(rank, port, world)
        return dist.group.WORLD
    return stateless_init_torch_distributed_process_group("127.0.0.1", port, rank, world)


def _both(group: Any, env: dict[str, str] | None = None) -> dict[str, PyNcclCommunicator]:
    """A communicator over shared memory and one over gloo (shared memory off on all ranks)."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        comms = {"shm": PyNcclCommunicator(group, "cpu")}
        os.environ[ENABLE_ENV] = "0"
        comms["gloo"] = PyNcclCommunicator(group, device=torch.device("cpu", 0))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert comms["shm"]._shm is not None and comms["gloo"]._shm is None
    return comms


def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[Any]:
    """Every rank's input (small integers, so that sums are exact in every dtype)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.rand(shape, generator=gen) < 0.3 for _ in range(world)]
    return [torch.randint(-9, 10, shape, generator=gen).to(dtype) for _ in range(world)]


# ----------------------------------------------------------------- every method


def _every_method(rank: int, port: int, world: int, source: str) -> dict[str, int]:
    torch.set_num_threads(1)
    group = _group(rank, world, port, source)
    seed = 0
    comms = _both(group)
    for transport, comm in comms.items():
        what = f"{transport} ({source}, {world} ranks)"
        assert comm.group is group and (comm.rank, comm.world_size) == (rank, world)
        assert comm.available and not comm.disabled and comm.device == torch.device("cpu")

        # all_reduce: every op, out of place, into a given tensor and in place
        torch_ops = {
            ReduceOp.SUM: lambda s: s.sum(0),
            ReduceOp.PRODUCT: lambda s: s.prod(0),
            ReduceOp.MIN: lambda s: s.min(0).values,
            ReduceOp.MAX: lambda s: s.max(0).values,
            ReduceOp.AVG: lambda s: s.sum(0) / world,
        }
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int16):
            for op, reference in torch_ops.items():
                if op == ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                seed += 1
                xs = _inputs(world, (3, 5), dtype, seed)
                expected = reference(torch.stack(xs)).to(dtype)
                mine = xs[rank].clone()
                got = comm.all_reduce(mine, op=op)
                assert got is not None and torch.equal(got, expected), f"{what} {op} {dtype}"
                assert torch.equal(mine, xs[rank]), f"{what}: the input was modified"
        xs = _inputs(world, (4,), torch.bool, 99)
        assert torch.equal(comm.all_reduce(xs[rank]), torch.stack(xs).any(0))  # OR
        out = torch.empty(6)
        x = torch.arange(6.0) + rank
        assert comm.all_reduce(x, out) is out and torch.equal(
            out, sum(torch.arange(6.0) + r for r in range(world))
        )
        assert comm.all_reduce(x, x) is x and torch.equal(x, out)  # in place
        # Large enough for the shared memory's reduce-scatter step (a rank sums its own
        # slice from its input, unless the result goes over that input); whole numbers, so
        # that the sum is exact in any order (gloo's ring adds in another).
        big = [torch.arange(300_000, dtype=torch.float32) * (r + 1) ** 2 for r in range(world)]
        total = big[0].clone()
        for addend in big[1:]:
            total += addend
        assert torch.equal(comm.all_reduce(big[rank].clone()), total), what
        inplace = big[rank].clone()
        assert comm.all_reduce(inplace, inplace) is inplace and torch.equal(inplace, total)

        # all_gather, all_gatherv
        xs = _inputs(world, (2, 3), torch.float32, 7)
        gathered = torch.empty(world * 2, 3)
        assert comm.all_gather(gathered, xs[rank]) is gathered
        assert torch.equal(gathered, torch.cat(xs)), what
        sizes = [r + 1 for r in range(world)]
        rows = [torch.full((n, 2), float(r)) for r, n in enumerate(sizes)]
        out = torch.empty(sum(sizes), 2, dtype=torch.float32)
        assert comm.all_gatherv(out, rows[rank], sizes) is out
        assert torch.equal(out, torch.cat(rows)), what

        # reduce_scatter, reduce_scatterv
        xs = _inputs(world, (world * 4,), torch.int32, 8)
        piece = torch.empty(4, dtype=torch.int32)
        for op, reference in (
            (ReduceOp.SUM, torch_ops[ReduceOp.SUM]),
            (ReduceOp.MAX, torch_ops[ReduceOp.MAX]),
        ):
            assert comm.reduce_scatter(piece, xs[rank], op=op) is piece
            assert torch.equal(piece, reference(torch.stack(xs))[4 * rank : 4 * rank + 4]), what
        xs = _inputs(world, (sum(sizes), 2), torch.float32, 9)
        mine = torch.empty(sizes[rank], 2)
        assert comm.reduce_scatterv(mine, xs[rank], sizes) is mine
        start = sum(sizes[:rank])
        assert torch.equal(mine, torch.stack(xs).sum(0)[start : start + sizes[rank]]), what

        # broadcast, from the last rank
        xs = _inputs(world, (5, 2), torch.float16, 10)
        t = xs[rank].clone()
        assert comm.broadcast(t, src=world - 1) is t and torch.equal(t, xs[-1]), what

        # send/recv: a pair, then a ring inside group_start/group_end
        if rank < 2:
            peer = 1 - rank
            got = torch.empty(3, dtype=torch.int64)
            if rank == 0:
                comm.send(torch.tensor([1, 2, 3]), peer)
                comm.recv(got, peer)
            else:
                comm.recv(got, peer)
                comm.send(got * 10, peer)
            assert got.tolist() == ([10, 20, 30] if rank == 0 else [1, 2, 3]), what
        comm.group_start()
        comm.send(torch.full((1000,), float(rank)), (rank + 1) % world)
        got = torch.empty(1000)
        assert comm.recv(got, (rank - 1) % world) is got
        comm.group_end()
        assert torch.equal(got, torch.full((1000,), float((rank - 1) % world))), what
    shm = comms["shm"]._shm
    return dict(shm.calls) if shm is not None else {}


@pytest.mark.parametrize(
    ("world", "source"), [(2, "spg"), (3, "spg"), (2, "torch"), (3, "stateless")]
)
def test_every_method_matches_torch(world: int, source: str) -> None:
    for calls in run_ranks(_every_method, world, free_port(), world, source, timeout=140):
        # The shared-memory communicator ran its sums, gathers and broadcasts there (4
        # dtypes x SUM and AVG but for the 2 integer AVGs, then 3 more all-reduces), and
        # agreed over shared memory on what gloo ran (PRODUCT, MIN, MAX: 13 operations).
        assert calls["all_reduce"] == 11 and calls["broadcast"] == 1, calls
        assert calls["all_gather"] == 2 and calls["reduce_scatter"] == 2, calls
        assert calls["agreement"] == 13, calls


# ------------------------------------------------------------ weight sync


def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1000, 16, generator=gen),
        "layers.0.attn.qkv": torch.randn(48, 16, generator=gen).to(torch.bfloat16),
        "layers.0.mlp.fp8": torch.randn(32, generator=gen).to(torch.float8_e4m3fn),
        "layers.0.mask": torch.rand(7, generator=gen) < 0.5,
        "step": torch.tensor(seed, dtype=torch.int64),  # 0-dim
        "empty": torch.empty(0, 4),
        "lm_head.weight": torch.randn(1 << 20, generator=gen),  # 4 MiB: several steps
    }


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # compares every dtype bit for bit


def _weight_sync(rank: int, port: int, world: int) -> str:
    torch.set_num_threads(1)
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world, store_timeout=60)
    for transport, comm in _both(pg, {BYTES_ENV: str(1 << 20)}).items():
        for version in (1, 2):
            trained = _state_dict(version)
            state = trained if rank == 0 else {k: torch.zeros_like(v) for k, v in trained.items()}
            for name, tensor in state.items():
                assert comm.broadcast(tensor, src=0) is tensor, name
            comm.group.barrier()
            for name, tensor in state.items():
                assert tensor.dtype == trained[name].dtype, name
                assert torch.equal(_raw(tensor), _raw(trained[name])), (
                    f"{transport}: {name} differs after sync {version}"
                )
        comm.destroy()
        assert comm.disabled and comm.broadcast(torch.zeros(1), 0) is None
    return "ok"


def test_a_state_dict_broadcast_from_the_trainer() -> None:
    assert run_ranks(_weight_sync, 3, free_port(), 3, timeout=140) == ["ok"] * 3


# ------------------------------------------------------------------ errors


def _raises(kind: type[Exception], *words: str) -> Any:
    """pytest.raises for ``kind`` whose message holds every one of ``words``."""
    return pytest.raises(kind, match="(?s)" + "".join(f"(?=.*{w})" for w in words))


def _errors(rank: int, port: int) -> str:
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60)
    for comm in _both(pg).values():
        # a wrong output size on rank 1: rank 1 says what is wrong, rank 0 who and what
        out = torch.empty(5 if rank == 1 else 4)
        kind = ValueError if rank == 1 else CollectiveMismatchError
        with _raises(kind, "all_gather", "rank 1", "output_tensor", "5 elements"):
            comm.all_gather(out, torch.zeros(2))
        # ranks that disagree on a broadcast's tensor all raise, naming both ranks
        with _raises(CollectiveMismatchError, "broadcast", r"rank 0 .*\(6,\)", r"rank 1 .*\(5,\)"):
            comm.broadcast(torch.zeros(6 if rank == 0 else 5), 0)
        with _raises(CollectiveMismatchError, "src", "rank 0 .* passed 0", "rank 1 .* passed 1"):
            comm.broadcast(torch.zeros(2), rank)
        kind = ValueError if rank == 0 else CollectiveMismatchError
        with _raises(kind, "all_reduce", "rank 0", "out_tensor", "torch.int64"):
            comm.all_reduce(
                torch.zeros(3), torch.zeros(3, dtype=torch.int64 if rank == 0 else torch.float32)
            )
        with _raises(ValueError, "reduce_scatter", f"rank {rank}", "input_tensor", "7 elements"):
            comm.reduce_scatter(torch.empty(3), torch.zeros(7))
        with _raises(ValueError, "broadcast", f"rank {rank}", r"invalid src rank \(2\)"):
            comm.broadcast(torch.zeros(1), 2)
        with _raises(ValueError, f"rank {rank}", "tensor must be contiguous"):
            comm.broadcast(torch.zeros(3, 4).t(), 0)
        # a conjugate view (its memory is not its values) on rank 1 only: refused there,
        # and rank 0 is told, instead of waiting for a rank that never sends
        z = torch.zeros(3, dtype=torch.complex64)
        kind = ValueError if rank == 1 else CollectiveMismatchError
        with _raises(kind, "broadcast", "rank 1", "conjugate or negative view"):
            comm.broadcast(z.conj() if rank == 1 else z, 0)
        with _raises(TypeError, "all_reduce", "not defined", "torch.int64"):
            comm.all_reduce(torch.zeros(2, dtype=torch.int64), op=ReduceOp.AVG)
        with _raises(ValueError, "send", rf"dst \({rank}\) is this rank itself"):
            comm.send(torch.zeros(1), rank)
        # a message of another size is received, dropped and reported; the pair stays in step
        if rank == 0:
            comm.send(torch.arange(4.0), 1)
            comm.send(torch.arange(2.0), 1)
        else:
            with _raises(
                ValueError,
                "recv on rank 1",
                r"expected shape \(2,\) torch.float32 from rank 0 .*sent shape \(4,\)",
                "dropped",
            ):
                comm.recv(torch.empty(2), 0)
            assert comm.recv(torch.empty(2), 0).tolist() == [0.0, 1.0]
        # and the group still works
        assert comm.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
    return "ok"


def test_errors_name_the_rank_and_the_parameter_and_the_group_goes_on() -> None:
    assert run_ranks(_errors, 2, free_port(), timeout=140) == ["ok"] * 2


def _store_keys(rank: int, port: int) -> list[int]:
    """The store's key count before, while and after communicators come and go."""
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60)
    pg.barrier()
    counts = [pg.store.num_keys()]
    for _ in range(3):
        comm = PyNcclCommunicator(pg, device="cpu")
        assert comm.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
        pg.barrier()
        counts.append(pg.store.num_keys())
        comm.destroy()
    pg.barrier()
    counts.append(pg.store.num_keys())
    pg.barrier()  # rank 0, which serves the store, counts before anyone leaves
    return counts


def test_communicators_over_a_group_store_leave_no_keys_behind() -> None:
    # Each communicator's gloo rendezvous wrote one key per rank in the group's store; they
    # went once every rank had joined (before: 2 more keys per communicator, for good).
    counts = run_ranks(_store_keys, 2, free_port(), timeout=120)[0]
    assert len(set(counts)) == 1, counts


def _alone(rank: int, port: int) -> list[Any]:
    comm = PyNcclCommunicator(StatelessProcessGroup.create("127.0.0.1", port, 0, 1), "cpu")
    x = torch.ones(2)
    return [comm.available, comm.disabled, comm.all_reduce(x), comm.broadcast(x, 0)]


def test_a_group_of_one_is_disabled_as_in_vllm() -> None:
    assert run_ranks(_alone, 1, free_port(), timeout=60) == [[False, True, None, None]]


def _no_cuda(rank: int, port: int, wire: str) -> str:
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60, wire=wire)
    with _raises(RuntimeError, "needs CUDA", "device='cpu'"):
        PyNcclCommunicator(pg, device=rank)
    with _raises(ValueError, "serves 'cpu' or CUDA"):
        PyNcclCommunicator(pg, device="meta")
    return "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("wire", ["bridge", "vllm"])
def test_a_cuda_device_without_cuda_fails_at_construction(wire: str) -> None:
    assert run_ranks(_no_cuda, 2, free_port(), wire, timeout=60) == ["ok"] * 2


def test_a_unique_id_is_checked_before_anything_is_loaded() -> None:
    with _raises(ValueError, "expected a 128-byte NCCL unique id, got 5 bytes"):
        PyNcclCommunicator.from_unique_id_bytes(b"short", 0, 2, "cuda:0")
    with _raises(TypeError, "unique_id_bytes must be bytes, got str"):
        PyNcclCommunicator.from_unique_id_bytes("x" * 128, 0, 2, "cuda:0")  # type: ignore[arg-type]
    with _raises(ValueError, re.escape("rank must be in [0, 2), got 2")):
        PyNcclCommunicator.from_unique_id_bytes(bytes(128), 2, 2, "cuda:0")
    with _raises(RuntimeError, "needs a CUDA device"):
        PyNcclCommunicator.from_unique_id_bytes(bytes(128), 0, 2, "cpu")
    alone = PyNcclCommunicator.from_unique_id_bytes(bytes(128), 0, 1, "cuda:0")
    assert alone.disabled and not alone.available and alone.group is None


def test_nccl_that_cannot_be_loaded_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "/nowhere/libnccl.so.2")
    with _raises(RuntimeError, "cannot load NCCL from '/nowhere/libnccl", "VLLM_NCCL_SO_PATH"):
        NCCLLibrary()
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "libc.so.6")
    with _raises(RuntimeError, "has no ncclGetErrorString: not an NCCL library"):
        NCCLLibrary()


def test_a_library_path_other_than_the_operators_is_never_loaded(tmp_path: Any) -> None:
    """Loading a library runs its code: a path a caller names is refused before dlopen."""
    planted = tmp_path / "libnccl.so.2"
    planted.write_bytes(b"not a library")
    with _raises(ValueError, "is not the NCCL library of this process", "VLLM_NCCL_SO_PATH"):
        NCCLLibrary(str(planted))
    with _raises(ValueError, "is not the NCCL library of this process"):
        PyNcclCommunicator.from_unique_id_bytes(bytes(128), 0, 2, "cuda:0", str(planted))


# -------------------------------------------------------------------- CUDA


def _cuda(rank: int, port: int, wire: str) -> str:
    torch.cuda.set_device(rank)
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60, wire=wire)
    comm = PyNcclCommunicator(pg, device=rank)
    assert comm.device == torch.device("cuda", rank) and comm.nccl_version
    dev = comm.device
    stream = torch.cuda.Stream(dev)
    x = torch.full((4,), float(rank + 1), device=dev)
    assert torch.equal(comm.all_reduce(x, stream=stream).cpu(), torch.full((4,), 3.0))
    stream.synchronize()
    out = torch.empty(8, device=dev)
    comm.all_gather(out, x)
    assert out.cpu().tolist() == [1.0] * 4 + [2.0] * 4
    piece = torch.empty(2, device=dev)
    comm.reduce_scatter(piece, x)
    assert piece.cpu().tolist() == [3.0, 3.0]
    t = torch.arange(5.0, device=dev) if rank == 0 else torch.zeros(5, device=dev)
    comm.broadcast(t, src=0)
    assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    comm.group_start()
    comm.send(x, 1 - rank)
    got = torch.empty(4, device=dev)
    comm.recv(got, 1 - rank)
    comm.group_end()
    assert got.cpu().tolist() == [float(2 - rank)] * 4
    rows = torch.empty(3, 2, device=dev)
    comm.all_gatherv(rows, torch.full((rank + 1, 2), float(rank), device=dev), [1, 2])
    assert rows.cpu().tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    comm.group.barrier()
    comm.destroy()
    return "ok"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("wire", ["bridge", "vllm"])
def test_cuda_collectives_on_two_gpus(wire: str) -> None:
    """On vLLM's wire the communicator calls NCCL itself, as vLLM's does."""
    assert run_ranks(_cuda, 2, free_port(), wire, timeout=140) == ["ok"] * 2


def _from_unique_id(rank: int, port: int) -> list[float]:
    torch.cuda.set_device(rank)
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60)
    made = bytes(NCCLLibrary().ncclGetUniqueId().internal) if rank == 0 else None
    unique_id = pg.broadcast_obj(made, src=0)
    comm = PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, 2, rank)
    total = comm.all_reduce(torch.full((3,), float(rank + 1), device=comm.device))
    pg.barrier()
    return total.cpu().tolist()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_communicator_from_unique_id_bytes_on_two_gpus() -> None:
    assert run_ranks(_from_unique_id, 2, free_port(), timeout=140) == [[3.0] * 3] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_devices_are_named_as_in_vllm() -> None:
    comm = PyNcclCommunicator(StatelessProcessGroup(0, 1, dist.HashStore(), None), 0)
    assert comm.device == torch.device("cuda", 0) and comm.disabled
