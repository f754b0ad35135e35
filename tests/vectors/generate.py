"""Write the shared wire test vectors: ``python tests/vectors/generate.py``.

Each line of ``msgpack.txt`` and ``envelope.txt`` is ``name<TAB>hex<TAB>elixir
literal``; the bytes are what the Python side writes for the case in ``cases.py``.
``tests/worker/test_vectors.py`` fails when the checked-in files are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from tests.vectors.cases import envelope_cases, msgpack_cases

HERE = Path(__file__).resolve().parent


def render_msgpack() -> str:
    """The text of msgpack.txt."""
    lines = [f"{name}\t{PLAIN.encode(value).hex()}\t{lit}" for name, value, lit in msgpack_cases()]
    return "\n".join(lines) + "\n"


def render_envelope() -> str:
    """The text of envelope.txt."""
    lines = []
    for name, msg, lit in envelope_cases():
        data = pb.encode_request(msg) if isinstance(msg, pb.Request) else pb.encode_reply(msg)
        lines.append(f"{name}\t{data.hex()}\t{lit}")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Write both files next to this script."""
    (HERE / "msgpack.txt").write_text(render_msgpack())
    (HERE / "envelope.txt").write_text(render_envelope())


if __name__ == "__main__":
    main()
