"""NFSWorkspace in one process, plus argument checks and one-rank gathers (no group needed)."""

from __future__ import annotations

import io
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

from bridge_py.distributed.distribute import (
    NFSWorkspace,
    gather_configs,
    gather_tensors,
    get_configs_parallel,
    get_tensors_parallel,
)
from bridge_py.distributed.errors import DistributedError
from tests.distributed.saved_files import deflated


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp"))


def test_write_then_read_from_any_rank(tmp_path: Path) -> None:
    writer = NFSWorkspace(tmp_path / "ws", rank=3)
    assert writer.is_initialized and writer.rank == 3
    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int8)}
    writer.write_configs_and_weights({"kind": "linear", "shape": [2, 3], "bias": None}, weights)
    state_file = tmp_path / "ws" / "rank_3_state.pth"
    assert state_file.is_file() and _leftovers(tmp_path / "ws") == []
    # The file is a plain torch state (loads with weights_only) ...
    raw = torch.load(state_file, weights_only=True)
    assert raw["config"]["kind"] == "linear" and torch.equal(raw["weight"]["w"], weights["w"])
    # ... that another rank's workspace on the same directory reads.
    reader = NFSWorkspace(tmp_path / "ws", rank=0)
    config, got = reader.read_configs_and_weights_from_rank(3)
    assert config == {"kind": "linear", "shape": [2, 3], "bias": None}
    assert got is not None and got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    assert reader.read_configs_and_weights_from_rank(7) == (None, None)


def test_default_rank_is_zero_without_torch_distributed(tmp_path: Path) -> None:
    workspace = NFSWorkspace(str(tmp_path))
    assert workspace.rank == 0
    workspace.write_configs_and_weights({}, {})
    assert (tmp_path / "rank_0_state.pth").is_file()


def test_reinitialisation_cleans_this_rank_state_only(tmp_path: Path) -> None:
    NFSWorkspace(tmp_path, rank=1).write_configs_and_weights({"old": True}, {})
    NFSWorkspace(tmp_path, rank=2).write_configs_and_weights({"other": True}, {})
    (tmp_path / ".rank_1_state.pth.abc123.tmp").write_bytes(b"half a file")  # a crashed write
    workspace = NFSWorkspace(tmp_path, rank=1)
    assert workspace.read_configs_and_weights_from_rank(1) == (None, None)
    assert _leftovers(tmp_path) == []
    assert workspace.read_configs_and_weights_from_rank(2)[0] == {"other": True}


def test_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    writer, reader = NFSWorkspace(tmp_path, rank=1), NFSWorkspace(tmp_path, rank=0)
    writer.write_configs_and_weights({"i": -1}, {"w": torch.full((1 << 16,), -1.0)})
    rounds, seen, errors = 20, [], []
    done = threading.Event()

    def read_loop() -> None:
        try:
            while not done.is_set():
                config, weights = reader.read_configs_and_weights_from_rank(1)
                assert config is not None and weights is not None
                assert weights["w"].numel() == 1 << 16
                assert bool((weights["w"] == config["i"]).all())
                seen.append(config["i"])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=read_loop)
    thread.start()
    for i in range(rounds):
        writer.write_configs_and_weights({"i": i}, {"w": torch.full((1 << 16,), float(i))})
    done.set()
    thread.join(30)
    assert errors == [] and seen
    assert _leftovers(tmp_path) == []


class _Payload:
    def __reduce__(self) -> tuple:
        return (print, ("this must never run",))


def test_reading_executes_no_pickled_code(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path, rank=0)
    torch.save({"config": {}, "weight": {"x": _Payload()}}, tmp_path / "rank_4_state.pth")
    with pytest.raises(pickle.UnpicklingError, match=r"rank 4.* does not unpickle"):
        workspace.read_configs_and_weights_from_rank(4)


@pytest.mark.timeout(60)
def test_a_state_file_that_is_no_file_is_refused_unread(tmp_path: Path) -> None:
    # Another rank's state file is its word, in a folder others may write: a link out of
    # the workspace was read (and a gather's reader deleted what it pointed at), a FIFO
    # blocked the reader forever, a directory raised a bare IsADirectoryError.
    workspace = NFSWorkspace(tmp_path / "ws", rank=0)
    outside = tmp_path / "outside.pth"
    torch.save({"config": {"secret": 1}, "weight": {}}, outside)
    state = tmp_path / "ws" / "rank_4_state.pth"
    cases = {
        "link": lambda: state.symlink_to(outside),
        "FIFO": lambda: os.mkfifo(state, 0o600),
        "directory": lambda: state.mkdir(),
    }
    for kind, make in cases.items():
        make()
        try:
            with pytest.raises(DistributedError, match=r"refused the state file of rank 4"):
                workspace.read_configs_and_weights_from_rank(4)
        finally:
            state.rmdir() if kind == "directory" else state.unlink()
    assert outside.exists()
    torch.save([1, 2], state)
    with pytest.raises(DistributedError, match="holds no dict of 'config' and 'weight'"):
        workspace.read_configs_and_weights_from_rank(4)


def test_a_state_file_that_would_inflate_is_refused_before_it_does(tmp_path: Path) -> None:
    # A 70 KB state file whose pickle is deflated became a 64 MiB str in the reader
    # (torch.load inflates what torch.save never compresses).
    workspace = NFSWorkspace(tmp_path, rank=0)
    saved = io.BytesIO()
    torch.save({"config": {"x": "a" * (64 << 20)}, "weight": {}}, saved)
    (tmp_path / "rank_4_state.pth").write_bytes(deflated(saved.getvalue()))
    with pytest.raises(pickle.UnpicklingError, match=r"rank 4.* its member '.*' is compressed"):
        workspace.read_configs_and_weights_from_rank(4)


def test_uninitialized_workspace() -> None:
    workspace = NFSWorkspace()
    assert not workspace.is_initialized
    with pytest.raises(ValueError, match="not initialized"):
        workspace.write_configs_and_weights({}, {})
    with pytest.raises(ValueError, match="not initialized"):
        workspace.read_configs_and_weights_from_rank(0)


def test_one_rank_gathers_without_a_group() -> None:
    tensor = torch.ones(3)
    with get_tensors_parallel(tensor, [0]) as got:
        assert len(got) == 1 and got[0] is tensor
    assert torch.equal(gather_tensors(tensor, [0])[0], tensor)
    with get_configs_parallel({"a": 1}, [0], None) as configs:
        assert configs == [{"a": 1}]
    assert gather_configs(None, [0], None) == [None]


@pytest.mark.parametrize(
    ("ranks", "error"),
    [([], ValueError), ([0, 0], ValueError), ([1], ValueError), ([True], TypeError)],
)
def test_bad_ranks_are_rejected(ranks: list, error: type) -> None:
    with pytest.raises(error), get_tensors_parallel(torch.ones(1), ranks):
        pass


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(TypeError, match="group"), get_tensors_parallel(torch.ones(1), [0], "g"):
        pass
    with pytest.raises(TypeError, match="Tensor"), get_tensors_parallel([1.0], [0]):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="timeout"):
        gather_tensors(torch.ones(1), [0], None, timeout=0)
