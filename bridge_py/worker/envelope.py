"""The bridge.proto envelope: Request and Reply, encoded and decoded by hand.

``proto/bridge.proto`` is the schema; this module is a small proto3 codec for just
those messages, so the worker needs no protobuf runtime. Their fields come from
:mod:`bridge_py.worker.schema`, generated from the .proto (``make codegen``); the
classes below name the same fields, which is checked when this module is imported. It
follows the rules in ``docs/protocol.md`` (fields in number order, defaults left out,
the set member of a oneof always written), which is what the official protobuf runtime
writes too: ``tests/worker/test_envelope.py`` checks our bytes against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, final, get_args

from bridge_py.worker import schema

# Field kinds of the schema (compared by identity: the generated tables hold these).
_UINT64 = schema.UINT64
_STRING = schema.STRING
_BYTES = schema.BYTES
_PACKED_UINT64 = schema.PACKED_UINT64

_WIRE_VARINT = 0
_WIRE_I64 = 1
_WIRE_LEN = 2
_WIRE_I32 = 5


class EnvelopeError(ValueError):
    """Bytes that are not a valid Request or Reply."""


MAX_REPEATED = 1 << 20
"""The most values a repeated field may hold (a release's handles): a message at the
size limit holds over 100 million one-byte varints, which took gigabytes and, released,
the handle registry's lock for seconds."""


@dataclass(slots=True)
class CreateInstance:
    """Construct an exported class."""

    class_name: str = ""
    args: bytes = b""
    kwargs: bytes = b""
    FIELDS: ClassVar = schema.FIELDS["CreateInstance"]


@dataclass(slots=True)
class CallMethod:
    """Call an exported method of a live object."""

    handle: int = 0
    method: str = ""
    args: bytes = b""
    kwargs: bytes = b""
    FIELDS: ClassVar = schema.FIELDS["CallMethod"]


@dataclass(slots=True)
class CallFunction:
    """Call an exported module function or static method."""

    function: str = ""
    args: bytes = b""
    kwargs: bytes = b""
    FIELDS: ClassVar = schema.FIELDS["CallFunction"]


@dataclass(slots=True)
class GetAttribute:
    """Read an exported attribute of a live object."""

    handle: int = 0
    name: str = ""
    FIELDS: ClassVar = schema.FIELDS["GetAttribute"]


@dataclass(slots=True)
class ReleaseHandles:
    """Forget objects."""

    handles: list[int] = field(default_factory=list)
    FIELDS: ClassVar = schema.FIELDS["ReleaseHandles"]


@dataclass(slots=True)
class ReleaseSession:
    """Forget every object of the request's session."""

    FIELDS: ClassVar = schema.FIELDS["ReleaseSession"]


@dataclass(slots=True)
class Describe:
    """Ask for the export table."""

    FIELDS: ClassVar = schema.FIELDS["Describe"]


@dataclass(slots=True)
class Ping:
    """Echo a payload."""

    payload: bytes = b""
    FIELDS: ClassVar = schema.FIELDS["Ping"]


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

_OPERATIONS: dict[str, type[Operation]] = {cls.__name__: cls for cls in get_args(Operation)}
# Request.op: field number <-> message type, and the type's field name (the op's name).
_OPS: dict[int, type[Operation]] = {
    number: _OPERATIONS[message] for number, _, message in schema.ONEOFS["Request"]["op"]
}
_OP_NUMBERS: dict[type[Operation], int] = {cls: number for number, cls in _OPS.items()}
_OP_NAMES: dict[type[Operation], str] = {
    _OPERATIONS[message]: name for _, name, message in schema.ONEOFS["Request"]["op"]
}


@final
@dataclass(slots=True)
class Request:
    """One operation for one worker; ``id`` pairs it with its Reply."""

    id: int = 0
    session: str = ""
    op: Operation | None = None
    # How long the caller will wait for the reply, in ms from when it sent the request
    # (0: no limit). See :mod:`bridge_py.deadline`.
    deadline_ms: int = 0


@dataclass(slots=True)
class Error:
    """Why a request failed (see the categories in docs/protocol.md)."""

    category: str = ""
    message: str = ""
    python_type: str = ""
    traceback: str = ""
    details: bytes = b""
    FIELDS: ClassVar = schema.FIELDS["Error"]


@dataclass(slots=True)
class Output:
    """What the worker's process wrote on its stdout and stderr (``--output frames``):
    whole lines, each ending in a newline, and how many lines were dropped before them
    (over the rate limit; see docs/protocol.md)."""

    text: bytes = b""
    dropped: int = 0
    FIELDS: ClassVar = schema.FIELDS["Output"]


@final
@dataclass(slots=True)
class Reply:
    """The answer to one Request: a msgpack ``value`` or an ``error``; or, with id 0,
    the worker's ``output``. One of the three, never more.

    ``value`` may also be a list of byte buffers, the value's bytes in pieces (see
    :func:`encode_reply_chunks`); decoded replies always hold one buffer.
    """

    id: int = 0
    value: bytes | memoryview | list[bytes | memoryview] | None = None
    error: Error | None = None
    output: Output | None = None


# -- encoding -------------------------------------------------------------------------

_SMALL_VARINTS = tuple(bytes((i,)) for i in range(0x80))
_SMALL_JOIN = 1 << 12  # pieces shorter than this are joined into one bytes object
_SHORT_VALUE_HEADS = tuple(b"\x12" + varint for varint in _SMALL_VARINTS)  # Reply.value's


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL_VARINTS[n]
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


# The non-oneof fields of Request (its op is written apart).
_REQUEST_HEAD = schema.FIELDS["Request"]


def encode_request(req: Request) -> bytes:
    """The protobuf bytes of a Request."""
    head = _encode_fields(req, _REQUEST_HEAD)
    if req.op is None:
        return head
    return head + _len_field(_OP_NUMBERS[type(req.op)], _encode_fields(req.op))


def encode_reply(reply: Reply) -> bytes:
    """The protobuf bytes of a Reply."""
    return b"".join(encode_reply_chunks(reply))


def encode_reply_chunks(reply: Reply) -> list[bytes | memoryview]:
    """A Reply's bytes as a list of pieces, so a large value is written without a copy.

    A small reply is one piece. A value given as a list of pieces (a tensor's header
    and a view of its storage) stays in pieces; each must be a byte-format buffer.
    """
    head = b"\x08" + _varint(reply.id) if reply.id else b""
    if reply.error is not None:
        return [head + _len_field(3, _encode_fields(reply.error))]
    if reply.output is not None:
        return [head + _len_field(4, _encode_fields(reply.output))]
    return value_reply_chunks(head, reply.value)


def value_reply_chunks(
    head: bytes, value: bytes | memoryview | list[bytes | memoryview] | None
) -> list[bytes | memoryview]:
    """:func:`encode_reply_chunks` of a value reply whose id field is already encoded:
    ``head`` is that field's bytes (a request's own id field, ``08`` and the varint, as it
    arrived, is the same field of its reply)."""
    if type(value) is bytes and len(value) < 0x80:  # most results: one field header byte
        return [head + _SHORT_VALUE_HEADS[len(value)] + value]
    if value is None:
        return [head]
    if isinstance(value, list):
        size = sum(map(len, value))
        return [head + b"\x12" + _varint(size), *value]
    if len(value) < _SMALL_JOIN:
        return [head + b"\x12" + _varint(len(value)) + value]
    return [head + b"\x12" + _varint(len(value)), value]


# -- decoding -------------------------------------------------------------------------
#
# The decoder walks a memoryview of the frame with integer positions: no generator,
# no per-field tuples, and a ``bytes`` field longer than VIEW_THRESHOLD comes back as
# a memoryview slice of the frame instead of a copy (a tensor argument is then copied
# only where it has to be: into the tensor).

Buffer = bytes | memoryview  # what the decoder walks: the frame itself, or a view of it
VIEW_THRESHOLD = 1 << 16
"""``bytes`` fields at least this long decode to memoryviews of the frame, not copies."""


def read_varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` of ``buf`` (which ends at ``end``) and where it ends; raises
    :class:`EnvelopeError` when it is cut short or longer than 64 bits."""
    if pos + 3 <= end:  # up to three bytes (below 2^21: ids, deadlines) unrolled
        first = buf[pos]
        if first < 0x80:
            return first, pos + 1
        second = buf[pos + 1]
        if second < 0x80:
            return (first & 0x7F) | second << 7, pos + 2
        third = buf[pos + 2]
        if third < 0x80:
            return (first & 0x7F) | (second & 0x7F) << 7 | third << 14, pos + 3
    result = 0
    shift = 0
    while True:
        if pos >= end:
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


def _bytes(buf: Buffer, pos: int, end: int) -> bytes | memoryview:
    if type(buf) is bytes or end - pos >= VIEW_THRESHOLD:
        return buf[pos:end]
    return bytes(buf[pos:end])


def _utf8(buf: Buffer, pos: int, end: int, where: str) -> str:
    try:
        return (buf[pos:end] if type(buf) is bytes else bytes(buf[pos:end])).decode("utf-8")
    except UnicodeDecodeError:
        raise EnvelopeError(f"{where} is not valid UTF-8") from None


def _wire_error(where: str, wire: int, expected: int) -> EnvelopeError:
    return EnvelopeError(f"{where} has wire type {wire}, expected {expected}")


def _decode_message(cls: type, buf: Buffer, pos: int, end: int) -> Any:
    """One message of class ``cls`` from ``buf[pos:end]``.

    Fields are looked up by their key (number and wire type together); a key that is
    not one of ``cls``'s (an unknown field, a wrong wire type) goes to :func:`_skip`.
    """
    by_key = _BY_KEY[cls]
    values: dict[str, Any] = {}
    while pos < end:
        key = buf[pos]
        if key & 0x80:
            key, pos = read_varint(buf, pos, end)
        else:
            pos += 1
        spec = by_key.get(key)
        if spec is None:
            pos = _skip(cls, key, buf, pos, end)
            continue
        name, kind = spec
        if pos >= end:
            raise EnvelopeError(f"{cls.__name__}.{name} is truncated")
        size = buf[pos]
        if size & 0x80:
            size, pos = read_varint(buf, pos, end)
        else:
            pos += 1
        if kind is _UINT64:
            values[name] = size
            continue
        if kind is _PACKED_ONE:
            items = values.setdefault(name, [])
            _room_for(items, cls, name)
            items.append(size)
            continue
        stop = pos + size
        if stop > end:
            raise EnvelopeError("length-delimited field runs past the end")
        if kind is _BYTES:
            values[name] = _bytes(buf, pos, stop)
        elif kind is _STRING:
            values[name] = _utf8(buf, pos, stop, f"{cls.__name__}.{name}")
        elif kind is _PACKED_UINT64:
            items = values.setdefault(name, [])
            while pos < stop:
                _room_for(items, cls, name)
                item, pos = read_varint(buf, pos, stop)
                items.append(item)
        else:  # a nested message
            values[name] = _decode_message(kind, buf, pos, stop)
        if cls is Reply:  # its oneof members are separate attributes: the last one wins
            for other in _REPLY_RESULT:
                if other != name:
                    values.pop(other, None)
        pos = stop
    return cls(**values)


def _room_for(items: list[int], cls: type, name: str) -> None:
    """Refuse a repeated field that would hold more than :data:`MAX_REPEATED` values."""
    if len(items) >= MAX_REPEATED:
        raise EnvelopeError(f"{cls.__name__}.{name} holds more than {MAX_REPEATED} values")


def _skip(cls: type, key: int, buf: Buffer, pos: int, end: int) -> int:
    """The position after a field whose key ``cls`` does not know.

    An unknown field is skipped, as proto3 does; a known field with the wrong wire
    type is an error.
    """
    number, wire = key >> 3, key & 7
    if number == 0:
        raise EnvelopeError("field number 0")
    spec = _SPECS[cls].get(number)
    if spec is not None:
        name, kind = spec
        expected = _WIRE_VARINT if kind is _UINT64 else _WIRE_LEN
        raise _wire_error(f"{cls.__name__}.{name}", wire, expected)
    if wire == _WIRE_VARINT:
        return read_varint(buf, pos, end)[1]
    if wire == _WIRE_LEN:
        size, pos = read_varint(buf, pos, end)
        pos += size
    elif wire == _WIRE_I64:
        pos += 8
    elif wire == _WIRE_I32:
        pos += 4
    else:
        raise EnvelopeError(f"unsupported wire type {wire}")
    if pos > end:
        raise EnvelopeError(f"field {number} of {cls.__name__} runs past the end")
    return pos


# Field number -> (attribute, kind) for every message; the oneof members of Request
# and Reply are listed here too (Request's ops all land in ``op``; a nested message's
# kind is its class).
_MESSAGES: dict[str, type[Operation | Error | Output]] = {
    **_OPERATIONS,
    "Error": Error,
    "Output": Output,
}
_SPECS: dict[type, dict[int, tuple[str, Any]]] = {
    cls: {number: (name, kind) for number, name, kind in cls.FIELDS} for cls in _MESSAGES.values()
}
_SPECS[Request] = {
    **{number: (name, kind) for number, name, kind in _REQUEST_HEAD},
    **{number: ("op", cls) for number, cls in _OPS.items()},
}
_SPECS[Reply] = {
    number: (name, _MESSAGES.get(kind, kind))
    for number, name, kind in (*schema.FIELDS["Reply"], *schema.ONEOFS["Reply"]["result"])
}
# Reply's oneof result: its members are separate attributes, setting one clears the others.
_REPLY_RESULT = tuple(name for _, name, _ in schema.ONEOFS["Reply"]["result"])

# Key (field number << 3 | wire type) -> (attribute, kind): what _decode_message reads.
_PACKED_ONE = "packed_uint64_one"  # one element of a repeated uint64 written unpacked


def _keyed(specs: dict[int, tuple[str, Any]]) -> dict[int, tuple[str, Any]]:
    by_key: dict[int, tuple[str, Any]] = {}
    for number, (name, kind) in specs.items():
        if kind is _UINT64:
            by_key[number << 3 | _WIRE_VARINT] = (name, kind)
        else:
            by_key[number << 3 | _WIRE_LEN] = (name, kind)
        if kind is _PACKED_UINT64:
            by_key[number << 3 | _WIRE_VARINT] = (name, _PACKED_ONE)
    return by_key


_BY_KEY = {cls: _keyed(specs) for cls, specs in _SPECS.items()}


def decode_request(data: bytes | bytearray | memoryview) -> Request:
    """Parse a Request; raises :class:`EnvelopeError` when the bytes are not one.

    Small ``bytes`` fields are copies; long ones (tensors) are views of ``data``.
    """
    if type(data) is bytes:
        return _decode_message(Request, data, 0, len(data))
    buf = memoryview(data).cast("B")
    return _decode_message(Request, buf, 0, len(buf))


def decode_reply(data: bytes | bytearray | memoryview) -> Reply:
    """Parse a Reply; raises :class:`EnvelopeError` when the bytes are not one."""
    buf = data if type(data) is bytes else memoryview(data).cast("B")
    return _decode_message(Reply, buf, 0, len(buf))


def peek_request_id(data: bytes | bytearray | memoryview) -> int:
    """The id of a Request that failed to decode, if its first field is readable, else 0."""
    buf = memoryview(data).cast("B")
    try:
        key, pos = read_varint(buf, 0, len(buf))
        if key == _REQUEST_ID_KEY:
            return read_varint(buf, pos, len(buf))[0]
    except EnvelopeError:
        pass
    return 0


def field_key(message: str, name: str) -> int:
    """The key (field number << 3 | wire type) of field ``name`` of ``message`` (oneof
    members included), as the schema numbers it."""
    oneofs = schema.ONEOFS.get(message, {}).values()
    for number, field_name, kind in (*schema.FIELDS[message], *(f for o in oneofs for f in o)):
        if field_name == name:
            return number << 3 | (_WIRE_VARINT if kind is _UINT64 else _WIRE_LEN)
    raise KeyError(f"{message} has no field {name}")


def check_keys(where: str, keys: tuple[tuple[int, str, str], ...]) -> None:
    """Raise when a key that ``where`` reads or writes as a literal, ``(key, message,
    field)``, is not the schema's.

    The byte-level readers and writers on every call's path test keys written as
    constants, which cost less than names looked up at each call; their modules call
    this once, at import, so that a field renumbered in the schema fails loudly there.
    """
    wrong = [
        f"{message}.{name} is {field_key(message, name):#04x}, not {key:#04x}"
        for key, message, name in keys
        if field_key(message, name) != key
    ]
    if wrong:
        raise RuntimeError(f"{where} reads keys the schema no longer has: {'; '.join(wrong)}")


def _check_classes() -> None:
    """Raise when a message class's attributes are not its fields in the schema (a field
    added to the .proto and generated needs an attribute here), or a field is of a kind
    :func:`_encode_fields` does not write."""
    wanted: dict[type, set[str]] = {cls: {f[1] for f in cls.FIELDS} for cls in _MESSAGES.values()}
    wanted[Request] = {f[1] for f in _REQUEST_HEAD} | {"op"}
    wanted[Reply] = {name for _, name, _ in schema.FIELDS["Reply"]} | set(_REPLY_RESULT)
    for cls in _MESSAGES.values():
        for _, name, kind in cls.FIELDS:
            if kind not in (_UINT64, _STRING, _BYTES, _PACKED_UINT64):
                raise RuntimeError(f"{cls.__name__}.{name}: the codec does not write {kind}")
    for cls, names in wanted.items():
        have = {f.name for f in fields(cls)}
        if have != names:
            raise RuntimeError(
                f"envelope.{cls.__name__} has fields {sorted(have)}, the schema {sorted(names)}"
            )


_check_classes()
_REQUEST_ID_KEY = field_key("Request", "id")
check_keys(
    "envelope",  # encode_reply_chunks (error: field 3, output: 4), value_reply_chunks
    (
        (0x08, "Reply", "id"),
        (0x12, "Reply", "value"),
        (0x1A, "Reply", "error"),
        (0x22, "Reply", "output"),
    ),
)


def op_name(op: Operation | type[Operation] | None) -> str:
    """The field name of an operation (or of its class) in bridge.proto, for messages
    and logs; ``"none"`` for None."""
    if op is None:
        return "none"
    return _OP_NAMES.get(op if isinstance(op, type) else type(op), "none")


__all__ = [
    "CallFunction",
    "CallMethod",
    "CreateInstance",
    "Describe",
    "EnvelopeError",
    "Error",
    "GetAttribute",
    "Operation",
    "Output",
    "Ping",
    "ReleaseHandles",
    "ReleaseSession",
    "Reply",
    "Request",
    "check_keys",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_reply_chunks",
    "encode_request",
    "field_key",
    "op_name",
    "peek_request_id",
    "read_varint",
    "value_reply_chunks",
]
