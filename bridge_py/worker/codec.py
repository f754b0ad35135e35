"""Values across the bridge: msgpack with four extension types.

The layout of every type is in ``docs/protocol.md``; this module is its Python half. A
tensor (extension 1) is the payload of the one tensor codec (``bridge_py.tensor_codec``),
of the dtypes Elixir speaks (its ``BRIDGE``). Decoding never unpickles anything: the only
things that can come out of a payload are plain values, tensors, tuples, :class:`Atom` s
and objects the worker already holds (refs, resolved through a :class:`RefResolver`).
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Any, Protocol

import msgpack
import torch

from bridge_py import tensor_codec
from bridge_py.tensor_codec import BRIDGE, header_size, joined
from bridge_py.worker.ext_scan import Edit, find_large_exts, first_large_ext_payload, splice

EXT_TENSOR = 1
EXT_REF = 2
EXT_ATOM = 3
EXT_TUPLE = 4

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1


class Atom(str):
    """An Elixir atom that crossed the bridge.

    A ``str`` subclass, so it works anywhere a string does (a dict key, a keyword
    argument name), but it encodes back to an atom, so ``:ok`` round-trips as ``:ok``.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Atom({str.__repr__(self)})"

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (Atom, (str(self),))


class CodecError(ValueError):
    """A value that cannot be encoded or a payload that cannot be decoded."""


class RefResolver(Protocol):
    """What the codec needs from the handle registry, for one request's session."""

    def resolve(self, ref: RefValue) -> Any:
        """Return the live object behind a ref (raise if it is not this session's)."""

    def register(self, obj: Any) -> tuple[int, str]:
        """Hold ``obj`` under a new handle; return the handle and its class name."""


def dtype_to_wire(dtype: torch.dtype) -> tuple[str, int]:
    """The ``(kind, bits)`` pair of a torch dtype, e.g. ``torch.float32 -> ("f", 32)``."""
    code = BRIDGE.codes.get(dtype)
    if code is None:
        raise CodecError(f"tensors of dtype {dtype} {BRIDGE.refusal}")
    return chr(code[0]), code[1]


def dtype_from_wire(kind: str, bits: int) -> torch.dtype:
    """The torch dtype of a ``(kind, bits)`` pair, e.g. ``("b", 16) -> torch.bfloat16``."""
    found = (
        BRIDGE.by_code.get(ord(kind) << 8 | bits) if len(kind) == 1 and 0 <= bits < 256 else None
    )
    if found is None:
        raise CodecError(f"unknown tensor type {kind!r}{bits}")
    return found[0]


# Nx's names of the wire kinds, for dtypes written as Elixir tuples like {:f, 32}.
_NX_KINDS = {"f": "f", "b": "bf", "s": "s", "u": "u", "c": "c", "p": "pred"}
_WIRE_KINDS = {nx: wire for wire, nx in _NX_KINDS.items()}


def dtype_to_term(dtype: torch.dtype) -> tuple[Atom, int]:
    """A torch dtype as the Elixir (Nx-style) type tuple: ``torch.bfloat16 -> (:bf, 16)``."""
    kind, bits = dtype_to_wire(dtype)
    return (Atom(_NX_KINDS[kind]), bits)


