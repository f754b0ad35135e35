"""Runs the frame fuzzer (``fuzz_frames.py``) for a bounded number of inputs.

``make test`` runs 100,000 inputs; ``make fuzz`` sets ``VLLM_BRIDGE_FUZZ_FRAMES`` for a
longer run. The seed (``VLLM_BRIDGE_FUZZ_SEED``, default 1) makes a run repeatable; a
failing input is saved under the test's temporary directory, and its path printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN, Atom, RefValue
from tests.vectors.cases import envelope_cases, msgpack_cases

HERE = Path(__file__).resolve().parent
FRAMES = int(os.environ.get("VLLM_BRIDGE_FUZZ_FRAMES", "100000"))
SEED = int(os.environ.get("VLLM_BRIDGE_FUZZ_SEED", "1"))
# About 2,000 inputs a second here: the bound leaves room for a slow machine.
LIMIT_S = max(600, FRAMES // 100)

pytestmark = pytest.mark.timeout(LIMIT_S + 60)


def _deep(kind: type, depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = kind([value])
    return value


def _seeds() -> list[bytes]:
    """Valid frames of every operation, with values of every kind, for libFuzzer to mutate."""
    values = [value for _name, value, _elixir in msgpack_cases()]
    values += [
        (Atom("ok"), [1, (2, {"k": (3,)})]),
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.empty(0, 3, 2),
        RefValue(1, "Counter"),
        _deep(tuple, 40),
        _deep(list, 120),
    ]
    frames = [pb.encode_request(pb.Request(id=7, op=pb.Ping(PLAIN.encode(v)))) for v in values]
    args = PLAIN.encode
    ops: list[pb.Operation] = [
        pb.CreateInstance("Counter", args([5])),
        pb.CallMethod(1, "incr", args([2])),
        pb.CallMethod(1, "incr"),
        pb.CallMethod(1, "fail", args(["no"])),
        pb.CallMethod(1, "incr", b"", args({"by": 3})),
        pb.CallFunction("echo", args([[1, (2, Atom("x"))]])),
        pb.CallFunction("leave", args([3])),
        pb.CallFunction("lock"),
        pb.GetAttribute(1, "value"),
        pb.ReleaseHandles([1, 2]),
        pb.ReleaseSession(),
        pb.Describe(),
    ]
    frames += [pb.encode_request(pb.Request(id=i + 1, op=op)) for i, op in enumerate(ops)]
    frames += [
        pb.encode_request(m) if isinstance(m, pb.Request) else pb.encode_reply(m)
        for _name, m, _elixir in envelope_cases()
    ]
    return frames


def test_frames_fuzzed_get_one_reply_each_and_values_round_trip(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index, frame in enumerate(_seeds()):
        (corpus / f"seed{index:03d}").write_bytes(frame)
    artifacts = tmp_path / "crashes"
    artifacts.mkdir()
    cmd = [
        sys.executable,
        str(HERE / "fuzz_frames.py"),
        f"-runs={FRAMES}",
        f"-seed={SEED}",
        "-max_len=4096",
        "-timeout=20",
        "-rss_limit_mb=4096",
        f"-artifact_prefix={artifacts}/",
        str(corpus),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S)
    tail = "\n".join(done.stderr.splitlines()[-40:])
    assert done.returncode == 0, (
        f"the fuzzer found a failing input (seed {SEED}); saved in {artifacts}: "
        f"{sorted(p.name for p in artifacts.iterdir())}\n{tail}"
    )
    assert f"Done {FRAMES} runs" in done.stderr, tail
