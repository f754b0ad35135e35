"""The bridge.proto envelope: Request and Reply, encoded and decoded by hand.

``proto/bridge.proto`` is the schema; this module is a small proto3 codec for just
those messages, so the worker needs no generated code and no particular protobuf
runtime. It follows the rules in ``docs/protocol.md`` (fields in number order,
defaults left out, the set member of a oneof always written), which is what the
official protobuf runtime writes too: ``tests/worker/test_envelope.py`` checks our
bytes against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

# Field kinds of the schema.
_UINT64 = "uint64"
_STRING = "string"
_BYTES = "bytes"
_PACKED_UINT64 = "packed_uint64"

_WIRE_VARINT = 0
_WIRE_I64 = 1
_WIRE_LEN = 2
_WIRE_I32 = 5


class EnvelopeError(ValueError):
    """Bytes that are not a valid Request or Reply."""


@dataclass
class CreateInstance:
    """Construct an exported class."""

    class_name: str = ""
    args: bytes = b""
    kwargs: bytes = b""
    FIELDS: ClassVar = ((1, "class_name", _STRING), (2, "args", _BYTES), (3, "kwargs", _BYTES))


@dataclass
class CallMethod:
    """Call an exported method of a live object."""

    handle: int = 0
    method: str = ""
    args: bytes = b""
    kwargs: bytes = b""
    FIELDS: ClassVar = (
        (1, "handle", _UINT64),
        (2, "method", _STRING),
        (3, "args", _BYTES),
        (4, "kwargs", _BYTES),
    )


@dataclass
class CallFunction:
    """Call an exported module function or static method."""

    function: str = ""
    args: bytes = b""
    kwargs: bytes = b""
    FIELDS: ClassVar = ((1, "function", _STRING), (2, "args", _BYTES), (3, "kwargs", _BYTES))


@dataclass
class GetAttribute:
    """Read an exported attribute of a live object."""

    handle: int = 0
    name: str = ""
    FIELDS: ClassVar = ((1, "handle", _UINT64), (2, "name", _STRING))


@dataclass
class ReleaseHandles:
    """Forget objects."""

    handles: list[int] = field(default_factory=list)
    FIELDS: ClassVar = ((1, "handles", _PACKED_UINT64),)


@dataclass
class ReleaseSession:
    """Forget every object of the request's session."""

    FIELDS: ClassVar = ()


@dataclass
class Describe:
    """Ask for the export table."""

    FIELDS: ClassVar = ()


@dataclass
class Ping:
    """Echo a payload."""

    payload: bytes = b""
    FIELDS: ClassVar = ((1, "payload", _BYTES),)


Operation = (
    CreateInstance
    | CallMethod
    | CallFunction
    | GetAttribute
    | ReleaseHandles
    | ReleaseSession
    | Describe
    | Ping
)

# Request.op: field number <-> message type.
_OPS: dict[int, type] = {
    10: CreateInstance,
    11: CallMethod,
    12: CallFunction,
    13: GetAttribute,
    14: ReleaseHandles,
    15: ReleaseSession,
    16: Describe,
    17: Ping,
}
_OP_NUMBERS: dict[type, int] = {cls: number for number, cls in _OPS.items()}


@dataclass
class Request:
    """One operation for one worker; ``id`` pairs it with its Reply."""

    id: int = 0
    session: str = ""
    op: Operation | None = None


@dataclass
class Error:
    """Why a request failed (see the categories in docs/protocol.md)."""

    category: str = ""
    message: str = ""
    python_type: str = ""
    traceback: str = ""
    details: bytes = b""
    FIELDS: ClassVar = (
        (1, "category", _STRING),
        (2, "message", _STRING),
        (3, "python_type", _STRING),
        (4, "traceback", _STRING),
        (5, "details", _BYTES),
    )


@dataclass
class Reply:
    """The answer to one Request: a msgpack ``value`` or an ``error``, never both."""

    id: int = 0
    value: bytes | None = None
    error: Error | None = None


# -- encoding -------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if n < 0:
        raise EnvelopeError(f"negative value {n} for an unsigned field")
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def _len_field(number: int, payload: bytes) -> bytes:
    return _tag(number, _WIRE_LEN) + _varint(len(payload)) + payload


def _encode_fields(msg: Any, fields: tuple[tuple[int, str, str], ...] | None = None) -> bytes:
    """The fields of ``msg`` (its ``FIELDS`` unless given), in number order, defaults left out."""
    parts: list[bytes] = []
    for number, name, kind in msg.FIELDS if fields is None else fields:
        value = getattr(msg, name)
        if not value:
            continue
        if kind == _UINT64:
            parts.append(_tag(number, _WIRE_VARINT) + _varint(value))
        elif kind == _STRING:
            parts.append(_len_field(number, value.encode("utf-8")))
        elif kind == _BYTES:
            parts.append(_len_field(number, bytes(value)))
        elif kind == _PACKED_UINT64:
            parts.append(_len_field(number, b"".join(_varint(v) for v in value)))
    return b"".join(parts)


# The non-oneof fields of Request and Reply (their oneof members are written apart).
_REQUEST_HEAD = ((1, "id", _UINT64), (2, "session", _STRING))
_REPLY_HEAD = ((1, "id", _UINT64),)


def encode_request(req: Request) -> bytes:
    """The protobuf bytes of a Request."""
    head = _encode_fields(req, _REQUEST_HEAD)
    if req.op is None:
        return head
    return head + _len_field(_OP_NUMBERS[type(req.op)], _encode_fields(req.op))


def encode_reply(reply: Reply) -> bytes:
    """The protobuf bytes of a Reply."""
    return b"".join(encode_reply_chunks(reply))