def dtype_from_term(value: Any) -> torch.dtype:
    """A torch dtype from what a client may send for one.

    Accepts an Nx-style type tuple (``(:f, 32)``, ``(:bf, 16)``, ``(:pred, 8)``), or a
    torch dtype name as a string or atom (``"float32"``, ``:bfloat16``).
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        kind, bits = value
        if isinstance(kind, str) and isinstance(bits, int) and kind in _WIRE_KINDS:
            return dtype_from_wire(_WIRE_KINDS[kind], bits)
    if isinstance(value, str):
        dtype = getattr(torch, str(value), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise CodecError(
        f"{value!r} is not a dtype: use an Nx-style type such as {{:f, 32}} or a torch "
        'dtype name such as "float32"'
    )


def tensor_pieces(tensor: torch.Tensor) -> tuple[bytes, memoryview | None]:
    """The ext-1 payload of a tensor in two pieces, without copying its elements: the
    header, and a byte view of the elements (None when there are none); see
    ``bridge_py.tensor_codec.pieces``, whose refusals are CodecErrors here."""
    try:
        return tensor_codec.pieces(tensor, BRIDGE)
    except TypeError as exc:
        raise CodecError(str(exc)) from None


def encode_tensor(tensor: torch.Tensor) -> bytes:
    """The ext-1 payload of a tensor: header, then its elements little-endian, row-major."""
    return joined(*tensor_pieces(tensor))


def decode_tensor(payload: bytes | memoryview, *, share: bool = False) -> torch.Tensor:
    """A CPU tensor from an ext-1 payload (``bridge_py.tensor_codec.decode``): with
    ``share``, a view of ``payload``'s memory where it can be, else a copy of its own;
    CodecError for a payload that does not add up."""
    return tensor_codec.decode(payload, share=share, dtypes=BRIDGE, error=CodecError)


def tensor_data_at(prefix: bytes | memoryview, size: int) -> int:
    """Where the elements of the first large tensor in a request frame of ``size`` bytes
    start, guessed from the frame's first bytes (0: none seen). The port's frame reader
    puts that offset on an aligned address, so the tensor can be decoded as a view of
    the frame (see :func:`decode_tensor`); a wrong guess only costs that tensor a copy.
    """
    at = first_large_ext_payload(prefix, size, EXT_TENSOR, _CUT_FROM)
    if not at or at + 3 > len(prefix):
        return 0
    return at + header_size(prefix[at + 2])


class Codec:
    """Encodes results and decodes arguments for one request.

    ``resolver`` connects refs to the handle registry; without one (pure value
    traffic, the test vectors) refs decode to :class:`RefValue` and objects that are
    not plain values cannot be encoded.
    """

    def __init__(self, resolver: RefResolver | None = None) -> None:
        self._resolver = resolver
        # One msgpack Packer per thread (a Packer is not thread-safe, and making one
        # per call costs more than packing a small value).
        self._local = threading.local()
        # The types whose objects this codec has held as refs: the next object of one
        # is held at once, without the type tests of _default (which depend on the
        # type alone, for a type without ``item``). At most _MAX_HELD types.
        self._held_types: set[type] = set()
        # The ext of each handle this codec has sent (handles are never reused, so an
        # entry is never wrong, only unused once released); at most _MAX_REFS.
        self._refs: dict[int, msgpack.ExtType] = {}

    # -- encoding -------------------------------------------------------------------

    def encode(self, value: Any) -> bytes:
        """Msgpack bytes of ``value``; unencodable objects become refs (given a resolver).

        Containers nested more than :data:`MAX_DEPTH` deep, or containing themselves,
        are refused.
        """
        if value is None:
            return _NIL
        packer = getattr(self._local, "packer", None)
        if packer is None:
            packer = self._local.packer = self._packer()
        try:
            data = packer.pack(value)
        except CodecError:
            raise
        except OverflowError as exc:
            raise CodecError(f"integer out of the 64-bit range: {exc}") from None
        except Exception as exc:  # raised by a value's own methods, or msgpack's checks
            if isinstance(value, _CONTAINERS):
                _check_nesting(value)  # a cycle or a deep value (msgpack's limit): say so
            raise CodecError(f"cannot encode a {type(value).__name__}: {_why(exc)}") from None
        # Each level takes at least a byte: only a longer value can nest too deep.
        if len(data) > MAX_DEPTH and isinstance(value, _CONTAINERS):
            _check_nesting(value)
        if len(data) > _KEEP_PACKER_BELOW:
            self._local.packer = None  # do not hold a buffer that large for good
        return data

    def encode_pieces(self, value: Any) -> bytes | list[bytes | memoryview]:
        """Like :meth:`encode`, but a large tensor comes back as pieces, not copied.

        The pieces, written one after the other, are exactly :meth:`encode`'s bytes:
        the msgpack ext header, the tensor header and a view of the elements.
        """
        if type(value) in _SCALARS or not isinstance(value, torch.Tensor):
            return self.encode(value)  # (the type test first: isinstance on Tensor is slow)
        header, data = tensor_pieces(value)
        if data is None or len(header) + len(data) < _PIECES_FROM:  # small: in one piece
            return self.encode(msgpack.ExtType(EXT_TENSOR, joined(header, data)))
        return [struct.pack(">BIb", 0xC9, len(header) + len(data), EXT_TENSOR) + header, data]

    def _packer(self) -> msgpack.Packer:
        return msgpack.Packer(
            default=self._default,
            use_bin_type=True,
            strict_types=True,
            datetime=False,
            buf_size=_PACKER_START,
        )

    def _nested(self, value: Any) -> bytes:
        """Encode from inside the Packer's ``default`` hook: with a Packer of its own."""
        try:
            return self._packer().pack(value)
        except OverflowError as exc:
            raise CodecError(f"integer out of the 64-bit range: {exc}") from None

    def _default(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in self._held_types:
            return self._hold(obj)
        if isinstance(obj, RefValue):  # (a constructor's result: early)
            return msgpack.ExtType(EXT_REF, obj.to_payload())
        if isinstance(obj, Atom):
            return msgpack.ExtType(EXT_ATOM, str(obj).encode())
        if isinstance(obj, tuple):
            return msgpack.ExtType(EXT_TUPLE, self._nested(list(obj)))
        if isinstance(obj, torch.Tensor):
            return msgpack.ExtType(EXT_TENSOR, encode_tensor(obj))
        if isinstance(obj, torch.dtype):
            return self._default(dtype_to_term(obj))
        if isinstance(obj, torch.device):
            return str(obj)
        # Subclasses of plain types (strict_types sends them here): encode as the base type.
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, int):
            if not _INT64_MIN <= obj <= _UINT64_MAX:
                raise CodecError(f"integer {obj} is outside the 64-bit range")
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, (list, set, frozenset)):
            return list(obj)
        if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # numpy scalars
            return obj.item()
        # Held from now on without the tests above, which the type alone decides (not
        # for a type with ``item``: the numpy test looks at the object's ``ndim``).
        held = self._held_types
        if self._resolver is not None and not hasattr(kind, "item") and len(held) < _MAX_HELD:
            held.add(kind)
        return self._hold(obj)

    def _hold(self, obj: Any) -> msgpack.ExtType:
        """A ref to ``obj``, which the resolver holds (under the handle it has, if any);
        without a resolver an object cannot cross."""
        if self._resolver is None:
            raise CodecError(f"a value of type {type(obj).__qualname__} cannot cross the bridge")
        handle, class_name = self._resolver.register(obj)
        ext = self._refs.get(handle)
        if ext is None:  # (making an ExtType is most of a ref's encoding)
            if len(self._refs) >= _MAX_REFS:
                self._refs.clear()
            ext = self._refs[handle] = msgpack.ExtType(EXT_REF, _ref_payload(handle, class_name))
        return ext

    # -- decoding -------------------------------------------------------------------

    def decode(self, data: bytes | memoryview) -> Any:
        """The value in msgpack bytes; raises :class:`CodecError` on malformed input.

        A memoryview (a long argument, as the envelope hands it over) is read in place.
        Containers nested more than :data:`MAX_DEPTH` deep are refused.
        """
        local = self._local
        local.tuples = False
        if len(data) >= _SCAN_FROM:
            edits = find_large_exts(
                data,
                ext_code=EXT_TENSOR,
                tuple_code=EXT_TUPLE,
                min_len=_CUT_FROM,
                budget=_SCAN_BUDGET,
                max_depth=MAX_DEPTH,
            )
            if edits is not None:
                return self._decode_cut(data, edits)
        value = self._unpack(data)
        # msgpack-python decodes its own timestamp extension (-1) without asking the
        # ext hook, and it is not one of the protocol's types; only bytes holding a
        # timestamp header can contain one. A value with tuples, or long enough to
        # nest deeper than MAX_DEPTH, or with such a header is walked (_complete). (An
        # int looks for the header's last byte: ``in`` with bytes costs five times more.)
        if (
            local.tuples
            or len(data) > MAX_DEPTH
            or type(data) is not bytes
            or (0xFF in data and any(marker in data for marker in _TIMESTAMP_HEADERS))
        ):
            value = self._complete(value, 1)
        return value

    def _decode_cut(self, data: bytes | memoryview, edits: list[Edit]) -> Any:
        """:meth:`decode` of a value with large tensors (found by ``find_large_exts``):
        each tensor is decoded from ``data`` itself (a view of the frame where it can
        be, see :func:`decode_tensor`: when the tensors are at least half of the memory
        they would keep alive), and msgpack decodes the rest, where each tensor
        is a placeholder: without this, msgpack would first copy each tensor's payload
        into a new ``bytes``. A placeholder names this decode's random nonce, so one
        sent by a client is refused as an unknown extension type like any other."""
        buf = memoryview(data).cast("B")
        cuts = [(start + _EXT_HEADER[buf[start]], end) for start, end, what in edits if what >= 0]
        # Views keep the whole frame alive: only where the tensors are most of it.
        share = False
        if not buf.readonly and buf.obj is not None:
            with memoryview(buf.obj) as whole:
                share = 2 * sum(end - start for start, end in cuts) >= whole.nbytes
        tensors = [decode_tensor(buf[start:end], share=share) for start, end in cuts]
        local = self._local
        nonce = os.urandom(8)
        local.cut = (nonce, tensors)
        try:
            value = self._unpack(splice(buf, edits, _EXT_CUT, nonce))
            # Always walked: the value is long, and may hold tuples or timestamps.
            return self._complete(value, 1)
        finally:
            local.cut = None

    def _unpack(self, data: bytes | memoryview) -> Any:
        """One msgpack value, tuples left as :class:`_TuplePayload` (see :meth:`_complete`)."""
        try:
            return msgpack.unpackb(
                data,
                ext_hook=self._ext_hook,
                raw=False,
                strict_map_key=False,
                object_pairs_hook=_distinct_keys,
                use_list=True,
                timestamp=0,
            )
        except CodecError:
            raise
        except msgpack.StackError:
            # msgpack's own limit (1024 levels) is far above ours.
            raise CodecError(f"value nested deeper than {MAX_DEPTH}") from None
        except LookupError:
            raise  # a ref the registry does not know (HandleNotFound): not_found
        except Exception as exc:
            raise CodecError(f"malformed msgpack value: {_why(exc)}") from None

    def _complete(self, value: Any, level: int) -> Any:
        """``value`` with its tuples decoded and its nesting checked, as the container
        at ``level`` (the top-level value is at level 1).

        Tuples are decoded here, one ``unpackb`` per tuple called from this loop, never
        from inside another ``unpackb``: msgpack's C decoder keeps a large context on
        the C stack, and one nested per level exhausted a thread's stack in a few
        hundred levels (a crash, not an exception).
        """
        kind = type(value)
        if kind is _TuplePayload:
            # Let the payload go once read: held by every level above, a value nested
            # n tuples deep cost n copies of itself (8 MiB under 120: 976 MiB).
            payload, value.payload = value.payload, b""
            items = self._unpack(payload)
            del payload
            if type(items) is not list:
                raise CodecError("tuple payload is not an array")
            if level > MAX_DEPTH:
                raise CodecError(f"value nested deeper than {MAX_DEPTH}")
            self._complete_items(items, level)
            return tuple(items)
        if kind is list:
            if level > MAX_DEPTH:
                raise CodecError(f"value nested deeper than {MAX_DEPTH}")
            self._complete_items(value, level)
            return value
        if kind is dict:
            if level > MAX_DEPTH:
                raise CodecError(f"value nested deeper than {MAX_DEPTH}")
            if _WALKED.isdisjoint(set(map(type, value))):
                for key, item in value.items():
                    if type(item) in _WALKED:
                        value[key] = self._complete(item, level + 1)
                return value
            completed: dict[Any, Any] = {}
            for key, item in value.items():
                key = self._complete(key, level + 1)
                item = self._complete(item, level + 1)
                try:
                    if key in completed:  # tuples equal only once decoded
                        raise CodecError(_same_key(next(k for k in completed if k == key), key))
                    completed[key] = item
                except TypeError:  # a key that cannot be one (a tuple holding a list)
                    raise CodecError(f"map key {key!r} is not hashable") from None
            return completed
        if kind is msgpack.Timestamp:
            raise CodecError("msgpack extension type -1 (timestamp) is not part of the protocol")
        return value

    def _complete_items(self, items: list[Any], level: int) -> None:
        """:meth:`_complete` each element of ``items`` that needs it, in place."""
        # Most long lists hold only scalars: one pass in C finds out.
        if _WALKED.isdisjoint(set(map(type, items))):
            return
        for index, item in enumerate(items):
            if type(item) in _WALKED:
                items[index] = self._complete(item, level + 1)

    def _ext_hook(self, code: int, payload: bytes) -> Any:
        if code == EXT_TUPLE:
            self._local.tuples = True
            return _TuplePayload(payload)  # decoded by _complete, not from in here
        if code == EXT_TENSOR:
            return decode_tensor(payload)
        if code == EXT_ATOM:
            return Atom(payload.decode("utf-8"))
        if code == EXT_REF:
            ref = RefValue.from_payload(payload)
            if self._resolver is None:
                return ref
            return self._resolver.resolve(ref)
        if code == _EXT_CUT:
            cut = getattr(self._local, "cut", None)
            if cut is not None and len(payload) == 16 and payload[:8] == cut[0]:
                index = int.from_bytes(payload[8:], "big")
                if index < len(cut[1]):
                    return cut[1][index]
        raise CodecError(f"unknown msgpack extension type {code}")


