"""All2AllManagerBase: what every all-to-all manager offers (vLLM 0.34's base class).

An all-to-all manager moves the tokens of a mixture-of-experts layer between the ranks of
an expert-parallel group. vLLM 0.34 splits the move in two: :meth:`~All2AllManagerBase.dispatch`
sends tokens already routed (their ``topk_weights`` and ``topk_ids``), while
:meth:`~All2AllManagerBase.dispatch_router_logits` sends them with the router's logits, to be
routed after the move. Methods that a manager must provide raise NotImplementedError here,
naming the manager's class and the method; the optional ones keep vLLM's defaults (no-ops,
``None``). ``base_device_communicator`` re-exports the class, where vLLM defines it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

__all__ = ["All2AllManagerBase", "Dispatched", "DispatchedTopk"]

logger = logging.getLogger(__name__)

# What ``dispatch_router_logits`` returns (vLLM's annotation): the hidden states and router
# logits of the tokens, then the extra tensors when some were given.
Dispatched = (
    tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]
)
# What ``dispatch`` returns: the hidden states, top-k weights and top-k expert ids of the
# tokens, then the extra tensors when some were given.
DispatchedTopk = (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]
)

# (class name, method) already warned about by checkpoint_prepare/checkpoint_restore.
_warned: set[tuple[str, str]] = set()


class All2AllManagerBase:
    """Moves the tokens of a mixture-of-experts layer between the ranks of one group.

    ``cpu_group`` is the group's gloo group; ``tcp_store_group`` (a StatelessProcessGroup,
    optional) is the one to probe for the ranks' nodes instead, as in vLLM. ``rank`` and
    ``world_size`` are this rank's and the group's; ``support_fault_tolerance`` is False
    (no manager here masks ranks that died).
    """

    rank: int
    world_size: int

    def __init__(self, cpu_group: Any, tcp_store_group: Any = None) -> None:
        """Initialize self. See help(type(self)) for accurate signature."""
        self.cpu_group = cpu_group
        self.tcp_store_group = tcp_store_group
        self.rank = cpu_group.rank()
        self.world_size = cpu_group.size()
        self.support_fault_tolerance = False
        self._internode: bool | None = None

    @property
    def internode(self) -> bool:
        """Whether the group spans several nodes: a collective probe of ``tcp_store_group``
        when given, else of ``cpu_group``, run on first use (vLLM runs it at construction)."""
        if self._internode is None:
            from bridge_py.distributed.groups.node import in_the_same_node_as

            probed = self.cpu_group if self.tcp_store_group is None else self.tcp_store_group
            self._internode = not all(in_the_same_node_as(probed, source_rank=0))
        return self._internode

    def _missing(self, method: str, what: str) -> NoReturn:
        raise NotImplementedError(
            f"{type(self).__name__}.{method} is not implemented: this all-to-all manager "
            f"has no {what}"
        )

    def get_handle(self, kwargs: dict[str, Any]) -> Any:
        """The communication handle (buffers) for a layer's configuration ``kwargs``."""
        self._missing("get_handle", "communication handle")

    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Dispatched:
        """Send each rank's tokens, with their router logits, to the ranks that need them."""
        self._missing("dispatch_router_logits", "dispatch of router logits")

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> DispatchedTopk:
        """Send each rank's routed tokens (top-k weights and ids) to the ranks that need them."""
        self._missing("dispatch", "dispatch of routed tokens")

    def query_active_mask(self) -> torch.Tensor:
        """The liveness mask of the ranks (int32: 0 live, 1 masked)."""
        self._missing("query_active_mask", "mask of live ranks")

    def query_fault(self) -> torch.Tensor:
        """A scalar bool tensor: whether a fault appeared since the last recovery point."""
        self._missing("query_fault", "fault detection")

    def clean_buffers(self) -> None:
        """Reset this rank's buffers and mask after a fault (rank-local)."""
        self._missing("clean_buffers", "buffers to clean after a fault")

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """Mask (or unmask) the group's rank ``rank``, as when the group scales down."""
        self._missing("update_mask", "mask of live ranks")

    def set_num_sms(self, num_sms: int) -> None:
        """Limit the GPU multiprocessors the manager's kernels use (a no-op here)."""

    def max_sms_used(self) -> int | None:
        """The most GPU multiprocessors the manager uses; None: it may use the whole GPU."""
        return None

    def _not_checkpointed(self, method: str) -> None:
        key = (type(self).__name__, method)
        if key not in _warned:
            _warned.add(key)
            logger.warning("%s.%s is not implemented; skipping.", *key)

    def checkpoint_prepare(self) -> None:
        """Prepare the manager's state for a checkpoint: here, a warning (once) that there
        is nothing to do, as vLLM's."""
        self._not_checkpointed("checkpoint_prepare")

    def checkpoint_restore(self) -> None:
        """Restore the manager's state after a checkpoint: here, a warning (once), as
        vLLM's."""
        self._not_checkpointed("checkpoint_restore")

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """Bring the processed tokens back to the ranks they came from."""
        self._missing("combine", "combine")

    def allocate_combine_input(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor | None:
        """A buffer for :meth:`combine`'s input that the transport reads directly (such as
        symmetric memory), or None: allocate an ordinary tensor (always, here)."""
        return None

    def combine_into_output(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor:
        """:meth:`combine`, with the result written into ``output``; returns ``output``."""
        output.copy_(self.combine(hidden_states, is_sequence_parallel))
        return output

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Allocate whatever buffers ``model``'s shapes call for (none here)."""

    def destroy(self) -> None:
        """Release the manager's resources."""

    def stage_ep_size(self) -> None:
        """Prepare a change of the expert-parallel size (a no-op here)."""

    def commit_ep_size(self) -> None:
        """Make a staged expert-parallel size the active one (a no-op here)."""

    @contextmanager
    def mask_remote_ranks(self) -> Iterator[None]:
        """Within the block, communicate with no other rank (a no-op here: it only yields)."""
        yield