def encode_reply_chunks(reply: Reply) -> list[bytes]:
    """A Reply's bytes as a list of pieces, so a large value is written without a copy."""
    head = _encode_fields(reply, _REPLY_HEAD)
    if reply.error is not None:
        return [head + _len_field(3, _encode_fields(reply.error))]
    if reply.value is not None:
        value = reply.value
        return [head + _tag(2, _WIRE_LEN) + _varint(len(value)), value]
    return [head]


# -- decoding -------------------------------------------------------------------------


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    if pos < len(buf) and buf[pos] < 0x80:  # most varints here are one byte
        return buf[pos], pos + 1
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise EnvelopeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result >= 1 << 64:
                raise EnvelopeError("varint longer than 64 bits")
            return result, pos
        shift += 7
        if shift >= 70:
            raise EnvelopeError("varint longer than 10 bytes")


def _fields(buf: memoryview):
    """Yield (number, wire type, value) for each field; value is int or memoryview."""
    pos = 0
    end = len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise EnvelopeError("field number 0")
        if wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
            yield number, wire, value
        elif wire == _WIRE_LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > end:
                raise EnvelopeError("length-delimited field runs past the end")
            yield number, wire, buf[pos : pos + size]
            pos += size
        elif wire == _WIRE_I64:
            if pos + 8 > end:
                raise EnvelopeError("truncated fixed64 field")
            pos += 8
        elif wire == _WIRE_I32:
            if pos + 4 > end:
                raise EnvelopeError("truncated fixed32 field")
            pos += 4
        else:
            raise EnvelopeError(f"unsupported wire type {wire}")


_SPECS: dict[type, dict[int, tuple[str, str]]] = {}


def _decode_message(cls: type, buf: memoryview) -> Any:
    specs = _SPECS.get(cls)
    if specs is None:
        specs = _SPECS[cls] = {number: (name, kind) for number, name, kind in cls.FIELDS}
    values: dict[str, Any] = {}
    for number, wire, value in _fields(buf):
        spec = specs.get(number)
        if spec is None:
            continue  # unknown field: skip, as proto3 does
        name, kind = spec
        if kind == _UINT64:
            _expect(wire, _WIRE_VARINT, cls, name)
            values[name] = value
        elif kind == _STRING:
            _expect(wire, _WIRE_LEN, cls, name)
            try:
                values[name] = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise EnvelopeError(f"{cls.__name__}.{name} is not valid UTF-8") from None
        elif kind == _BYTES:
            _expect(wire, _WIRE_LEN, cls, name)
            values[name] = bytes(value)
        elif kind == _PACKED_UINT64:
            items = values.setdefault(name, [])
            if wire == _WIRE_VARINT:
                items.append(value)
            else:
                _expect(wire, _WIRE_LEN, cls, name)
                pos = 0
                while pos < len(value):
                    item, pos = _read_varint(value, pos)
                    items.append(item)
    return cls(**values)


def _expect(wire: int, expected: int, cls: type, name: str) -> None:
    if wire != expected:
        raise EnvelopeError(f"{cls.__name__}.{name} has wire type {wire}, expected {expected}")


def decode_request(data: bytes | memoryview) -> Request:
    """Parse a Request; raises :class:`EnvelopeError` when the bytes are not one."""
    buf = memoryview(data)
    req = Request()
    for number, wire, value in _fields(buf):
        if number == 1:
            _expect(wire, _WIRE_VARINT, Request, "id")
            req.id = value
        elif number == 2:
            _expect(wire, _WIRE_LEN, Request, "session")
            try:
                req.session = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise EnvelopeError("Request.session is not valid UTF-8") from None
        elif number in _OPS:
            _expect(wire, _WIRE_LEN, Request, "op")
            req.op = _decode_message(_OPS[number], value)
    return req


def decode_reply(data: bytes | memoryview) -> Reply:
    """Parse a Reply; raises :class:`EnvelopeError` when the bytes are not one."""
    buf = memoryview(data)
    reply = Reply()
    for number, wire, value in _fields(buf):
        if number == 1:
            _expect(wire, _WIRE_VARINT, Reply, "id")
            reply.id = value
        elif number == 2:
            _expect(wire, _WIRE_LEN, Reply, "value")
            reply.value, reply.error = bytes(value), None
        elif number == 3:
            _expect(wire, _WIRE_LEN, Reply, "error")
            reply.error, reply.value = _decode_message(Error, value), None
    return reply


def peek_request_id(data: bytes | memoryview) -> int:
    """The id of a Request that failed to decode, if its first field is readable, else 0."""
    buf = memoryview(data)
    try:
        key, pos = _read_varint(buf, 0)
        if key == (1 << 3) | _WIRE_VARINT:
            return _read_varint(buf, pos)[0]
    except EnvelopeError:
        pass
    return 0


def op_name(op: Operation | None) -> str:
    """The field name of an operation in bridge.proto, for messages and logs."""
    names = {
        CreateInstance: "create",
        CallMethod: "call",
        CallFunction: "call_function",
        GetAttribute: "get_attr",
        ReleaseHandles: "release",
        ReleaseSession: "release_session",
        Describe: "describe",
        Ping: "ping",
    }
    return names.get(type(op), "none")


__all__ = [
    "CallFunction",
    "CallMethod",
    "CreateInstance",
    "Describe",
    "EnvelopeError",
    "Error",
    "GetAttribute",
    "Operation",
    "Ping",
    "ReleaseHandles",
    "ReleaseSession",
    "Reply",
    "Request",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_reply_chunks",
    "encode_request",
    "op_name",
    "peek_request_id",
]