def _distinct_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A map's pairs as a dict; CodecError when two keys are one key here (``True``,
    ``1`` and ``1.0``; an atom and the string of its name), where a dict would keep one
    value and lose the others without a word."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: dict[Any, Any] = {}
        for key, _ in pairs:
            if key in seen:
                raise CodecError(_same_key(seen[key], key))
            seen[key] = key
    return value


def _same_key(first: Any, second: Any) -> str:
    return (
        f"map keys {first!r} and {second!r} are one key in Python: one value would be "
        "lost; use keys that differ here"
    )


class _TuplePayload:
    """A tuple's msgpack payload, still to be decoded (see ``Codec._complete``).

    Hashable by identity, so a tuple used as a map key can wait in the map too.
    """

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


MAX_DEPTH = 128
"""How deep containers (lists, maps, tuples) may nest in one value, both ways.

The top-level container is level 1: ``[[1]]`` is nested 2 deep. The Elixir side has
the same limit (``VllmBridge.Msgpack.max_depth/0``).
"""

_NIL = b"\xc0"
_HANDLE = struct.Struct(">Q")  # a ref's handle, at the start of its ext-2 payload

_MAX_HELD = 256
_MAX_REFS = 4096  # refs remembered per codec (see Codec._hold)
# A thread's Packer starts small (msgpack's default is 256 KiB, for every thread)
# and is dropped after packing anything past _KEEP_PACKER_BELOW, so an idle thread
# holds little memory.
_PACKER_START = 1 << 12
_KEEP_PACKER_BELOW = 1 << 16
_PIECES_FROM = 1 << 16  # tensors this large are sent as pieces by encode_pieces
# Values this long are scanned for tensors of at least _CUT_FROM bytes, which are then
# decoded from the value's own memory, not from msgpack's copy (Codec._decode_cut); the
# scan looks at no more than _SCAN_BUDGET other items. _EXT_CUT: the placeholders'
# extension type, which is none of the protocol's.
_SCAN_FROM = 1 << 16
_CUT_FROM = 1 << 12
_SCAN_BUDGET = 512
_EXT_CUT = 127
_EXT_HEADER = {0xC7: 3, 0xC8: 4, 0xC9: 6}  # ext 8, 16, 32: header bytes before the payload
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})  # never a tensor
# What a decoded value's walk (Codec._complete) looks inside or refuses.
_WALKED = frozenset({list, dict, _TuplePayload, msgpack.Timestamp})

