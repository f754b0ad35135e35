"""A faulty link between two hosts (``tests.hosts``): packets delayed, some dropped.

``with faulty_link(a, b, loss=0.3, delay=0.2) as link:`` adds a second link between two
hosts of ``hosts(2)``, beside their veth link: a TUN device in each host's network
namespace, with point-to-point addresses in a private /24 of its own (``10.232.R.1`` on
``a``, ``10.232.R.2`` on ``b``; ``link.address(host)``), MTU 1500, and a relay in this
process that carries each IP packet from one device to the other ``delay`` seconds after
it was sent, in the order sent, dropping each with probability ``loss``. A connection to
``link.address(a)`` from ``b`` thus crosses a link with that delay and loss, each way:
what the issue's "a link that drops 30% of packets (netem) or adds 200 ms" models, a slow
or lossy network between two machines, on which TCP must retransmit and wait.

Why in userspace: the usual tool, the netem queueing discipline (``tc qdisc ... netem``),
is not in every kernel (this project's test machine has no CONFIG_NET_SCH_NETEM, nor tc's
gact or nftables' queue), while TUN devices are nearly everywhere. A relay also makes the
faults exact: the delay is the same for every packet, and the drops come from a seeded
random generator, so a run that failed can be told apart by its seed (``link.seed``, in
``str(link)``; pass ``seed=`` to draw the same sequence of drops again, packet for packet;
which packet gets which draw still depends on timing).

Random loss makes TCP stall for long: it resends a lost segment after a timeout that
doubles with each loss of it (from 0.2 s, or more once losses inflate its estimate of the
round trip), and with 30% of packets lost each way about half of its resends fail too
(measured here, 4 connections of request/response pairs of 100 bytes: of 1929 pairs, 41
took over 6 s, 4 over 30 s, one 90 s, and one connection gave up after 100 s). A test that
must finish in bounded time caps that with ``max_losses=N``: no TCP segment (same
connection, sequence number and kind; a bare acknowledgment by what it acknowledges) is
dropped more than N times. With ``loss=0.3, max_losses=2`` about 28% of the packets were
dropped, and of 1200 such pairs 4 took over 6 s, the slowest 14 s (``link.stats()``
counts what was carried and dropped). Even so a connection can stall for longer: TCP's
estimate of the round trip grows from acknowledgments of resent segments (2.3 s was seen on
a link of no delay, with a retransmission timeout of 8.7 s), and a segment lost twice then
waits two such timeouts. ``max_losses=1`` keeps such a stall within one.

Nothing is routed beyond the two devices: each host's only route over the link is to the
other end's address. On leaving the block the relay stops (its thread is joined), and its
file descriptors are closed, which removes both devices (they are not persistent).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.hosts import Host

__all__ = ["FaultyLink", "faulty_link"]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_MTU = 1500


def _open_tun(netns: str, name: str) -> int:
    """Make TUN device ``name`` in network namespace ``netns`` and return its descriptor.

    A TUN device is made in the namespace of whoever opens ``/dev/net/tun``; so a thread
    of its own enters ``netns`` (``setns(2)`` moves the calling thread only), opens it
    there and ends, leaving this process's other threads where they were.
    """
    outcome: list[int | BaseException] = []

    def inside() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            with open(f"/run/netns/{netns}", "rb") as target:
                if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns into {netns}: {os.strerror(code)}")
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                request = struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI)
                fcntl.ioctl(fd, _TUNSETIFF, request)
            except BaseException:
                os.close(fd)
                raise
            outcome.append(fd)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=inside, name=f"tun {name} in {netns}")
    thread.start()
    thread.join(20)
    if not outcome:
        raise AssertionError(f"opening TUN {name} in {netns} did not finish")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _segment(packet: bytes) -> bytes | None:
    """What a resend of this IPv4 TCP packet has in common with it (None: not one):
    addresses, ports and sequence number, whether it carries data, SYN or FIN, and for a
    bare acknowledgment what it acknowledges (resent data may acknowledge more)."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != 6:  # (6: TCP)
        return None
    tcp = packet[(packet[0] & 0x0F) * 4 :]
    if len(tcp) < 20:
        return None
    data = len(tcp) > (tcp[12] >> 4) * 4
    syn_fin = tcp[13] & 0x03
    acked = b"" if data or syn_fin else tcp[8:12]
    return packet[12:20] + tcp[0:8] + bytes([syn_fin, data]) + acked


@dataclass
class _Direction:
    """One way of the link: packets read from ``source``, written to ``sink`` when due."""

    name: str
    source: int
    sink: int
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)
    carried: int = 0
    dropped: int = 0
    failed: int = 0


