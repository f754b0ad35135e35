"""A StatelessProcessGroup on vLLM's wire: what vLLM's own class does through the store.

With ``create(..., wire="vllm")`` (or ``VLLM_BRIDGE_WIRE=vllm``) a rank of ours can be in one
group with ranks running ``vllm.distributed.utils.StatelessProcessGroup`` (vLLM 0.33 and
0.34, whose class is the same): every operation writes and reads the keys vLLM's does, with
the values it does, and advances the same counters:

* ``send_obj``/``send``: ``send_to/<dst>/<n>`` and ``send_tensor/<dst>/<n>``, numbered by
  the sender's ``send_dst_counter[dst]`` (both kinds share it); the receiver reads
  ``.../<its rank>/<recv_src_counter[src]>``;
* ``broadcast_obj``/``broadcast``: ``broadcast_from/<src>/<n>`` and
  ``broadcast_tensor/<src>/<n>``, by ``broadcast_send_counter`` and
  ``broadcast_recv_src_counter[src]``; ``all_gather_obj`` is one broadcast from every rank,
  and ``all_reduce`` an ``all_gather_obj`` of the tensors, folded in rank order into a new
  tensor;
* ``barrier``: rank 0 broadcasts ``barrier_<uuid>``, every rank sets
  ``arrival_<id>_<rank>`` and waits for all of them, then sets ``departure_<id>_<rank>``;
  rank 0 waits for every departure and deletes the keys;
* values are pickles (tensors too, as ``pickle.dumps(tensor)``), written by
  ``vllm_pickle.dumps`` and read by its allow-list (``vllm_pickle.loads``), never by full
  pickle unless the operator allows it.

Where the wire leaves room, it does better than vLLM's class: every wait is bounded by the
caller's ``timeout`` (a barrier's own, else the store's) and deadline, and fails with our
errors naming this rank, the peer and the key; a receive that times out leaves its counter
where it was, so the next call waits for the same value; and a received object's key is
deleted by its receiver (vLLM's stay until the sender expires them). No auth key can be
used: vLLM's ranks could not check it.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING, Any, Protocol

import torch

from bridge_py import deadline
from bridge_py.distributed import vllm_pickle
from bridge_py.distributed.auth import ENV_VAR as AUTH_ENV_VAR
from bridge_py.distributed.auth import AuthenticationError, key_required, switched_on
from bridge_py.distributed.errors import (
    BarrierFailure,
    BarrierTimeout,
    CollectiveMismatchError,
    GroupTimeout,
)
from bridge_py.distributed.spg import tensors
from bridge_py.distributed.spg.common import lost, timed_out, wait_limit
from bridge_py.distributed.store.quiet import QUIET
from bridge_py.distributed.store.requests import StoreRequest
from bridge_py.distributed.store.torch_api import set_bytes
from bridge_py.distributed.store.waiting import BoundedWaiter

if TYPE_CHECKING:
    from collections import deque

    from torch.distributed import Store

__all__ = ["ALLOW_ENV_VAR", "WIRES", "WIRE_ENV_VAR", "VllmWire", "resolve_wire"]

WIRE_ENV_VAR = "VLLM_BRIDGE_WIRE"
ALLOW_ENV_VAR = "VLLM_BRIDGE_ALLOW_VLLM_WIRE"
WIRES = ("bridge", "vllm")


def resolve_wire(wire: str | None) -> str:
    """The wire a group uses: ``wire`` itself, else ``$VLLM_BRIDGE_WIRE``, else "bridge".

    "vllm" is refused (AuthenticationError) where the operator asked for authenticated
    groups (``$VLLM_BRIDGE_AUTH_KEY`` or ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY``), since vLLM's
    ranks cannot check a key, unless the operator also allows it with
    ``$VLLM_BRIDGE_ALLOW_VLLM_WIRE=1``. ValueError for a wire that is neither.
    """
    chosen = os.environ.get(WIRE_ENV_VAR, "").strip() or "bridge" if wire is None else wire
    if chosen not in WIRES:
        source = f"${WIRE_ENV_VAR}" if wire is None else "wire"
        raise ValueError(f"{source} must be 'bridge' or 'vllm', got {chosen!r}")
    allowed = switched_on(ALLOW_ENV_VAR)
    if chosen == "vllm" and (os.environ.get(AUTH_ENV_VAR) or key_required()) and not allowed:
        raise AuthenticationError(
            f"refused wire='vllm': the operator requires authenticated groups ({AUTH_ENV_VAR} "
            f"or its REQUIRE switch is set) and vLLM's ranks cannot check a key; the operator "
            f"may allow the vLLM wire with {ALLOW_ENV_VAR}=1"
        )
    return chosen


class GroupState(Protocol):
    """The fields of a StatelessProcessGroup (vLLM's) that its operations advance."""

    send_dst_counter: dict[int, int]
    recv_src_counter: dict[int, int]
    broadcast_send_counter: int
    broadcast_recv_src_counter: dict[int, int]
    entries: deque[tuple[str, float]]
    data_expiration_seconds: int


class VllmWire:
    """One rank's operations on vLLM's wire (see the module docstring).

    The group's own fields hold the state vLLM's class keeps (its counters and ``entries``),
    so each operation takes the group; this object holds only the connections it waits on
    and deletes with.
    """

    def __init__(self, store: Store, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._others = [r for r in range(world_size) if r != rank]
        self._waiter = BoundedWaiter(store)

    def limit(self, timeout: float | None) -> float:
        """``timeout`` (None: the store's), checked to be a positive number of seconds,
        and clamped to the running call's deadline (``bridge_py.deadline``) if it has one."""
        return deadline.clamp(wait_limit(self.store, timeout))

    # --- writing and waiting ------------------------------------------------------------

    def _put(self, group: GroupState, op: str, key: str, value: Any) -> None:
        """vLLM's write of one value: expire what is due, set ``key``, remember it."""
        data = vllm_pickle.dumps(value)
        self.expire(group)
        with StoreRequest(op, self.rank, key, store=self.store):
            set_bytes(self.store, key, data)
        group.entries.append((key, time.time()))

    def _get(self, op: str, keys: list[str], srcs: list[int], timeout: float) -> list[bytes]:
        """The values of ``keys`` (written by ``srcs``) once all exist; GroupTimeout naming
        the ranks whose keys are missing after ``timeout`` seconds."""
        start = time.monotonic()
        try:
            with QUIET:
                found = self._waiter.multi_get(keys, timeout)
        except RuntimeError as exc:
            raise lost(op, self.rank, ", ".join(map(repr, keys)), -1, start, exc) from exc
        if found is not None:
            return found
        missing = [(k, s) for k, s in zip(keys, srcs, strict=True) if not self._exists(k)]
        keys_missing = [k for k, _ in missing] or keys
        whom: int | list[int] = srcs[0] if len(srcs) == 1 else [s for _, s in missing] or srcs
        what = f"key {keys_missing[0]!r}" if len(keys_missing) == 1 else f"keys {keys_missing}"
        raise timed_out(op, self.rank, what, whom, start, timeout)

    def _delete(self, keys: list[str], op: str) -> None:
        """Delete ``keys``, as vLLM's barrier deletes its keys (one request each)."""
        for key in keys:
            with StoreRequest(op, self.rank, key, "deleting", store=self.store):
                self.store.delete_key(key)

    def _exists(self, key: str) -> bool:
        with StoreRequest("a timed-out wait", self.rank, key, "checking", store=self.store):
            return bool(self.store.check([key]))

    # --- point to point -----------------------------------------------------------------

    def send(self, group: GroupState, kind: str, value: Any, dst: int) -> None:
        """``send_obj`` (``kind`` "send_to") or ``send`` ("send_tensor") to ``dst``."""
        op = "send_obj" if kind == "send_to" else "send"
        self._put(group, op, f"{kind}/{dst}/{group.send_dst_counter[dst]}", value)
        group.send_dst_counter[dst] += 1

    def recv(self, group: GroupState, kind: str, src: int, timeout: float | None) -> Any:
        """``recv_obj`` (``kind`` "send_to") or ``recv``'s value from ``src`` (for ``recv``
        a tensor, else CollectiveMismatchError); its key is deleted once read (only this
        rank reads it)."""
        op = "recv_obj" if kind == "send_to" else "recv"
        key = f"{kind}/{self.rank}/{group.recv_src_counter[src]}"
        data = self._get(op, [key], [src], self.limit(timeout))[0]
        group.recv_src_counter[src] += 1  # received: consumed, whether or not it loads
        self._delete([key], op)
        value = vllm_pickle.loads(data, f"the value {key!r} from rank {src}")
        if kind == "send_tensor" and not isinstance(value, torch.Tensor):
            raise CollectiveMismatchError(
                f"recv on rank {self.rank}: rank {src} sent {type(value).__name__}, not a tensor"
            )
        return value

    # --- collectives --------------------------------------------------------------------

    def broadcast_send(self, group: GroupState, kind: str, value: Any) -> None:
        """The source's side of ``broadcast_obj`` (``kind`` "broadcast_from") or
        ``broadcast`` ("broadcast_tensor")."""
        op = "broadcast_obj" if kind == "broadcast_from" else "broadcast"
        self._put(group, op, f"{kind}/{self.rank}/{group.broadcast_send_counter}", value)
        group.broadcast_send_counter += 1

    def broadcast_recv(self, group: GroupState, kind: str, src: int, timeout: float | None) -> Any:
        """A receiver's side of ``broadcast_send``: the value ``src`` broadcast next."""
        op = "broadcast_obj" if kind == "broadcast_from" else "broadcast"
        key = f"{kind}/{src}/{group.broadcast_recv_src_counter[src]}"
        data = self._get(op, [key], [src], self.limit(timeout))[0]
        group.broadcast_recv_src_counter[src] += 1
        return vllm_pickle.loads(data, f"the value {key!r} from rank {src}")

    def all_gather(self, group: GroupState, value: Any, op: str) -> list[Any]:
        """Every rank's ``value`` in rank order: one broadcast from each rank, read in one
        wait (of the store's timeout) for all of them."""
        timeout = self.limit(None)
        self.broadcast_send(group, "broadcast_from", value)
        counters = group.broadcast_recv_src_counter
        keys = [f"broadcast_from/{r}/{counters[r]}" for r in self._others]
        datas = self._get(op, keys, self._others, timeout)
        gathered = [value] * self.world_size
        for src, key, data in zip(self._others, keys, datas, strict=True):
            counters[src] += 1
            gathered[src] = vllm_pickle.loads(data, f"the value {key!r} from rank {src}")
        return gathered

    def all_reduce(self, group: GroupState, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        """vLLM's ``all_reduce``: every rank's tensor gathered as an object, folded in rank
        order into a new tensor (on ``tensor``'s device)."""
        fold = tensors.reducer(op)  # a bad op fails before anything is sent
        gathered = self.all_gather(group, tensor, "all_reduce")
        for src, other in enumerate(gathered):
            if (
                not isinstance(other, torch.Tensor)
                or other.dtype != tensor.dtype
                or other.shape != tensor.shape
            ):
                what = type(other).__name__
                if isinstance(other, torch.Tensor):
                    what = f"{other.dtype} {tuple(other.shape)}"
                raise CollectiveMismatchError(
                    f"all_reduce on rank {self.rank}: rank {src} gave {what}, this rank "
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                )
        cpu = [t.to("cpu") for t in gathered]
        return tensors.reduce(cpu, fold).to(tensor.device)

    def barrier(self, group: GroupState, timeout: float) -> None:
        """vLLM's three-phase barrier, each wait bounded by ``timeout`` (the caller's, already
        clamped to its deadline)."""
        if self.rank == 0:
            barrier_id = f"barrier_{uuid.uuid4()}"
            self.broadcast_send(group, "broadcast_from", barrier_id)
        else:
            barrier_id = self._barrier_id(group, timeout)
        arrivals = [f"arrival_{barrier_id}_{r}" for r in range(self.world_size)]
        departures = [f"departure_{barrier_id}_{r}" for r in range(self.world_size)]
        self._barrier_phase(arrivals, timeout, "1 (arrival)", wait=True)
        self._barrier_phase(departures, timeout, "2 (departure)", wait=self.rank == 0)
        if self.rank == 0:
            self._delete(arrivals + departures, "barrier")

    def _barrier_id(self, group: GroupState, timeout: float) -> str:
        try:
            barrier_id = self.broadcast_recv(group, "broadcast_from", 0, timeout)
        except GroupTimeout as exc:
            raise BarrierTimeout(
                f"barrier on rank {self.rank} timed out after {timeout:g} s waiting for "
                f"rank 0 to broadcast the barrier's id: {exc}"
            ) from exc
        if not isinstance(barrier_id, str) or not barrier_id.startswith("barrier_"):
            raise BarrierFailure(
                f"barrier on rank {self.rank}: rank 0 broadcast {type(barrier_id).__name__} "
                "where the barrier's id was expected (did it call something else?)"
            )
        return barrier_id

    def _barrier_phase(self, keys: list[str], timeout: float, phase: str, wait: bool) -> None:
        """Set this rank's key of ``keys``; then, if ``wait``, wait for all of them."""
        with StoreRequest("barrier", self.rank, keys[self.rank], store=self.store):
            set_bytes(self.store, keys[self.rank], b"1")
        if not wait:
            return
        start = time.monotonic()
        try:
            with QUIET:
                arrived = self._waiter.wait(keys, timeout)
        except RuntimeError as exc:
            raise lost("barrier", self.rank, f"phase {phase}", -1, start, exc) from exc
        if arrived:
            return
        missing = [r for r, key in enumerate(keys) if not self._exists(key)]
        whom = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        raise BarrierTimeout(
            f"barrier on rank {self.rank} timed out after {timeout:g} s in phase {phase}: "
            f"{self.world_size - len(missing)} of {self.world_size} ranks arrived, {whom} "
            f"did not (keys {[keys[r] for r in missing]})"
        )

    # --- expiry -------------------------------------------------------------------------

    def expire(self, group: GroupState) -> None:
        """vLLM's ``expire_data``: delete the keys this rank wrote, oldest first, while
        they are older than ``data_expiration_seconds``."""
        entries, now = group.entries, time.time()
        while entries and now - entries[0][1] > group.data_expiration_seconds:
            key = entries[0][0]
            with StoreRequest("expire_data", self.rank, key, "deleting", store=self.store):
                self.store.delete_key(key)
            entries.popleft()
