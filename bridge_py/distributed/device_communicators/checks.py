"""The argument checks, waits and message headers every communicator shares.

:class:`CommunicatorChecks` is mixed into ``DeviceCommunicatorBase`` (so into the CPU
communicator) and into ``PyNcclCommunicator``: one wording for every error about a
caller's arguments (``"<op> on rank R (global G) of <group>: <what is wrong>"``), one
wait within the caller's deadline, and one header format for point-to-point messages,
which the receiver compares with what it expects (see ``agreement``).

A class that mixes it in sets ``agreement`` (its :class:`Agreement`), ``device``,
``world_size``, ``backend`` (``"gloo"`` or ``"nccl"``, for the dtypes a sum supports) and
``_device_blocks`` (whether a wait on its data transport blocks the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed import Work

from bridge_py.distributed.device_communicators.agreement import (
    Agreement,
    Signature,
    describe_dtype,
    dtype_of,
    param,
    shape_text,
)
from bridge_py.distributed.device_communicators.wire_dtypes import reducible
from bridge_py.distributed.groups.work import finish
from bridge_py.tensor_codec import non_dense, overlapping

__all__ = ["CommunicatorChecks"]

_T = TypeVar("_T")


class CommunicatorChecks:
    """Validation, waits and message headers of a communicator (see the module docstring)."""

    agreement: Agreement
    device: torch.device
    world_size: int
    backend: str
    _device_blocks: bool

    def _error(self, op: str, message: str, kind: type[Exception] = ValueError) -> Exception:
        """An error about ``op``'s arguments, naming this rank and the group."""
        who = self.agreement.who(self.agreement.rank_in_group)
        return kind(f"{op} on {who} of {self.agreement.label}: {message}")

    def _check_tensor(
        self,
        op: str,
        tensor: Any,
        reduce: bool = False,
        *,
        name: str = "input_",
        like: torch.Tensor | None = None,
        strict: bool = False,
        written: bool = False,
    ) -> None:
        """``tensor`` (the parameter ``name``) is a dense tensor of this communicator's
        device type; summable with ``reduce``, of ``like``'s dtype when given, with
        ``written`` (the collective writes into it) without elements that share memory, and
        with ``strict`` contiguous, on this very device and not a conjugate or negative
        view."""
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
            raise self._error(op, f"{name}: expected a torch.Tensor, got {kind}", TypeError)
        if tensor.device.type != self.device.type or (strict and tensor.device != self.device):
            serves = self.device if strict else self.device.type
            raise self._error(
                op, f"{name} is on {tensor.device} but this communicator serves {serves} tensors"
            )
        layout = non_dense(tensor)
        if layout is not None:
            raise self._error(op, f"{name} is a {layout} tensor: collectives take dense tensors")
        if written and overlapping(tensor):
            raise self._error(
                op,
                f"{name} cannot be written: elements of it share memory (a stride of 0, as "
                "after expand()); pass a tensor of its own",
            )
        if strict and not tensor.is_contiguous():
            raise self._error(op, f"{name} must be contiguous (shape {tuple(tensor.shape)})")
        if strict and (tensor.is_conj() or tensor.is_neg()):
            raise self._error(
                op,
                f"{name} is a conjugate or negative view, whose memory does not hold its "
                "values: pass tensor.resolve_conj().resolve_neg()",
            )
        if like is not None and tensor.dtype != like.dtype:
            raise self._error(op, f"{name} is {tensor.dtype} but the input is {like.dtype}")
        if reduce and not reducible(tensor.dtype, self.backend):
            raise self._error(op, f"{name}: dtype {tensor.dtype} cannot be summed", TypeError)

    def _check_peer(self, op: str, name: str, peer: Any, allow_self: bool) -> int:
        """``peer`` (the parameter ``name``) as a rank of the group."""
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise self._error(
                op, f"{name} must be an int rank in the group, got {peer!r}", TypeError
            )
        if not 0 <= peer < self.world_size:
            raise self._error(
                op, f"invalid {name} rank ({peer}): the group has ranks 0..{self.world_size - 1}"
            )
        if not allow_self and peer == self.agreement.rank_in_group:
            raise self._error(op, f"{name} ({peer}) is this rank itself")
        return peer

    def _check_sizes(self, op: str, sizes: Any, name: str = "sizes") -> list[int]:
        """``sizes`` (the parameter ``name``) as one non-negative int per rank."""
        if not isinstance(sizes, Sequence) or isinstance(sizes, (str, bytes)):
            raise self._error(op, f"{name} must be a list of ints, got {sizes!r}", TypeError)
        if len(sizes) != self.world_size:
            raise self._error(
                op, f"{name} has {len(sizes)} entries but the group has {self.world_size} ranks"
            )
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
            raise self._error(op, f"{name} must be non-negative ints, got {list(sizes)}")
        return list(sizes)

    @staticmethod
    def _validated(check: Callable[[], _T]) -> tuple[_T | None, Exception | None]:
        """``check()``, or the TypeError/ValueError it raised about this rank's arguments."""
        try:
            return check(), None
        except (TypeError, ValueError) as exc:
            return None, exc

    def _finish(self, work: Any, op: str, cpu_group: bool = False) -> None:
        """Wait for the ``work`` of ``op`` (on the CPU group with ``cpu_group``), within
        the caller's deadline where the wait blocks the CPU (``groups.work.finish``). A
        wait that times out leaves the group unusable: its later collectives are refused
        (``Agreement.refuse_if_broken``), as is handing back this one's result."""
        agreement = self.agreement
        bounded = cpu_group or self._device_blocks
        finish(work, op, agreement.where, bounded=bounded, group=agreement.cpu_group)

    # ------------------------------------------------------------- message headers

    @staticmethod
    def _header(tensor: torch.Tensor, wire: torch.Tensor, shape: Any = None) -> torch.Tensor:
        """What a message announces (with checks on): its tensor's dtype and shape (or
        ``shape``), and the wire's form (whether it travels as bytes, how many elements)."""
        return Signature(
            "send",
            tensor.dtype,
            tuple(tensor.shape if shape is None else shape),
            (int(wire.dtype != tensor.dtype), wire.numel()),
        ).encode(False)

    def _expect(
        self,
        expected: torch.Tensor,
        src: int,
        receive: Callable[[torch.Tensor, bool], Work | None],
    ) -> None:
        """Receive the header of group rank ``src``'s message and compare it with the
        ``expected`` one; on a mismatch, receive the payload it announces, drop it (the pair
        stays in step) and raise a ValueError. ``receive(buffer, header)`` posts a receive."""
        got = torch.empty_like(expected)
        self._finish(receive(got, True), "recv", True)
        if torch.equal(got, expected):
            return
        sent, wanted = got.tolist(), expected.tolist()
        is_bytes, numel = param(sent, 0), param(sent, 1)
        if numel > 0:
            dtype = None if is_bytes else dtype_of(sent[2])
            scratch = torch.empty(numel, dtype=dtype or torch.uint8, device=self.device)
            self._finish(receive(scratch, False), "recv")
        raise self._error(
            "recv",
            f"expected shape {shape_text(wanted)} {describe_dtype(wanted[2])} from "
            f"{self.agreement.who(src)}, but it sent shape {shape_text(sent)} "
            f"{describe_dtype(sent[2])}; the message was received and dropped",
        )
