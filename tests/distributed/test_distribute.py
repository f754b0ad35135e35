"""get_tensors_parallel / get_configs_parallel with real processes, groups and /dev/shm."""

from __future__ import annotations

import enum
import io
import json
import multiprocessing
import os
import pickle
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge_py.distributed import (
    StatelessProcessGroup,
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from bridge_py.distributed.distribute import (
    gather_configs,
    gather_tensors,
    get_configs_parallel,
    get_tensors_parallel,
)
from bridge_py.distributed.distribute.codec import CONFIGS, TENSORS
from bridge_py.distributed.distribute.group import CallId, as_group_sync
from bridge_py.distributed.distribute.nfs import NfsChannel
from bridge_py.distributed.distribute.shm import ShmChannel, segment_name
from bridge_py.distributed.errors import (
    CollectiveMismatchError,
    DistributedError,
    SharedMemoryError,
)
from bridge_py.distributed.shm import segments
from bridge_py.distributed.shm.wait import pid_namespace
from tests.distributed.harness import free_port, run_ranks, run_ranks_with_small_dev_shm
from tests.distributed.saved_files import deflated

SHM = Path("/dev/shm")
TIMEOUT = 20.0  # barrier timeout of the gathers (StatelessProcessGroup) in the happy paths


def _segments() -> set[str]:
    if not SHM.is_dir():
        return set()
    return {n for n in os.listdir(SHM) if n.startswith(segments.NAME_PREFIX) and "_gather" in n}


@pytest.fixture(autouse=True)
def no_segment_left() -> Any:
    """Every test of this module must leave /dev/shm as it found it."""
    before = _segments()
    yield
    assert _segments() - before == set()


def _group(kind: str, rank: int, world_size: int, port: int) -> Any:
    if kind == "spg":
        return StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=30)
    return stateless_init_torch_distributed_process_group(
        "127.0.0.1", port, rank, world_size, backend="gloo", timeout=30
    )


def _release(kind: str, group: Any) -> None:
    if kind == "gloo":
        stateless_destroy_torch_distributed_process_group(group)


# dtype, shape; the tensors of a case differ in values from rank to rank.
CASES = [
    (torch.float32, (2, 3)),
    (torch.bfloat16, (5,)),
    (torch.int64, ()),
    (torch.bool, (2, 2, 2)),
    (torch.float16, (0, 3)),
    (torch.complex64, (3,)),
    (torch.uint8, (4, 1)),
]


def _tensor(rank: int, case: int) -> torch.Tensor:
    dtype, shape = CASES[case]
    values = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64) + 10 * rank
    if dtype == torch.bool:
        return (values.long() % (rank + 2) == 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype).reshape(shape)
    return values.to(dtype).reshape(shape)


def _tensors_job(rank: int, kind: str, port: int, world_size: int, ranks: list[int]) -> list:
    group = _group(kind, rank, world_size, port)
    lengths = []
    for case in range(len(CASES)):
        with get_tensors_parallel(_tensor(rank, case), ranks, group, timeout=TIMEOUT) as got:
            lengths.append(len(got))
            for src, tensor in zip(ranks if got else [], got, strict=True):
                expected = _tensor(src, case)
                assert tensor.dtype == expected.dtype and tensor.shape == expected.shape
                assert torch.equal(tensor, expected), (src, case)
    # Non-contiguous input; gather_tensors returns copies.
    source = torch.arange(12.0).reshape(3, 4).t() + rank
    plain = gather_tensors(source, ranks, group, timeout=TIMEOUT)
    if plain:
        assert [t.tolist() for t in plain] == [(source - rank + r).tolist() for r in ranks]
        assert plain[0] is not source and plain[0].data_ptr() != source.data_ptr()
    lengths.append(len(plain))
    _release(kind, group)
    return lengths


