"""StatelessProcessGroup: vLLM's metadata group over a TCPStore, with the same names and fields.

Compatible with ``vllm.distributed.utils.StatelessProcessGroup`` (fields, their order,
counters, method signatures, pickled objects between ranks), and better in these ways:

* point-to-point keys name the sender, so two ranks sending to one rank never collide;
* values are deleted from the store once every receiver has read them (p2p, broadcast,
  all_gather, barrier), so the store stays small however many operations run;
* ``barrier(timeout)`` fails within ``timeout`` with a message naming the rank, the phase and
  how many ranks arrived, whatever the store's timeout is (see ``barrier.py``);
* ``recv_obj`` and ``broadcast_obj`` take a keyword-only ``timeout`` (default: the store's
  timeout, as in vLLM) and fail with a message naming this rank, the sender, the key and the
  time waited when the sender never writes (it died, or took another path); the wait runs
  on a separate connection (``waiting.py``), so the group's own stays usable;
* ``create`` binds only the given interface (IPv4 or IPv6), accepts a pre-bound socket,
  returns only when all ranks have joined, and says why when it cannot;
* with a shared key (``create(..., auth_key=...)``, ``group.auth_key = ...`` or the
  environment variable ``VLLM_BRIDGE_AUTH_KEY``) every value carries an HMAC-SHA256 tag
  bound to its store key, checked before unpickling (``auth.py``): whoever can reach the
  store but lacks the key cannot make a rank unpickle anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import pickle
import socket
import time
import traceback
from collections import deque
from typing import Any

from torch.distributed import Store

from bridge_py.distributed import keys
from bridge_py.distributed.auth import AuthKey, open_payload, resolve_key, seal_payload
from bridge_py.distributed.barrier import run_barrier
from bridge_py.distributed.store import format_address, join_group, open_store
from bridge_py.distributed.waiting import BoundedWaiter

__all__ = ["StatelessProcessGroup", "validate_rank"]

Socket = socket.socket


def validate_rank(rank: int, world_size: int, name: str = "rank") -> None:
    """Raise TypeError/ValueError unless ``world_size >= 1`` and ``0 <= rank < world_size``."""
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
    every rank the same ``auth_key`` (see :attr:`auth_key`), so that values written by anyone
    without the key are refused before they are unpickled.
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
        self.send_dst_counter = {i: 0 for i in range(self.world_size)}
        self.recv_src_counter = {i: 0 for i in range(self.world_size)}
        self.broadcast_recv_src_counter = {i: 0 for i in range(self.world_size)}
        # Not dataclass fields: the documented field list stays vLLM's.
        self._barrier_count = 0
        self._waiter = BoundedWaiter(self.store)
        self._auth_key: bytes | None = resolve_key(None)

    @property
    def auth_key(self) -> bytes | None:
        """The shared key that authenticates values (None: plain pickles, as in vLLM).

        Not a dataclass field, so the documented fields stay vLLM's. It starts as
        ``$VLLM_BRIDGE_AUTH_KEY`` (None when unset or empty); ``create(..., auth_key=...)``
        sets it, and so can assigning bytes or a str (UTF-8) before the first operation.
        Assigning None goes back to the environment variable. All ranks need the same key.
        """
        return self._auth_key

    @auth_key.setter
    def auth_key(self, key: AuthKey | None) -> None:
        self._auth_key = resolve_key(key)

    def _dumps(self, key: str, obj: Any) -> bytes:
        """``obj`` pickled, and tagged for store key ``key`` when there is an auth key."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return seal_payload(self._auth_key, _context(key), payload)

    def _loads(self, key: str, data: bytes, src: int) -> Any:
        """The object in ``data``, read from ``key`` written by ``src``; checked, then unpickled."""
        what = f"the value of key {key!r} from rank {src} (received by rank {self.rank})"
        return pickle.loads(open_payload(self._auth_key, _context(key), data, what))

    def _default_timeout(self) -> float:
        timeout = getattr(self.store, "timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout.total_seconds()
        return 300.0

    def _await(self, key: str, src: int, op: str, timeout: float | None) -> bytes:
        """The value of ``key`` (written by ``src``), waiting at most ``timeout`` seconds.

        The wait runs on the bounded waiter's own connection; only then is the value read on
        the main connection, which therefore never holds a wait that might be abandoned.
        """
        limit = self._default_timeout() if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        start = time.monotonic()
        try:
            arrived = self._waiter.wait([key], limit)
        except RuntimeError as exc:
            raise RuntimeError(
                f"{op} on rank {self.rank} lost the store after "
                f"{time.monotonic() - start:.1f} s while waiting for key {key!r} from rank "
                f"{src} (did rank 0, which serves the store, exit?): {exc}"
            ) from exc
        if not arrived:
            raise RuntimeError(
                f"{op} on rank {self.rank} timed out after {time.monotonic() - start:.1f} s "
                f"(timeout {limit:g} s) waiting for key {key!r} from rank {src}: rank {src} "
                "did not send it (did it exit, or call something else?)"
            )
        return self.store.get(key)

    def _peer(self, peer: int, name: str) -> int:
        validate_rank(peer, self.world_size, name)
        return peer

    def _write(self, key: str, value: bytes) -> None:
        self.store.set(key, value)
        self.entries.append((key, time.time()))

    def send_obj(self, obj: Any, dst: int) -> None:
        """Send an object to a destination rank.

        The object is pickled under a key naming this rank, ``dst`` and a per-pair sequence
        number; ``dst`` deletes it when it receives it.
        """
        self._peer(dst, "dst")
        self.expire_data()
        key = keys.p2p_value(self.rank, dst, self.send_dst_counter[dst])
        self._write(key, self._dumps(key, obj))
        self.send_dst_counter[dst] += 1

    def expire_data(self) -> None:
        """Expire data that is older than data_expiration_seconds seconds.

        Deletes the keys this rank wrote more than ``data_expiration_seconds`` ago (whether or
        not they were received), so that values nobody reads do not stay in the store.
        """
        now = time.time()
        while self.entries:
            key, written = self.entries[0]
            if now - written <= self.data_expiration_seconds:
                break
            self.store.delete_key(key)
            self.entries.popleft()

    def recv_obj(self, src: int, *, timeout: float | None = None) -> Any:
        """Receive an object from a source rank.

        Blocks until ``src`` has sent its next object, then deletes it from the store and
        returns it. Waits at most ``timeout`` seconds (None: the store's timeout), then
        raises RuntimeError naming this rank, ``src``, the key and the time waited; the
        object is then still expected, so a later call may receive it. With an auth key, a
        value that fails its check raises AuthenticationError (a RuntimeError) naming the
        key and ``src``, and is dropped without being unpickled.
        """
        self._peer(src, "src")
        key = keys.p2p_value(src, self.rank, self.recv_src_counter[src])
        data = self._await(key, src, "recv_obj", timeout)
        self.store.delete_key(key)
        self.recv_src_counter[src] += 1
        return self._loads(key, data, src)

    def broadcast_obj(self, obj: Any | None, src: int, *, timeout: float | None = None) -> Any:
        """Broadcast an object from a source rank to all other ranks.

        Returns ``obj`` on ``src`` and the received object on the other ranks. Unlike vLLM's,
        which does not clean up after all ranks have received the object, the last receiver
        deletes it from the store, so it can be used any number of times. Receivers wait at
        most ``timeout`` seconds (None: the store's timeout) and raise as ``recv_obj`` does.
        """
        self._peer(src, "src")
        if self.rank == src:
            self.expire_data()
            if self.world_size > 1:
                seq = self.broadcast_send_counter
                key = keys.broadcast_value(src, seq)
                self._write(key, self._dumps(key, obj))
                # The ack counter is the receivers' key, but if they never all read the value
                # it is this rank's expire_data that must remove it.
                self.entries.append((keys.broadcast_acks(src, seq), time.time()))
            self.broadcast_send_counter += 1
            return obj
        seq = self.broadcast_recv_src_counter[src]
        key = keys.broadcast_value(src, seq)
        data = self._await(key, src, "broadcast_obj", timeout)
        self.broadcast_recv_src_counter[src] += 1
        acks = keys.broadcast_acks(src, seq)
        if self.store.add(acks, 1) >= self.world_size - 1:
            self.store.delete_key(key)
            self.store.delete_key(acks)
        return self._loads(key, data, src)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """All gather an object from all ranks.

        Returns the objects of all ranks in rank order. It is one broadcast from each rank
        (the counters advance as for vLLM's), this rank's first so that no rank waits for
        another's turn.
        """
        self.broadcast_obj(obj, src=self.rank)
        return [
            obj if src == self.rank else self.broadcast_obj(None, src=src)
            for src in range(self.world_size)
        ]

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
        if any rank gives up, every rank of that barrier fails, so the next barrier starts
        cleanly. The barrier's keys are deleted once all ranks have left.

        Args:
            timeout: Maximum time in seconds to wait for each phase (in seconds)

        Raises:
            RuntimeError: If coordination fails or times out, naming the rank, the phase and
                how many of world_size ranks arrived.
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        barrier_id = self._barrier_count
        self._barrier_count += 1
        run_barrier(self.store, self._waiter, self.rank, self.world_size, barrier_id, timeout)

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = 3600,
        store_timeout: int = 300,
        *,
        listen_socket: Socket | None = None,
        auth_key: AuthKey | None = None,
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

        Rank 0 serves the store on ``host:port`` only (IPv4 or IPv6), or on
        ``listen_socket``, a socket it has already bound (port 0 avoids port races).
        Every rank returns once all ``world_size`` ranks have joined, or raises
        ``StoreError`` (a RuntimeError) within ``store_timeout`` seconds saying how many
        ranks joined, that the port is in use, or which address could not be reached.

        ``auth_key`` (bytes, or a str taken as UTF-8; None: ``$VLLM_BRIDGE_AUTH_KEY``, if
        set) authenticates every value the group stores: all ranks must give the same key.
        """
        validate_rank(rank, world_size)
        key = resolve_key(auth_key)  # a bad key fails before anything is served
        deadline = time.monotonic() + store_timeout
        store, sock = open_store(host, port, rank, store_timeout, listen_socket=listen_socket)
        owned = listen_socket is None
        address = format_address(host, sock.getsockname()[1] if sock is not None else port)
        try:
            join_group(store, rank, world_size, address, store_timeout, deadline)
        except BaseException as exc:
            # Release the store (rank 0: stop serving) before the error travels up: frames
            # kept alive by the traceback would otherwise keep the server running.
            del store
            traceback.clear_frames(exc.__traceback__)
            if owned and sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
            raise
        group = StatelessProcessGroup(
            rank=rank,
            world_size=world_size,
            store=store,
            socket=sock,
            data_expiration_seconds=data_expiration_seconds,
        )
        group._auth_key = key
        return group


def _context(key: str) -> str:
    """What a value's tag is bound to: its store key, which names sender, receiver and number."""
    return f"spg/{key}"
