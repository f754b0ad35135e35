"""All-to-all managers: how ``dispatch``/``combine`` move mixture-of-experts tokens.

:class:`NaiveAll2AllManager` is vLLM's testing-and-debugging manager in its
all-gather/reduce-scatter form (vLLM's ``AgRsAll2AllManager``, also exported under that
name): ``dispatch`` and ``dispatch_router_logits`` gather the tokens of every rank (an
``all_gatherv`` of the hidden states, the top-k weights and ids or the router logits, and
the extra tensors), ``combine`` sums the experts' outputs over the ranks and hands each rank
back the rows of its own tokens (a ``reduce_scatterv``). vLLM reads the per-rank token
counts from its forward context; here a dispatch exchanges them (one small all-gather) and
``combine`` reuses the counts of the latest dispatch.
"""

from __future__ import annotations

from typing import Any

import torch

from bridge_py.distributed.device_communicators.base_device_communicator import (
    All2AllManagerBase,
    DeviceCommunicatorBase,
    Dispatched,
    DispatchedTopk,
)
from bridge_py.distributed.device_communicators.torch_compat import all_gather_into
from bridge_py.distributed.errors import StateError

__all__ = ["AgRsAll2AllManager", "NaiveAll2AllManager"]


class NaiveAll2AllManager(All2AllManagerBase):
    """
    A naive implementation of all2all communication: every rank receives every token.
    Not efficient; for testing, debugging and CPU groups.
    """

    def __init__(
        self,
        cpu_group: Any,
        tcp_store_group: Any = None,
        *,
        communicator: DeviceCommunicatorBase | None = None,
    ) -> None:
        """Initialize self. See help(type(self)) for accurate signature.

        ``communicator`` (not in vLLM, which uses its expert- or data-parallel group) runs
        the gathers and reduce-scatters: the device communicator that owns the manager.
        Without one, the manager makes a plain one on ``cpu_group`` (gloo) and releases it
        in :meth:`destroy`.
        """
        super().__init__(cpu_group, tcp_store_group)
        self._owns_communicator = communicator is None
        self.communicator = communicator or DeviceCommunicatorBase(cpu_group)
        self._sizes: list[int] | None = None

    def _gather(self, op: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's rows of each of ``tensors`` (its tokens), in rank order; records the
        ranks' token counts for :meth:`combine`."""
        hidden_states = tensors[0]
        valid = isinstance(hidden_states, torch.Tensor) and hidden_states.dim() > 0
        # The counts travel even from a rank with bad input (as -1), so that every rank
        # learns of it and raises, instead of the others waiting for that rank's tokens.
        local = torch.tensor([hidden_states.shape[0] if valid else -1], dtype=torch.int64)
        counts = torch.empty(self.world_size, dtype=torch.int64)
        work = all_gather_into(counts, local, self.cpu_group, async_op=True)
        self.communicator._finish(work, f"{op} (token counts)", True)
        sizes = [int(n) for n in counts.tolist()]
        bad = [rank for rank, n in enumerate(sizes) if n < 0]
        if bad:
            raise self.communicator._error(
                op, f"hidden_states needs a token dimension (dim 0) on group ranks {bad}"
            )
        gathered = self.communicator.all_gatherv(tensors, dim=0, sizes=sizes)
        self._sizes = sizes
        assert isinstance(gathered, list)  # (a list in, a list out)
        return gathered

    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Dispatched:
        """Gather the tokens (rows) of every rank, with their router logits, in rank order.

        Returns ``(hidden_states, router_logits)`` holding all ranks' tokens, plus the list
        of gathered ``extra_tensors`` when given. ``is_sequence_parallel`` is accepted for
        vLLM's signature; the tokens are those of this manager's group either way.
        """
        tensors = [hidden_states, router_logits, *(extra_tensors or [])]
        gathered = self._gather("dispatch_router_logits", tensors)
        if extra_tensors is not None:
            return gathered[0], gathered[1], gathered[2:]
        return gathered[0], gathered[1]

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> DispatchedTopk:
        """Gather the routed tokens (rows) of every rank, in rank order.

        Returns ``(hidden_states, topk_weights, topk_ids)`` holding all ranks' tokens, plus
        the list of gathered ``extra_tensors`` when given. ``is_sequence_parallel`` is
        accepted for vLLM's signature; the tokens are those of this manager's group either
        way.
        """
        tensors = [hidden_states, topk_weights, topk_ids, *(extra_tensors or [])]
        gathered = self._gather("dispatch", tensors)
        if extra_tensors is not None:
            return gathered[0], gathered[1], gathered[2], gathered[3:]
        return gathered[0], gathered[1], gathered[2]

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """Sum ``hidden_states`` over the ranks and keep the rows of this rank's tokens."""
        if self._sizes is None:
            raise StateError("combine called before dispatch: the token counts are unknown")
        return self.communicator.reduce_scatterv(hidden_states, dim=0, sizes=self._sizes)

    def combine_into_output(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor:
        """:meth:`combine`, with this rank's rows written into ``output``; returns it."""
        combined = self.combine(hidden_states, is_sequence_parallel)
        return self.communicator._into("combine_into_output", output, combined)

    def destroy(self) -> None:
        """Forget the token counts of the latest dispatch (and release the communicator
        the manager made itself)."""
        self._sizes = None
        if self._owns_communicator:
            self.communicator.destroy()


# vLLM's name for the all-gather/reduce-scatter manager.
AgRsAll2AllManager = NaiveAll2AllManager
