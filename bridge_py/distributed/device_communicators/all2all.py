"""All-to-all managers: how ``dispatch``/``combine`` move mixture-of-experts tokens.

:class:`NaiveAll2AllManager` is vLLM's testing-and-debugging manager in its
all-gather/reduce-scatter form (vLLM's ``AgRsAll2AllManager``, also exported under that
name): ``dispatch`` gathers the tokens of every rank (an ``all_gatherv`` of the hidden
states, router logits and extra tensors), ``combine`` sums the experts' outputs over the
ranks and hands each rank back the rows of its own tokens (a ``reduce_scatterv``). vLLM
reads the per-rank token counts from its forward context; here ``dispatch`` exchanges them
(one small all-gather) and ``combine`` reuses the counts of the latest ``dispatch``.
"""

from __future__ import annotations

import torch

from bridge_py.distributed.device_communicators.base_device_communicator import (
    All2AllManagerBase,
    DeviceCommunicatorBase,
    Dispatched,
)
from bridge_py.distributed.device_communicators.torch_compat import all_gather_into
from bridge_py.distributed.errors import StateError

__all__ = ["AgRsAll2AllManager", "NaiveAll2AllManager"]


class NaiveAll2AllManager(All2AllManagerBase):
    """
    A naive implementation of all2all communication: every rank receives every token.
    Not efficient; for testing, debugging and CPU groups.
    """

    def __init__(self, communicator: DeviceCommunicatorBase) -> None:
        super().__init__(communicator)
        self._sizes: list[int] | None = None

    def _token_counts(self, num_tokens: int) -> list[int]:
        local = torch.tensor([num_tokens], dtype=torch.int64)
        counts = torch.empty(self.world_size, dtype=torch.int64)
        work = all_gather_into(counts, local, self.cpu_group, async_op=True)
        self.communicator._finish(work, "dispatch (token counts)", True)
        return [int(n) for n in counts.tolist()]

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Dispatched:
        """Gather the tokens (rows) of every rank, in rank order.

        Returns ``(hidden_states, router_logits)`` holding all ranks' tokens, plus the
        gathered ``extra_tensors`` when given. ``is_sequence_parallel`` is accepted for
        vLLM's signature; the tokens are those of this communicator's group either way.
        """
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() == 0:
            raise ValueError("dispatch needs hidden_states with a token dimension (dim 0)")
        sizes = self._token_counts(hidden_states.shape[0])
        tensors = [hidden_states, router_logits, *(extra_tensors or [])]
        gathered = self.communicator.all_gatherv(tensors, dim=0, sizes=sizes)
        self._sizes = sizes
        if extra_tensors is not None:
            return gathered[0], gathered[1], list(gathered[2:])
        return gathered[0], gathered[1]

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """Sum ``hidden_states`` over the ranks and keep the rows of this rank's tokens."""
        if self._sizes is None:
            raise StateError("combine called before dispatch: the token counts are unknown")
        return self.communicator.reduce_scatterv(hidden_states, dim=0, sizes=self._sizes)

    def destroy(self) -> None:
        """Forget the token counts of the latest dispatch."""
        self._sizes = None


# vLLM's name for the all-gather/reduce-scatter manager.
AgRsAll2AllManager = NaiveAll2AllManager
