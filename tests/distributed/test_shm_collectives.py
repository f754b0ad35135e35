"""Shared-memory collectives of CpuCommunicator on 2 and 4 real processes.

Each rank builds every rank's input itself (seeded), so results are compared exactly with
the rank-ordered sum computed locally, and with gloo's result in the same run (plain
``torch.distributed`` on the group's gloo group): bit for bit on 2 ranks; on 4 ranks exactly
for integers and within a few units in the last place for floats (gloo's ring adds in
another order). Every dtype the communicator supports (all-gather, reduce-scatter and
broadcast too), sizes 0, 1, odd, 4 KiB, 4 MiB and larger than the buffer (chunked), 500
back-to-back all-reduces, the fallback to gloo, a killed rank (the creator of the segment),
and a timing table (printed, run with ``-s``; or
``python -m tests.distributed.test_shm_collectives``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bridge_py.distributed.device_communicators import CollectiveMismatchError, CpuCommunicator
from bridge_py.distributed.device_communicators.agreement import CHECK_ENV
from bridge_py.distributed.device_communicators.shm_collectives import (
    BYTES_ENV,
    ENABLE_ENV,
    NAME_PREFIX,
    TIMEOUT_ENV,
)
from bridge_py.distributed.device_communicators.wire_dtypes import for_reduction
from bridge_py.distributed.errors import DistributedError, PeerGoneError
from bridge_py.distributed.parallel_state import GroupCoordinator
from tests.distributed.harness import free_port, join_gloo, run_ranks, run_ranks_with_small_dev_shm

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
    torch.complex64,
]
SMALL_BUFFER = 1 << 20  # data area of the "small" communicators: chunking is exercised


def _segments() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith(NAME_PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    """No segment of ours survives a test (each is unlinked as soon as it is set up)."""
    before = _segments()
    yield
    assert _segments() - before == set()


def _init(rank: int, port: int, world_size: int) -> None:
    join_gloo(rank, port, world_size)


def _communicator(env: dict[str, str]) -> CpuCommunicator:
    """A CpuCommunicator on a new gloo group of the world, built with ``env`` set."""
    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return CpuCommunicator(group, unique_name="shm-test")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _calls(comm: CpuCommunicator, op: str) -> int:
    """How many ``op`` collectives ``comm`` ran over shared memory (0 on gloo)."""
    return 0 if comm.shm is None else comm.shm.calls[op]


# dtypes gloo sums as they are (uint64 as int64's bits), so the sum goes into the input
SUMMED_AS_IS = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32,
    torch.int64, torch.uint8, torch.uint64, torch.complex64, torch.complex128,
}  # fmt: skip


def make(rank: int, dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input: random, full range for 8-bit integers (their sums wrap)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.rand(numel, generator=gen) < 0.3
    if dtype.is_floating_point or dtype.is_complex:
        wide = torch.complex64 if dtype.is_complex else torch.float32
        return torch.randn(numel, generator=gen, dtype=wide).to(dtype)
    low, high = {torch.int8: (-128, 128), torch.uint8: (0, 256)}.get(dtype, (-1000, 1000))
    return torch.randint(low, high, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def ordered_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``((t0 + t1) + t2) + ...`` in the tensors' dtype; a logical OR for bool."""
    if tensors[0].dtype == torch.bool:
        return torch.stack(tensors).any(dim=0)
    out = tensors[0] + tensors[1]
    for tensor in tensors[2:]:
        out += tensor
    return out


