"""The value codec: round trips, canonical forms, and clear errors."""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgpack
import pytest
import torch

from bridge_py.worker.codec import PLAIN, Atom, Codec, CodecError, RefValue, decode_tensor
from bridge_py.worker.registry import HandleRegistry, SessionResolver

DTYPES = [
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3), (2, 0, 4)], ids=str)
def test_tensors_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.rand(shape) * 100).to(dtype)
    back = PLAIN.decode(PLAIN.encode(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_non_contiguous_tensors_are_sent_contiguous() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    assert torch.equal(PLAIN.decode(PLAIN.encode(t)), t)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(6.0).requires_grad_(),  # a leaf that requires grad
        lambda: torch.arange(6.0, requires_grad=True) * 2,  # a result in a graph
        lambda: torch.arange(12.0)[::2],  # one dimension, strided
        lambda: torch.arange(12.0).reshape(3, 4).t(),  # two, transposed
        lambda: torch.tensor(2.5),  # none
        lambda: torch.nn.Parameter(torch.ones(2, 2)),  # a subclass
        lambda: torch.randn(3, dtype=torch.complex64).conj(),  # a conjugate bit
        lambda: torch._neg_view(torch.arange(4.0)),  # a negative bit
    ],
    ids=["leaf-grad", "graph", "strided", "transposed", "0-d", "parameter", "conj", "neg"],
)
def test_a_tensor_is_sent_as_its_plain_contiguous_copy_would_be(
    make: Callable[[], torch.Tensor],
) -> None:
    t = make()
    plain = t.detach().resolve_conj().resolve_neg().clone().contiguous()
    assert PLAIN.encode(t) == PLAIN.encode(plain)
    assert PLAIN.encode_pieces(t) == PLAIN.encode_pieces(plain) == PLAIN.encode(plain)
    assert torch.equal(PLAIN.decode(PLAIN.encode(t)), plain)


def test_decoded_tensors_own_writable_memory() -> None:
    back = PLAIN.decode(PLAIN.encode(torch.ones(4)))
    back.add_(1)  # would be undefined behaviour on a view of immutable bytes
    assert torch.equal(back, torch.full((4,), 2.0))


def test_atoms_tuples_and_nesting_round_trip() -> None:
    value = {Atom("k"): (Atom("ok"), [1, (2.5, None)], b"\x00"), "s": "str"}
    back = PLAIN.decode(PLAIN.encode(value))
    assert back == value
    key = next(iter(back))
    assert type(key) is Atom and type(back[key][0]) is Atom and type(back[key]) is tuple


def test_integers_outside_64_bits_are_refused() -> None:
    with pytest.raises(CodecError, match="64-bit"):
        PLAIN.encode(2**64)
    with pytest.raises(CodecError, match="64-bit"):
        PLAIN.encode([-(2**63) - 1])


def test_unencodable_values_without_a_registry_are_refused() -> None:
    with pytest.raises(CodecError, match="cannot cross"):
        PLAIN.encode(object())


def test_unknown_extension_and_garbage_are_codec_errors() -> None:
    with pytest.raises(CodecError, match="extension type 9"):
        PLAIN.decode(msgpack.packb(msgpack.ExtType(9, b"x")))
    with pytest.raises(CodecError):
        PLAIN.decode(b"\xc1")
    with pytest.raises(CodecError):
        PLAIN.decode(b"\x92\x01")


def _timestamp_forms() -> list[bytes]:
    """msgpack's timestamp extension (-1) in every header msgpack-python reads as one."""
    forms = [b"\xd6\xff" + bytes(4), b"\xd7\xff" + bytes(8)]
    for size in (4, 8, 12):
        body = bytes([0xFF]) + bytes(size)
        forms += [
            bytes([0xC7, size]) + body,  # ext8
            bytes([0xC8, 0, size]) + body,  # ext16
            bytes([0xC9, 0, 0, 0, size]) + body,  # ext32
        ]
    return forms


@pytest.mark.parametrize("form", _timestamp_forms(), ids=lambda form: form[:6].hex())
def test_timestamps_are_refused_in_every_header(form: bytes) -> None:
    # Found by the frame fuzzer: an ext8 timestamp (c7 08 ff) decoded to a
    # msgpack.Timestamp, which encodes back as a fixext8 that is refused.
    for data in (form, b"\x92\x01" + form, b"\x81\xa1k" + form):
        with pytest.raises(CodecError, match="timestamp"):
            PLAIN.decode(data)


@pytest.mark.parametrize(
    "payload",
    [b"f", b"z\x20\x01" + b"\x00" * 8, b"f\x20\x01" + (2).to_bytes(8, "big") + b"\x00"],
)
def test_malformed_tensor_payloads_are_codec_errors(payload: bytes) -> None:
    with pytest.raises(CodecError):
        decode_tensor(payload)


def test_refs_without_registry_decode_to_ref_values() -> None:
    ref = RefValue(5, "X")
    assert PLAIN.decode(PLAIN.encode([ref])) == [ref]


