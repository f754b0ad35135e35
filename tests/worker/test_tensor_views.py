"""Large tensor arguments are decoded from the frame they came in, without a copy.

The port reads a large frame into memory of its own, placed so that its first tensor's
elements are aligned; the codec decodes that tensor as a view of the frame, not from
msgpack's copy of its payload (``Codec._decode_cut``). These tests hold the copies
away (the tensor's memory is the frame's; no ``bytes`` the size of the payload is
allocated), check that one frame's tensor is never overwritten by the next, and that
the cut decode gives what msgpack's own decode gives, for good values and mutated ones.
"""

from __future__ import annotations

import io
import random
import struct
import tracemalloc
from typing import Any

import pytest
import torch

from bridge_py.worker import codec as codec_module
from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN, Atom, Codec, CodecError, tensor_data_at
from bridge_py.worker.transports.frames import FrameReader

MIB = 1 << 20


def _frame(tensor: torch.Tensor, request_id: int) -> bytes:
    """A length-prefixed request frame calling ``echo(tensor)``."""
    op = pb.CallFunction(function="echo", args=PLAIN.encode([tensor]))
    body = pb.encode_request(pb.Request(id=request_id, op=op))
    return struct.pack(">I", len(body)) + body


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8, count=1).data_ptr()


def _args(frame: bytes | memoryview) -> Any:
    req = pb.decode_request(frame)
    assert isinstance(req.op, pb.CallFunction)
    return req.op.args


def test_a_large_tensor_argument_is_a_view_of_its_own_frame() -> None:
    first = torch.arange(2 * MIB, dtype=torch.float32)
    second = torch.full((2 * MIB,), -1.0)
    reader = FrameReader(io.BytesIO(_frame(first, 1) + _frame(second, 2)), 1 << 30, tensor_data_at)
    frame1 = reader.read()
    assert isinstance(frame1, memoryview)
    args1 = _args(frame1)
    del frame1
    (t1,) = PLAIN.decode(args1)
    start = _address(args1)
    # No copy: the tensor's elements are in the frame, on a 64-byte boundary.
    assert start <= t1.data_ptr() < start + len(args1)
    assert t1.data_ptr() % 64 == 0
    assert torch.equal(t1, first)
    t1[0] = 42.0  # writable, and nobody else's memory
    del args1

    frame2 = reader.read()
    assert isinstance(frame2, memoryview)
    (t2,) = PLAIN.decode(_args(frame2))
    # The second frame has memory of its own: the first tensor keeps its values.
    assert torch.equal(t2, second)
    assert t1[0].item() == 42.0 and torch.equal(t1[1:], first[1:])
    assert t2.data_ptr() + t2.nbytes <= t1.data_ptr() or t1.data_ptr() + t1.nbytes <= t2.data_ptr()
    assert reader.read() is None


def test_decoding_a_large_tensor_allocates_no_copy_of_its_payload() -> None:
    tensor = torch.arange(4 * MIB, dtype=torch.int32)
    data = bytearray(PLAIN.encode({"x": [tensor, 1, "two"], "y": (Atom("ok"), tensor[:3])}))
    view = memoryview(data)
    tracemalloc.start()
    try:
        value = PLAIN.decode(view)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MIB  # msgpack's copy of the payload alone would be 16 MiB
    assert torch.equal(value["x"][0], tensor)
    assert value["x"][1:] == [1, "two"] and value["y"][0] == "ok"


def test_a_tensor_in_read_only_or_misaligned_memory_is_copied_once() -> None:
    tensor = torch.randn(MIB // 16, dtype=torch.complex128)
    encoded = PLAIN.encode([tensor])
    for data in (encoded, memoryview(bytearray(b"\0" + encoded))[1:]):
        tracemalloc.start()
        try:
            (back,) = PLAIN.decode(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < MIB // 4  # (the copy itself is torch's memory, not traced)
        assert torch.equal(back, tensor)
        back.zero_()  # its own memory: the input is not written
        assert PLAIN.decode(data)[0].abs().sum() > 0


def test_a_placeholder_sent_by_a_client_is_an_unknown_extension() -> None:
    big = PLAIN.encode(torch.zeros(MIB, dtype=torch.uint8))
    forged = b"\xd8\x7f" + bytes(16)
    with pytest.raises(CodecError, match="unknown msgpack extension type 127"):
        PLAIN.decode(memoryview(bytearray(b"\x92" + big + forged)))


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(8 if depth < 3 else 4)
    if choice == 0:
        dtype = rng.choice([torch.float32, torch.complex128, torch.bool, torch.int16, torch.uint8])
        size = rng.choice([0, 3, 5000, 70_000])
        if dtype is torch.bool:
            return torch.randint(0, 2, (size,)).bool()
        return torch.randint(0, 100, (size,)).to(dtype)
    if choice == 1:
        return rng.randrange(-(2**40), 2**40)
    if choice == 2:
        return "s" * rng.randrange(0, 300)
    if choice == 3:
        return bytes(rng.randrange(0, 70_000))
    if choice == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if choice == 5:
        return tuple(_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5)))
    if choice == 6:
        return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(0, 5))}
    return Atom("ok")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _outcome(codec: Codec, data: memoryview) -> tuple[str, Any]:
    try:
        return "value", codec.decode(data)
    except CodecError:
        return "error", None


def test_the_cut_decode_gives_what_msgpack_gives_for_good_and_mutated_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(17)
    checked = 0
    for _ in range(150):
        value = [_random_value(rng) for _ in range(rng.randrange(1, 4))]
        encoded = bytearray(PLAIN.encode(value))
        if len(encoded) < 1 << 16:
            continue
        for mutation in range(6):
            data = bytearray(encoded)
            if mutation == 1:
                del data[rng.randrange(len(data)) :]
            elif mutation > 1:
                for _ in range(mutation):
                    data[rng.randrange(min(len(data), 64))] = rng.randrange(256)
            shift = rng.randrange(16)  # misaligned too
            view = memoryview(bytearray(shift) + data)[shift:]
            cut = _outcome(PLAIN, view)
            with monkeypatch.context() as patched:
                patched.setattr(codec_module, "_SCAN_FROM", 1 << 62)
                whole = _outcome(PLAIN, memoryview(bytes(data)))
            assert cut[0] == whole[0] and _same(cut[1], whole[1]), (mutation, cut[0], whole[0])
            if mutation == 0:
                assert _same(cut[1], value)
            checked += 1
    assert checked > 100


def test_a_tensor_that_is_a_small_part_of_its_frame_is_copied_not_viewed() -> None:
    # A view would keep the whole frame (here 4 MiB of other bytes) alive with it.
    small = torch.arange(4096, dtype=torch.float64)
    data = bytearray(PLAIN.encode([bytes(4 * MIB), small]))
    view = memoryview(data)
    _, back = PLAIN.decode(view)
    start = _address(view)
    assert not start <= back.data_ptr() < start + len(view)
    assert torch.equal(back, small)
