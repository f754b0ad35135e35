"""Entry point: ``python -m bridge_py.worker``.

Serves an export table (the shipped one by default) over stdin/stdout frames until
stdin closes, or over gRPC (``--grpc HOST:PORT``), or both (``--grpc ... --stdio``):
one dispatcher and one handle registry behind both transports.

Before anything else it moves the protocol off file descriptors 0 and 1: fd 1 is
pointed at stderr, so whatever Python or C code prints can never corrupt a frame, and
fd 0 at /dev/null, so no child process can steal a frame. With ``--output frames``
(what the Elixir runtime uses) fds 1 and 2 go to a pipe instead, whose lines are sent
to the client as frames of their own (``bridge_py.worker.output``).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from bridge_py.worker import process_group
from bridge_py.worker.transports.grpc_sessions import DEFAULT_SESSION_IDLE

# How long exit hooks may run once the parent is gone: the whole exit stays within 2 s.
_ORPHAN_GRACE = 1.0

if TYPE_CHECKING:  # imported after the stdio switch: importing torch may print
    from bridge_py.worker.dispatcher import Dispatcher
    from bridge_py.worker.exports import ExportTable
    from bridge_py.worker.transports.grpc_credentials import Token


def _claim_stdio() -> tuple[int, int]:
    """Duplicate the protocol streams to private fds and neutralise fds 0 and 1."""
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = sys.stderr
    return proto_in, proto_out


def _load_exports(spec: str) -> ExportTable:
    """Call the ``module:function`` named on the command line for the export table."""
    from bridge_py.worker.exports import ExportTable

    module_name, _, function = spec.partition(":")
    table = getattr(importlib.import_module(module_name), function or "default_exports")()
    if not isinstance(table, ExportTable):
        raise SystemExit(f"--exports {spec} returned {type(table).__name__}, not an ExportTable")
    return table


def _microseconds(text: str) -> float:
    """A non-negative number of microseconds, for argparse."""
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _threads(text: str) -> int:
    """A thread limit of at least 2 (a leader and one call), for argparse."""
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {text}")
    return value


class _RefuseToken(argparse.Action):
    """``--token`` is gone: a token in argv shows in ``ps`` and ``/proc/*/cmdline``."""

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kw: object) -> None:
        parser.error(
            "--token is not accepted: a token on the command line is visible to every "
            "local user (ps, /proc/*/cmdline). Set $VLLM_BRIDGE_TOKEN, or use --token-file "
            "PATH (a file only you can read)"
        )


