"""Make every rank agree on a collective's arguments before any data moves.

With gloo, ranks that call a collective with different shapes do not get an error: the
process aborts (``gloo::EnforceNotMet``, then ``terminate``) or hangs. And a rank that
rejects its own arguments (a ``dst`` out of range, a size that does not divide) leaves the
others blocked in the collective until the timeout.

:class:`Agreement` prevents both. Before a collective, each rank contributes one fixed-size
row of int64 (which operation, its dtype, shape and parameters, and whether its own
arguments were valid) to a single all-gather on the group's CPU (gloo) group. The row has
the same size whatever the arguments, so this exchange itself cannot mismatch. Every rank
then sees the same table and reaches the same verdict: all go on, or all raise a
:class:`CollectiveMismatchError` naming the group, the ranks and what differs. No rank is
left waiting, and the group stays usable.

The table travels on one of two carriers, with the same rows and the same verdicts: the
gloo all-gather above, or, when the communicator has shared-memory collectives, one
shared-memory step (``ShmCollectives.exchange``; an all-reduce carries its row in its own
first data step). Point-to-point messages reuse the row as their header (see
``DeviceCommunicatorBase.send``).

The check costs one small exchange per collective. It is on by default for CPU
communicators and off for CUDA ones (where it would add a host round trip to every
collective); the environment variable ``VLLM_BRIDGE_CHECK_COLLECTIVES`` (``1``/``0``)
overrides the default. It must have the same value on every rank of a group.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.torch_compat import all_gather_into
from bridge_py.distributed.errors import (
    CollectiveMismatchError,
    DistributedError,
)
from bridge_py.distributed.groups.objects import all_gather_bytes
from bridge_py.distributed.groups.work import finish, refuse_if_unusable

__all__ = [
    "ANY_DIM",
    "CHECK_ENV",
    "ROW_BYTES",
    "Agreement",
    "CollectiveMismatchError",
    "Judge",
    "Signature",
    "checks_enabled",
    "describe_dtype",
    "dtype_code",
    "dtype_of",
    "hash_ints",
    "shape_text",
]

CHECK_ENV = "VLLM_BRIDGE_CHECK_COLLECTIVES"

_MAX_DIMS = 8
_MAX_PARAMS = 4
# op, error flag, dtype, ndim, shape slots, parameter slots
_WIDTH = 4 + _MAX_DIMS + _MAX_PARAMS
_ROW = struct.Struct(f"<{_WIDTH}q")
ROW_BYTES = _ROW.size  # one encoded row, as the carriers move it
ANY_DIM = -2  # a shape entry that may differ between ranks (the gathered dim of all_gatherv)
_MAX_TEXT = 4096  # bytes of a rank's complaint shared with the others

# A carrier's verdict on the rows of every rank (rank order); raises to refuse.
Judge = Callable[[list[bytes]], None]

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def checks_enabled(device: torch.device) -> bool:
    """Whether collectives on ``device`` are checked: the environment, else CPU only."""
    value = os.environ.get(CHECK_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return device.type == "cpu"


def _stable_hash(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def dtype_code(dtype: torch.dtype) -> int:
    """A number naming ``dtype`` identically in every process."""
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)
    return _stable_hash(str(dtype))


def describe_dtype(code: int) -> str:
    """The dtype a :func:`dtype_code` names, as text."""
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else f"<dtype #{code}>"


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype a :func:`dtype_code` names, None for one that is not in the table."""
    return _DTYPES[code] if 0 <= code < len(_DTYPES) else None


