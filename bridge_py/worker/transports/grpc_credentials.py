"""Who may use a gRPC worker: its token (from the environment or a private file) or its socket.

A gRPC worker serves nobody without a credential. On TCP that is a shared token,
taken from ``$VLLM_BRIDGE_TOKEN`` or from a file readable by its owner only, and
never from the command line (``/proc/*/cmdline`` is world-readable). With neither,
one is generated and written to a new 0600 file whose path (never the token) is
printed. On a Unix domain socket the socket itself is the credential: it is created
0600, so only this user (and root) can connect.

This module only finds, checks and writes tokens and prepares socket paths; the
server (``grpc.py``) enforces them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from bridge_py.distributed.shm.wait import process_alive

TOKEN_ENV = "VLLM_BRIDGE_TOKEN"
UNIX_PREFIX = "unix:"
# 256 random bits, URL-safe: printable ASCII, so it fits an HTTP/2 header value.
_TOKEN_BYTES = 32
_MAX_TOKEN_CHARS = 4096


class CredentialError(ValueError):
    """A token or socket that cannot be used as configured (the message says why)."""


@dataclass(frozen=True, slots=True)
class Token:
    """The token a server requires, and where it came from.

    ``written_to`` is the file a generated token was written to (``None`` when the
    token was given); ``temporary`` says that file is the server's own, removed when
    the process exits.
    """

    value: str
    source: str
    written_to: Path | None = None
    temporary: bool = False


def check_token(text: str, source: str) -> str:
    """``text`` without surrounding whitespace, if it can serve as a token; else raise."""
    token = text.strip()
    if not token:
        raise CredentialError(f"the token from {source} is empty")
    if len(token) > _MAX_TOKEN_CHARS:
        raise CredentialError(f"the token from {source} is over {_MAX_TOKEN_CHARS} characters")
    if not (token.isascii() and token.isprintable()):
        raise CredentialError(
            f"the token from {source} must be printable ASCII (it is sent as an HTTP/2 header)"
        )
    return token


def read_token_file(path: Path) -> str:
    """The token in ``path``, a regular file of this user (or root) that nobody else can read.

    The checks run on the opened file (``fstat``), so the file cannot be swapped
    between the check and the read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise CredentialError(f"cannot read token file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CredentialError(f"token file {path} is not a regular file")
        if info.st_uid not in (os.geteuid(), 0):
            raise CredentialError(
                f"token file {path} belongs to uid {info.st_uid}, not to this user "
                f"(uid {os.geteuid()}) or root"
            )
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise CredentialError(
                f"token file {path} has mode {mode:04o}: group and others must have no "
                f"access to it (chmod 600 {path})"
            )
        data = file.read(_MAX_TOKEN_CHARS + 2)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise CredentialError(f"the token from {path} must be printable ASCII") from None
    return check_token(text, str(path))


def write_new_token(path: Path) -> str:
    """Generate a token and write it to ``path``, a new file (0600); return the token.

    ``O_CREAT | O_EXCL | O_NOFOLLOW``: an existing file or link at ``path`` is never
    written through.
    """
    token = secrets.token_urlsafe(_TOKEN_BYTES)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise CredentialError(f"cannot create token file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)
        file.write(token + "\n")
    return token


_DIRECTORY = "vllm-bridge-grpc-"


def _private_directory() -> Path:
    """A new 0700 directory: under ``$XDG_RUNTIME_DIR`` when set, else the temp dir.

    Its name carries this process's PID namespace and PID, so that the next worker can
    tell the directories of workers killed before their exit hook ran (SIGKILL) and
    removes them first (:func:`_remove_stale`)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    parent = Path(runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir())
    namespace = _pid_namespace()
    _remove_stale(parent, namespace)
    prefix = f"{_DIRECTORY}{namespace}-{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def _pid_namespace() -> str:
    """The inode of this process's PID namespace ("0" where it cannot be read)."""
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "0"


def _remove_stale(parent: Path, namespace: str) -> None:
    """Remove the token directories in ``parent`` that this user's workers of this PID
    namespace left when they were killed: those whose worker's PID no longer runs (a
    directory that is not exactly what a worker makes is left alone)."""
    for entry in parent.glob(f"{_DIRECTORY}{namespace}-*-*"):
        pid = entry.name.split("-")[4]
        with contextlib.suppress(OSError, ValueError):
            info = entry.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            if process_alive(int(pid)):
                continue
            token = entry / "token"
            if os.path.lexists(token) and stat.S_ISREG(token.lstat().st_mode):
                token.unlink()
            entry.rmdir()  # fails, and so keeps it, if anything else is in it


def remove_generated(token: Token) -> None:
    """Remove the file of a ``temporary`` token and its private directory (at exit).

    A token given, or written to ``--token-file``, is left alone: that file is the
    user's, for clients (and the next start) to read.
    """
    if not token.temporary or token.written_to is None:
        return
    with contextlib.suppress(OSError):
        token.written_to.unlink()
    with contextlib.suppress(OSError):
        token.written_to.parent.rmdir()


def find_token(
    token_file: Path | None, environ: Mapping[str, str], *, required: bool
) -> Token | None:
    """The token a server must require, by the documented rules.

    1. ``$VLLM_BRIDGE_TOKEN`` (non-empty) is the token; giving ``token_file`` too is
       an error, so that which one is in force is never a guess.
    2. ``token_file`` that exists holds the token (see :func:`read_token_file`).
    3. ``token_file`` that does not exist is created with a generated token, and kept.
    4. Neither: when ``required`` (TCP), a token is generated into a new file in a
       private directory (``remove_generated`` removes it at exit); else (a Unix
       socket) no token is required.
    """
    from_env = environ.get(TOKEN_ENV, "")
    if from_env:
        if token_file is not None:
            raise CredentialError(
                f"both ${TOKEN_ENV} and --token-file {token_file} are set: give the token one way"
            )
        return Token(check_token(from_env, f"${TOKEN_ENV}"), f"${TOKEN_ENV}")
    if token_file is not None:
        if os.path.lexists(token_file):
            return Token(read_token_file(token_file), str(token_file))
        return Token(write_new_token(token_file), "generated", written_to=token_file)
    if not required:
        return None
    path = _private_directory() / "token"
    return Token(write_new_token(path), "generated", written_to=path, temporary=True)


# -- Unix domain sockets ----------------------------------------------------------------


def unix_path(address: str) -> Path | None:
    """The socket path of a ``unix:PATH`` address; ``None`` for a TCP address.

    Abstract sockets (``unix-abstract:``) are refused: they have no file permissions,
    so any local process could connect.
    """
    if address.startswith("unix-abstract:"):
        raise CredentialError(
            f"{address}: abstract Unix sockets have no permissions; use unix:PATH"
        )
    if not address.startswith(UNIX_PREFIX):
        return None
    path = address[len(UNIX_PREFIX) :]
    if path.startswith("//"):  # unix:///abs/path, the URI form
        path = path[2:]
    if not path:
        raise CredentialError(f"{address}: expected unix:PATH")
    return Path(path)


def clear_socket_path(path: Path) -> None:
    """Make ``path`` free for a new socket, removing only a dead socket of this user.

    Anything else there (a file, a directory, another user's socket, a socket a
    server still listens on) is refused: grpc would otherwise unlink a live socket
    and take its place.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise CredentialError(f"{path} exists and is not a socket: refusing to replace it")
    if info.st_uid != os.geteuid():
        raise CredentialError(
            f"{path} is a socket of uid {info.st_uid}, not of this user: refusing to replace it"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno != errno.ECONNREFUSED:
            raise CredentialError(f"cannot check socket {path}: {exc.strerror}") from None
    else:
        raise CredentialError(f"{path} is the socket of a running server: refusing to take it")
    finally:
        probe.close()
    path.unlink()


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files created inside get no group or other permissions (0600 for a socket).

    The umask is per process: this is for the moment at startup when the socket is
    bound, so that it is never reachable with wider permissions.
    """
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def check_private_socket(path: Path) -> None:
    """Raise unless ``path`` is a socket of this user with mode 0600."""
    info = os.lstat(path)
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid() or mode != 0o600:
        raise CredentialError(f"socket {path} has mode {mode:04o}, not 0600 of this user")
