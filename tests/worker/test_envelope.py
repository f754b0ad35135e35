"""The hand-written envelope codec against the official protobuf runtime (the oracle).

bridge.proto is compiled with grpc_tools into a temporary directory; every shared
vector must encode to the same bytes as protobuf's own serializer and parse back to
the same message with protobuf's parser.
"""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bridge_py.worker import envelope as pb
from bridge_py.worker.call_plans import id_field_end, split_call
from tests.vectors.cases import envelope_cases

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def official(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("proto")
    status = protoc.main(
        [
            "protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out}",
            str(ROOT / "proto/bridge.proto"),
        ]
    )
    assert status == 0
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("bridge_pb2")
    finally:
        sys.path.remove(str(out))


def _to_official(msg: pb.Request | pb.Reply, official: ModuleType):
    if isinstance(msg, pb.Reply):
        out = official.Reply(id=msg.id)
        if msg.error is not None:
            e = msg.error
            out.error.CopyFrom(
                official.Error(
                    category=e.category,
                    message=e.message,
                    python_type=e.python_type,
                    traceback=e.traceback,
                    details=e.details,
                )
            )
        elif msg.output is not None:
            out.output.CopyFrom(official.Output(text=msg.output.text, dropped=msg.output.dropped))
        elif msg.value is not None:
            out.value = msg.value
        return out
    out = official.Request(id=msg.id, session=msg.session, deadline_ms=msg.deadline_ms)
    op_field = pb.op_name(msg.op)
    sub = getattr(out, op_field)
    sub.SetInParent()
    for _number, name, _kind in type(msg.op).FIELDS:
        value = getattr(msg.op, name)
        if isinstance(value, list):
            getattr(sub, name).extend(value)
        else:
            setattr(sub, name, value)
    return out


@pytest.mark.parametrize("case", envelope_cases(), ids=lambda c: c[0])
def test_bytes_match_official_protobuf(case, official: ModuleType) -> None:
    _name, msg, _lit = case
    ours = pb.encode_request(msg) if isinstance(msg, pb.Request) else pb.encode_reply(msg)
    theirs = _to_official(msg, official).SerializeToString()
    assert ours == theirs
    # And protobuf's bytes decode with our decoder to the same message.
    decode = pb.decode_request if isinstance(msg, pb.Request) else pb.decode_reply
    assert decode(theirs) == msg


def test_decoder_accepts_unpacked_repeated_and_unknown_fields(official: ModuleType) -> None:
    # handles 1 and 2 unpacked (tag 0x08 each), plus an unknown field 9 inside Release.
    inner = b"\x08\x01\x08\x02\x4a\x01z"
    data = b"\x08\x05\x72" + bytes([len(inner)]) + inner + b"\x98\x06\x01"
    req = pb.decode_request(data)
    assert req.id == 5 and req.op == pb.ReleaseHandles([1, 2])
    assert official.Request.FromString(data).release.handles == [1, 2]


@pytest.mark.parametrize(
    "junk",
    [b"\x08", b"\x08\xff", b"\x12\x05ab", b"\x0b", b"\x00\x01", b"\x08" + b"\xff" * 11],
)
def test_malformed_envelopes_raise_envelope_error(junk: bytes) -> None:
    with pytest.raises(pb.EnvelopeError):
        pb.decode_request(junk)


def test_a_repeated_field_holds_at_most_max_repeated_values() -> None:
    # A release naming 100 million handles fits the message size limit; decoding it took
    # gigabytes, and releasing it the registry's lock for seconds.
    most = pb.encode_request(pb.Request(id=1, op=pb.ReleaseHandles([1] * pb.MAX_REPEATED)))
    assert len(pb.decode_request(most).op.handles) == pb.MAX_REPEATED
    more = pb.encode_request(pb.Request(id=1, op=pb.ReleaseHandles([1] * (pb.MAX_REPEATED + 1))))
    with pytest.raises(pb.EnvelopeError, match=r"ReleaseHandles.handles holds more than 1048576"):
        pb.decode_request(more)


def test_peek_request_id() -> None:
    assert pb.peek_request_id(b"\x08\x2a\xff") == 42
    assert pb.peek_request_id(b"\x12\x00") == 0
    assert pb.peek_request_id(b"") == 0


@pytest.mark.parametrize(
    "request_id", [1, 7, 127, 128, 300, 2**14 - 1, 2**14, 2**21, 2**35 + 5, 2**56, 2**63 - 1]
)
def test_id_field_end_finds_the_id_field_every_encoder_writes(request_id: int) -> None:
    for session in ("", "grpc-" + "ab" * 32):
        frame = pb.encode_request(pb.Request(request_id, session, pb.CallMethod(3, "incr")))
        end = id_field_end(frame)
        assert pb.decode_reply(frame[:end]).id == request_id  # also its reply's id field
        assert frame[end:] == pb.encode_request(pb.Request(0, session, pb.CallMethod(3, "incr")))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x08",  # the varint missing
        b"\x08\x80",  # the varint cut short
        b"\x08" + b"\x80" * 3,
        b"\x08" + b"\xff" * 9 + b"\x01",  # 64 bits and more: the full way says what it is
        b"\x08" + b"\xff" * 12,
        b"\x12\x01a\x08\x01",  # the id not first
        pb.encode_request(pb.Request(2**63, "", pb.CallMethod(3, "incr"))),
        pb.encode_request(pb.Request(0, "s", pb.Ping())),
    ],
)
def test_id_field_end_is_0_without_an_id_field_up_front(frame: bytes) -> None:
    assert id_field_end(frame) == 0


