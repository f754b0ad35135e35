"""The calls of GroupCoordinator that move a mixture-of-experts layer's tokens.

:class:`ExpertExchange` is mixed into ``GroupCoordinator``: vLLM 0.34's two dispatches
(:meth:`~ExpertExchange.dispatch` of routed tokens, with their top-k weights and ids, and
:meth:`~ExpertExchange.dispatch_router_logits` of tokens with their router logits),
:meth:`~ExpertExchange.combine` and its into-an-output form, and the reduce-scatter that
form rests on. Each goes to the group's device communicator, whose all-to-all manager (on
expert-parallel groups while data parallelism is on) moves the tokens; without one the
tokens stay where they are.
"""

from __future__ import annotations

import torch

from bridge_py.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
    Dispatched,
    DispatchedTopk,
)

__all__ = ["ExpertExchange"]


class ExpertExchange:
    """The token exchange of a GroupCoordinator (see the module docstring)."""

    _comm: DeviceCommunicatorBase

    def dispatch_router_logits(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Dispatched:
        """Move each rank's tokens to the ranks that need them (expert parallelism).

        Returns ``(hidden_states, router_logits)``, plus the extra tensors when given;
        unchanged unless the device communicator has an all-to-all manager.
        """
        return self._comm.dispatch_router_logits(
            hidden_states, router_logits, is_sequence_parallel, extra_tensors
        )

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> DispatchedTopk:
        """Move each rank's routed tokens to the ranks that need them (expert parallelism).

        ``topk_weights`` and ``topk_ids`` say each token's experts and their weights (one
        row per token). Returns ``(hidden_states, topk_weights, topk_ids)``, plus the extra
        tensors when given; unchanged unless the device communicator has an all-to-all
        manager.
        """
        return self._comm.dispatch(
            hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors
        )

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """Bring processed tokens back to their ranks (the inverse of :meth:`dispatch`
        and :meth:`dispatch_router_logits`)."""
        return self._comm.combine(hidden_states, is_sequence_parallel)

    def allocate_combine_input(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor | None:
        """A buffer for :meth:`combine`'s input that the transport reads directly, or None
        (always, here: no transport has such memory): allocate an ordinary tensor."""
        return self._comm.allocate_combine_input(shape, dtype, device, is_sequence_parallel)

    def combine_into_output(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
        is_sequence_parallel: bool = False,
    ) -> torch.Tensor:
        """:meth:`combine`, with this rank's tokens written into ``output`` (a tensor of
        their shape); returns ``output``."""
        return self._comm.combine_into_output(hidden_states, output, is_sequence_parallel)

    def reduce_scatterv_into_output(
        self,
        input_: torch.Tensor,
        output: torch.Tensor,
        dim: int = -1,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """Sum over the group, then write this rank's ``sizes[rank]`` entries along ``dim``
        into ``output`` (a tensor of that shape); returns ``output``."""
        return self._comm.reduce_scatterv_into_output(input_, output, dim, sizes)
