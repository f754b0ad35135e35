"""StatelessProcessGroup's tensor operations: send, recv, broadcast and all_reduce.

Real processes (``run_ranks``, bounded) run every operation at 2 and 3 ranks over both
transports, with pickling switched off in the group's values module (a tensor is its dtype,
shape and bytes, never a pickle), and compare the results with torch's own computation:
all four reduce ops on float32, bfloat16 and int64, sums of random floats equal bit for bit
on every rank, sizes that take a board slot, a store queue and a shared-memory segment,
non-contiguous tensors, and tensors that do not match (a clear error, and the group goes
on). In-process tests over one real TCPStore check the wire format, that values forged by
someone without the key are refused, that a pickle where a tensor is expected is never
unpickled, and that waits end at their timeout and at the caller's deadline.
"""

from __future__ import annotations

import datetime
import functools
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed import ReduceOp, TCPStore

from bridge_py import deadline
from bridge_py.distributed import StatelessProcessGroup, auth
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.errors import (
    CollectiveMismatchError,
    GroupTimeout,
    PeerGoneError,
    StateError,
)
from bridge_py.distributed.spg import keys, tensors, values
from bridge_py.distributed.spg import p2p as spg_p2p
from tests.distributed.harness import (
    TRANSPORTS,
    free_port,
    run_ranks,
    transport_of,
    use_transport,
)

pytestmark = pytest.mark.timeout(120)

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
OPS = ("SUM", "PRODUCT", "MAX", "MIN")
# Elements of float32 messages: one fits a board slot (64 KiB), one goes through the store
# queue on one node (under the 256 KiB segment threshold), one through a segment.
SIZES = (16, 40_000, 300_000)