@dataclass(frozen=True)
class Signature:
    """What must be equal on every rank for one collective call.

    ``shape`` entries equal to ``-2`` may differ between ranks. ``params`` are small ints
    (a normalised dim, a root, a hash of a size list); ``param_names`` name them in errors,
    a trailing ``#`` marking a hashed value.
    """

    op: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    params: tuple[int, ...] = ()
    param_names: tuple[str, ...] = field(default=())

    def encode(self, failed: bool) -> torch.Tensor:
        """This signature as one row of the agreement table (int64)."""
        return torch.tensor(self.values(failed), dtype=torch.int64)

    def row(self, failed: bool) -> bytes:
        """:meth:`encode`'s row as the bytes the carriers move (:data:`ROW_BYTES`)."""
        return _ROW.pack(*self.values(failed))

    def values(self, failed: bool) -> list[int]:
        """The ints of this signature's row: op, failed, dtype, ndim, shape, params."""
        row = [0] * _WIDTH
        row[0] = _stable_hash(self.op)
        row[1] = 1 if failed else 0
        row[2] = -1 if self.dtype is None else dtype_code(self.dtype)
        shape = self.shape
        if shape is None:
            row[3] = -1
        else:
            row[3] = len(shape)
            dims = list(shape[:_MAX_DIMS])
            if len(shape) > _MAX_DIMS:  # the tail shares the last slot, as a hash
                dims[-1] = _stable_hash(repr(tuple(shape[_MAX_DIMS - 1 :])))
            row[4 : 4 + len(dims)] = dims
        params = list(self.params[:_MAX_PARAMS])
        if len(self.params) > _MAX_PARAMS:
            params[-1] = _stable_hash(repr(tuple(self.params[_MAX_PARAMS - 1 :])))
        row[4 + _MAX_DIMS : 4 + _MAX_DIMS + len(params)] = params
        return row


def decode(row: bytes) -> list[int]:
    """The ints of a row that :meth:`Signature.row` packed."""
    return list(_ROW.unpack(row))


def param(row: Sequence[int], i: int) -> int:
    """Parameter ``i`` of a decoded row."""
    return row[4 + _MAX_DIMS + i]


def shape_text(row: Sequence[int]) -> str:
    """The shape of a decoded row as text (``(4, 2)``, ``*`` for a dim that may differ)."""
    ndim = row[3]
    if ndim < 0:
        return "no tensor"
    dims = ["*" if d == ANY_DIM else str(d) for d in row[4 : 4 + min(ndim, _MAX_DIMS)]]
    if ndim > _MAX_DIMS:
        dims[-1] = "..."
    return "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"


