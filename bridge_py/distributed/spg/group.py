"""StatelessProcessGroup: vLLM's metadata group over a TCPStore, with the same names and fields.

Compatible with ``vllm.distributed.utils.StatelessProcessGroup`` (fields, their order,
counters, method signatures, pickled objects between ranks), and better in these ways:

* ``create`` binds only the given interface (IPv4 or IPv6), accepts a pre-bound socket,
  returns only when all ranks have joined, and says why when it cannot;
* every wait is bounded (``recv_obj`` and ``broadcast_obj`` take a keyword-only
  ``timeout``, ``barrier`` keeps to its own) and fails with an error naming this rank, the
  peer and what it waited for; a rank that exits is reported within a second on one node;
* a receive that gave up took nothing (the next one gets the object), but a collective
  that failed (``barrier``, ``all_gather_obj``, ``all_reduce``) leaves the ranks out of
  step, so the group refuses every later operation at once, naming that collective
  (NCCL's abort rule), instead of failing each one after its full timeout;
* the store stays small: values are deleted once every receiver has read them;
* with a shared key (``create(..., auth_key=...)``, ``group.auth_key = ...`` or the
  environment variable ``VLLM_BRIDGE_AUTH_KEY``) every value carries an HMAC-SHA256 tag
  bound to its name, checked before unpickling: whoever can reach the store but lacks the
  key cannot make a rank unpickle anything;
* ``send``, ``recv``, ``broadcast`` and ``all_reduce`` move a tensor as its dtype, shape and
  bytes (``tensor_codec``), never as a pickle, and check it against the receiver's tensor;
  ``all_reduce`` reduces in rank order, so every rank gets the same bits.

Implementation: the group is a thin facade over one transport, chosen once when ``create``
has learnt where its ranks run (each rank publishes a node card: its machine, and the name
of a shared-memory board it made). Ranks on several machines use ``StoreTransport``
(``store_transport.py``); ranks that all share one use ``ShmTransport``
(``shm_transport.py``), which posts on boards and rings FIFO doorbells and sends through
the store only what does not fit. A group constructed directly from a store uses the store.
Both pack values the same way (``values.py``: pickles, or segments for large ones, sealed
with the key).

That is this package's wire, for groups of its own ranks. ``create(..., wire="vllm")`` (or
``$VLLM_BRIDGE_WIRE=vllm``) puts the group on vLLM's wire instead, to be in one group with
ranks running vLLM's class: ``vllm_wire.py`` does every operation there, and each method
below hands it over in its first lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any

import torch
from torch.distributed import ReduceOp, Store

from bridge_py import deadline, tensor_codec
from bridge_py.distributed.auth import AuthenticationError, AuthKey, resolve_key
from bridge_py.distributed.errors import (
    BarrierFailure,
    CollectiveMismatchError,
    GroupTimeout,
    PeerGoneError,
    StoreError,
    unusable_group,
)
from bridge_py.distributed.shm import segments
from bridge_py.distributed.spg import tensors, values
from bridge_py.distributed.spg.board import Board, BoardError
from bridge_py.distributed.spg.shm_transport import ShmTransport, queue_flusher
from bridge_py.distributed.spg.store_transport import StoreTransport
from bridge_py.distributed.spg.vllm_wire import VllmWire, resolve_wire
from bridge_py.distributed.store import (
    format_address,
    format_seconds,
    join_group,
    open_store,
    plain_host,
    require_queues,
)

__all__ = ["StatelessProcessGroup", "validate_rank"]

Socket = socket.socket
logger = logging.getLogger(__name__)

JOIN_NOTICE_AFTER = 5.0
"""Seconds a rank waits in ``create`` before it logs (once) that it is still waiting."""

_OUT_OF_STEP = (GroupTimeout, PeerGoneError, StoreError, BarrierFailure)
"""How a collective fails when its ranks may no longer agree on which call is which: the
group is unusable after one (``StatelessProcessGroup._fail``)."""

_NO_KEY_ON_VLLM_WIRE = "auth_key cannot be used with wire='vllm': vLLM's ranks could not check it"


def validate_rank(rank: int, world_size: int, name: str = "rank") -> None:
    """Raise TypeError/ValueError unless ``world_size >= 1`` and ``0 <= rank < world_size``."""
    if type(rank) is int and type(world_size) is int and 0 <= rank < world_size:
        return  # every call of a correct program: two type tests and a comparison
    for label, value in (("world_size", world_size), (name, rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{name} must be in [0, {world_size}), got {rank}")


@dataclasses.dataclass
class StatelessProcessGroup:
    """A dataclass to hold a metadata store, and the rank, world_size of the
    group. Only use it to communicate metadata between processes.
    For data-plane communication, create NCCL-related objects.

    Objects are pickled between ranks: only form groups with processes you trust, or give
    every rank the same auth key (see :meth:`create`), so that values written by anyone
    without the key are refused before they are unpickled. Tensors (:meth:`send`,
    :meth:`recv`, :meth:`broadcast`, :meth:`all_reduce`) travel as their bytes, never
    pickled, and are sealed with the same key.
    """

    rank: int
    world_size: int
    store: Store
    # Rank 0's listening socket (None elsewhere), kept so that it lives as long as the group.
    socket: Socket | None
    data_expiration_seconds: int = 3600
    # dst rank -> number of objects sent to it
    send_dst_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    # src rank -> number of objects received from it
    recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    broadcast_send_counter: int = 0
    # src rank -> number of broadcasts received from it
    broadcast_recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    # Keys this rank wrote, with the time written, oldest first (see expire_data).
    entries: deque[tuple[str, float]] = dataclasses.field(default_factory=deque)

    def __post_init__(self) -> None:
        validate_rank(self.rank, self.world_size)
        if self.world_size > 1:
            require_queues(self.store)
        self.send_dst_counter = {i: 0 for i in range(self.world_size)}
        self.recv_src_counter = {i: 0 for i in range(self.world_size)}
        self.broadcast_recv_src_counter = {i: 0 for i in range(self.world_size)}
        # Not dataclass fields: the documented field list stays vLLM's.
        self._barrier_count = 0
        self._failed: str | None = None  # why the group is unusable (see _fail)
        self._others = [r for r in range(self.world_size) if r != self.rank]
        # create() sets the wire it resolved before constructing, as it does the key.
        wire = self.__dict__.get("_wire") or resolve_wire(None)
        self._wire = wire
        self._vllm = VllmWire(self.store, self.rank, self.world_size) if wire == "vllm" else None
        if self._vllm is not None:
            self._values = values.Values(self.rank, self.world_size, None)
            return
        # create() sets the key it resolved before constructing (so that with the operator's
        # VLLM_BRIDGE_REQUIRE_AUTH_KEY an explicit key is not asked for again here).
        preset = self.__dict__.get("_auth_key")
        key = preset if preset is not None else resolve_key(None)
        self._values = values.Values(self.rank, self.world_size, key)
        weakref.finalize(self, self._values.segments.release)
        self._store_transport = StoreTransport(
            self.store, self.rank, self.world_size, self._values, self.entries
        )
        self._transport: StoreTransport | ShmTransport = self._store_transport

    @property
    def wire(self) -> str:
        """ "bridge" (this package's wire) or "vllm" (vLLM's: see ``create``)."""
        return self._wire

    @property
    def auth_key(self) -> bytes | None:
        """The shared key that authenticates values (None: plain pickles, as in vLLM).

        It starts as ``$VLLM_BRIDGE_AUTH_KEY`` (None when unset or empty); ``create(...,
        auth_key=...)`` sets it, and so can assigning bytes or a str (UTF-8) before the first
        operation. Assigning None goes back to the environment variable. All ranks need the
        same key. The operator's environment wins: with ``$VLLM_BRIDGE_AUTH_KEY`` set, another
        key raises AuthenticationError, and with ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY=1`` so does
        going without one. A group on vLLM's wire has none, and refuses one (ValueError).
        """
        return self._values.key

    @auth_key.setter
    def auth_key(self, key: AuthKey | None) -> None:
        if self._vllm is not None:
            if key is not None:
                raise ValueError(_NO_KEY_ON_VLLM_WIRE)
            return
        self._values.key = resolve_key(key)

    # --- where the ranks run ------------------------------------------------------------

    def _choose_transport(self) -> None:
        """Learn where every rank runs (a collective of ``create``) and keep the transport
        that fits: shared-memory boards when all ranks share this machine and made one,
        else the store (with large values between ranks of one machine in segments)."""
        if self.world_size == 1 or self._vllm is not None:
            return
        board = None
        identity = values.node_identity()
        if identity != values.NOT_LOCAL:
            with contextlib.suppress(OSError):
                board = Board(self.rank, self.world_size)
        card = identity if board is None else identity + b"\n" + board.name.encode()
        cards = self._exchange_cards(card)
        nodes = [c.split(b"\n", 1)[0] for c in cards]
        local = [identity != values.NOT_LOCAL and node == identity for node in nodes]
        names = [c.split(b"\n", 1)[1].decode() for c in cards if b"\n" in c]
        if any(local[r] for r in range(self.world_size) if r != self.rank):
            segments.remove_orphans()
        self._store_transport.locate(local)
        if board is not None and all(local) and len(names) == self.world_size:
            # Messages still unreceived in its rings go to the store queues when the group
            # closes: a receiver that has not opened the board finds them there.
            weakref.finalize(self, board.close, queue_flusher(self.store, self.rank))
            # A rank may have closed its group already: what it sent is in the store queues.
            try:
                board.connect(names, missing_ok=True)
            except BoardError as exc:
                board.close()
                raise BoardError(f"rank {self.rank} could not join the boards: {exc}") from exc
            self._transport = ShmTransport(board, names, self._store_transport)
            return
        if board is not None:
            board.close()

    def _exchange_cards(self, card: bytes) -> list[bytes]:
        """Every rank's node card (sealed in the store, as values are)."""
        name, op = f"node/{self.rank}", "StatelessProcessGroup.create"
        self._store_transport.put(op, name, self._values.seal(name, card))
        others = [r for r in range(self.world_size) if r != self.rank]
        wanted = [f"node/{r}" for r in others]
        got = self._store_transport.gather(wanted, others, op)
        cards = [
            self._values.unseal(key, data, f"the node card {key!r} of rank {src}")
            for key, data, src in zip(wanted, got, others, strict=True)
        ]
        cards.insert(self.rank, card)
        # Rank 0 serves the store: it returns only once every rank has read the cards (a
        # rank still reading would lose the store if rank 0 exited right after create),
        # and then deletes them: the store keeps nothing of it.
        if self.rank != 0:
            self._store_transport.put(op, f"node/read/{self.rank}", b"1")
            return cards
        read = [f"node/read/{r}" for r in others]
        self._store_transport.gather(read, others, op)
        self._store_transport.discard(wanted + read + [name])
        self._store_transport.flush()
        return cards

    # --- point to point -----------------------------------------------------------------

    def send_obj(self, obj: Any, dst: int) -> None:
        """Send an object to a destination rank.

        The object is pickled and sent, numbered per pair, without waiting for the receiver
        to take it; ``dst`` receives objects in the order they were sent.
        """
        if type(dst) is not int or not 0 <= dst < self.world_size:
            validate_rank(dst, self.world_size, "dst")
        if self._failed is not None:
            self._refuse("send_obj")
        if self._vllm is not None:
            self._vllm.send(self, "send_to", obj, dst)
            return
        self._expire_if_due()
        seq = self.send_dst_counter[dst]
        self._transport.send(dst, seq, obj)
        self.send_dst_counter[dst] = seq + 1

    def recv_obj(self, src: int, *, timeout: float | None = None) -> Any:
        """Receive an object from a source rank.

        Blocks until ``src`` has sent its next object, then returns it. Waits at most
        ``timeout`` seconds (None: the store's timeout), then raises GroupTimeout (a
        RuntimeError and a TimeoutError) naming this rank, ``src`` and the object; the object
        is then still expected, so a later call may receive it. When ``src`` is known to have
        exited, raises PeerGoneError. With an auth key, a value that fails its check raises
        AuthenticationError (a RuntimeError) naming the object and ``src``, and is dropped
        without being unpickled.
        """
        return self._recv(src, timeout, None)

    def _recv(self, src: int, timeout: float | None, like: torch.Tensor | None) -> Any:
        """``recv_obj``, or (``like``: a tensor like it is expected) ``recv``'s receive."""
        if type(src) is not int or not 0 <= src < self.world_size:
            validate_rank(src, self.world_size, "src")
        if self._failed is not None:
            self._refuse("recv_obj" if like is None else "recv")
        if self._vllm is not None:
            kind = "send_to" if like is None else "send_tensor"
            return self._vllm.recv(self, kind, src, timeout)
        if timeout is not None:
            self._store_transport.limit(timeout)  # checked before anything else
        timeout = self._clamped(timeout)
        seq = self.recv_src_counter[src]
        load = self._transport.recv(src, seq, timeout, like)
        self.recv_src_counter[src] = seq + 1  # received: consumed, whether or not it loads
        return load()

    def _clamped(self, timeout: float | None) -> float | None:
        """A receive's ``timeout`` (None: the store's), clamped to the running call's
        deadline when it has one (``bridge_py.deadline``: a worker's caller's)."""
        if not deadline.current():
            return timeout
        return deadline.clamp(self._store_transport.limit(timeout))

    # --- collectives --------------------------------------------------------------------

    def broadcast_obj(self, obj: Any | None, src: int, *, timeout: float | None = None) -> Any:
        """Broadcast an object from a source rank to all other ranks.

        Returns ``obj`` on ``src`` and the received object on the other ranks. Unlike vLLM's,
        which does not clean up after all ranks have received the object, the value is
        deleted once every receiver has it, so it can be used any number of times. ``src``
        never waits for the receivers; they wait at most ``timeout`` seconds (None: the
        store's timeout) and raise as ``recv_obj`` does.
        """
        validate_rank(src, self.world_size, "src")
        if self._failed is not None:
            self._refuse("broadcast_obj")
        if self._vllm is not None:
            if self.rank == src:
                self._vllm.broadcast_send(self, "broadcast_from", obj)
                return obj
            return self._vllm.broadcast_recv(self, "broadcast_from", src, timeout)
        if self.rank == src:
            self._expire_if_due()
            if self.world_size > 1:
                self._transport.broadcast_send(self.broadcast_send_counter, obj)
            self.broadcast_send_counter += 1
            return obj
        return self._broadcast_recv(src, timeout, None)

    def _broadcast_recv(self, src: int, timeout: float | None, like: torch.Tensor | None) -> Any:
        """A receiver's ``broadcast_obj`` (``like``: or ``broadcast``, see ``_recv``)."""
        seq = self.broadcast_recv_src_counter[src]
        load = self._transport.broadcast_recv(src, seq, self._clamped(timeout), like)
        self.broadcast_recv_src_counter[src] = seq + 1  # received: consumed, whatever loads
        return load()

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """All gather an object from all ranks.

        Returns the objects of all ranks in rank order. The counters advance as for vLLM's
        (one broadcast from every rank). Waits at most the store's timeout, then raises
        GroupTimeout naming the ranks whose values are missing, or PeerGoneError naming
        those that exited; the group is unusable after either, as after a failed
        ``barrier``.
        """
        if self._failed is not None:
            self._refuse("all_gather_obj")
        try:
            if self._vllm is not None:
                return self._vllm.all_gather(self, obj, "all_gather_obj")
            return self._all_gather(obj, None)
        except _OUT_OF_STEP as exc:
            self._fail("all_gather_obj", exc)
            raise

    def _all_gather(self, obj: Any, like: torch.Tensor | None) -> list[Any]:
        """``all_gather_obj`` (``like``: of tensors, see ``_recv``). A value that arrived
        but does not load is consumed, as ``recv_obj``'s is: the counters advance."""
        if self.world_size == 1:
            self.broadcast_send_counter += 1
            return [obj]
        self._expire_if_due()
        counters = self.broadcast_recv_src_counter
        seqs = list(map(counters.__getitem__, range(self.world_size)))
        try:
            result = self._transport.all_gather(self.broadcast_send_counter, seqs, obj, like)
        except (CollectiveMismatchError, AuthenticationError):
            self._gathered(counters)
            raise
        self._gathered(counters)
        return result

    def _gathered(self, counters: dict[int, int]) -> None:
        """Every rank's value of an all_gather has been received: count them."""
        self.broadcast_send_counter += 1
        for src in self._others:
            counters[src] += 1

    def barrier(self, timeout: float = 30.0) -> None:
        """A robust barrier to synchronize all ranks.

        Uses a multi-phase approach to ensure all processes reach the barrier
        before proceeding:

        1. Each process signals it has reached the barrier

        2. Each process signals that it has confirmed the arrival of all other
           ranks.

        3. Rank 0 waits for all other ranks to signal their departure to ensure
           that all ranks have departed the barrier first.

        Every rank must call barrier in the same order (barriers are numbered, not named).
        Each phase waits at most ``timeout`` seconds, whatever the store's own timeout is;
        if any rank gives up, every rank of that barrier fails (a rank that comes late, or
        skipped it, fails at its next barrier at once, with the same message). The group
        is unusable after a failed barrier: every later operation of it raises StateError
        at once, naming the barrier; create a new group on every rank. On one machine a
        rank that exits fails the barrier within a second.

        Args:
            timeout: Maximum time in seconds to wait for each phase (in seconds)

        Raises:
            BarrierTimeout: a rank did not arrive (or leave) in time; also a TimeoutError.
                The message names this rank, the phase and how many of world_size ranks
                arrived.
            BarrierFailure: the barrier failed otherwise: another rank gave up on it (its
                message says which and why), or a rank left the group.
            StateError: an earlier barrier, ``all_gather_obj`` or ``all_reduce`` of the
                group failed, so the group is unusable.
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if self._failed is not None:
            self._refuse("barrier")
        timeout = deadline.clamp(timeout)
        barrier_id = self._barrier_count
        self._barrier_count += 1
        try:
            if self._vllm is not None:
                self._vllm.barrier(self, timeout)
            else:
                self._transport.barrier(barrier_id, timeout)
        except _OUT_OF_STEP as exc:
            self._fail(f"barrier {barrier_id}", exc)
            raise

    # --- tensors ------------------------------------------------------------------------

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, timeout: float | None = None
    ) -> torch.Tensor:
        """Broadcast a tensor from source rank to all other ranks.

        ``src`` sends ``tensor`` (its dtype, shape and bytes, never a pickle) and returns
        it. Every other rank fills its own ``tensor`` in place and returns it: it must have
        the dtype and shape of the source's, else CollectiveMismatchError (a ValueError)
        names both ranks and what differs. vLLM's returns a new tensor and leaves
        ``tensor`` alone; code that uses the result works with either. Numbered, waited
        for and cleaned up as ``broadcast_obj`` is (its errors name that operation). On
        vLLM's wire the tensor is pickled and received as vLLM's is: a new tensor.
        """
        validate_rank(src, self.world_size, "src")
        if self._failed is not None:
            self._refuse("broadcast")
        if self._vllm is not None:
            if self.rank == src:
                self._vllm.broadcast_send(self, "broadcast_tensor", tensor)
                return tensor
            return self._vllm.broadcast_recv(self, "broadcast_tensor", src, timeout)
        if self.rank == src:
            self.broadcast_obj(tensors.Encoded(tensor), src)
            return tensor
        like = tensor_codec.checked(tensor, into=True)  # before anything is received
        return tensors.fill(tensor, self._broadcast_recv(src, timeout, like))

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send a tensor to a destination rank.

        Sends its dtype, shape and bytes (never a pickle; a tensor off the CPU is copied
        to it first), numbered with the objects ``send_obj`` sends and as promptly: ``dst``
        receives it with ``recv`` (or, as a new CPU tensor, with ``recv_obj``). On vLLM's
        wire it is pickled, as vLLM's is, and only ``recv`` receives it.
        """
        if self._vllm is not None:
            validate_rank(dst, self.world_size, "dst")
            if self._failed is not None:
                self._refuse("send")
            self._vllm.send(self, "send_tensor", tensor, dst)
            return
        self.send_obj(tensors.Encoded(tensor), dst)

    def recv(self, tensor: torch.Tensor, src: int, *, timeout: float | None = None) -> torch.Tensor:
        """Receive a tensor from a source rank.

        Fills ``tensor`` in place with the next tensor ``src`` sent (with ``send``), and
        returns it. The tensor received must have the dtype and shape of ``tensor``, else
        CollectiveMismatchError (a ValueError) names both ranks and what differs; an
        object sent with ``send_obj`` is refused the same way, and never unpickled. It is
        consumed either way, so the next call receives the next one. Waits and raises
        as ``recv_obj`` does (its errors name that operation).
        """
        like = tensor_codec.checked(tensor, into=True)  # before anything is received
        return tensors.fill(tensor, self._recv(src, timeout, like))

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp.RedOpType | str = ReduceOp.SUM
    ) -> torch.Tensor:
        """All-reduce a tensor across all ranks.

        Returns a new tensor, on the device of ``tensor`` (which is left unchanged, as in
        vLLM), that reduces every rank's ``tensor`` with ``op``: ``ReduceOp.SUM``,
        ``PRODUCT``, ``MAX`` or ``MIN``, or its name as a string ("max"); any other op
        raises ValueError before anything is sent. Each rank's tensor travels once, as
        its dtype, shape and bytes (never a pickle), and every rank reduces the same
        tensors on the CPU in rank order, so all ranks get the same result, bit for bit,
        floating-point sums included. A tensor off the CPU is copied to it, and the
        result back. Tensors of different dtypes or shapes raise
        CollectiveMismatchError (a ValueError) on the ranks that receive them. The
        counters advance, and waits end, as for ``all_gather_obj`` (whose errors name
        that operation).
        """
        if self._failed is not None:
            self._refuse("all_reduce")
        try:
            if self._vllm is not None:
                return self._vllm.all_reduce(self, tensor, op)
            fold = tensors.reducer(op)
            mine = tensor_codec.on_cpu(tensor)
            gathered = self._all_gather(tensors.Encoded(mine), tensors.spec(mine))
        except _OUT_OF_STEP as exc:
            self._fail("all_reduce", exc)
            raise
        gathered[self.rank] = mine
        return tensors.reduce(gathered, fold).to(tensor.device)

    # --- after a failure ----------------------------------------------------------------

    def _fail(self, what: str, exc: BaseException) -> None:
        """A collective (``what``) failed on this rank with ``exc``: the ranks may now
        disagree on which call is which (one skipped it, or gave up on it while another
        still waits), and every barrier or gather after it would fail after its full
        timeout. Mark the group unusable, so that every later operation is refused at once
        (``_refuse``), as NCCL's communicators are after an abort."""
        if self._failed is None:
            reason = str(exc).splitlines()[0] if str(exc) else ""
            self._failed = f"{what} failed on it ({type(exc).__name__}: {reason})"

    def _refuse(self, op: str) -> None:
        """Raise the StateError of ``op`` on a group a collective failed on (``_fail``)."""
        assert self._failed is not None
        where = f"rank {self.rank} of a StatelessProcessGroup of {self.world_size}"
        raise unusable_group(op, where, self._failed)

    # --- expiry -------------------------------------------------------------------------

    def _expire_if_due(self) -> None:
        """``expire_data``, when this rank's oldest entry is due or it has segments out."""
        entries = self.entries
        due = entries and time.time() - entries[0][1] > self.data_expiration_seconds
        if due or self._values.segments:
            self.expire_data()

    def expire_data(self) -> None:
        """Expire data that is older than data_expiration_seconds seconds.

        Deletes the values this rank wrote more than ``data_expiration_seconds`` ago (whether
        or not they were received), objects it sent that long ago that are still unreceived
        included, so that values nobody reads do not stay behind.
        """
        if self._vllm is not None:
            self._vllm.expire(self)
            return
        sent = [self.send_dst_counter[r] for r in range(self.world_size)]
        self._transport.expire(self.data_expiration_seconds, sent)
        self._values.segments.expire(self.data_expiration_seconds)

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = 3600,
        store_timeout: int = 300,
        listen_socket: Socket | None = None,
        *,
        auth_key: AuthKey | None = None,
        wire: str | None = None,
    ) -> StatelessProcessGroup:
        """A replacement for `torch.distributed.init_process_group` that does not
        pollute the global state.

        If we have process A and process B called `torch.distributed.init_process_group`
        to form a group, and then we want to form another group with process A, B, C,
        D, it is not possible in PyTorch, because process A and process B have already
        formed a group, and process C and process D cannot join that group. This
        function is a workaround for this issue.

        `torch.distributed.init_process_group` is a global call, while this function
        is a stateless call. It will return a `StatelessProcessGroup` object that can be
        used for exchanging metadata. With this function, process A and process B
        can call `StatelessProcessGroup.create` to form a group, and then process A, B,
        C, and D can call `StatelessProcessGroup.create` to form another group.

        Rank 0 serves the store on ``host:port`` only (IPv4 or IPv6, ``"::1"`` or
        ``"[::1]"``), or on
        ``listen_socket``, a socket it has already bound (port 0 avoids port races).
        Every rank returns once all ``world_size`` ranks have joined, or raises
        ``StoreError`` (a RuntimeError) within ``store_timeout`` seconds (or by the running
        call's deadline, a worker's caller's, when that comes first: ``bridge_py.deadline``)
        saying how many ranks joined, that the port is in use, or which address could not
        be reached; a rank 0 that gave up serves nothing any more. When
        all ranks run on one machine, the group then passes objects through shared memory
        instead of the store. Rank 0 returns last, once every rank is done with the store
        in ``create``, so that it may exit at once without failing another rank's ``create``.

        ``auth_key`` (bytes, or a str taken as UTF-8; None: ``$VLLM_BRIDGE_AUTH_KEY``, if
        set) authenticates every value the group stores: all ranks must give the same key.
        When the environment sets ``$VLLM_BRIDGE_AUTH_KEY`` (the operator's key), an
        ``auth_key`` that differs from it raises AuthenticationError (a RuntimeError) before
        anything is served or joined; so does creating a group without any key when
        ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY=1``.

        ``wire`` is "bridge" (this package's: shared memory on one node, sealed values) or
        "vllm" (None: ``$VLLM_BRIDGE_WIRE``, else "bridge"). On vLLM's wire the group can hold
        ranks running vLLM's own ``StatelessProcessGroup`` (either may serve the store): it
        joins as vLLM's does (torch's count of the store's clients, rank 0 waiting for all
        of them), stores what vLLM's stores, and reads values through an allow-list instead
        of full pickle. It takes no ``auth_key`` (ValueError), and is refused
        (AuthenticationError) where the operator requires keys, unless the operator allows it
        with ``$VLLM_BRIDGE_ALLOW_VLLM_WIRE=1``.
        """
        validate_rank(rank, world_size)
        host = plain_host(host)
        chosen = resolve_wire(wire)
        if chosen == "vllm" and auth_key is not None:
            raise ValueError(_NO_KEY_ON_VLLM_WIRE)
        key = None if chosen == "vllm" else resolve_key(auth_key)  # fails before serving
        # The join ends at the caller's deadline when that comes first (a worker's call).
        within = deadline.clamp(store_timeout) if store_timeout > 0 else store_timeout
        until = time.monotonic() + within
        count = world_size if chosen == "vllm" else None
        # A rank left alone says so once, rather than nothing until it gives up (one
        # that gives up sooner than that says why when it does).
        notice = threading.Timer(
            JOIN_NOTICE_AFTER,
            logger.warning,
            (
                "rank %d of %d has waited %g s in create for all ranks to join the store "
                "at %s (it gives up after %s s)",
                rank,
                world_size,
                JOIN_NOTICE_AFTER,
                format_address(host, port),
                format_seconds(within),
            ),
        )
        notice.daemon = True
        if within > JOIN_NOTICE_AFTER:
            notice.start()
        try:
            store, sock = open_store(
                host,
                port,
                rank,
                store_timeout,
                listen_socket=listen_socket,
                torch_join=count,
                within=within,
            )
            owned = listen_socket is None
            address = format_address(host, sock.getsockname()[1] if sock is not None else port)
            try:
                if chosen == "bridge":
                    join_group(store, rank, world_size, address, within, until)
            except BaseException as exc:
                # Release the store (rank 0: stop serving) before the error travels up: frames
                # kept alive by the traceback would otherwise keep the server running.
                del store
                traceback.clear_frames(exc.__traceback__)
                if owned and sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
                raise
        finally:
            notice.cancel()
        # The key resolved above goes in before __post_init__, which then keeps it.
        group = StatelessProcessGroup.__new__(StatelessProcessGroup)
        group.__dict__["_auth_key"] = key
        group.__dict__["_wire"] = chosen
        group.__init__(  # type: ignore[misc]
            rank=rank,
            world_size=world_size,
            store=store,
            socket=sock,
            data_expiration_seconds=data_expiration_seconds,
        )
        group._choose_transport()
        return group