def _program() -> str:
    """How this process was started, for usage lines: the installed command's name
    (``vllm-bridge-worker``), or ``python -m bridge_py.worker``."""
    name = Path(sys.argv[0]).name
    return "python -m bridge_py.worker" if name in ("__main__.py", "-c", "") else name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_program(), description=__doc__)
    parser.add_argument(
        "--exports",
        default="bridge_py.worker.export_table:default_exports",
        metavar="MODULE:FUNCTION",
        help="a function returning the ExportTable to serve (default: the shipped table)",
    )
    parser.add_argument(
        "--max-frame-bytes", type=int, default=None, help="port: refuse longer frames (2 GiB)"
    )
    parser.add_argument(
        "--spin-us",
        type=_microseconds,
        default=None,
        metavar="MICROSECONDS",
        help="port: keep reading for the next request this long before sleeping, on any "
        "machine (default: up to 200, while measurement shows that spinning is faster "
        "and this process is not kept waiting for a CPU)",
    )
    parser.add_argument(
        "--max-threads",
        type=_threads,
        default=None,
        metavar="N",
        help="port: threads for calls that block at once, the reader included (256); "
        "past it, calls are refused as busy",
    )
    parser.add_argument(
        "--output",
        choices=("stderr", "frames"),
        default="stderr",
        help="port: where what the process prints on fds 1 and 2 goes: the inherited "
        "stderr (default), or frames to the client (Reply id 0, Output; docs/protocol.md)",
    )
    parser.add_argument(
        "--grpc",
        metavar="HOST:PORT|unix:PATH",
        help="serve gRPC (port 0: any free port); TCP needs a token, unix:PATH is made 0600",
    )
    parser.add_argument(
        "--token",
        nargs="?",
        action=_RefuseToken,
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="gRPC: the token every call must carry, in a file only its owner can read; "
        "a missing file is created with a generated token (default: $VLLM_BRIDGE_TOKEN, "
        "else a generated token in a private file whose path is printed)",
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=None, help="gRPC: message size limit (256 MiB)"
    )
    parser.add_argument(
        "--session-idle-s",
        type=float,
        default=DEFAULT_SESSION_IDLE,
        help="gRPC: a session with no request for this many seconds expires, and its "
        f"objects are released ({DEFAULT_SESSION_IDLE:g}; 0: never)",
    )
    parser.add_argument(
        "--port-file",
        type=Path,
        help="gRPC: write the bound port here once serving (0 on a unix socket)",
    )
    parser.add_argument(
        "--stdio", action="store_true", help="with --grpc: serve stdin/stdout frames too"
    )
    parser.add_argument(
        "--require-auth-key",
        action="store_true",
        help="refuse process groups and queues without an auth key "
        "(sets $VLLM_BRIDGE_REQUIRE_AUTH_KEY=1)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, serve, exit without waiting on calls still blocked in Python."""
    args = _parser().parse_args(argv)
    use_stdio = args.grpc is None or args.stdio
    proto_in, proto_out = _claim_stdio()
    writer = None
    if use_stdio and args.output == "frames":
        from bridge_py.worker.output import capture
        from bridge_py.worker.transports.frames import FrameWriter

        writer = FrameWriter(proto_out)
        capture(writer)
    if args.require_auth_key:
        from bridge_py.distributed.auth import REQUIRE_ENV_VAR

        os.environ[REQUIRE_ENV_VAR] = "1"  # the operator's policy, read where keys are

    from bridge_py.worker.dispatcher import Dispatcher

    dispatcher = Dispatcher(_load_exports(args.exports))
    if "bridge_py.distributed" in sys.modules:
        # A worker killed with its objects (SIGKILL: no atexit hook ran) leaves their
        # shared memory behind: the next worker on the host removes what ranks that were
        # killed left (``shm.segments``; what live processes hold stays).
        from bridge_py.distributed.shm.segments import remove_orphans

        remove_orphans()
    # Held here so the gRPC server lives as long as the process.
    grpc_server = _start_grpc(dispatcher, args) if args.grpc is not None else None
    if use_stdio:
        from bridge_py.worker.parent_watch import watch_parent
        from bridge_py.worker.transports.polling_input import DEFAULT_SPIN, PollingInput
        from bridge_py.worker.transports.port import (
            DEFAULT_MAX_FRAME,
            DEFAULT_MAX_THREADS,
            PortTransport,
        )

        # Whoever started us is our client: once it is gone, so are we, even if stdin
        # stays open or a call is stuck (see parent_watch), and so is what we started.
        process_group.lead()
        watch_parent(lambda: _exit_promptly(grace=_ORPHAN_GRACE))
        # No --spin-us: spin up to the default while measurement says it pays; with it,
        # spin up to that long on any machine (0: never).
        if args.spin_us is None:
            reader = PollingInput(proto_in, DEFAULT_SPIN)
        else:
            reader = PollingInput(proto_in, args.spin_us * 1e-6, measured=False)
        PortTransport(
            dispatcher,
            reader,
            writer or proto_out,
            max_frame=args.max_frame_bytes or DEFAULT_MAX_FRAME,
            max_threads=args.max_threads or DEFAULT_MAX_THREADS,
        ).serve()
        # stdin closed: the client is gone.
    else:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    del grpc_server
    _exit_promptly()
    return 0


def _exit_promptly(grace: float = 2.0) -> None:
    """Run atexit hooks (they unlink shared memory), then leave, within ``grace`` seconds.

    Calls still blocked in Python (a barrier) must not keep the process alive, so the
    process never joins their threads, and a hook that hangs cannot delay the exit by
    more than ``grace``.
    """
    watchdog = threading.Timer(grace, _leave)
    watchdog.daemon = True
    watchdog.start()
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stderr.flush()
        _leave()


def _leave() -> None:
    """Exit now, taking the processes exported code started along (``process_group``)."""
    process_group.end_others()
    os._exit(0)


def _start_grpc(dispatcher: Dispatcher, args: argparse.Namespace) -> object:
    """Start the gRPC server (exit with status 2 and a message if it cannot).

    Its credential comes from ``grpc_credentials.find_token``; a generated token's
    file is named on stderr (never the token itself).
    """
    from bridge_py.worker.transports.grpc import DEFAULT_MAX_MESSAGE, serve_grpc
    from bridge_py.worker.transports.grpc_credentials import (
        CredentialError,
        find_token,
        remove_generated,
        unix_path,
    )

    token = None
    try:
        socket_path = unix_path(args.grpc)
        token = find_token(args.token_file, os.environ, required=socket_path is None)
        serving = serve_grpc(
            dispatcher,
            args.grpc,
            token=token.value if token else None,
            max_message_bytes=args.max_message_bytes or DEFAULT_MAX_MESSAGE,
            session_idle=args.session_idle_s,
        )
    except (CredentialError, OSError, ValueError) as exc:
        if token is not None:
            remove_generated(token)
        print(f"bridge_py.worker: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    atexit.register(serving.remove_socket)
    if token is not None:
        atexit.register(remove_generated, token)
    _say_how_to_connect(serving.target, token)
    if args.port_file is not None:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(serving.port))
        tmp.replace(args.port_file)
    return serving.server


def _say_how_to_connect(target: str, token: Token | None) -> None:
    """One stderr line on where the server is and which credential it requires."""
    if token is None:
        how = "socket mode 0600: this user only, no token"
    elif token.written_to is not None:
        how = (
            f"generated token written to {token.written_to} (anyone who can read it can "
            f"run code in this worker; clients send it as 'authorization: Bearer <token>')"
        )
    else:
        how = f"token from {token.source} required"
    print(f"bridge_py.worker: serving gRPC on {target}; {how}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
