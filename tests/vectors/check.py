"""Check another implementation's encodings against the Python cases.

``python tests/vectors/check.py msgpack|envelope FILE``: each line of FILE is
``name<TAB>hex``, the other side's encoding of the case ``name`` in ``cases.py``.
Exits 0 when Python decodes every line to exactly the case's value (types included:
an atom is not a plain string, a tuple not a list), else prints each mismatch and
exits 1. ExUnit runs it for the Elixir-to-Python direction.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from tests.vectors.cases import envelope_cases, msgpack_cases


def same(a: Any, b: Any) -> bool:
    """Deep equality that also compares types (Atom vs str, tuple vs list, dtypes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        b_items = list(b.items())
        return all(any(same(k, bk) and same(v, bv) for bk, bv in b_items) for k, v in a.items())
    return bool(a == b)


def check(kind: str, path: Path) -> list[str]:
    """Mismatch messages for every line of ``path`` (empty when all match)."""
    if kind == "msgpack":
        expected = {name: value for name, value, _ in msgpack_cases()}
    else:
        expected = {name: msg for name, msg, _ in envelope_cases()}
    problems = []
    seen = set()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, hexdata = line.split("\t")[:2]
        seen.add(name)
        data = bytes.fromhex(hexdata)
        if name not in expected:
            problems.append(f"{name}: no such case")
            continue
        try:
            if kind == "msgpack":
                got = PLAIN.decode(data)
            elif name.startswith("request_"):
                got = pb.decode_request(data)
            else:
                got = pb.decode_reply(data)
        except Exception as exc:
            problems.append(f"{name}: cannot decode {hexdata}: {exc}")
            continue
        ok = same(got, expected[name]) if kind == "msgpack" else got == expected[name]
        if not ok:
            problems.append(f"{name}: decoded {got!r}, expected {expected[name]!r}")
    for name in expected.keys() - seen:
        problems.append(f"{name}: missing from {path}")
    return problems


def main(argv: list[str]) -> int:
    """CLI entry: print mismatches, return the exit status."""
    kind, path = argv[0], Path(argv[1])
    problems = check(kind, path)
    for problem in problems:
        print(problem)
    print(f"{kind}: {len(problems)} mismatches")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