class Agreement:
    """The pre-collective argument check of one group (see the module docstring).

    ``carrier`` moves this rank's row and hands every rank's rows to a judge: the gloo
    all-gather by default; a communicator with shared-memory collectives sets its
    ``ShmCollectives.exchange``.
    """

    def __init__(
        self,
        cpu_group: ProcessGroup,
        rank_in_group: int,
        ranks: Sequence[int],
        label: str,
        enabled: bool,
    ) -> None:
        self.cpu_group = cpu_group
        self.rank_in_group = rank_in_group
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.label = label
        self.enabled = enabled
        self.carrier: Callable[[bytes, Judge], None] = self._over_gloo
        # The operation being checked, and where: what a timed-out exchange names.
        self.checking = ""
        self.where = f"{self.who(rank_in_group)} of {label}"

    def refuse_if_broken(self, op: str) -> None:
        """Raise StateError when an earlier operation on this group was abandoned (it timed
        out): this rank's ``op`` would be matched with what the other ranks still run of
        that one (``groups.work.refuse_if_unusable``)."""
        refuse_if_unusable(self.cpu_group, op, self.where)

    def who(self, rank_in_group: int) -> str:
        """``rank R (global G)`` for a rank of this group."""
        return f"rank {rank_in_group} (global {self.ranks[rank_in_group]})"

    def check(self, signature: Signature, error: Exception | None = None) -> None:
        """Raise on every rank unless all ranks passed valid, matching arguments.

        ``error`` is this rank's own complaint about its arguments (None when they are
        valid). With checks disabled, or in a group of one, it is raised at once and nothing
        is exchanged.
        """
        self.refuse_if_broken(signature.op)
        if not self.enabled or self.world_size == 1:
            if error is not None:
                raise error
            return
        row = signature.row(error is not None)
        self.checking = signature.op
        self.carrier(row, lambda rows: self.judge(signature, rows, error))

    def step(self, signature: Signature) -> tuple[bytes, Judge]:
        """The row a shared-memory operation carries in its first step, and its judge. With
        checks off the row still goes along: ranks out of step raise, never mix data."""
        self.refuse_if_broken(signature.op)
        return signature.row(False), lambda rows: self.judge(signature, rows, None)

    def _over_gloo(self, row: bytes, judge: Judge) -> None:
        """The gloo carrier: one all-gather of every rank's row."""
        mine = torch.frombuffer(bytearray(row), dtype=torch.int64)
        table = torch.empty(self.world_size * _WIDTH, dtype=torch.int64)
        work = all_gather_into(table, mine, self.cpu_group, async_op=True)
        finish(work, f"{self.checking} (its argument check)", self.where, group=self.cpu_group)
        data = table.numpy().tobytes()
        judge([data[r * ROW_BYTES : (r + 1) * ROW_BYTES] for r in range(self.world_size)])

    def judge(self, signature: Signature, rows: list[bytes], error: Exception | None) -> None:
        """The verdict on every rank's row: return, or raise (the same on every rank)."""
        first = rows[0]
        if error is None and first[8:16] == bytes(8) and all(row == first for row in rows):
            return  # the common case, decided without decoding
        table = [decode(row) for row in rows]
        if any(r[1] for r in table):
            # Rare path: share the complaints so that every rank can say what went wrong.
            texts = self._complaints("" if error is None else str(error))
            if error is not None:
                raise error
            culprits = [f"{self.who(r)}: {texts[r]}" for r in range(self.world_size) if table[r][1]]
            raise CollectiveMismatchError(
                f"{signature.op} in {self.label} was not run because other ranks rejected "
                f"their arguments: " + "; ".join(culprits)
            )
        other = next((r for r in range(1, self.world_size) if table[r] != table[0]), None)
        if other is not None:
            raise CollectiveMismatchError(self._explain(signature, table, 0, other))

    def _complaints(self, text: str) -> list[str]:
        """Every rank's ``text`` (its first :data:`_MAX_TEXT` bytes), in rank order: bytes
        decoded as UTF-8, never unpickled, since these messages are only text and anyone who
        can inject into the group's connection would choose the bytes."""
        try:
            parts = all_gather_bytes(
                self.cpu_group, text.encode()[:_MAX_TEXT], _MAX_TEXT, where=self.where
            )
        except DistributedError:  # a forged size: say so rather than allocate what it asks
            return ["(a complaint that is not one: its size is out of range)"] * self.world_size
        return [part.decode(errors="replace") for part in parts]

    def _explain(self, signature: Signature, rows: list[list[int]], a: int, b: int) -> str:
        ra, rb = rows[a], rows[b]
        head = f"{signature.op} in {self.label}: "
        if ra[0] != rb[0]:
            return head + (
                f"{self.who(a)} and {self.who(b)} called different collectives at the "
                "same point (every rank of a group must call the same collectives in the "
                "same order)"
            )
        if ra[2 : 4 + _MAX_DIMS] != rb[2 : 4 + _MAX_DIMS]:
            return head + (
                f"ranks disagree on the tensor: {self.who(a)} has shape {shape_text(ra)} "
                f"{describe_dtype(ra[2])}, {self.who(b)} has shape {shape_text(rb)} "
                f"{describe_dtype(rb[2])}"
            )
        for i in range(_MAX_PARAMS):
            if param(ra, i) != param(rb, i):
                name = signature.param_names[i] if i < len(signature.param_names) else "args"
                if name.endswith("#"):  # a hashed value: its number means nothing to a reader
                    return head + (
                        f"ranks disagree on {name[:-1]}: {self.who(a)} and {self.who(b)} "
                        "passed different values"
                    )
                return head + (
                    f"ranks disagree on {name}: {self.who(a)} passed {param(ra, i)}, "
                    f"{self.who(b)} passed {param(rb, i)}"
                )
        return head + f"{self.who(a)} and {self.who(b)} passed different arguments"


def hash_ints(values: Sequence[int] | None) -> int:
    """A stable number standing for a list of ints (or None) in a :class:`Signature`."""
    return -1 if values is None else _stable_hash(repr([int(v) for v in values]))