class _Registry:
    def __init__(self) -> None:
        self.objects: dict[int, object] = {}

    def resolve(self, ref: RefValue) -> object:
        return self.objects[ref.handle]

    def register(self, obj: object) -> tuple[int, str]:
        handle = len(self.objects) + 1
        self.objects[handle] = obj
        return handle, type(obj).__name__


def test_unencodable_results_become_refs_and_resolve_back() -> None:
    codec = Codec(_Registry())
    thing = object()
    data = codec.encode({"x": thing})
    ref = PLAIN.decode(data)["x"]
    assert ref == RefValue(1, "object")
    assert codec.decode(PLAIN.encode(ref)) is thing


def _holding_codec() -> tuple[HandleRegistry, Codec]:
    """A registry, and a codec that holds what it cannot encode there (session "s")."""
    registry = HandleRegistry()
    return registry, Codec(SessionResolver(registry, "s", lambda kind: kind.__name__))


class _ArrayLike:
    """Like a numpy value: a 0-d one is a scalar (its item), any other an object."""

    def __init__(self, ndim: int) -> None:
        self.ndim = ndim

    def item(self) -> int:
        return 7


def test_objects_are_held_by_what_each_one_is_after_their_type_was_held() -> None:
    # The codec remembers the types it has held, so the next object of one is held
    # without the type tests: every later value must still go the way it went before.
    registry, codec = _holding_codec()

    class Thing:
        pass

    class Number(int):
        pass

    first, second = Thing(), Thing()
    for _ in range(2):
        refs = PLAIN.decode(codec.encode([first, second, first]))
        assert [type(r) for r in refs] == [RefValue] * 3
        assert refs[0] == refs[2] != refs[1]  # one handle per object, kept
        assert codec.decode(PLAIN.encode(refs)) == [first, second, first]
        # a plain type's subclass is still its value, an array-like value is decided by
        # its own dimensions, a ref is sent as it is, each time and in any order
        ref = RefValue(99, "Other")
        assert PLAIN.decode(codec.encode([Number(3), _ArrayLike(0), ref])) == [3, 7, ref]
        held = PLAIN.decode(codec.encode([_ArrayLike(1), _ArrayLike(0)]))
        assert type(held[0]) is RefValue and held[1] == 7
    assert len(registry) == 4  # first, second and the two 1-d array-likes
    # without a registry, objects are refused every time
    for _ in range(2):
        with pytest.raises(CodecError, match="Thing cannot cross the bridge"):
            PLAIN.encode(first)


def test_many_types_of_objects_are_all_held() -> None:
    registry, codec = _holding_codec()
    objects = [type(f"Kind{i}", (), {})() for i in range(300)]  # more than the codec notes
    for _ in range(2):
        refs = PLAIN.decode(codec.encode(objects))
        assert [r.class_name for r in refs] == [f"Kind{i}" for i in range(300)]
        assert codec.decode(PLAIN.encode(refs)) == objects
    assert len(registry) == 300


def test_one_codec_encodes_from_many_threads_at_once() -> None:
    # Each thread packs with a Packer of its own; a shared one would interleave
    # values. Large values make each thread drop and rebuild its Packer too.
    codec = Codec()
    errors: list[str] = []

    def run(k: int) -> None:
        for i in range(300):
            value = [k, i, (Atom("t"), "x" * (i * 997 if i % 50 == 0 else i)), {"k": (k, i)}]
            if codec.decode(codec.encode(value)) != value:
                errors.append(f"thread {k}, value {i}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


@pytest.mark.parametrize("shape", [(0,), (5,), (300, 300), (2, 70_000)], ids=str)
def test_encode_pieces_are_the_encoded_bytes_in_pieces(shape: tuple[int, ...]) -> None:
    t = torch.rand(shape)
    pieces = PLAIN.encode_pieces(t)
    joined = b"".join(pieces) if isinstance(pieces, list) else pieces
    assert joined == PLAIN.encode(t)
    if t.numel() * 4 >= 1 << 16:  # a large tensor is not copied: its memory is a piece
        assert isinstance(pieces, list)
        data = pieces[-1]
        assert len(data) == t.numel() * 4
        assert data.obj.__array_interface__["data"][0] == t.data_ptr()


def test_an_object_held_again_after_its_release_comes_back_under_its_new_handle() -> None:
    # The codec remembers the ref it sent for each handle: a released handle must never
    # be sent again, also for the same object held anew, and past what it remembers.
    registry, codec = _holding_codec()
    thing = object()
    first = PLAIN.decode(codec.encode(thing))
    assert PLAIN.decode(codec.encode(thing)) == first
    assert registry.release([first.handle] * 2, "s") == 1  # (handed out twice)
    again = PLAIN.decode(codec.encode(thing))
    assert again.handle != first.handle and codec.decode(PLAIN.encode(again)) is thing
    objects = [object() for _ in range(5000)]  # more than the codec remembers
    for _ in range(2):
        refs = PLAIN.decode(codec.encode(objects))
        assert len({r.handle for r in refs}) == 5000
        assert codec.decode(PLAIN.encode(refs)) == objects