def _value(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s 3x4 tensor: small integers, exact in every dtype and every order of
    reduction, so torch's own reductions must agree with all_reduce's exactly."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-3, 4, (3, 4), generator=generator).to(dtype)


def _noisy(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Random floats, whose sum depends on the order of additions."""
    return torch.randn(1000, generator=torch.Generator().manual_seed(rank)).to(dtype)


def _ramp(rank: int, size: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float32) * (rank + 1)


class _NoPickle:
    """Stands for the pickle module in ``values``: any use fails the test."""

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"pickle.{name} was used for a tensor")


def _error(call) -> str:
    try:
        call()
    except CollectiveMismatchError as exc:
        return str(exc)
    raise AssertionError("expected a CollectiveMismatchError")


def _p2p(group: StatelessProcessGroup, out: dict) -> None:
    """A ring (each rank sends to the next): every dtype, non-contiguous at both ends; then
    every size."""
    rank, n = group.rank, group.world_size
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for dtype in DTYPES:
        group.send(_value(rank, dtype).t(), dst=nxt)
    for size in SIZES:
        group.send(_ramp(rank, size), dst=nxt)
    for dtype in DTYPES:
        into = torch.empty(3, 4, dtype=dtype).t()
        got = group.recv(into, src=prv, timeout=30)
        out["recv", dtype] = (got is into, got.clone())
    for size in SIZES:
        into = torch.empty(size)
        got = group.recv(into, src=prv, timeout=30)
        out["recv", size] = got is into and torch.equal(into, _ramp(prv, size))


def _broadcasts(group: StatelessProcessGroup, out: dict) -> None:
    """From every rank, every dtype; then a large one (a segment on one node)."""
    for src in range(group.world_size):
        for dtype in DTYPES:
            mine = _value(src, dtype) if group.rank == src else torch.empty(3, 4, dtype=dtype)
            got = group.broadcast(mine, src=src, timeout=30)
            out["bcast", src, dtype] = (got is mine, got.clone())
    big = _ramp(0, SIZES[-1]) if group.rank == 0 else torch.zeros(SIZES[-1])
    out["bcast", "big"] = torch.equal(group.broadcast(big, src=0), _ramp(0, SIZES[-1]))


def _all_reduces(group: StatelessProcessGroup, out: dict) -> None:
    rank = group.rank
    for op in OPS:
        for dtype in DTYPES:
            mine = _value(rank, dtype)
            got = group.all_reduce(mine, op=getattr(ReduceOp, op))
            out["ar", op, dtype] = got
            out["ar untouched", op, dtype] = torch.equal(mine, _value(rank, dtype))
    out["ar by name"] = group.all_reduce(_value(rank, torch.int64), op="max")
    out["ar default"] = group.all_reduce(_value(rank, torch.int64))
    out["ar non-contiguous"] = group.all_reduce(_value(rank, torch.float32).t())
    for dtype in (torch.float32, torch.bfloat16):
        out["noisy", dtype] = group.all_reduce(_noisy(rank, dtype))
    big = group.all_reduce(_ramp(rank, SIZES[-1]))
    out["ar big"] = torch.equal(big, _ramp(0, SIZES[-1]) * sum(range(1, group.world_size + 1)))


def _mismatches(group: StatelessProcessGroup, out: dict) -> None:
    """Tensors that do not fit: an error on the receiving ranks, then the group goes on."""
    rank, n = group.rank, group.world_size
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    group.send(torch.zeros(4), dst=nxt)
    group.send(torch.zeros(4, dtype=torch.int64), dst=nxt)
    out["recv shape"] = _error(lambda: group.recv(torch.empty(5), src=prv, timeout=30))
    out["recv dtype"] = _error(lambda: group.recv(torch.empty(4), src=prv, timeout=30))
    group.send(torch.ones(2), dst=nxt)
    out["recv after"] = group.recv(torch.empty(2), src=prv, timeout=30).tolist()

    if rank == 0:
        group.broadcast(torch.zeros(4), src=0)
    else:
        into = torch.empty(4, dtype=torch.bfloat16)
        out["bcast dtype"] = _error(lambda: group.broadcast(into, src=0, timeout=30))
    out["bcast after"] = group.broadcast(torch.full((2,), float(rank)), src=n - 1).tolist()

    # The last rank's tensor is longer: every rank receives one that does not fit its own.
    odd = torch.ones(5 if rank == n - 1 else 4)
    out["ar shape"] = _error(lambda: group.all_reduce(odd))
    out["ar after"] = group.all_reduce(torch.ones(2)).tolist()


def _battery(rank: int, port: int, world_size: int, transport: str) -> dict:
    use_transport(transport)
    key = KEY if world_size == 3 else None  # keyed values (and segment digests) at 3 ranks
    group = StatelessProcessGroup.create(
        "127.0.0.1", port, rank, world_size, store_timeout=30, auth_key=key
    )
    assert transport_of(group) == transport
    values.pickle = _NoPickle()  # type: ignore[assignment]
    out: dict = {}
    _p2p(group, out)
    _broadcasts(group, out)
    _all_reduces(group, out)
    _mismatches(group, out)
    out["segments"] = group._values.segments._generation  # large values written to segments
    group.barrier(timeout=30)
    out["counters"] = (
        dict(group.send_dst_counter),
        dict(group.recv_src_counter),
        group.broadcast_send_counter,
        dict(group.broadcast_recv_src_counter),
    )
    # Checked here: tensors returned to the parent would travel through shared memory.
    _check_battery(out, rank, world_size, transport)
    return rank


def _expected_reduction(op: str, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    stacked = torch.stack([_value(r, dtype) for r in range(world_size)])
    reduce = {"SUM": torch.sum, "PRODUCT": torch.prod, "MAX": torch.amax, "MIN": torch.amin}[op]
    return reduce(stacked, 0).to(dtype)


def _check_battery(out: dict, rank: int, world_size: int, transport: str) -> None:
    n, prv, nxt = world_size, (rank - 1) % world_size, (rank + 1) % world_size
    for dtype in DTYPES:
        same, got = out["recv", dtype]
        assert same and torch.equal(got, _value(prv, dtype).t()), dtype
        for src in range(n):
            same, got = out["bcast", src, dtype]
            assert same and torch.equal(got, _value(src, dtype)), (src, dtype)
        for op in OPS:
            got = out["ar", op, dtype]
            assert torch.equal(got, _expected_reduction(op, dtype, n)), (op, dtype, got)
            assert out["ar untouched", op, dtype], (op, dtype)
    assert all(out["recv", size] for size in SIZES)
    assert out["bcast", "big"] and out["ar big"]
    assert (out["segments"] > 0) == (transport == "shm"), out["segments"]
    assert torch.equal(out["ar by name"], _expected_reduction("MAX", torch.int64, n))
    assert torch.equal(out["ar default"], _expected_reduction("SUM", torch.int64, n))
    assert torch.equal(out["ar non-contiguous"], _expected_reduction("SUM", torch.float32, n).t())
    for dtype in (torch.float32, torch.bfloat16):
        # Rank order, one addition at a time: the same bits on every rank.
        expected = functools.reduce(torch.add, [_noisy(r, dtype) for r in range(n)])
        assert torch.equal(out["noisy", dtype], expected), dtype

    for label, what in (("recv shape", "shape"), ("recv dtype", "dtype")):
        message = out[label]
        assert f"from rank {prv} (received by rank {rank})" in message, message
        assert f"(different {what})" in message, message
    assert out["recv after"] == [1.0, 1.0]
    if rank:
        message = out["bcast dtype"]
        assert "'bcast/0/" in message and f"received by rank {rank}" in message, message
        assert "torch.float32" in message and "(different dtype)" in message, message
    assert out["bcast after"] == [float(n - 1)] * 2
    assert "(different shape)" in out["ar shape"], out["ar shape"]
    assert out["ar after"] == [float(n)] * 2

    # The counters advance as vLLM's would, the calls that failed included.
    sent = len(DTYPES) + len(SIZES) + 3  # the ring's messages, the mismatch test's three
    # The all_reduces (each a broadcast from every rank): ops x dtypes; by name, default,
    # non-contiguous, two noisy, big; the mismatch test's two.
    gathers = len(OPS) * len(DTYPES) + 6 + 2

    def broadcasts(src: int) -> int:
        # Each dtype; rank 0 the big one and the mismatched one, the last rank one more.
        return gathers + len(DTYPES) + 2 * (src == 0) + (src == n - 1)

    assert out["counters"] == (
        {r: sent * (r == nxt) for r in range(n)},
        {r: sent * (r == prv) for r in range(n)},
        broadcasts(rank),
        {r: 0 if r == rank else broadcasts(r) for r in range(n)},
    )


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tensor_operations(transport: str, world_size: int) -> None:
    # Each rank checks its own results (a failure names the rank and shows its traceback).
    checked = run_ranks(_battery, world_size, free_port(), world_size, transport, timeout=90)
    assert checked == list(range(world_size))


def _recv_from_exited(rank: int, port: int) -> str | None:
    use_transport("shm")
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=30)
    group.barrier(timeout=30)  # rank 1 is done with the store
    if rank == 0:
        return None  # exits at once: rank 1 sees it gone
    start = time.monotonic()
    with pytest.raises(PeerGoneError) as info:
        group.recv(torch.empty(2), src=0, timeout=20)
    assert time.monotonic() - start < 5
    return str(info.value)


def test_a_receive_from_a_rank_that_exited_ends_at_once_on_one_node() -> None:
    _none, message = run_ranks(_recv_from_exited, 2, free_port(), timeout=60)
    assert "rank 0 exited" in message and "'p2p/0/1/0'" in message, message


# --- in one process, over one real TCPStore --------------------------------------------------


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_VAR, raising=False)


@pytest.fixture
def pair() -> Iterator[tuple[StatelessProcessGroup, StatelessProcessGroup]]:
    """Ranks 0 and 1 of a 2-rank group (the store transport), each with its own client."""
    server = TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    client = TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=10))
    yield (
        StatelessProcessGroup(rank=0, world_size=2, store=server, socket=None),
        StatelessProcessGroup(rank=1, world_size=2, store=client, socket=None),
    )


class Evil:
    """Unpickling this creates ``path``: proof that code from the bytes ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


def _take(store, src: int, dst: int) -> bytes:
    """The next message queued from ``src`` to ``dst``, taken off the queue."""
    return spg_p2p.unframe(store.queue_pop(keys.p2p_queue(src, dst), False))[1].tobytes()


def _put(store, src: int, dst: int, seq: int, value: bytes) -> None:
    store.queue_push(keys.p2p_queue(src, dst), spg_p2p.frame(seq, value))


def test_a_tensor_travels_as_dtype_shape_and_bytes_not_as_a_pickle(pair) -> None:
    rank0, rank1 = pair
    sent = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    rank1.send(sent, dst=0)
    stored = _take(rank0.store, 1, 0)
    # the tag, then msgpack extension 1's payload: kind, bits, ndim, the dims, the elements
    layout = b"b\x10\x02" + (2).to_bytes(8, "big") + (3).to_bytes(8, "big")
    assert stored == b"\x00VBT2" + layout + sent.view(torch.int16).numpy().tobytes()
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(stored)
    _put(rank0.store, 1, 0, 0, stored)
    assert torch.equal(rank0.recv_obj(1, timeout=5), sent)  # recv_obj takes it as a new tensor
    rank1.send(sent, dst=0)
    wrong = torch.zeros(3, 2, dtype=torch.bfloat16)
    with pytest.raises(CollectiveMismatchError, match=r"shape \(2, 3\).*\(different shape\)"):
        rank0.recv(wrong, src=1, timeout=5)
    assert not wrong.any()  # nothing written
    rank1.send(sent, dst=0)
    leaf = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    assert rank0.recv(leaf, src=1, timeout=5) is leaf  # filled; autograd records nothing
    assert torch.equal(leaf.detach(), sent) and leaf.grad_fn is None


def test_payloads_round_trip_and_those_that_do_not_add_up_are_refused() -> None:
    for tensor in (
        torch.tensor(3.5),  # no dimensions
        torch.empty(0, 4),  # no elements
        torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate
        torch.tensor([True, False]),
        torch.arange(12, dtype=torch.float16).reshape(3, 4)[:, ::2],  # a strided view
    ):
        got = tensors.decode(tensors.encode(tensor), tensor, "v")
        assert got.dtype == tensor.dtype and torch.equal(got, tensor.resolve_conj())
    fp8 = torch.arange(4.0).to(torch.float8_e4m3fn)  # a dtype that travels between ranks only
    assert torch.equal(tensors.decode(tensors.encode(fp8), None, "v").float(), fp8.float())
    good = tensors.encode(torch.zeros(2, 3))
    kind_at = len(tensors.MAGIC)
    absurd = tensors.encode(torch.zeros(2)).replace(
        (2).to_bytes(8, "big"), (1 << 63).to_bytes(8, "big")
    )
    for payload in (
        good[:-1],  # a byte short
        good + b"\x00",  # a byte long
        good[: kind_at + 2],  # the header cut
        good[: kind_at + 3 + 8],  # the shape cut
        good[:kind_at] + b"z" + good[kind_at + 1 :],  # an unknown dtype
        absurd,  # a shape beyond torch's sizes
    ):
        with pytest.raises(CollectiveMismatchError, match=r"^v is a malformed tensor: "):
            tensors.decode(payload, None, "v")
    for payload in (b"", b"\x00VBT1\x07float32\x00" + bytes(4)):  # empty; the old layout
        with pytest.raises(CollectiveMismatchError, match=r"^refused v: a tensor was expected"):
            tensors.decode(payload, None, "v")


def test_a_pickle_where_a_tensor_is_expected_is_never_unpickled(pair, tmp_path: Path) -> None:
    rank0, rank1 = pair
    target = tmp_path / "pwned"
    _put(rank0.store, 1, 0, 0, pickle.dumps(Evil(target)))
    into = torch.zeros(2)
    with pytest.raises(CollectiveMismatchError, match="not unpickled"):
        rank0.recv(into, src=1, timeout=5)
    rank0.store.set(keys.broadcast_value(1, 0), pickle.dumps(Evil(target)))
    with pytest.raises(CollectiveMismatchError, match="'bcast/1/0' from rank 1"):
        rank0.broadcast(into, src=1, timeout=5)
    rank0.store.set(keys.broadcast_value(1, 1), pickle.dumps(Evil(target)))
    with pytest.raises(CollectiveMismatchError, match="'bcast/1/1' from rank 1"):
        rank0.all_reduce(into)
    assert not target.exists() and torch.equal(into, torch.zeros(2))
    rank1.send_dst_counter[0] = 1  # the refused message was consumed: the next one arrives
    rank1.send(torch.ones(2), dst=0)
    assert rank0.recv(into, src=1, timeout=5).tolist() == [1.0, 1.0]


def test_tensors_forged_without_the_key_are_refused(pair) -> None:
    rank0, rank1 = pair
    rank0.auth_key = rank1.auth_key = KEY
    rank1.send(torch.ones(2), dst=0)
    assert _take(rank0.store, 1, 0).startswith(auth.MAGIC)
    forged = tensors.encode(torch.full((2,), 7.0))
    attempts = {
        "no tag": forged,
        "wrong key": auth.sign(OTHER_KEY, "spg/" + keys.p2p_value(1, 0, 1), forged),
    }
    into = torch.zeros(2)
    for seq, (label, data) in enumerate(attempts.items()):
        _put(rank0.store, 1, 0, seq, data)
        with pytest.raises(AuthenticationError, match=f"'p2p/1/0/{seq}' from rank 1"):
            rank0.recv(into, src=1, timeout=5)
        assert torch.equal(into, torch.zeros(2)), label
    rank1.send_dst_counter[0] = len(attempts)
    rank1.send(torch.ones(2), dst=0)
    assert rank0.recv(into, src=1, timeout=5).tolist() == [1.0, 1.0]
    rank0.store.set(keys.broadcast_value(1, 0), forged)
    with pytest.raises(AuthenticationError, match="'bcast/1/0' from rank 1"):
        rank0.broadcast(torch.zeros(2), src=1, timeout=5)
    rank0.store.set(keys.broadcast_value(1, 1), forged)  # rank 1's value of the next gather
    with pytest.raises(AuthenticationError, match="'bcast/1/1' from rank 1"):
        rank0.all_reduce(torch.zeros(2))
    assert rank0.broadcast_send_counter == 1  # the gather was consumed: the group goes on


def test_waits_end_at_the_timeout_and_at_the_deadline_taking_nothing(pair) -> None:
    rank0, rank1 = pair
    start = time.monotonic()
    with pytest.raises(GroupTimeout, match="p2p/1/0/0"):
        rank0.recv(torch.empty(1), src=1, timeout=0.3)
    with deadline.until(time.monotonic() + 0.3), pytest.raises(GroupTimeout):
        rank0.broadcast(torch.empty(1), src=1)
    rank1.send(torch.ones(1), dst=0)
    assert rank0.recv(torch.empty(1), src=1, timeout=5).tolist() == [1.0]
    with deadline.until(time.monotonic() + 0.3), pytest.raises(GroupTimeout):
        rank0.all_reduce(torch.empty(1))
    assert time.monotonic() - start < 5  # not the store's 10 s
    # A collective that gave up leaves the ranks out of step: what follows is refused.
    with pytest.raises(StateError, match="all_reduce failed on it"):
        rank0.recv(torch.empty(1), src=1, timeout=5)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_arguments_are_checked_before_anything_moves(pair) -> None:
    rank0, _rank1 = pair
    with pytest.raises(ValueError, match=r"ReduceOp\.SUM, PRODUCT, MAX or MIN"):
        rank0.all_reduce(torch.ones(1), op=ReduceOp.AVG)
    with pytest.raises(ValueError, match=r"ReduceOp\.SUM"):
        rank0.all_reduce(torch.ones(1), op="mean")
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        rank0.send([1.0], dst=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        rank0.recv([1.0], src=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be sent"):
        rank0.send(torch.ones(1, dtype=torch.complex32), dst=1)
    assert rank0.broadcast_send_counter == 0 and rank0.send_dst_counter[1] == 0
    assert rank0.store.queue_len(keys.p2p_queue(0, 1)) == 0


def test_a_group_of_one_reduces_to_a_copy() -> None:
    group = StatelessProcessGroup.create("127.0.0.1", 0, 0, 1, store_timeout=10)
    tensor = torch.arange(3.0)
    result = group.all_reduce(tensor, op=ReduceOp.PRODUCT)
    assert torch.equal(result, tensor) and result is not tensor
    assert group.broadcast(tensor, src=0) is tensor
    assert group.broadcast_send_counter == 2
    group.socket.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_a_gpu_go_through_the_cpu(pair) -> None:
    rank0, rank1 = pair
    sent = torch.arange(4.0, device="cuda")
    rank1.send(sent, dst=0)
    into = torch.zeros(4, device="cuda")
    assert rank0.recv(into, src=1, timeout=5) is into and torch.equal(into, sent)
    other = threading.Thread(target=rank1.all_reduce, args=(torch.ones(4),))
    other.start()
    result = rank0.all_reduce(sent)
    other.join()
    assert result.device == sent.device and torch.equal(result, sent + 1)


def _not_dense(rank: int, port: int) -> list[str]:
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=30)
    refused = []

    def refuse(call) -> None:
        try:
            call()
        except TypeError as exc:
            refused.append(str(exc))
        else:
            raise AssertionError("expected a TypeError")

    if rank == 0:
        refuse(lambda: group.send(torch.arange(3.0).to_sparse(), dst=1))
        refuse(lambda: group.send(torch.empty(3, device="meta"), dst=1))
        group.send(torch.ones(3), dst=1)
        group.broadcast(torch.full((2,), 7.0), src=0)
        got = []
    else:
        refuse(lambda: group.recv(torch.zeros(3).to_sparse(), src=0))
        refuse(lambda: group.recv(torch.zeros(1).expand(3), src=0))
        refuse(lambda: group.broadcast(torch.nested.nested_tensor([torch.zeros(2)]), src=0))
        # nothing was sent by the refused sends, nothing consumed by the refused receives
        got = [group.recv(torch.empty(3), src=0, timeout=30).tolist()]
        got.append(group.broadcast(torch.empty(2), src=0, timeout=30).tolist())
    group.barrier(timeout=30)
    return refused + [str(g) for g in got]


def test_tensors_that_are_not_dense_are_refused_before_anything_moves() -> None:
    sender, receiver = run_ranks(_not_dense, 2, free_port(), timeout=60)
    assert sender == [
        "a sparse_coo tensor cannot be sent: only dense tensors travel",
        "a meta tensor cannot be sent: it has no elements",
    ]
    assert receiver == [
        "a sparse_coo tensor cannot be received into: only dense tensors travel",
        "a tensor whose elements share memory (a stride of 0, as after expand()) cannot be "
        "received into: pass a tensor of its own",
        "a nested tensor cannot be received into: only dense tensors travel",
        "[1.0, 1.0, 1.0]",
        "[7.0, 7.0]",
    ]