def gloo_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over ``group`` as plain gloo computes it (dtypes adapted as the communicator)."""
    wire, restore = for_reduction(tensor, "gloo")
    wire = wire.clone()
    dist.all_reduce(wire, group=group)
    return restore(wire).reshape(tensor.shape)


def close_to_gloo(actual: torch.Tensor, gloo: torch.Tensor, world_size: int, what: str) -> None:
    """Exact for integers and 2 ranks; otherwise a few rounding steps of the dtype."""
    if world_size == 2 or not (actual.dtype.is_floating_point or actual.dtype.is_complex):
        assert torch.equal(actual, gloo), f"{what}: differs from gloo"
        return
    if actual.dtype.is_complex:
        actual, gloo = torch.view_as_real(actual), torch.view_as_real(gloo)
    eps = torch.finfo(actual.dtype).eps
    scale = gloo.abs().to(torch.float64) + 1.0
    diff = (actual.to(torch.float64) - gloo.to(torch.float64)).abs()
    bound = (world_size * eps) * scale
    assert bool((diff <= bound).all()), f"{what}: {float((diff / scale).max())} > {world_size}eps"


# ------------------------------------------------------------------------ every dtype


def _sizes(dtype: torch.dtype) -> list[int]:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return [0, 1, 4096 // itemsize, 333_333, (4 << 20) // itemsize]


def _all_dtypes(rank: int, port: int, world_size: int) -> dict[str, int]:
    torch.set_num_threads(1)
    _init(rank, port, world_size)
    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="tp")
    comm = g.device_communicator
    assert isinstance(comm, CpuCommunicator) and comm.shm is not None
    assert comm.shm.name.lstrip("/") not in os.listdir("/dev/shm"), "segment not unlinked"
    small = _communicator({BYTES_ENV: str(SMALL_BUFFER)})
    assert small.shm is not None and small.shm.slot_bytes < (4 << 20) // world_size
    seed = 0
    for dtype in DTYPES:
        sizes = _sizes(dtype)
        if dtype not in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            sizes = sizes[:-1]  # 4 MiB once per kind of element (keeps the run short)
        for numel in sizes:
            seed += 1
            inputs = [make(r, dtype, numel, seed) for r in range(world_size)]
            mine = inputs[rank]
            expected = ordered_sum(inputs) if numel else mine.clone()
            gloo = gloo_sum(mine, g.cpu_group) if numel else expected
            what = f"all_reduce {dtype} x{numel}"
            for which in (g, small):
                given = mine.clone()
                actual = which.all_reduce(given)
                assert actual.dtype == dtype and actual.shape == mine.shape, what
                assert torch.equal(actual, expected), f"{what}: not the rank-ordered sum"
                close_to_gloo(actual, gloo, world_size, what)
                # as vLLM's CPU communicator: summed into the input where it can hold it
                assert (actual is given) == (numel > 0 and dtype in SUMMED_AS_IS), what
                if actual is not given:
                    assert torch.equal(given, mine), f"{what}: the input was modified"
        # all-gather and reduce-scatter go through shared memory too
        numel = 5 * world_size
        seed += 1
        inputs = [make(r, dtype, numel, seed).reshape(5, world_size) for r in range(world_size)]
        gathered = small.all_gather(inputs[rank], dim=0)
        assert torch.equal(gathered, torch.cat(inputs, dim=0)), f"all_gather {dtype}"
        scattered = small.reduce_scatter(inputs[rank], dim=-1)
        assert torch.equal(scattered, ordered_sum(inputs)[:, rank : rank + 1]), f"rs {dtype}"
        # and broadcast, here into a non-contiguous tensor (a transposed view)
        got = small.broadcast(inputs[rank].clone().t(), src=world_size - 1)
        assert torch.equal(got, inputs[-1].t()), f"broadcast {dtype}"
    # a 4 MiB all-gather and reduce-scatter through a buffer smaller than them
    big = [make(r, torch.float32, 1 << 20, 7) for r in range(world_size)]
    assert torch.equal(small.all_gather(big[rank], dim=0), torch.cat(big))
    part = (1 << 20) // world_size
    reduced = small.reduce_scatter(big[rank], dim=0)
    assert torch.equal(reduced, ordered_sum(big)[rank * part : (rank + 1) * part])
    assert torch.equal(small.broadcast(big[rank].clone(), src=1), big[1])
    counts = {
        "all_reduce": _calls(comm, "all_reduce"),
        "small_all_reduce": _calls(small, "all_reduce"),
        "all_gather": _calls(small, "all_gather"),
        "reduce_scatter": _calls(small, "reduce_scatter"),
        "broadcast": _calls(small, "broadcast"),
    }
    small.destroy()
    g.destroy()
    dist.destroy_process_group()
    return counts


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_dtype_and_size_matches_gloo(world_size: int) -> None:
    results = run_ranks(_all_dtypes, world_size, free_port(), world_size, timeout=170)
    for counts in results:
        # zero-size all-reduces only run the agreement: 11 dtypes x 3 or 4 non-empty sizes
        assert counts["all_reduce"] == counts["small_all_reduce"] == 37, counts
        assert counts["all_gather"] == 12 and counts["reduce_scatter"] == 12, counts
        assert counts["broadcast"] == 12, counts


# ------------------------------------------------------------------ many in a row


def _many(rank: int, port: int, world_size: int) -> int:
    torch.set_num_threads(1)  # 4 ranks share 2 cores here: no intra-op threads on top
    _init(rank, port, world_size)
    comm = _communicator({BYTES_ENV: str(SMALL_BUFFER)})
    assert comm.shm is not None
    ramp = torch.arange(70_000, dtype=torch.float32)
    for i in range(500):
        numel = (1 + i % 7) * 10_000  # 40 KB .. 280 KB: both the direct and the RS/AG path
        value = ramp[:numel] + (rank * 1000 + i)
        expected = world_size * ramp[:numel] + sum(r * 1000 + i for r in range(world_size))
        out = comm.all_reduce(value)
        assert torch.equal(out, expected), f"all-reduce {i} of {numel} differs"
        if i % 50 == 0:  # interleave other collectives over the same buffer
            got = comm.all_gather(torch.full((3,), float(rank + i)), dim=0)
            assert got.tolist() == [float(r + i) for r in range(world_size) for _ in range(3)]
    calls = _calls(comm, "all_reduce")
    comm.destroy()
    dist.destroy_process_group()
    return calls


@pytest.mark.parametrize("world_size", [2, 4])
def test_500_consecutive_all_reduces_do_not_race(world_size: int) -> None:
    assert run_ranks(_many, world_size, free_port(), world_size, timeout=120) == [500] * world_size


def _pieces(rank: int, port: int, world_size: int) -> list[tuple[str, int, bool]]:
    """(where the rank runs, torch threads, whether a 4 MiB op is left whole for them)."""
    _init(rank, port, world_size)
    big = torch.zeros(1 << 20)
    total = float(sum(range(world_size)))
    allowed = sorted(os.sched_getaffinity(0))
    seen = []
    for where, cpus in (
        ("anywhere", allowed),  # every rank may run on every CPU: they share them all
        ("first two", allowed[:2]),  # as in a container of 2 CPUs: shared all the same
        ("bound", [allowed[rank % len(allowed)]]),  # one CPU each (shared past 2 ranks)
    ):
        os.sched_setaffinity(0, cpus)
        comm = _communicator({})
        assert comm.shm is not None
        for threads in (len(cpus) + 1, 1):
            torch.set_num_threads(threads)
            seen.append((where, threads, comm.shm.elementwise.piece(big) == big.numel()))
            assert torch.equal(comm.all_reduce(big + rank), torch.full_like(big, total))
        comm.destroy()
    dist.destroy_process_group()
    return seen


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_use_torch_threads_only_where_they_have_cpus_of_their_own(world_size: int) -> None:
    # A rank's intra-op threads would take CPUs from the rank it waits for: a 4 MiB
    # all-reduce of 2 ranks on 2 CPUs took 12 ms with torch's default 2 threads each and
    # 1 ms without (bench/README.md). Long ops use the threads only where there is a CPU
    # for each of them (threads x ranks that may run on the rank's CPUs <= those CPUs),
    # and one thread has nothing to cut an op for.
    allowed = len(os.sched_getaffinity(0))
    for seen in run_ranks(_pieces, world_size, free_port(), world_size, timeout=120):
        assert seen == [
            ("anywhere", allowed + 1, False),  # more threads than CPUs: single-thread pieces
            ("anywhere", 1, True),
            ("first two", 3, False),
            ("first two", 1, True),
            ("bound", 2, False),
            ("bound", 1, True),
        ]


# ------------------------------------------------- conjugate and negative views


def _lazy_views(rank: int, port: int) -> list[str]:
    """Each collective given tensors whose elements are not their values: a conjugate
    view (``z.conj()``) and a negative one (``z.conj().imag``), on shared memory and on
    gloo, with tensors past a piece (100,000 elements) and small ones."""
    torch.set_num_threads(1)
    _init(rank, port, 2)
    failures = []
    for name, comm in (("shm", _communicator({})), ("gloo", _communicator({ENABLE_ENV: "0"}))):
        assert (comm.shm is not None) == (name == "shm")
        for n in (5, 100_000):
            ramp = torch.arange(n, dtype=torch.float32)
            z = [torch.complex(ramp + r, ramp * (r + 2)) for r in range(2)]
            received = torch.zeros(n, dtype=torch.complex64)  # rank 1: into its conjugate
            conj, neg = z[rank].conj(), z[rank].conj().imag
            into = z[0].clone() if rank == 0 else received.conj()
            cases = [
                ("all_reduce of a conjugate view", "all_reduce", (conj,), (z[0] + z[1]).conj()),
                ("all_reduce of a negative view", "all_reduce", (neg,), -(z[0] + z[1]).imag),
                ("all_gather of a conjugate view", "all_gather", (conj, 0), torch.cat(z).conj()),
                ("broadcast into a conjugate view", "broadcast", (into, 0), z[0]),
            ]
            for what, op, args, expected in cases:
                try:
                    got = getattr(comm, op)(*args)
                except Exception as exc:  # the failure is the finding: report it
                    failures.append(f"{name} {what} x{n}: {type(exc).__name__}: {exc}")
                    continue
                if not torch.equal(got.resolve_conj().resolve_neg(), expected.resolve_conj()):
                    failures.append(f"{name} {what} x{n}: wrong values")
            if rank == 1 and not torch.equal(received.conj(), z[0]):
                failures.append(f"{name} broadcast x{n}: the view's memory holds the wrong values")
        comm.destroy()
    dist.destroy_process_group()
    return failures


def test_conjugate_and_negative_views_travel_as_their_values() -> None:
    assert run_ranks(_lazy_views, 2, free_port(), timeout=90) == [[], []]


def _odd_tensors(rank: int, port: int) -> list[str]:
    """Tensors that are not plain dense values, on rank 1 only: a sparse or a nested one
    is refused on every rank at once (rank 0 is told, and does not wait), a tensor that
    requires grad is summed by its values, an expanded one (elements sharing memory) is
    sent but not written into; the group goes on after each."""
    torch.set_num_threads(1)
    _init(rank, port, 2)
    seen = []
    for name, comm in (("shm", _communicator({})), ("gloo", _communicator({ENABLE_ENV: "0"}))):
        plain = torch.arange(8.0)
        odd = {
            "sparse": plain.to_sparse(),
            "nested": torch.nested.nested_tensor([plain, plain]),
            "grad": plain.clone().requires_grad_(),
            "expanded": torch.ones(1).expand(8),
        }
        for kind, tensor in odd.items():
            for op in ("all_reduce", "all_gather", "broadcast"):
                mine = tensor if rank == 1 else plain.clone()  # (all_reduce may sum into it)
                try:
                    got = getattr(comm, op)(*((mine,) if op == "all_reduce" else (mine, 0)))
                    seen.append(f"{name} {kind} {op}: {got.tolist()}")
                except (ValueError, CollectiveMismatchError) as exc:
                    seen.append(f"{name} {kind} {op}: {type(exc).__name__}: {exc}")
                assert torch.equal(comm.all_reduce(plain.clone()), 2 * plain), "the group went on"
        comm.destroy()
    dist.destroy_process_group()
    return seen


def test_tensors_that_are_not_dense_values_are_refused_on_every_rank() -> None:
    ranks = run_ranks(_odd_tensors, 2, free_port(), timeout=90)
    plain, doubled = list(range(8)), [2.0 * i for i in range(8)]
    for rank, seen in enumerate(ranks):
        lines = {line.split(":")[0]: line for line in seen}
        for name in ("shm", "gloo"):
            for kind in ("sparse", "nested"):
                for op in ("all_reduce", "all_gather", "broadcast"):
                    line = lines[f"{name} {kind} {op}"]
                    if rank == 1:
                        assert f"ValueError: {op} on rank 1" in line, line
                        assert f"input_ is a {kind if kind == 'nested' else 'sparse_coo'}" in line
                    else:
                        assert "CollectiveMismatchError" in line and "rank 1" in line, line
            assert lines[f"{name} grad all_reduce"].endswith(str(doubled)), lines
            assert lines[f"{name} grad broadcast"].endswith(str([float(i) for i in plain]))
            assert lines[f"{name} expanded all_reduce"].endswith(str([i + 1.0 for i in plain]))
            broadcast = lines[f"{name} expanded broadcast"]
            if rank == 1:
                assert "input_ cannot be written" in broadcast and "expand()" in broadcast
            else:
                assert "CollectiveMismatchError" in broadcast, broadcast


# ------------------------------------------------------------ fallback and mismatches


def _fallback(rank: int, port: int) -> dict[str, Any]:
    _init(rank, port, 2)
    off = _communicator({ENABLE_ENV: "0"})
    # only rank 1 declines: every rank must fall back, or they would not meet
    half = _communicator({ENABLE_ENV: "0" if rank == 1 else "1"})
    on = _communicator({})
    x = torch.arange(6.0) + rank
    for comm in (off, half, on):
        assert torch.equal(comm.all_reduce(x.clone()), torch.arange(6.0) * 2 + 1)
    result = {
        "off": (off.shm is None, off.dist_module is dist, _calls(off, "all_reduce")),
        "half": (half.shm is None, _calls(half, "all_reduce")),
        "on": (on.shm is not None, _calls(on, "all_reduce")),
    }
    for comm in (off, half, on):
        comm.destroy()
    dist.destroy_process_group()
    return result


def test_fallback_to_gloo_when_disabled_on_any_rank() -> None:
    for result in run_ranks(_fallback, 2, free_port(), timeout=60):
        assert result == {"off": (True, True, 0), "half": (True, 0), "on": (True, 1)}


def _small_dev_shm(rank: int, port: int) -> tuple[bool, list[float]]:
    _init(rank, port, 2)
    comm = _communicator({})
    total = comm.all_reduce(torch.arange(6.0) + rank)
    result = (comm.shm is None, total.tolist())
    comm.destroy()
    dist.destroy_process_group()
    return result


@pytest.mark.timeout(150)
def test_a_dev_shm_too_small_for_the_segment_falls_back_to_gloo() -> None:
    # The 16 MiB segment does not fit in a 4 MiB /dev/shm: rank 0 cannot make it, every
    # rank hears so and sums over gloo (none of them raises, or waits for the others).
    sums = [[True, [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]]] * 2
    assert run_ranks_with_small_dev_shm(_small_dev_shm, 2, "4m") == sums


def _mismatch_unchecked(rank: int, port: int) -> str:
    _init(rank, port, 2)
    comm = _communicator({CHECK_ENV: "0"})
    assert comm.shm is not None and not comm.agreement.enabled
    try:
        comm.all_reduce(torch.ones(4 + rank))
    except CollectiveMismatchError as exc:
        message = str(exc)
    else:
        raise AssertionError("mismatched all-reduce went through")
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), 2.0))  # still in step
    comm.destroy()
    dist.destroy_process_group()
    return message


def test_mismatch_raises_even_with_checks_off() -> None:
    messages = run_ranks(_mismatch_unchecked, 2, free_port(), timeout=60)
    assert messages[0] == messages[1] and "(4,)" in messages[0] and "(5,)" in messages[0]


# ------------------------------------------------------------------- a killed rank


def _victim(port: int) -> None:
    _init(0, port, 2)
    comm = _communicator({})
    assert comm.shm is not None
    for _ in range(50):
        comm.all_reduce(torch.ones(1000))
    os.kill(os.getpid(), signal.SIGKILL)


def _survivor(rank: int, port: int) -> tuple[str, float, int]:
    _init(rank, port, 2)
    comm = _communicator({TIMEOUT_ENV: "60"})
    calls = 0
    start = time.monotonic()
    try:
        while True:
            comm.all_reduce(torch.ones(1000))
            calls += 1
            start = time.monotonic()
    except PeerGoneError as exc:  # the killed rank is seen gone, well before the timeout
        message = str(exc)
    elapsed = time.monotonic() - start
    try:  # the transport stays refused
        comm.all_reduce(torch.ones(1))
    except DistributedError as exc:
        assert "unusable" in str(exc)
    else:
        raise AssertionError("a broken transport ran a collective")
    return message, elapsed, calls


def test_killed_rank_fails_the_others_clearly_and_leaves_no_segment() -> None:
    port = free_port()
    ctx = multiprocessing.get_context(
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    victim = ctx.Process(target=_victim, args=(port,), daemon=True)
    victim.start()
    try:
        [(message, elapsed, calls)] = run_ranks(_survivor, 2, port, ranks=[1], timeout=90)
    finally:
        victim.kill()
        victim.join(10)
    assert victim.exitcode == -signal.SIGKILL
    assert calls == 50
    assert "rank 0" in message and "shm-test" in message and "exited" in message, message
    assert elapsed < 10, f"took {elapsed:.1f} s to notice"


# -------------------------------------------------------------------------- timings


def _timings(rank: int, port: int, repeat: int) -> dict[str, float]:
    torch.set_num_threads(1)
    _init(rank, port, 2)
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="tp")
    os.environ[ENABLE_ENV] = "0"
    try:
        h = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="tp_gloo")
    finally:
        del os.environ[ENABLE_ENV]
    out: dict[str, float] = {}
    for nbytes in (4 << 10, 4 << 20):
        x = torch.randn(nbytes // 4)
        n = repeat if nbytes < (1 << 20) else max(5, repeat // 10)
        out[f"plain gloo all_reduce {nbytes}"] = _median(
            lambda x=x: dist.all_reduce(x.clone(), group=g.device_group), n
        )
        out[f"GroupCoordinator gloo {nbytes}"] = _median(lambda x=x: h.all_reduce(x), n)
        out[f"GroupCoordinator shm {nbytes}"] = _median(lambda x=x: g.all_reduce(x), n)
    g.destroy()
    h.destroy()
    dist.destroy_process_group()
    return out


def _median(fn: Any, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def print_timings(repeat: int) -> None:
    """Median microseconds per all-reduce on 2 ranks (rank 0's view)."""
    table = run_ranks(_timings, 2, free_port(), repeat, timeout=170)[0]
    print(f"\n{'2 ranks, f32, median':<40}{'us':>10}")
    for key, seconds in table.items():
        print(f"{key:<40}{seconds * 1e6:>10.0f}")
    for nbytes in (4 << 10, 4 << 20):
        gloo = table[f"plain gloo all_reduce {nbytes}"]
        shm = table[f"GroupCoordinator shm {nbytes}"]
        print(f"speed-up of shm over plain gloo at {nbytes} B: {gloo / shm:.1f}x")


def test_print_timings() -> None:
    print_timings(100)


if __name__ == "__main__":
    print_timings(400)
