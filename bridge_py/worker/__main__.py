"""Entry point: ``python -m bridge_py.worker``.

Serves the shipped export table over stdin/stdout frames until stdin closes. Before
anything else it moves the protocol off file descriptors 0 and 1: fd 1 is pointed at
stderr, so whatever Python or C code prints can never corrupt a frame, and fd 0 at
/dev/null, so no child process can steal a frame.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from bridge_py.worker.exports import ExportTable


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
    module_name, _, function = spec.partition(":")
    table = getattr(importlib.import_module(module_name), function or "default_exports")()
    if not isinstance(table, ExportTable):
        raise SystemExit(f"--exports {spec} returned {type(table).__name__}, not an ExportTable")
    return table


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, serve until stdin closes, exit without waiting on blocked calls."""
    parser = argparse.ArgumentParser(prog="python -m bridge_py.worker", description=__doc__)
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        default=None,
        help="refuse frames longer than this (default 2 GiB)",
    )
    parser.add_argument(
        "--exports",
        default="bridge_py.worker.export_table:default_exports",
        metavar="MODULE:FUNCTION",
        help="a function returning the ExportTable to serve (default: the shipped table)",
    )
    args = parser.parse_args(argv)
    proto_in, proto_out = _claim_stdio()

    from bridge_py.worker.dispatcher import Dispatcher
    from bridge_py.worker.transports.port import DEFAULT_MAX_FRAME, PortTransport

    dispatcher = Dispatcher(_load_exports(args.exports))
    with os.fdopen(proto_in, "rb", buffering=1 << 16) as infile:
        PortTransport(
            dispatcher, infile, proto_out, max_frame=args.max_frame_bytes or DEFAULT_MAX_FRAME
        ).serve()
    # stdin closed: the client is gone. Calls still blocked (a barrier) must not keep
    # the process alive, so leave without joining threads.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