# fixext4, fixext8 and ext8 (12 bytes) with type -1: msgpack's timestamp encodings.
# Every header msgpack-python decodes as a timestamp: type -1 in fixext 4 and 8, and in
# ext 8, 16 and 32 with a length of 4, 8 or 12 (all of them end in the type byte, ff).
_TIMESTAMP_HEADERS = (
    b"\xd6\xff",
    b"\xd7\xff",
    *(bytes([0xC7, size, 0xFF]) for size in (4, 8, 12)),
    *(bytes([0xC8, 0, size, 0xFF]) for size in (4, 8, 12)),
    *(bytes([0xC9, 0, 0, 0, size, 0xFF]) for size in (4, 8, 12)),
)


# What the encoder sends as a container: tuples (and named tuples) as extension 4, sets
# as arrays, subclasses of list and dict as their base type.
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _check_nesting(
    value: list[Any] | tuple[Any, ...] | dict[Any, Any] | set[Any] | frozenset[Any],
) -> None:
    """Raise :class:`CodecError` if containers nest deeper than :data:`MAX_DEPTH` in ``value``.

    Depth first with a stack of its own; a value that contains itself is too deep too.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, level = stack.pop()
        if level > MAX_DEPTH:
            raise CodecError(f"value nested deeper than {MAX_DEPTH}")
        members = (
            [*container.keys(), *container.values()] if isinstance(container, dict) else container
        )
        # Most containers hold no container: one pass in C over their types finds out.
        kinds = set(map(type, members))
        if kinds <= _SCALARS or not any(issubclass(kind, _CONTAINERS) for kind in kinds):
            continue
        stack.extend((m, level + 1) for m in members if isinstance(m, _CONTAINERS))


def _why(exc: BaseException) -> str:
    """An exception as a short reason: its message, or its type when it has none."""
    return str(exc) or type(exc).__name__


def _ref_payload(handle: int, class_name: str) -> bytes:
    """The ext-2 payload of a ref: the handle as u64 big-endian, then the class name."""
    return _HANDLE.pack(handle) + class_name.encode()


class RefValue:
    """A ref as plain data: the handle id and class name (used where no registry is)."""

    __slots__ = ("class_name", "handle")

    def __init__(self, handle: int, class_name: str = "") -> None:
        self.handle = handle
        self.class_name = class_name

    def to_payload(self) -> bytes:
        """The ext-2 payload: handle as u64 big-endian, then the class name."""
        return _ref_payload(self.handle, self.class_name)

    @classmethod
    def from_payload(cls, payload: bytes) -> RefValue:
        """Parse an ext-2 payload."""
        if len(payload) < 8:
            raise CodecError("ref payload shorter than its handle")
        return cls(_HANDLE.unpack_from(payload)[0], payload[8:].decode("utf-8"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RefValue) and (self.handle, self.class_name) == (
            other.handle,
            other.class_name,
        )

    def __hash__(self) -> int:
        return hash((self.handle, self.class_name))

    def __repr__(self) -> str:
        return f"RefValue({self.handle}, {self.class_name!r})"


PLAIN = Codec()
"""A codec without a registry, for pure values."""
