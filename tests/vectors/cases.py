"""The shared wire test vectors: each case is a Python value and the Elixir term it is.

``generate.py`` writes ``msgpack.txt`` and ``envelope.txt`` (``name<TAB>hex<TAB>elixir
literal``) from these cases; ExUnit decodes each hex to the literal and encodes the
literal back to the same bytes, and ``check.py`` decodes Elixir's encodings against
the Python values here. One list, both directions.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import Atom, RefValue


def ex_bin(data: bytes) -> str:
    """An Elixir binary literal of raw bytes."""
    return "<<" + ", ".join(str(b) for b in data) + ">>"


def ex_str(text: str) -> str:
    """An Elixir string literal (escaped)."""
    out = []
    for ch in text:
        if ch in '"\\#':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def ex_tensor(t: torch.Tensor, etype: str) -> str:
    """An Elixir %VllmBridge.Tensor{} literal with the tensor's little-endian bytes."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    shape = "{" + ", ".join(str(d) for d in t.shape) + "}"
    return f"%VllmBridge.Tensor{{type: {etype}, shape: {shape}, data: {ex_bin(data)}}}"


def _ints() -> list[tuple[str, Any, str]]:
    values = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
    values += [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
    return [(f"int_{v}".replace("-", "neg"), v, str(v)) for v in values]


def msgpack_cases() -> list[tuple[str, Any, str]]:
    """(name, Python value, Elixir literal) for the value codec."""
    long_text = "x" * 40
    cases: list[tuple[str, Any, str]] = [
        ("nil", None, "nil"),
        ("true", True, "true"),
        ("false", False, "false"),
        *_ints(),
        ("float_1_5", 1.5, "1.5"),
        ("float_neg", -2.25, "-2.25"),
        ("float_big", 1.0e100, "1.0e100"),
        ("float_tenth", 0.1, "0.1"),
        ("str_empty", "", '""'),
        ("str_ascii", "hello", '"hello"'),
        ("str_unicode", "héllo ✓", ex_str("héllo ✓")),
        ("str_8", long_text, ex_str(long_text)),
        ("str_16", "y" * 300, ex_str("y" * 300)),
        ("bin_8", b"\x00\xff", ex_bin(b"\x00\xff")),
        ("bin_16", bytes(range(256)) + b"\xff" * 44, ex_bin(bytes(range(256)) + b"\xff" * 44)),
        ("list_empty", [], "[]"),
        ("list_small", [1, "a", None], '[1, "a", nil]'),
        ("list_16", list(range(16)), "[" + ", ".join(str(i) for i in range(16)) + "]"),
        ("map_empty", {}, "%{}"),
        ("map_small", {"a": 1}, '%{"a" => 1}'),
        (
            "map_16",
            {f"k{i:02d}": i for i in range(16)},
            "%{" + ", ".join(f'"k{i:02d}" => {i}' for i in range(16)) + "}",
        ),
        ("map_int_keys", {1: "one", 2: "two"}, '%{1 => "one", 2 => "two"}'),
        ("atom_ok", Atom("ok"), ":ok"),
        ("atom_quoted", Atom("hello world"), ':"hello world"'),
        ("map_atom_key", {Atom("rank"): 0}, "%{rank: 0}"),
        ("tuple_empty", (), "{}"),
        ("tuple_ok", (Atom("ok"), 1), "{:ok, 1}"),
        ("tuple_nested", (1, (2, [3])), "{1, {2, [3]}}"),
        ("ref", RefValue(7, "StatelessProcessGroup"), _ref(7, "StatelessProcessGroup")),
        ("ref_big", RefValue(2**40, ""), _ref(2**40, "")),
    ]
    tensors = [
        ("tensor_f32", torch.tensor([1.0, 2.5], dtype=torch.float32), "{:f, 32}"),
        ("tensor_s64_2x2", torch.tensor([[1, -2], [3, 2**40]], dtype=torch.int64), "{:s, 64}"),
        ("tensor_bf16_scalar", torch.tensor(1.5, dtype=torch.bfloat16), "{:bf, 16}"),
        ("tensor_f16", torch.tensor([0.5, -1.0, 65504.0], dtype=torch.float16), "{:f, 16}"),
        ("tensor_f64_0d", torch.tensor(3.25, dtype=torch.float64), "{:f, 64}"),
        ("tensor_u8_empty", torch.zeros(0, dtype=torch.uint8), "{:u, 8}"),
        ("tensor_bool", torch.tensor([True, False, True]), "{:pred, 8}"),
        ("tensor_s8_3d", torch.arange(-4, 4, dtype=torch.int8).reshape(2, 2, 2), "{:s, 8}"),
    ]
    cases += [(name, t, ex_tensor(t, etype)) for name, t, etype in tensors]
    cases.append(
        (
            "nested",
            {"t": torch.tensor([1], dtype=torch.int32), "xs": [1.5, (Atom("a"), b"\x80")]},
            '%{"t" => '
            + ex_tensor(torch.tensor([1], dtype=torch.int32), "{:s, 32}")
            + ', "xs" => [1.5, {:a, <<128>>}]}',
        )
    )
    return cases


def _ref(handle: int, class_name: str) -> str:
    return f"%VllmBridge.Ref{{id: {handle}, class: {ex_str(class_name)}}}"


def _req(req_id: int, session: str, op_name: str, fields: str, deadline_ms: int = 0) -> str:
    # The Elixir codec's map has :deadline_ms only when the request has one.
    deadline = f", deadline_ms: {deadline_ms}" if deadline_ms else ""
    op = f"{{:{op_name}, %{{{fields}}}}}"
    return f"%{{id: {req_id}, session: {ex_str(session)}{deadline}, op: {op}}}"


ARGS = struct.pack(">B", 0x92) + b"\x01\xa1a"  # msgpack [1, "a"]
KWARGS = b"\x81\xa3src\x00"  # msgpack %{"src" => 0}


def envelope_cases() -> list[tuple[str, pb.Request | pb.Reply, str]]:
    """(name, envelope, Elixir literal) for the proto codec; names say request or reply."""
    output_text = b"torch warning\n\xff\n"  # lines of bytes, not always UTF-8
    a, k = ex_bin(ARGS), ex_bin(KWARGS)
    return [
        (
            "request_ping",
            pb.Request(id=1, op=pb.Ping(payload=b"\x91\x01")),
            _req(1, "", "ping", "payload: <<145, 1>>"),
        ),
        ("request_ping_empty", pb.Request(id=2, op=pb.Ping()), _req(2, "", "ping", 'payload: ""')),
        (
            "request_create",
            pb.Request(
                id=3, session="s1", op=pb.CreateInstance("StatelessProcessGroup", ARGS, KWARGS)
            ),
            _req(3, "s1", "create", f'class_name: "StatelessProcessGroup", args: {a}, kwargs: {k}'),
        ),
        (
            "request_call",
            pb.Request(
                id=2**40, session="default", op=pb.CallMethod(300, "broadcast_obj", ARGS, b"")
            ),
            _req(
                2**40,
                "default",
                "call",
                f'handle: 300, method: "broadcast_obj", args: {a}, kwargs: ""',
            ),
        ),
        (
            "request_call_function",
            pb.Request(id=5, op=pb.CallFunction("StatelessProcessGroup.create", ARGS, KWARGS)),
            _req(
                5,
                "",
                "call_function",
                f'function: "StatelessProcessGroup.create", args: {a}, kwargs: {k}',
            ),
        ),
        (
            "request_get_attr",
            pb.Request(id=6, op=pb.GetAttribute(9, "rank")),
            _req(6, "", "get_attr", 'handle: 9, name: "rank"'),
        ),
        (
            "request_release",
            pb.Request(id=7, op=pb.ReleaseHandles([1, 300, 2**33])),
            _req(7, "", "release", f"handles: [1, 300, {2**33}]"),
        ),
        (
            "request_release_empty",
            pb.Request(id=8, op=pb.ReleaseHandles([])),
            _req(8, "", "release", "handles: []"),
        ),
        (
            "request_release_session",
            pb.Request(id=9, session="job-7", op=pb.ReleaseSession()),
            _req(9, "job-7", "release_session", ""),
        ),
        ("request_describe", pb.Request(id=10, op=pb.Describe()), _req(10, "", "describe", "")),
        (
            "request_call_deadline",
            pb.Request(id=14, op=pb.CallMethod(7, "recv_obj", b"\x91\x00", b""), deadline_ms=500),
            _req(
                14, "", "call", 'handle: 7, method: "recv_obj", args: <<145, 0>>, kwargs: ""', 500
            ),
        ),
        (
            "request_call_session_deadline",
            pb.Request(id=15, session="s1", op=pb.CallMethod(7, "rank"), deadline_ms=120_000),
            _req(15, "s1", "call", 'handle: 7, method: "rank", args: "", kwargs: ""', 120_000),
        ),
        ("reply_value", pb.Reply(id=11, value=b"\xc0"), "%{id: 11, result: {:value, <<192>>}}"),
        ("reply_value_empty", pb.Reply(id=12, value=b""), '%{id: 12, result: {:value, ""}}'),
        (
            "reply_error",
            pb.Reply(
                id=13,
                error=pb.Error(
                    "python",
                    "RuntimeError: boom",
                    "RuntimeError",
                    "Traceback (most recent call last):\n  boom\n",
                    b"\x80",
                ),
            ),
            '%{id: 13, result: {:error, %{category: "python", message: "RuntimeError: boom", '
            'python_type: "RuntimeError", '
            'traceback: "Traceback (most recent call last):\\n  boom\\n", '
            "details: <<128>>}}}",
        ),
        (
            "reply_error_minimal",
            pb.Reply(id=14, error=pb.Error("protocol", "bad frame")),
            '%{id: 14, result: {:error, %{category: "protocol", message: "bad frame", '
            'python_type: "", traceback: "", details: ""}}}',
        ),
        (
            "reply_protocol_no_id",
            pb.Reply(id=0, error=pb.Error("protocol", "x")),
            '%{id: 0, result: {:error, %{category: "protocol", message: "x", python_type: "", '
            'traceback: "", details: ""}}}',
        ),
        (
            "reply_output",
            pb.Reply(id=0, output=pb.Output(output_text, 300)),
            f"%{{id: 0, result: {{:output, %{{text: {ex_bin(output_text)}, dropped: 300}}}}}}",
        ),
        (
            "reply_output_empty",
            pb.Reply(id=0, output=pb.Output()),
            '%{id: 0, result: {:output, %{text: "", dropped: 0}}}',
        ),
    ]