class FaultyLink:
    """The link made by :func:`faulty_link`: its addresses, its seed, what it carried."""

    def __init__(
        self, a: Host, b: Host, loss: float, delay: float, seed: int, max_losses: int | None
    ) -> None:
        self.loss = loss
        self.max_losses = max_losses
        self.delay = delay
        self.seed = seed
        self.subnet = f"10.232.{random.randrange(1, 255)}"
        self._addresses = {a.name: f"{self.subnet}.1", b.name: f"{self.subnet}.2"}
        self._random = random.Random(seed)
        self._losses: dict[bytes, int] = {}  # drops so far, per TCP segment (max_losses)
        self._directions: list[_Direction] = []
        self._fds: list[int] = []
        self._stop_read, self._stop_write = os.pipe()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __str__(self) -> str:
        bound = "" if self.max_losses is None else f", max_losses={self.max_losses}"
        return (
            f"faulty link {self.subnet}.0/24 (loss={self.loss:g}{bound}, "
            f"delay={self.delay:g} s, seed={self.seed})"
        )

    def address(self, host: Host) -> str:
        """``host``'s address on this link (its peer's route to it runs over the link)."""
        return self._addresses[host.name]

    def stats(self) -> dict[str, dict[str, int]]:
        """Per direction ("a->b", "b->a"): packets carried, dropped, and failed to write."""
        return {
            d.name: {"carried": d.carried, "dropped": d.dropped, "failed": d.failed}
            for d in self._directions
        }

    def _open(self, a: Host, b: Host) -> None:
        """Make both devices, give them their addresses, bring them up, start the relay."""
        tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        names = [f"vbf{tag}a", f"vbf{tag}b"]
        for host, name, peer in zip((a, b), names, (b, a), strict=True):
            self._fds.append(_open_tun(host.netns, name))
            mine, theirs = self.address(host), self.address(peer)
            host.ip("link", "set", "dev", name, "addrgenmode", "none")  # no IPv6 chatter
            host.ip("addr", "add", f"{mine}/32", "peer", f"{theirs}/32", "dev", name)
            host.ip("link", "set", "dev", name, "mtu", str(_MTU), "up")
        fa, fb = self._fds
        self._directions = [_Direction("a->b", fa, fb), _Direction("b->a", fb, fa)]
        self._thread = threading.Thread(target=self._relay, name=str(self), daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        """Carry packets until told to stop; keep the first error for :meth:`close`."""
        try:
            self._carry()
        except BaseException as exc:
            self.error = exc

    def _carry(self) -> None:
        by_source = {d.source: d for d in self._directions}
        while True:
            now = time.monotonic()
            for direction in self._directions:  # what is due, in the order it came
                while direction.queue and direction.queue[0][0] <= now:
                    _, packet = direction.queue.popleft()
                    try:
                        os.write(direction.sink, packet)
                        direction.carried += 1
                    except OSError:  # (the receiving device is down: a lost packet)
                        direction.failed += 1
            due = [d.queue[0][0] for d in self._directions if d.queue]
            wait = max(0.0, min(due) - time.monotonic()) if due else None
            readable, _, _ = select.select([*by_source, self._stop_read], [], [], wait)
            if self._stop_read in readable:
                return
            for fd in readable:
                direction = by_source[fd]
                while True:
                    try:
                        packet = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno == errno.EBADFD:  # (device down)
                            break
                        raise
                    if self._drops(packet):
                        direction.dropped += 1
                    else:
                        direction.queue.append((time.monotonic() + self.delay, packet))

    def _drops(self, packet: bytes) -> bool:
        """Whether to drop ``packet``: with probability ``loss``, unless it is a TCP segment
        dropped ``max_losses`` times already (one draw per packet either way, so that the
        seed gives the same sequence of draws)."""
        lost = self._random.random() < self.loss
        if not lost or self.max_losses is None:
            return lost
        key = _segment(packet)
        if key is None:
            return True
        count = self._losses.get(key, 0)
        if count >= self.max_losses:
            return False
        self._losses[key] = count + 1
        return True

    def close(self) -> None:
        """Stop the relay, close both devices (which removes them); raise what it met."""
        if self._thread is not None:
            os.write(self._stop_write, b"x")
            self._thread.join(10)
            assert not self._thread.is_alive(), f"{self}: the relay did not stop"
        for fd in (*self._fds, self._stop_read, self._stop_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        if self.error is not None:
            raise AssertionError(f"{self}: the relay failed: {self.error!r}") from self.error


@contextlib.contextmanager
def faulty_link(
    a: Host,
    b: Host,
    *,
    loss: float = 0.0,
    delay: float = 0.0,
    seed: int | None = None,
    max_losses: int | None = None,
) -> Iterator[FaultyLink]:
    """A link between hosts ``a`` and ``b`` that drops ``loss`` of the packets (each way)
    and delays each by ``delay`` seconds; removed on leaving (see the module). ``seed``
    (None: drawn at random, kept in ``link.seed``) seeds the drops; ``max_losses`` (None:
    no bound) is the most times one TCP segment is dropped, to bound TCP's stalls."""
    assert 0.0 <= loss < 1.0 and delay >= 0.0, (loss, delay)
    assert max_losses is None or max_losses >= 0, max_losses
    chosen = random.randrange(1 << 32) if seed is None else seed
    link = FaultyLink(a, b, loss, delay, chosen, max_losses)
    try:
        link._open(a, b)
        yield link
    finally:
        link.close()
