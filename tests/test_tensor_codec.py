"""The one tensor codec (bridge_py.tensor_codec): its layout, dtype table, checks and decoder.

The worker's extension 1 (tests/worker) and the tagged values between ranks
(tests/distributed/test_dist_tensors.py) are this codec's payload; what both share is
tested here once: every dtype both ways, the views an encoder must resolve, the tensors it
must refuse, a decoder that refuses every malformed payload with one clear error, writes
into the receiver's tensor in one copy or shares a frame's memory, and the byte order.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge_py import tensor_codec
from bridge_py.tensor_codec import ALL, BRIDGE, decode, joined, pieces

# The table of docs/protocol.md: torch's name -> (kind, bits); the last six between ranks only.
TABLE = {
    "float16": ("f", 16),
    "bfloat16": ("b", 16),
    "float32": ("f", 32),
    "float64": ("f", 64),
    "complex64": ("c", 64),
    "complex128": ("c", 128),
    "int8": ("s", 8),
    "int16": ("s", 16),
    "int32": ("s", 32),
    "int64": ("s", 64),
    "uint8": ("u", 8),
    "uint16": ("u", 16),
    "uint32": ("u", 32),
    "uint64": ("u", 64),
    "bool": ("p", 8),
    "float8_e4m3fn": ("e", 8),
    "float8_e4m3fnuz": ("E", 8),
    "float8_e5m2": ("m", 8),
    "float8_e5m2fnuz": ("M", 8),
    "float8_e8m0fnu": ("x", 8),
    "float4_e2m1fn_x2": ("q", 8),
}
RANKS_ONLY = list(TABLE)[15:]
DTYPES = [getattr(torch, name) for name in TABLE if hasattr(torch, name)]


class Refused(ValueError):
    """A caller's own error class (the worker's CodecError, CollectiveMismatchError)."""


def _encode(tensor: torch.Tensor, dtypes: tensor_codec.Dtypes = ALL) -> bytes:
    return joined(*pieces(tensor, dtypes))


def _raw(tensor: torch.Tensor) -> bytes:
    """The elements of a plain tensor as bytes (any dtype: as uint8)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Elements of every bit pattern the dtype's bytes can hold (random bytes)."""
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def _documented() -> dict[str, tuple[str, int]]:
    """The dtype tables of docs/protocol.md: ``| float32 | f 32 | ... |`` rows."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    found = {}
    for name, kind, bits in re.findall(r"\| (\w+) \| (\w) (\d+) (?=\|)", text):
        found[name] = (kind, int(bits))
    return found


def test_the_dtype_table_is_the_documented_one() -> None:
    assert _documented() == TABLE
    for dtype in DTYPES:
        kind, bits = TABLE[str(dtype).removeprefix("torch.")]
        assert ALL.codes[dtype] == bytes((ord(kind), bits))
        assert bits == 8 * dtype.itemsize
    assert len(ALL.codes) == len(DTYPES) and len(ALL.by_code) == len(DTYPES)  # one code each
    assert set(BRIDGE.codes) == {d for d in DTYPES if str(d)[6:] not in RANKS_ONLY}
    assert all(BRIDGE.codes[d] == ALL.codes[d] for d in BRIDGE.codes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3), (2, 0, 4)], ids=str)
def test_every_dtype_round_trips_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _sample(dtype, shape)
    payload = _encode(tensor)
    dims = b"".join(size.to_bytes(8, "big") for size in shape)
    assert payload == ALL.codes[dtype] + bytes([len(shape)]) + dims + _raw(tensor)
    back = decode(payload)
    assert back.dtype == dtype and back.shape == tensor.shape and _raw(back) == _raw(tensor)
    into = torch.empty(shape, dtype=dtype)
    assert decode(payload, into) is into and _raw(into) == _raw(tensor)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, dtype=torch.complex64).conj(),  # conjugate bit, contiguous
        lambda: torch.randn(3, 2, dtype=torch.complex128).conj().t(),  # and strided
        lambda: torch._neg_view(torch.randn(5)),  # negative bit, contiguous
        lambda: torch.randn(4, dtype=torch.complex64).conj().imag,  # and strided
        lambda: torch.arange(6.0, requires_grad=True) * 2,  # in a graph
        lambda: torch.nn.Parameter(torch.ones(2, 2)),  # a leaf that requires grad
        lambda: torch.arange(12.0).reshape(3, 4).t(),  # transposed
        lambda: torch.arange(3.0).expand(2, 3),  # elements that share memory
        lambda: torch.randn(2, 3, dtype=torch.complex64).conj()[:0],  # none, conjugate
    ],
    ids=[
        "conj",
        "conj-strided",
        "neg",
        "neg-strided",
        "graph",
        "leaf",
        "transposed",
        "expanded",
        "empty-conj",
    ],
)
def test_a_view_is_sent_as_its_values(make: Callable[[], torch.Tensor]) -> None:
    tensor = make()
    values = tensor.detach().resolve_conj().resolve_neg().clone().contiguous()
    assert _encode(tensor) == _encode(values)
    assert torch.equal(decode(_encode(tensor)), values)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: torch.arange(3.0).to_sparse(), "a sparse_coo tensor cannot be sent"),
        (lambda: torch.zeros(0, 3).to_sparse(), "a sparse_coo tensor cannot be sent"),
        (lambda: torch.eye(2).to_sparse_csr(), "a sparse_csr tensor cannot be sent"),
        (lambda: torch.nested.nested_tensor([torch.zeros(2)]), "a nested tensor cannot be sent"),
        (lambda: torch.nested.nested_tensor([]), "a nested tensor cannot be sent"),
        (lambda: torch.empty(3, device="meta"), "a meta tensor cannot be sent"),
        (lambda: torch.empty(0, device="meta"), "a meta tensor cannot be sent"),
        (lambda: [1.0, 2.0], "expected a torch.Tensor, got list"),
        (lambda: torch.zeros(2, dtype=torch.complex32), "tensors of dtype torch.complex32 cannot"),
    ],
    ids=[
        "sparse",
        "sparse-empty",
        "csr",
        "nested",
        "nested-empty",
        "meta",
        "meta-empty",
        "list",
        "complex32",
    ],
)
def test_what_cannot_travel_is_refused_with_one_clear_error(
    make: Callable[[], Any], message: str
) -> None:
    with warnings.catch_warnings():  # torch's: CSR tensors are beta, nested ones prototypes
        warnings.simplefilter("ignore", UserWarning)
        value = make()
    for dtypes in (ALL, BRIDGE):
        with pytest.raises(TypeError, match=f"^{message}"):
            pieces(value, dtypes)


@pytest.mark.parametrize("name", RANKS_ONLY)
def test_float8_and_float4_travel_between_ranks_only(name: str) -> None:
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    tensor = _sample(dtype, (4,))
    with pytest.raises(TypeError, match=f"^tensors of dtype torch.{name} cannot cross the bridge"):
        pieces(tensor, BRIDGE)
    kind, bits = TABLE[name]
    with pytest.raises(Refused, match=f"^unknown tensor type '{kind}'{bits}$"):
        decode(_encode(tensor), dtypes=BRIDGE, error=Refused)


def _good() -> bytes:
    return _encode(torch.arange(6.0).reshape(2, 3))


HOSTILE = {
    "empty": (b"", "tensor payload shorter than its header"),
    "kind only": (b"f", "tensor payload shorter than its header"),
    "no ndim": (b"f\x20", "tensor payload shorter than its header"),
    "shape cut": (_good()[:10], "tensor payload shorter than its shape"),
    "255 dims, none there": (b"f\x20\xff", "tensor payload shorter than its shape"),
    "unknown kind": (b"z" + _good()[1:], "unknown tensor type 'z'32"),
    "unknown bits": (b"f\x18" + _good()[2:], "unknown tensor type 'f'24"),
    "not ASCII": (b"\xff\x20" + _good()[2:], "unknown tensor type 'ÿ'32"),
    "a byte short": (
        _good()[:-1],
        r"tensor of shape \(2, 3\) and type f32 needs 24 bytes of data, got 23",
    ),
    "a byte long": (
        _good() + b"\0",
        r"tensor of shape \(2, 3\) and type f32 needs 24 bytes of data, got 25",
    ),
    "u64 overflow": (
        b"u\x08\x02" + (1 << 63).to_bytes(8, "big") + (1 << 63).to_bytes(8, "big"),
        r"tensor shape \(9223372036854775808, 9223372036854775808\) is too large",
    ),
    "extent past 2^63, no elements": (
        b"f\x20\x03" + b"".join(d.to_bytes(8, "big") for d in (0, 1 << 62, 4)),
        r"tensor shape \(0, 4611686018427387904, 4\) is too large: torch's sizes and strides",
    ),
    "2^64 elements, 4 bytes": (
        b"f\x20\x02" + (1 << 32).to_bytes(8, "big") * 2 + bytes(4),
        r"tensor shape \(4294967296, 4294967296\) is too large",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_payload_is_one_clear_error_of_the_callers_class(case: str) -> None:
    payload, message = HOSTILE[case]
    for data in (payload, bytearray(payload), memoryview(bytearray(payload))):
        with pytest.raises(Refused, match=f"^{message}"):
            decode(data, error=Refused)
        with pytest.raises(ValueError, match=f"^the value of 'k' is a malformed tensor: {message}"):
            decode(data, what="the value of 'k'")
    into = torch.full((2, 3), 7.0)
    with pytest.raises(Refused):
        decode(payload, into, what="v", error=Refused)
    assert torch.equal(into, torch.full((2, 3), 7.0))  # nothing written


def test_a_receiver_of_another_dtype_or_shape_gets_nothing() -> None:
    payload = _encode(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    for into, differs in (
        (torch.zeros(3, 2, dtype=torch.int32), "shape"),
        (torch.zeros(2, 3, dtype=torch.int64), "dtype"),
        (torch.zeros(6, dtype=torch.float32), "dtype and shape"),
    ):
        with pytest.raises(Refused, match=rf"^v is a torch.int32 tensor .*\(different {differs}\)"):
            decode(payload, into, what="v", error=Refused)
        assert not into.any()


@pytest.mark.parametrize("numel", [6, 1 << 17, 1 << 22], ids=["small", "large", "16MiB"])
def test_a_receiver_is_written_in_place_or_described(numel: int) -> None:
    sent = torch.randn(numel)
    payload = _encode(sent)
    into = torch.zeros(numel)
    assert decode(payload, into) is into and torch.equal(into, sent)  # in place
    leaf = torch.zeros(numel, requires_grad=True)
    assert decode(payload, leaf) is leaf and torch.equal(leaf.detach(), sent)
    assert leaf.grad_fn is None
    for like in (torch.zeros(2 * numel)[::2], torch.empty(numel, device="meta")):
        got = decode(payload, like)  # strided, meta: only described, a new tensor returned
        assert got is not like and got.is_contiguous() and torch.equal(got, sent)
    assert not torch.zeros(2 * numel)[::2].any()


@pytest.mark.parametrize("numel", [6, 1 << 17], ids=["small", "large"])
def test_a_decoded_tensor_owns_aligned_writable_memory_unless_shared(numel: int) -> None:
    sent = torch.randn(numel, dtype=torch.complex128)
    payload = _encode(sent)
    at = 64 - tensor_codec.header_size(1) % 64  # the elements on a 64-byte boundary
    frame = bytearray(at) + bytearray(payload)
    shared_view = memoryview(frame)[at:]
    for data, share in (
        (payload, True),  # read-only: copied
        (memoryview(bytearray(b"\0" + payload))[1:], True),  # misaligned: copied
        (shared_view, False),  # not asked to share
    ):
        back = decode(data, share=share)
        assert torch.equal(back, sent) and back.data_ptr() % 16 == 0
        back.zero_()  # writable, and nobody else's memory
        assert torch.equal(decode(data), sent)
    shared = decode(shared_view, share=True)
    assert torch.equal(shared, sent)
    if numel * 16 >= 1 << 18:  # only a large tensor shares its frame
        start = torch.frombuffer(frame, dtype=torch.uint8).data_ptr()
        assert start <= shared.data_ptr() < start + len(frame)


def test_the_wire_is_little_endian_on_every_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # A big-endian host reverses every number's bytes (a complex number's parts each)
    # on the way out and back in; here, a little-endian host is told it is big-endian.
    monkeypatch.setattr(tensor_codec, "_SWAP", True)
    ints = torch.tensor([1, 0x0102], dtype=torch.int32)
    _, data = pieces(ints)
    assert bytes(data or b"") == b"\0\0\0\x01\0\0\x01\x02"
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    swapped = torch.tensor([1.0, 2.0]).numpy().byteswap().tobytes()
    assert _encode(z)[-8:] == swapped
    for tensor in (ints, z, torch.tensor([True, False]), torch.randn(1 << 17)):
        payload = _encode(tensor)
        assert torch.equal(decode(payload), tensor)  # the bytes came back reversed
        shared = memoryview(bytearray(payload))
        assert torch.equal(decode(shared, share=True), tensor)
        into = torch.empty_like(tensor)
        assert decode(payload, into) is into and torch.equal(into, tensor)


def test_the_codec_loads_nothing_of_the_distributed_package() -> None:
    # The worker decodes with it without paying for bridge_py.distributed's imports.
    code = (
        "import sys, bridge_py.tensor_codec, bridge_py.worker.codec\n"
        "assert 'bridge_py.distributed' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