def test_id_field_end_agrees_with_the_decoder_on_mutated_frames() -> None:
    rng = random.Random(5)
    for request_id in (9, 1000, 2**30):
        frame = pb.encode_request(pb.Request(request_id, "s", pb.CallMethod(3, "incr")))
        for data in _mutations(frame, rng):
            end = id_field_end(data)
            if end:  # a field 1 varint up front, of at most 9 bytes, ending at end
                assert data[0] == 0x08 and all(b & 0x80 for b in data[1 : end - 1])
                assert not data[end - 1] & 0x80 and end <= 10
                assert pb.peek_request_id(data) == pb.peek_request_id(data[:end])


def _mutations(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` truncated, extended, and with bytes flipped: valid and invalid neighbours."""
    out = [data[:cut] for cut in range(len(data))] + [data + b"\x00", data + b"\x08\x01"]
    for _ in range(40):
        b = bytearray(data)
        b[rng.randrange(len(b))] = rng.randrange(256)
        out.append(bytes(b))
    return out


def _random_request(rng: random.Random) -> pb.Request:
    ops: list[pb.Operation] = [
        pb.CallMethod(
            handle=rng.choice([0, 1, 127, 128, 2**40]),
            method=rng.choice(["", "incr", "é" * rng.randrange(1, 80)]),
            args=rng.randbytes(rng.choice([0, 1, 130, 300])),
            kwargs=rng.randbytes(rng.choice([0, 2, 200])),
        ),
        pb.CallFunction(
            rng.choice(["", "echo", "f" * 200]),
            args=rng.randbytes(rng.choice([0, 1, 130])),
            kwargs=rng.randbytes(rng.choice([0, 2])),
        ),
        pb.GetAttribute(rng.choice([0, 5, 2**40]), rng.choice(["", "rank", "x" * 150])),
        pb.Ping(rng.randbytes(rng.choice([0, 1, 200]))),
        pb.CreateInstance("Counter", rng.randbytes(3)),
    ]
    return pb.Request(
        id=rng.choice([0, 1, 300]),
        session=rng.choice(["", "s", "x" * 200]),
        op=rng.choice(ops),
        deadline_ms=rng.choice([0, 5, 120_000, 2**40]),
    )


def _named(req: pb.Request) -> tuple[object, ...]:
    """What a call plan's key must stand for: the session, the operation and its target."""
    op = req.op
    if isinstance(op, pb.CallMethod):
        return (req.session, pb.CallMethod, op.handle, op.method)
    if isinstance(op, pb.CallFunction):
        return (req.session, pb.CallFunction, op.function)
    if isinstance(op, pb.CreateInstance):
        return (req.session, pb.CreateInstance, op.class_name)
    if isinstance(op, pb.GetAttribute):
        return (req.session, pb.GetAttribute, op.handle, op.name)
    return (req.session, type(op))


def _carried(req: pb.Request) -> tuple[bytes, bytes]:
    op = req.op
    if isinstance(op, pb.Ping):
        return op.payload, b""
    if isinstance(op, (pb.CallMethod, pb.CallFunction, pb.CreateInstance)):
        return op.args, op.kwargs
    return b"", b""


def test_split_call_agrees_with_the_general_decoder() -> None:
    # On every input, valid or not: when split_call splits a frame, the general decoder
    # reads the same id, deadline and argument bytes from it, and frames with equal keys
    # name the same thing in the same session. (It splits some invalid frames too, such
    # as text that is not UTF-8: their keys are never those of a valid frame, so they
    # never find a plan and take the full way, which says what is wrong.)
    rng = random.Random(7)
    named_by_key: dict[bytes, tuple[object, ...]] = {}
    invalid_keys: set[bytes] = set()
    splits = 0
    for _ in range(300):
        req = _random_request(rng)
        data = pb.encode_request(req)
        for candidate in [data, *_mutations(data, rng)]:
            split = split_call(candidate)
            if split is None:
                continue
            splits += 1
            end, key, deadline_ms, args, kwargs = split
            try:
                decoded = pb.decode_request(candidate)
            except pb.EnvelopeError:
                invalid_keys.add(key)
                continue
            assert pb.decode_request(candidate[:end]) == pb.Request(decoded.id)  # the id field
            assert (deadline_ms, (args, kwargs)) == (decoded.deadline_ms, _carried(decoded))
            assert named_by_key.setdefault(key, _named(decoded)) == _named(decoded), candidate
    assert splits > 300
    assert not invalid_keys & named_by_key.keys()


@pytest.mark.parametrize("session", ["", "s1", "grpc-" + "ab" * 32])
def test_split_call_leaves_the_id_deadline_and_arguments_out_of_the_key(session: str) -> None:
    keys = set()
    # the varint's length changes after 127, 16,383 and 2,097,151 (inline up to there)
    for deadline_ms in (0, 1, 127, 128, 4750, 16_383, 16_384, 119_975, 2**21 - 1, 2**21, 2**64 - 1):
        for args in (b"", b"\x91\x01", b"\xdc\x00\x7c" + b"\x00" * 124, b"\x91" + b"\x00" * 300):
            call = pb.CallMethod(3, "incr", args, b"\x80")
            frame = pb.encode_request(pb.Request(300, session, call, deadline_ms))
            split = split_call(frame)
            assert split is not None
            assert split[0] == 3 and split[2:] == (deadline_ms, args, b"\x80")
            keys.add(split[1])
    assert len(keys) == 1
    # A truncated deadline, or one that ends the frame, is not split.
    for deadline_ms in (200, 2**20):
        frame = pb.encode_request(pb.Request(300, session, deadline_ms=deadline_ms))
        assert split_call(frame[:-1]) is None
        assert split_call(frame) is None
