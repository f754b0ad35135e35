"""No credentials, no service: how a gRPC worker gets its token or socket, and refuses the rest.

Every test starts real workers (``python -m bridge_py.worker --grpc ...``) and talks
to them over real sockets.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bridge_py.client import BridgeError, connect
from tests.grpc.conftest import SAMPLE, GrpcWorker
from tests.worker.processes import start_worker, stop_worker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients in this process find no token in the environment."""
    monkeypatch.delenv("VLLM_BRIDGE_TOKEN", raising=False)


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A private directory with a short path (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="bridge-") as name:
        yield Path(name)


def _refused(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Start a worker that must refuse to start: its exit status and stderr."""
    proc = start_worker(
        *args,
        exports=SAMPLE,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={"VLLM_BRIDGE_TOKEN": "", **(env or {})},
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        stop_worker(proc)
    return proc.returncode, err.decode(errors="replace")


def _generated_token_file(log: str) -> Path:
    match = re.search(r"generated token written to (\S+)", log)
    assert match, log
    return Path(match.group(1))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_tcp_worker_without_a_token_makes_one_and_serves_only_its_holders(
    no_env_token: None,
) -> None:
    worker = GrpcWorker(token_env=False)
    try:
        log = worker.log()
        token_file = _generated_token_file(log)
        token = token_file.read_text().strip()
        assert token not in log  # the path is printed, never the token
        assert _mode(token_file) == 0o600 and _mode(token_file.parent) == 0o700
        assert len(token) >= 40  # 256 random bits, URL-safe
        for given in [None, "guess"]:
            with pytest.raises(BridgeError) as info:
                connect(worker.target, token=given)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with connect(worker.target, token_file=token_file) as client:
            assert client.create("Counter", 1).incr() == 2
    finally:
        worker.stop()
    # A token the worker generated for itself goes with it.
    assert not token_file.exists() and not token_file.parent.exists()


def test_a_killed_workers_generated_token_goes_with_the_next_worker(no_env_token: None) -> None:
    killed = GrpcWorker(token_env=False)
    left = _generated_token_file(killed.log())
    killed.proc.send_signal(signal.SIGKILL)  # no exit hook runs
    killed.proc.wait(30)
    killed.stop()
    assert left.exists()  # left behind, as by any SIGKILLed process
    worker = GrpcWorker(token_env=False)
    try:
        own = _generated_token_file(worker.log())
        assert not left.parent.exists()  # removed by the next worker
        assert own.exists() and own.parent != left.parent
    finally:
        worker.stop()


@pytest.mark.parametrize("form", [["--token", "s3cret-on-argv"], ["--token=s3cret-on-argv"]])
def test_a_token_on_the_command_line_is_refused(form: list[str]) -> None:
    status, err = _refused("--grpc", "127.0.0.1:0", *form)
    assert status == 2
    assert "--token is not accepted" in err and "/proc/*/cmdline" in err
    assert "VLLM_BRIDGE_TOKEN" in err and "--token-file" in err
    assert "s3cret-on-argv" not in err


def test_a_token_file_of_the_owner_only_is_used(tmp: Path, no_env_token: None) -> None:
    token_file = tmp / "token"
    token = secrets.token_urlsafe(32)
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    worker = GrpcWorker("--token-file", str(token_file), token_env=False)
    try:
        assert str(token_file) in worker.log() and token not in worker.log()
        with pytest.raises(BridgeError) as info:
            connect(worker.target, token="wrong")
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with connect(worker.target, token=token) as client:
            assert client.ping("hi") == "hi"
    finally:
        worker.stop()
    assert token_file.read_text() == token + "\n"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_others_can_reach_is_refused(tmp: Path, mode: int) -> None:
    token_file = tmp / "token"
    token_file.write_text("s3cret-in-a-file")
    token_file.chmod(mode)
    status, err = _refused("--grpc", "127.0.0.1:0", "--token-file", str(token_file))
    assert status == 2
    assert str(token_file) in err and f"mode {mode:04o}" in err and "chmod 600" in err
    assert "s3cret-in-a-file" not in err


def test_a_missing_token_file_is_created_with_a_generated_token(
    tmp: Path, no_env_token: None
) -> None:
    token_file = tmp / "made-here"
    worker = GrpcWorker("--token-file", str(token_file), token_env=False)
    try:
        assert _generated_token_file(worker.log()) == token_file
        assert _mode(token_file) == 0o600
        with connect(worker.target, token_file=token_file) as client:
            assert client.ping(3) == 3
    finally:
        worker.stop()
    # Written where the user asked: kept for clients and for the next start.
    assert token_file.exists()


def test_a_token_from_both_the_environment_and_a_file_is_refused(tmp: Path) -> None:
    token_file = tmp / "token"
    token_file.write_text("from-file")
    token_file.chmod(0o600)
    status, err = _refused(
        "--grpc", "127.0.0.1:0", "--token-file", str(token_file), env={"VLLM_BRIDGE_TOKEN": "e"}
    )
    assert status == 2 and "give the token one way" in err


def test_a_unix_socket_worker_is_0600_and_serves_its_user(tmp: Path, no_env_token: None) -> None:
    path = tmp / "w.sock"
    old = os.umask(0)  # the worker inherits it: its own umask must make the socket private
    try:
        worker = GrpcWorker("--grpc", f"unix:{path}", token_env=False)
    finally:
        os.umask(old)
    try:
        info = os.lstat(path)
        assert stat.S_ISSOCK(info.st_mode) and _mode(path) == 0o600
        assert info.st_uid == os.geteuid()
        assert "unix:" + str(path) in worker.log()
        with connect(f"unix:{path}") as client:
            counter = client.create("Counter", 41)
            assert counter.incr() == 42
    finally:
        worker.stop()


def test_a_unix_socket_path_that_is_not_our_dead_socket_is_refused(tmp: Path) -> None:
    # A regular file: left as it is.
    path = tmp / "file.sock"
    path.write_text("keep me")
    status, err = _refused("--grpc", f"unix:{path}")
    assert status == 2 and "exists and is not a socket" in err
    assert path.read_text() == "keep me"

    # A socket a server still listens on: not taken over.
    live = tmp / "live.sock"
    first = GrpcWorker("--grpc", f"unix:{live}", token_env=False)
    try:
        status, err = _refused("--grpc", f"unix:{live}")
        assert status == 2 and "socket of a running server" in err
        with connect(f"unix:{live}") as client:
            assert client.ping("still mine") == "still mine"
    finally:
        first.stop()

    # A dead socket of ours (its server was killed) is replaced.
    dead = tmp / "dead.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(dead))
    listener.close()
    assert stat.S_ISSOCK(os.lstat(dead).st_mode)
    again = GrpcWorker("--grpc", f"unix:{dead}", token_env=False)
    try:
        with connect(f"unix:{dead}") as client:
            assert client.ping(1) == 1
    finally:
        again.stop()


def test_an_abstract_unix_socket_is_refused() -> None:
    status, err = _refused("--grpc", "unix-abstract:bridge-test")
    assert status == 2 and "abstract Unix sockets have no permissions" in err
