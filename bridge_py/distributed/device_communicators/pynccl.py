"""PyNcclCommunicator: vLLM's weight-sync communicator, on CUDA through torch's NCCL, and on CPU.

RL trainers (TRL, TorchRL) push new weights into vLLM's inference ranks with it:

    pg = StatelessProcessGroup.create(host, port, rank, world_size)
    comm = PyNcclCommunicator(pg, device=device)
    for tensor in state_dict.values():
        comm.broadcast(tensor, src=0)
    comm.group.barrier()

Same constructor, attributes and methods as vLLM's
(`vllm.distributed.device_communicators.pynccl`), with these differences:

* On CUDA, in a group of this package's ranks, the operations are torch's NCCL backend
  (`ProcessGroupNCCL`, on the group's store, torch.distributed's global state untouched).
  On a group on vLLM's wire (and from `from_unique_id_bytes`) they are NCCL's own calls,
  made as vLLM's are (`pynccl_wrapper`, `nccl_group`), so that they pair with vLLM's ranks.
* It works on CPU (`device="cpu"`), so trainer code runs, and is tested, without a GPU: a
  gloo group built on the group's store carries the data, and when every rank shares one
  machine, sums (all-reduce, reduce-scatter), all-gathers and broadcasts go through the CPU
  communicator's shared-memory collectives (`ShmCollectives`) instead.
* Arguments are checked, and errors name the operation, the rank and the parameter (vLLM
  asserts, or NCCL fails). On CPU the ranks also agree on every operation's arguments
  before data moves (`VLLM_BRIDGE_CHECK_COLLECTIVES=0` turns that off; the shared-memory
  path checks anyway, at no cost), so a mismatch raises on every rank instead of aborting
  a process. Tensors must be contiguous (vLLM's would read the wrong memory).
* The methods that fill a tensor return it (`batch_isend_irecv`: those it received;
  vLLM's return None, but `all_reduce`): a caller from Elixir needs that, its tensors
  being copies.
* A CUDA device without CUDA or NCCL raises at construction; vLLM's disables itself there,
  and a weight sync then silently does nothing. In a group of one rank `available` is
  False, `disabled` True and every method returns None at once, as in vLLM.
* `scatter` and `all_to_all_single` are grouped sends and receives, as vLLM's are; on
  CPU the ranks agree on the split sizes first (`all_to_all_single`: that every rank
  expects the rows the others send it). `batch_isend_irecv` checks every operation
  before posting any (vLLM's skips one it does not know).
* `suspend` frees NCCL's memory with `ncclCommSuspend` where NCCL is called directly, as
  vLLM's; elsewhere it closes the torch group and the shared memory, and `resume` makes
  them anew. In between, operations raise StateError (vLLM's leave that to NCCL).
* No NCCL windows (`register_comm_window`).

The class is built in layers: `pynccl_core` (state, checks, how data moves),
`pynccl_p2p` (sends, receives and what is made of them), and this module (set-up, life,
collectives).

Streams (CUDA): torch's NCCL backend runs each operation on an internal stream, ordered
after the work queued on `stream` (default: the current stream) before the call and
before the work queued on it afterwards; the host does not wait. vLLM's enqueues on
`stream` itself: the order of work is the same. On CPU every operation has completed when
it returns, and `stream` is ignored.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import Backend, PrefixStore, ProcessGroup, ReduceOp, TCPStore
from torch.distributed.distributed_c10d import _get_default_timeout

from bridge_py.distributed.device_communicators.agreement import (
    Agreement,
    Signature,
    checks_enabled,
    hash_ints,
)
from bridge_py.distributed.device_communicators.base_device_communicator import (
    pad_rows,
    spread_rows,
    unpad_rows,
)
from bridge_py.distributed.device_communicators.nccl_group import (
    NcclGroup,
    check_unique_id_bytes,
)
from bridge_py.distributed.device_communicators.pynccl_core import flat_bytes
from bridge_py.distributed.device_communicators.pynccl_p2p import PyNcclPointToPoint
from bridge_py.distributed.device_communicators.pynccl_wrapper import operator_library
from bridge_py.distributed.device_communicators.shm_collectives import ShmCollectives
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.groups.torch_group import (
    _assemble,
    forget_rendezvous,
    stateless_destroy_torch_distributed_process_group,
    store_of,
)
from bridge_py.distributed.groups.work import finish
from bridge_py.distributed.spg.group import StatelessProcessGroup, validate_rank
from bridge_py.distributed.store.requests import StoreRequest

__all__ = ["PyNcclCommunicator"]


def _as_device(device: int | str | torch.device) -> torch.device:
    if isinstance(device, bool):
        raise TypeError(f"device must be an int, a str or a torch.device, got {device!r}")
    found = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if found.type == "cuda" and found.index is None and torch.cuda.is_available():
        found = torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if found.type == "cpu" else found  # CPU tensors have no index


def _on_vllm_wire(group: ProcessGroup | StatelessProcessGroup) -> bool:
    return isinstance(group, StatelessProcessGroup) and group.wire == "vllm"


def _agreed_token(group: ProcessGroup | StatelessProcessGroup, rank: int) -> str:
    """Rank 0's random token, on every rank: the prefix of this communicator's store keys."""
    token = secrets.token_bytes(8)
    if not isinstance(group, ProcessGroup):
        return str(group.broadcast_obj(token.hex() if rank == 0 else None, src=0))
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group unknown to torch's global state
        backend = str(group.name())
    if backend == Backend.NCCL:
        raise ValueError("PyNcclCommunicator should be attached to a non-NCCL group.")
    tensor = torch.frombuffer(bytearray(token), dtype=torch.uint8)
    where = f"rank {rank} of its group"
    finish(group.broadcast(tensor, 0), "PyNcclCommunicator's set-up", where, group=group)
    return bytes(tensor.tolist()).hex()


class PyNcclCommunicator(PyNcclPointToPoint):
    """vLLM's NCCL communicator for a group of ranks, on CUDA (torch's NCCL) or on CPU.

    Made from a `StatelessProcessGroup` (or a gloo ProcessGroup) and a device; its
    operations take tensors on that device, and group ranks as `src` and `dst`. On CPU,
    ranks on one machine move data through shared memory, others through gloo.
    """

    def __init__(
        self,
        group: ProcessGroup | StatelessProcessGroup,
        device: int | str | torch.device,
        library_path: str | None = None,
    ) -> None:
        """Join the other ranks of `group`: a collective, every rank constructs its own.

        Args:
            group: the ranks: a `StatelessProcessGroup`, or a torch ProcessGroup (gloo).
            device: where the tensors are: `"cpu"`, or a CUDA device (an int `i` means
                `cuda:i`; each rank should have a GPU of its own).
            library_path: NCCL's library, where NCCL is called directly (on vLLM's wire;
                None: ``pynccl_wrapper.find_nccl_library()``); unused otherwise.
        """
        if isinstance(group, ProcessGroup):
            rank, world_size = group.rank(), group.size()
        else:
            rank, world_size = group.rank, group.world_size
        self._start(group, rank, world_size, device, library_path, None)

    @classmethod
    def from_unique_id_bytes(
        cls,
        unique_id_bytes: bytes,
        rank: int,
        world_size: int,
        device: int | str | torch.device,
        library_path: str | None = None,
    ) -> PyNcclCommunicator:
        """Join an NCCL communicator from its unique id, for ranks without a group.

        Every rank passes the same 128 bytes (made once by ``ncclGetUniqueId`` and shared
        by other means) and must call this at the same time: NCCL's set-up waits for all of
        them. Then, as vLLM's does, the communicator runs a one-element all-reduce, which
        every other rank (vLLM's or a foreign one) must match. Needs CUDA and NCCL
        (StateError otherwise); ``group`` is None.
        """
        check_unique_id_bytes(unique_id_bytes)
        validate_rank(rank, world_size)
        if _as_device(device).type != "cuda":
            raise StateError(
                f"PyNcclCommunicator.from_unique_id_bytes needs a CUDA device, not {device!r}"
            )
        self = cls.__new__(cls)
        self._start(None, rank, world_size, device, library_path, bytes(unique_id_bytes))
        return self

    def _start(
        self,
        group: ProcessGroup | StatelessProcessGroup | None,
        rank: int,
        world_size: int,
        device: int | str | torch.device,
        library_path: str | None,
        unique_id: bytes | None,
    ) -> None:
        """The constructor's work, for a group or (``group`` None) a unique id's bytes."""
        self.rank, self.world_size = rank, world_size
        self.group = group  # type: ignore[assignment]  # None only from a unique id
        self.device = _as_device(device)
        self.nccl_version: int | None = None
        self.available = self.world_size > 1
        self.disabled = not self.available
        self.label = f"PyNcclCommunicator ({self.device.type}, {self.world_size} ranks)"
        cpu = self.device.type == "cpu"
        self.backend = "gloo" if cpu else "nccl"
        self._device_blocks = cpu  # gloo's waits block the CPU, NCCL's order a stream
        self._shm: ShmCollectives | None = None
        self._pg: ProcessGroup | NcclGroup | None = None
        self._depth, self._suspended = 0, False
        self._shm_offer: bool | None = None  # None: the environment's choice
        self._sends, self._recvs = [], []
        if self.available and (group is None or (not cpu and _on_vllm_wire(group))):
            operator_library(library_path)  # a caller's library is refused before all else
            self._require_cuda(cpu)
            vllm_group = cast(StatelessProcessGroup | None, group)
            nccl = NcclGroup.join(
                vllm_group, self.rank, self.world_size, self.device, library_path, unique_id
            )
            self._pg, self.nccl_version = nccl, nccl.version
            group = None  # (joined)
        self._open(group if self.available else None)

    def _open(self, group: ProcessGroup | StatelessProcessGroup | None) -> None:
        """Make this communicator's torch group on `group`'s store (None: keep `_pg`), its
        agreement and (CPU) shared memory, or run (CUDA) NCCL's set-up all-reduce: the
        constructor's work, and `resume`'s."""
        cpu = self.device.type == "cpu"
        rendezvous: dist.Store | None = None  # the store gloo's rendezvous used
        if group is not None:
            self._pg, rendezvous = self._connect(group, cpu)
        self.agreement = Agreement(
            cast(ProcessGroup, self._pg),
            self.rank,
            list(range(self.world_size)),
            self.label,
            cpu and checks_enabled(self.device),
        )
        if self._pg is not None and cpu:
            ranks = list(range(self.world_size))
            offer = self._shm_offer
            self._shm = ShmCollectives.create(
                self._group, self.rank, ranks, self.label, enabled=offer
            )
            self._shm_offer = self._shm is not None  # (resume takes the same transport)
            if self._shm is not None:
                self.agreement.carrier = self._shm.exchange
            # The set-up's all-reduce needed every rank inside the gloo group, so no rank
            # reads this one's rendezvous address any more: its key goes, and communicators
            # made and destroyed over one store leave nothing in it.
            store = cast(dist.Store, rendezvous)
            with StoreRequest(
                self.label, self.rank, "its gloo rendezvous key", "deleting", store=store
            ):
                forget_rendezvous(store, self.rank)
        elif self._pg is not None:
            if self.nccl_version is None:
                major, minor, patch = torch.cuda.nccl.version()[:3]
                self.nccl_version = major * 10000 + minor * 100 + patch
            with torch.cuda.device(self.device):  # NCCL sets its communicator up now
                self.all_reduce(torch.zeros(1, device=self.device))
                torch.cuda.current_stream().synchronize()

    def _require_cuda(self, cpu: bool) -> None:
        if not cpu and self.device.type != "cuda":
            raise ValueError(f"PyNcclCommunicator serves 'cpu' or CUDA, not {self.device}")
        if not cpu and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise StateError(
                f"PyNcclCommunicator on {self.device} needs CUDA and a torch built with "
                "NCCL; use device='cpu' on a machine without them"
            )

    def _connect(
        self, group: ProcessGroup | StatelessProcessGroup, cpu: bool
    ) -> tuple[ProcessGroup, dist.Store]:
        """This communicator's own torch group (gloo or NCCL) on the group's store, and the
        store (under the communicator's own prefix) its rendezvous used."""
        self._require_cuda(cpu)
        backend = Backend("gloo" if cpu else "nccl")
        store = PrefixStore(f"pynccl/{_agreed_token(group, self.rank)}/", store_of(group))
        timeout = _get_default_timeout(backend)
        # (_assemble only wraps the store in another PrefixStore: any store does.)
        pg = _assemble(cast(TCPStore, store), self.rank, self.world_size, backend, timeout)
        return pg, store

    def _release(self) -> None:
        """Close the shared memory and the torch group (or destroy NCCL's communicator)."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if isinstance(self._pg, NcclGroup):
            self._pg.destroy()
        elif self._pg is not None:
            with contextlib.suppress(Exception):
                stateless_destroy_torch_distributed_process_group(self._pg)
        self._pg = None

    def destroy(self) -> None:
        """Release the shared memory and the torch group; the communicator is then disabled."""
        self._release()
        self.available, self.disabled = False, True

    def suspend(self) -> None:
        """Release the communicator's memory until `resume`: a collective (every rank
        suspends), idempotent. Meanwhile its operations raise StateError.

        vLLM's frees NCCL's buffers with ``ncclCommSuspend`` (NCCL 2.29.7 and later) and
        keeps the communicator; so does this one where it calls NCCL itself (on vLLM's wire,
        or from a unique id; with an older NCCL nothing is freed, as in vLLM). Elsewhere it
        closes its shared memory and its torch group (gloo or NCCL), which `resume` makes
        anew. On CPU the ranks first agree that all of them are suspending.
        """
        if self.disabled or self._suspended:
            return
        if self._depth:
            raise StateError(f"suspend on {self.agreement.where}: inside group_start/group_end")
        self.agreement.check(Signature("suspend"))
        if isinstance(self._pg, NcclGroup):
            self._pg.suspend()
        else:
            self._release()
        self._suspended = True

    def resume(self) -> None:
        """Make a suspended communicator usable again (a collective: every rank resumes,
        and its torch group is made anew over the group's store); else nothing."""
        if self.disabled or not self._suspended:
            return
        self._suspended = False
        try:
            if isinstance(self._pg, NcclGroup):
                self._pg.resume()
            else:
                self._open(self.group)
        except BaseException:
            if not isinstance(self._pg, NcclGroup):
                self._release()  # (what was made of it: the next resume starts afresh)
            self._suspended = True
            raise

    # -------------------------------------------------------------- collectives

    def all_reduce(
        self,
        in_tensor: torch.Tensor,
        out_tensor: torch.Tensor | None = None,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """Reduce `in_tensor` over the group (a sum, or `op`) into `out_tensor` (a new
        tensor when None; it may be `in_tensor` itself) and return it. Sums of `bool`
        tensors are a logical OR."""
        if self.disabled:
            return None
        name = "all_reduce"

        def check() -> Signature:
            self._check(name, "in_tensor", in_tensor)
            code = self._check_op(name, op, in_tensor.dtype)
            if out_tensor is not None:
                self._check(name, "out_tensor", out_tensor, in_tensor)
                numel = in_tensor.numel()
                self._check_numel(name, "out_tensor", out_tensor, numel, "not in_tensor's")
            return Signature(name, in_tensor.dtype, (in_tensor.numel(),), (code,), ("op",))

        signature = self._signed(name, check)
        out = torch.empty_like(in_tensor) if out_tensor is None else out_tensor
        with self._on(stream):
            self._reduce(signature, name, out, in_tensor, op)
        return out

    def all_gather(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """Every rank's `input_tensor`, in rank order, into `output_tensor` (`world_size`
        times as many elements, the same dtype); returns `output_tensor`."""
        if self.disabled:
            return None
        name = "all_gather"

        def check() -> Signature:
            self._check(name, "input_tensor", input_tensor)
            self._check(name, "output_tensor", output_tensor, input_tensor)
            numel = self.world_size * input_tensor.numel()
            how = f"not world_size ({self.world_size}) x input_tensor's"
            self._check_numel(name, "output_tensor", output_tensor, numel, how)
            return Signature(name, input_tensor.dtype, (input_tensor.numel(),))

        signature = self._signed(name, check)
        with self._on(stream):
            self._gather(signature, output_tensor, input_tensor)
        return output_tensor

    def all_gatherv(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: list[int],
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """All-gather along dim 0 where rank `r` gives `sizes[r]` rows: `output_tensor` has
        `sum(sizes)` rows, shaped like `input_tensor` otherwise; returns it."""
        if self.disabled:
            return None
        name = "all_gatherv"

        def check() -> Signature:
            counts = self._check_rows(name, output_tensor, input_tensor, sizes, False)
            numel = max(counts) * math.prod(input_tensor.shape[1:])
            params = (hash_ints(counts),)
            return Signature(name, input_tensor.dtype, (numel,), params, ("sizes#",))

        signature = self._signed(name, check)
        with self._on(stream):
            padded = pad_rows(input_tensor, max(sizes)).contiguous()
            gathered = input_tensor.new_empty((self.world_size, *padded.shape))
            self._gather(signature, gathered, padded)
            output_tensor.copy_(unpad_rows(gathered, sizes))
        return output_tensor

    def reduce_scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """Reduce `input_tensor` over the group (a sum, or `op`) and keep this rank's piece
        (piece `rank` of `world_size` equal ones) in `output_tensor`; returns it."""
        if self.disabled:
            return None
        name = "reduce_scatter"

        def check() -> Signature:
            self._check(name, "input_tensor", input_tensor)
            code = self._check_op(name, op, input_tensor.dtype)
            self._check(name, "output_tensor", output_tensor, input_tensor)
            numel = output_tensor.numel() * self.world_size
            how = f"not world_size ({self.world_size}) x output_tensor's"
            self._check_numel(name, "input_tensor", input_tensor, numel, how)
            return Signature(name, input_tensor.dtype, (numel,), (code,), ("op",))

        signature = self._signed(name, check)
        with self._on(stream):
            self._reduce(signature, name, output_tensor, input_tensor, op)
        return output_tensor

    def reduce_scatterv(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: list[int],
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """Reduce-scatter along dim 0 where rank `r` keeps `sizes[r]` rows: `input_tensor`
        has `sum(sizes)` rows; returns `output_tensor`."""
        if self.disabled:
            return None
        name = "reduce_scatterv"

        def check() -> Signature:
            counts = self._check_rows(name, output_tensor, input_tensor, sizes, True)
            code = self._check_op(name, op, input_tensor.dtype)
            params = (code, hash_ints(counts))
            numel = input_tensor.numel()
            return Signature(name, input_tensor.dtype, (numel,), params, ("op", "sizes#"))

        signature = self._signed(name, check)
        with self._on(stream):
            padded = spread_rows(input_tensor, sizes)
            mine = input_tensor.new_empty(padded.shape[1:])
            self._reduce(signature, name, mine, padded, op)
            output_tensor.copy_(mine[: sizes[self.rank]])
        return output_tensor

    def reduce(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        root: int,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """Reduce `input_tensor` over the group (a sum, or `op`) into rank `root`'s
        `output_tensor` (it may be `input_tensor` itself); returns `output_tensor`, which
        the other ranks neither read nor write (nor check)."""
        if self.disabled:
            return None
        name = "reduce"

        def check() -> Signature:
            self._check(name, "input_tensor", input_tensor)
            code = self._check_op(name, op, input_tensor.dtype)
            target, numel = self._check_peer(name, "root", root, True), input_tensor.numel()
            if self.rank == target:
                self._check(name, "output_tensor", output_tensor, input_tensor)
                how = "not input_tensor's"
                self._check_numel(name, "output_tensor", output_tensor, numel, how)
            params = (code, target)
            return Signature(name, input_tensor.dtype, (numel,), params, ("op", "root"))

        signature = self._signed(name, check)
        with self._on(stream):
            self._reduce(signature, name, output_tensor, input_tensor, op, root)
        return output_tensor

    def broadcast(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None
    ) -> torch.Tensor | None:
        """Rank `src`'s `tensor` into every rank's `tensor` (in place); returns `tensor`."""
        if self.disabled:
            return None
        name = "broadcast"

        def check() -> Signature:
            self._check(name, "tensor", tensor)
            source = self._check_peer(name, "src", src, True)
            return Signature(name, tensor.dtype, (tensor.numel(),), (source,), ("src",))

        signature = self._signed(name, check)
        data = flat_bytes(tensor)

        with self._on(stream):
            self._move(
                signature,
                lambda shm, row, judge: shm.broadcast(data, src, row, judge),
                lambda: self._group.broadcast(data, src) if data.numel() else None,
            )
        return tensor
