"""The copies and sums of the shared-memory collectives, on the CPUs this rank may take.

torch runs an elementwise op of more than 32768 elements on its intra-op (OpenMP)
threads. The ranks of a group on one node already use its cores: where this rank's
threads would take CPUs from the others (its threads, times the ranks that may run on
some of its CPUs, outnumber those CPUs: the default whenever no thread count is set), the
woken threads mostly compete with the ranks the group waits for, and the collectives
slow down many times over (bench/README.md has the figures). So an op runs whole, on torch's
threads, only when it is at least ``PARALLEL_BYTES`` long and the threads have CPUs of
their own (or there is one thread); otherwise it stays on the calling thread: a copy is
one ``memcpy`` by numpy (which copies without threads, and without the GIL), a sum is cut
into pieces below torch's grain size.

``VLLM_BRIDGE_CPU_SHM_THREADS`` = ``0`` always stays on the calling thread, ``1`` never
does (read once, at import).
"""

from __future__ import annotations

import os
from typing import Any

import numpy
import torch

__all__ = ["PARALLEL_BYTES", "THREADS_ENV", "Elementwise"]

THREADS_ENV = "VLLM_BRIDGE_CPU_SHM_THREADS"
PARALLEL_BYTES = 1 << 20  # ops at least this long may run on torch's intra-op threads
_PIECE = 32768  # torch's grain size: an op this long stays on the calling thread
_THREADS = os.environ.get(THREADS_ENV, "").strip()


class Elementwise:
    """Copies and rank-ordered sums of contiguous 1-D CPU tensors for a rank that may run
    on ``cpus`` CPUs, some of which ``sharing`` ranks of its group (itself included) may
    run on."""

    def __init__(self, cpus: int, sharing: int) -> None:
        self.cpus = cpus
        self.sharing = sharing

    def piece(self, tensor: torch.Tensor) -> int:
        """How many elements of ``tensor`` one torch op may cover (all of them where it
        may run on torch's threads)."""
        n = tensor.numel()
        if _THREADS == "1" or (
            _THREADS != "0"
            and n * tensor.element_size() >= PARALLEL_BYTES
            and ((threads := torch.get_num_threads()) == 1 or threads * self.sharing <= self.cpus)
        ):
            return max(n, 1)  # (one thread: nothing to cut it for)
        return _PIECE

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for tensors of one dtype whose memory holds their values
        (not conjugate or negative views)."""
        if self.piece(dst) >= dst.numel():
            dst.copy_(src)
        else:  # (torch's copy in single-thread pieces took twice as long)
            numpy.copyto(_bytes(dst), _bytes(src))

    def ordered_sum(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """``out = ((parts[0] + parts[1]) + parts[2]) + ...``, each partial sum rounded to
        out's dtype; ``out`` may be ``parts[0]`` or ``parts[1]`` (not a later part)."""
        if len(parts) == 1:
            self.copy(out, parts[0])
            return
        step = self.piece(out)
        for a in range(0, out.numel(), step):
            b = a + step
            piece = out[a:b]
            torch.add(parts[0][a:b], parts[1][a:b], out=piece)
            for part in parts[2:]:
                piece.add_(part[a:b])


def _bytes(tensor: torch.Tensor) -> Any:
    """The memory of a contiguous 1-D CPU tensor as a numpy array of bytes (numpy has no
    bfloat16; a copy moves bytes, whatever they mean)."""
    return tensor.detach().view(torch.uint8).numpy()