@pytest.mark.parametrize(
    ("kind", "world_size", "ranks"),
    [("spg", 2, [1, 0]), ("gloo", 3, [1, 2]), ("spg", 3, [2, 0, 1])],
    ids=["spg-2-reader1", "gloo-3-rank0-outside", "spg-3-reader2"],
)
def test_tensors(kind: str, world_size: int, ranks: list[int]) -> None:
    results = run_ranks(_tensors_job, world_size, kind, free_port(), world_size, ranks)
    for rank, lengths in enumerate(results):
        assert lengths == [len(ranks) if rank == ranks[0] else 0] * (len(CASES) + 1)


def _config(rank: int) -> dict | None:
    if rank == 0:
        return None
    return {
        "name": f"layer{rank}",
        "nested": {"empty": {}, "none": None, "flags": [True, False], "scale": rank / 4},
        "weight": torch.full((2, rank), float(rank)),
        "shards": (torch.arange(3) * rank, "tp"),
        "views": [torch.arange(10)[rank::3]],
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def _configs_job(
    rank: int, kind: str, port: int, world_size: int, ranks: list[int], workspace: str | None
) -> list[int]:
    group = _group(kind, rank, world_size, port)
    lengths = []
    with get_configs_parallel(_config(rank), ranks, group, workspace, timeout=TIMEOUT) as got:
        lengths.append(len(got))
        for src, config in zip(ranks if got else [], got, strict=True):
            assert _same(config, _config(src)), (src, config)
    plain = gather_configs({"rank": rank}, ranks, group, workspace, timeout=TIMEOUT)
    assert plain == ([{"rank": r} for r in ranks] if rank == ranks[0] else [])
    lengths.append(len(plain))
    _release(kind, group)
    return lengths


@pytest.mark.parametrize("transport", ["shm", "workspace"])
@pytest.mark.parametrize(
    ("kind", "world_size", "ranks"),
    [("spg", 3, [2, 0, 1]), ("gloo", 3, [1, 2])],
    ids=["spg-3-reader2", "gloo-3-rank0-outside"],
)
def test_configs(
    kind: str, world_size: int, ranks: list[int], transport: str, tmp_path: Path
) -> None:
    workspace = str(tmp_path / "ws") if transport == "workspace" else None
    results = run_ranks(_configs_job, world_size, kind, free_port(), world_size, ranks, workspace)
    for rank, lengths in enumerate(results):
        assert lengths == [len(ranks) if rank == ranks[0] else 0] * 2
    if workspace is not None:
        assert list(Path(workspace).iterdir()) == []  # every call's folder is gone


def _body_raises_job(rank: int, port: int, world_size: int) -> str:
    group = _group("spg", rank, world_size, port)
    outcome = "ok"
    try:
        with get_tensors_parallel(torch.ones(3) * rank, [0, 1, 2], group, timeout=TIMEOUT) as got:
            if rank == 1:
                raise ValueError("body failed")
            assert len(got) == (3 if rank == 0 else 0)
    except ValueError as exc:
        outcome = str(exc)
    # The group is still usable: the next gather works.
    assert len(gather_tensors(torch.ones(1), [0, 1, 2], group, timeout=TIMEOUT)) in (0, 3)
    return outcome


def test_body_raising_on_one_rank_still_cleans_up() -> None:
    results = run_ranks(_body_raises_job, 3, free_port(), 3)
    assert results == ["ok", "body failed", "ok"]


def _two_jobs(rank: int, ports: list[int], rounds: int) -> int:
    job, local = divmod(rank, 2)
    group = _group("spg", local, 2, ports[job])
    checked = 0
    for step in range(rounds):
        mine = torch.full((64,), float(1000 * job + 10 * step + local))
        with get_tensors_parallel(mine, [0, 1], group, timeout=TIMEOUT) as got:
            for src, tensor in enumerate(got):
                assert torch.equal(tensor, torch.full((64,), float(1000 * job + 10 * step + src)))
                checked += 1
        configs = gather_configs({"job": job, "src": local}, [0, 1], group, timeout=TIMEOUT)
        assert configs in ([], [{"job": job, "src": 0}, {"job": job, "src": 1}])
    return checked


def test_two_groups_on_one_node_do_not_collide() -> None:
    # Ranks 0, 1 form one job and ranks 2, 3 another, with the same group ranks (0 and 1).
    rounds = 5
    results = run_ranks(_two_jobs, 4, [free_port(), free_port()], rounds)
    assert results == [2 * rounds, 0, 2 * rounds, 0]


def _dying_rank(rank: int, port: int, world_size: int, ranks: list[int], token_file: str) -> None:
    """Take part in a gather up to a point, then get SIGKILLed (no cleanup code runs)."""
    group = _group("spg", rank, world_size, port)
    sync = as_group_sync(group, timeout=3)
    call = sync.agree_call(ranks[0])
    if rank != ranks[0]:  # a writer dies right after writing its segment
        ShmChannel(call).publish(rank, TENSORS.encode(torch.ones(1024)))
    else:  # the reader dies once every writer has written
        sync.barrier()
    Path(token_file).write_text(json.dumps(call))
    os.kill(os.getpid(), signal.SIGKILL)


def _survivor(rank: int, port: int, world_size: int, ranks: list[int]) -> tuple[str, float, str]:
    """``(message, seconds, error class)`` of the failed gather."""
    group = _group("spg", rank, world_size, port)
    start = time.monotonic()
    try:
        with get_tensors_parallel(torch.ones(1024) * rank, ranks, group, timeout=3):
            pass
    except DistributedError as exc:
        return str(exc), time.monotonic() - start, type(exc).__name__
    return "no error", time.monotonic() - start, ""


@pytest.mark.parametrize("dies", ["writer", "reader"])
def test_killed_rank_leaves_no_segment(dies: str, tmp_path: Path) -> None:
    world_size, victim = 3, 2  # rank 0 serves the group's store: it must survive
    ranks = [0, 1, 2] if dies == "writer" else [2, 0, 1]
    port, token_file = free_port(), tmp_path / "token"
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    dying = multiprocessing.get_context(method).Process(
        target=_dying_rank, args=(victim, port, world_size, ranks, str(token_file)), daemon=True
    )
    dying.start()
    try:
        results = run_ranks(_survivor, world_size, port, world_size, ranks, ranks=[0, 1])
    finally:
        dying.join(30)
        if dying.is_alive():
            dying.kill()
    assert dying.exitcode == -signal.SIGKILL
    for message, elapsed, kind in results:
        assert "get_tensors_parallel" in message and "barrier" in message, message
        assert elapsed < 15, elapsed
        # The group's own error class, not a bare DistributedError: a timeout stays one.
        assert kind in (
            "BarrierTimeout",
            "BarrierFailure",
            "BarrierStoreError",
            "PeerGoneError",
            "StoreError",
        ), kind
    # Rank 0 sees rank 2 exit (a barrier over the boards; rank 1 too, once it has failed and
    # left) or times out (over the store); rank 1 too, or it sees rank 0's store go away when
    # rank 0 exits (whatever the socket says then: closed, reset, a short read).
    assert "exited" in results[0][0] or "timed out" in results[0][0], results[0][0]
    assert any(words in results[1][0] for words in ("exited", "timed out", "store error")), results[
        1
    ][0]
    call = CallId(*json.loads(token_file.read_text()))
    assert not [r for r in range(world_size) if (SHM / segment_name(call, r)).exists()]


def _all_die(rank: int, port: int, name_file: str, go_file: str) -> None:
    """A gather of two ranks up to the writer's segment; then the writer is SIGKILLed, and
    the reader too once ``go_file`` exists: no rank is left to remove the segment."""
    sync = as_group_sync(_group("spg", rank, 2, port), timeout=TIMEOUT)
    call = sync.agree_call(0)
    if rank == 1:
        ShmChannel(call).publish(1, TENSORS.encode(torch.ones(1024)))
        Path(name_file).write_text(segment_name(call, 1))
    else:
        until = time.monotonic() + 60
        while not Path(go_file).exists() and time.monotonic() < until:
            time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_segments_of_a_gather_whose_ranks_all_died_are_removed_as_orphans(
    tmp_path: Path,
) -> None:
    """What a gather leaves when every rank is killed names its reader, which has exited:
    ``remove_orphans`` (which every same-node group runs) removes it, and not before."""
    port, name_file, go_file = free_port(), tmp_path / "name", tmp_path / "go"
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    procs = [
        ctx.Process(target=_all_die, args=(r, port, str(name_file), str(go_file)), daemon=True)
        for r in (0, 1)
    ]
    for proc in procs:
        proc.start()
    try:
        procs[1].join(60)
        name = name_file.read_text()
        assert (SHM / name).exists()
        # The writer is gone, the reader is not: the segment may still be read.
        assert name not in segments.remove_orphans() and (SHM / name).exists()
        go_file.touch()
        procs[0].join(60)
        assert [proc.exitcode for proc in procs] == [-signal.SIGKILL] * 2
        assert name in segments.remove_orphans()
        assert not (SHM / name).exists()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()


def _bad_config_job(rank: int, port: int, world_size: int, workspace: str | None) -> str:
    group = _group("spg", rank, world_size, port)
    config = {1: "not a str key"} if rank == 1 else {"rank": rank}
    start = time.monotonic()
    try:
        got = gather_configs(config, [0, 1, 2], group, workspace, timeout=TIMEOUT)
    except (TypeError, DistributedError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = f"got {len(got)}"
    assert time.monotonic() - start < TIMEOUT / 2  # nobody waited for a barrier to time out
    return outcome


@pytest.mark.parametrize("through", ["shm", "nfs"])
def test_a_config_that_cannot_be_written_fails_without_a_hang(through: str, tmp_path: Path) -> None:
    workspace = str(tmp_path) if through == "nfs" else None
    results = run_ranks(_bad_config_job, 3, free_port(), 3, workspace)
    if through == "shm":
        assert results[0].startswith("SharedMemoryError: shared-memory segment "), results[0]
        assert "of rank 1 is missing" in results[0], results[0]
    else:
        assert results[0].startswith("DistributedError: rank 1 left no state file"), results[0]
    assert results[1].startswith("TypeError: config key 1"), results[1]
    assert results[2] == "got 0"


def _coordinator_job(rank: int, port: int) -> list[int]:
    from bridge_py.distributed import parallel_state as ps

    ps.init_distributed_environment(
        world_size=4,
        rank=rank,
        distributed_init_method=ps.get_distributed_init_method("127.0.0.1", port),
        backend="gloo",
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp = ps.get_tp_group()  # global ranks [0, 1] or [2, 3]; group ranks 0 and 1
    lengths = []
    with get_tensors_parallel(torch.tensor([rank]), [1, 0], tp) as got:
        first = tp.ranks[0]
        assert [t.tolist() for t in got] in ([], [[first + 1], [first]])
        lengths.append(len(got))
    # torch.distributed's default group (group=None): ranks are global ranks.
    with get_configs_parallel({"rank": rank}, [3, 1], None) as configs:
        assert configs in ([], [{"rank": 3}, {"rank": 1}])
        lengths.append(len(configs))
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    return lengths


def test_group_coordinator_and_default_group() -> None:
    results = run_ranks(_coordinator_job, 4, free_port())
    assert results == [[0, 0], [2, 0], [0, 0], [2, 2]]


def test_a_truncated_segment_is_a_shared_memory_error() -> None:
    call = CallId(0x5EED, os.getpid(), pid_namespace())
    channel = ShmChannel(call)
    channel.publish(1, TENSORS.encode(torch.ones(1024)))
    path = SHM / segment_name(call, 1)
    os.truncate(path, 100)  # the header is there, the 4 KiB body is not
    with pytest.raises(SharedMemoryError, match=rf"segment '{path.name}' of rank 1 is trunc"):
        channel.take(1, lambda view, what: bytes(view))
    assert not path.exists()  # taken: unlinked even though unreadable


class Evil:
    """Unpickling this creates ``path``: proof that code from a segment ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _hostile_value(kind: str, marker: str) -> list[bytes]:
    """What a hostile rank 1 writes in its segment: something no gather writes."""
    if kind == "pickle":  # a pickle where a tensor is expected
        return [pickle.dumps(Evil(marker))]
    if kind == "shared":  # a good tensor, but anyone may write it
        return TENSORS.encode(torch.ones(2))
    config: Any = {
        "config": {"x": Evil(marker)},  # a config whose pickle calls open()
        "inflating": {"x": "a" * (64 << 20)},  # 64 MiB of one letter, deflated below
        "viewed": {"x": torch.zeros(1).expand(1 << 26)},  # 4 bytes seen as 256 MiB
        "renamed": {"x": _renamed(12)},  # one list named 4,096 times
    }[kind]
    saved = io.BytesIO()
    torch.save(config, saved)
    if kind == "inflating":
        return [deflated(saved.getvalue())]
    return [saved.getvalue()]


def _renamed(depth: int) -> list:
    """A list of two names of one list of two names of ... (``depth`` deep)."""
    inner: list = [1.0]
    for _ in range(depth):
        inner = [inner, inner]
    return inner


def _hostile_writer(rank: int, port: int, kind: str, marker: str) -> str:
    """Rank 0 gathers through the public API; rank 1 puts in its segment what no gather
    writes (``kind``), then joins the gather's two barriers as a failing writer would."""
    group = _group("spg", rank, 2, port)
    if rank == 0:
        configs = kind not in ("pickle", "shared")
        gather: Any = gather_configs if configs else gather_tensors
        try:
            got = gather({"rank": 0} if configs else torch.ones(2), [0, 1], group)
        except DistributedError as exc:
            return f"{type(exc).__name__}: {exc}"
        return f"got {got}"
    sync = as_group_sync(group, timeout=TIMEOUT)
    path = SHM / segment_name(sync.agree_call(0), 1)
    segments.write_once(path.name, _hostile_value(kind, marker))
    if kind == "shared":
        os.chmod(path, 0o666)
    sync.barrier()
    sync.barrier()
    left = path.exists()
    path.unlink(missing_ok=True)
    return f"left: {left}"


# A gather's segment of rank 1, as an error message quotes it.
_SEGMENT_1 = r"'vbspg_[0-9]+_[0-9]+_gather[0-9a-f]+r1'"


@pytest.mark.parametrize("kind", ["pickle", "config", "shared", "inflating", "viewed", "renamed"])
def test_a_hostile_segment_is_refused_unread(kind: str, tmp_path: Path) -> None:
    # ("inflating", "viewed", "renamed": a config of a few KB that would take 64-256 MiB,
    # or one copy per name, in the reader; refused before it grows.)
    marker = tmp_path / "pwned"
    reader, writer = run_ranks(_hostile_writer, 2, free_port(), kind, str(marker))
    assert not marker.exists()  # nothing in the segment was unpickled
    config = rf"CollectiveMismatchError: the value of rank 1 in shared-memory segment {_SEGMENT_1}"
    expected = {
        "pickle": r"CollectiveMismatchError: refused the value of rank 1 in shared-memory "
        rf"segment {_SEGMENT_1}: a tensor was expected, .* not unpickled",
        "config": rf"{config} is not a gathered config: .*Weights only load failed",
        "inflating": rf"{config} is not a gathered config: its member '.*' is compressed",
        "viewed": rf"{config} is not a gathered config: its tensors hold more than the \d+ ",
        "renamed": rf"{config} is not a gathered config: it names one list more than once",
        "shared": rf"SharedMemoryError: shared-memory segment {_SEGMENT_1} of rank 1 is "
        r"refused: .*group or others may write it",
    }[kind]
    assert re.match(expected, reader, re.DOTALL), reader
    # The reader unlinks what it read, and leaves alone a file it must not trust.
    assert writer == f"left: {kind == 'shared'}"


def _hostile_workspace_writer(rank: int, port: int, kind: str, workspace: str, outside: str) -> str:
    """Rank 0 gathers configs through a workspace; rank 1 leaves as its state file what no
    gather writes (``kind``: a link to ``outside``, or a FIFO), then joins the barriers."""
    group = _group("spg", rank, 2, port)
    if rank == 0:
        try:
            got = gather_configs({"rank": 0}, [0, 1], group, workspace, timeout=TIMEOUT)
        except DistributedError as exc:
            return f"{type(exc).__name__}: {exc}"
        return f"got {got}"
    sync = as_group_sync(group, timeout=TIMEOUT)
    folder = NfsChannel(workspace, sync.agree_call(0).token).folder
    folder.mkdir()
    state = folder / "rank_1_state.pth"
    if kind == "link":
        state.symlink_to(outside)
    else:
        os.mkfifo(state, 0o600)
    sync.barrier()
    sync.barrier()
    return "done"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["link", "FIFO"])
def test_a_hostile_state_file_is_refused_unread(kind: str, tmp_path: Path) -> None:
    # A link out of the workspace was read as rank 1's config, and what it pointed at
    # deleted; a FIFO blocked the reader forever.
    outside = tmp_path / "outside.pth"
    outside.write_bytes(CONFIGS.encode({"secret": "outside the workspace"})[0])
    workspace = tmp_path / "ws"
    workspace.mkdir()
    reader, writer = run_ranks(
        _hostile_workspace_writer, 2, free_port(), kind, str(workspace), str(outside)
    )
    assert re.match(
        r"DistributedError: refused the value of rank 1 in .*rank_1_state.pth'", reader
    ), reader
    assert writer == "done"
    assert outside.exists()


def test_a_segment_name_taken_first_is_a_shared_memory_error() -> None:
    # Anyone who sees a gather's segments appear can work out the next rank's name and
    # make it first; the writer raised a bare FileExistsError.
    channel = ShmChannel(CallId(12345, os.getpid(), pid_namespace()))
    taken = SHM / channel.name(1)
    taken.touch(mode=0o600)
    try:
        with pytest.raises(SharedMemoryError, match="of rank 1 exists already"):
            channel.publish(1, [b"x"])
    finally:
        taken.unlink()


def _huge_token(rank: int, port: int) -> str:
    """Rank 0, the reader, sends a gather's id whose token no file name can hold; rank 1
    gathers through the public API."""
    group = _group("spg", rank, 2, port)
    sync = as_group_sync(group, timeout=TIMEOUT)
    if rank == 0:
        sync.broadcast([1 << 1100, os.getpid(), pid_namespace()], 0)
        time.sleep(3)  # it serves the store: stay while rank 1 reads the broadcast
        return "sent"
    try:
        gather_configs({"rank": 1}, [0, 1], group, timeout=TIMEOUT)
    except DistributedError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "gathered"


def test_a_gather_id_out_of_range_is_refused() -> None:
    # The token names the call's files: one of 2**1100 made the writer fail with a bare
    # "File name too long" OSError.
    _, writer = run_ranks(_huge_token, 2, free_port())
    assert re.match(
        r"DistributedError: .*rank 0 sent \[\d+.* where a gather's id belongs", writer
    ), writer


def _saved(value: Any) -> memoryview:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return memoryview(buffer.getvalue())


def test_a_config_is_checked_as_plain_data_on_both_sides() -> None:
    # torch.load(weights_only=True) rebuilds more than a config holds, and a writer's
    # subclass of a scalar (an IntEnum, a str subclass) was saved as its class, which the
    # reader then refused: the writer now saves it as its base type, and the reader checks
    # what it loaded as the writer does.
    class Level(enum.IntEnum):
        HIGH = 2

    class Name(str):
        pass

    sent = {"level": Level.HIGH, "name": Name("x"), "scale": 0.5}
    got = CONFIGS.decode(memoryview(b"".join(CONFIGS.encode(sent))), "sent")
    assert got == {"level": 2, "name": "x", "scale": 0.5}
    assert [type(v) for v in got.values()] == [int, str, float]
    shared = torch.zeros(4)
    for bad in [
        [1, 2, 3],  # not a dict at the root
        {1: "x"},  # a key that is not a str
        {"s": {1, 2}},  # a set
        {"d": torch.float16},  # a dtype
    ]:
        with pytest.raises(CollectiveMismatchError, match="the value of rank 1 is not a gathered"):
            CONFIGS.decode(_saved(bad), "the value of rank 1")
    # Tensors that shared memory in the file come out as tensors of their own.
    got = CONFIGS.decode(_saved({"a": shared[:2], "b": shared[1:3]}), "shared")
    got["a"][1] = 42.0
    assert got["b"][0] == 0.0


def _no_room_job(rank: int, port: int) -> tuple[str, list[float]]:
    group = StatelessProcessGroup.create("127.0.0.1", port, rank=rank, world_size=2)
    try:
        with get_tensors_parallel(torch.full((1 << 20,), float(rank)), [0, 1], group) as got:
            first = str([float(t[0]) for t in got])
    except SharedMemoryError as exc:
        first = str(exc)
    with get_tensors_parallel(torch.full((4,), float(rank)), [0, 1], group) as got:
        after = [float(t[0]) for t in got]
    return first, after


@pytest.mark.timeout(150)
def test_a_value_with_no_room_on_dev_shm_fails_clearly_and_the_next_gather_works() -> None:
    # A 4 MiB tensor on a 3 MiB /dev/shm: the writer says which segment did not fit and
    # why (it raised a bare "[Errno 28] No space left on device"), the reader that the
    # value is missing; neither waits in vain, and the next gather (that fits) works.
    (reader, after0), (writer, after1) = run_ranks_with_small_dev_shm(_no_room_job, 2, "3m")
    assert "of rank 1 is missing: its writer exited, or could not write it" in reader, reader
    assert re.search(r"gather[0-9a-f]+r1': cannot write 41943\d\d bytes on /dev/shm", writer)
    assert "No space left on device" in writer, writer
    assert (after0, after1) == ([0.0, 1.0], [])


def _full_workspace_job(rank: int, port: int) -> tuple[str, list[int]]:
    group = StatelessProcessGroup.create("127.0.0.1", port, rank=rank, world_size=2)
    config = {"rank": rank, "pad": "x" * (3 << 20)}
    try:
        with get_configs_parallel(config, [0, 1], group, "/dev/shm/ws") as got:
            first = str([c["rank"] for c in got])
    except (OSError, DistributedError) as exc:
        first = f"{type(exc).__name__}: {exc}"
    with get_configs_parallel({"rank": rank}, [0, 1], group, "/dev/shm/ws") as got:
        after = [c["rank"] for c in got]
    return first, after


@pytest.mark.timeout(150)
def test_a_full_workspace_names_the_file_that_did_not_fit() -> None:
    # The workspace on a 2 MiB file system (here the namespace's own /dev/shm): the writer's
    # OSError names its state file (it said only "No space left on device"), the reader's
    # error that rank 1 left none; the next gather works.
    (reader, after0), (writer, after1) = run_ranks_with_small_dev_shm(_full_workspace_job, 2, "2m")
    assert reader.startswith("DistributedError: rank 1 left no state file in /dev/shm/ws/")
    state_file = r"'/dev/shm/ws/bp[0-9a-f]+/rank_1_state.pth'"
    assert re.fullmatch(r"OSError: \[Errno 28\] No space left on device: " + state_file, writer)
    assert (after0, after1) == ([0, 1], [])
