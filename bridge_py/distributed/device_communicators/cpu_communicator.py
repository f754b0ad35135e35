"""CpuCommunicator: collectives of a CPU group over gloo.

Everything runs through ``self.dist_module``, which is ``torch.distributed`` (on the gloo
device group) today. A shared-memory fast path, like vLLM's ``_CPUSHMDistributed``, plugs
in by replacing ``dist_module`` with an object offering the same functions
(``all_reduce``, ``all_gather_single`` or ``all_gather_into_tensor``,
``reduce_scatter_single`` or ``reduce_scatter_tensor``, ``gather``, ``broadcast``, ``send``,
``recv``, with torch.distributed's signatures): see
:meth:`CpuCommunicator._select_dist_module`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.all2all import (
    All2AllDispatchMixin,
    NaiveAll2AllManager,
)
from bridge_py.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

__all__ = ["CpuCommunicator"]


class CpuCommunicator(All2AllDispatchMixin, DeviceCommunicatorBase):
    """Device communicator for CPU tensors (gloo), with all-to-all support for EP groups."""

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        *,
        use_all2all: bool | None = None,
    ) -> None:
        """Initialize self. See help(type(self)) for accurate signature."""
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        self.dist_module = self._select_dist_module()
        if self.use_all2all:
            self.all2all_manager = NaiveAll2AllManager(self)

    def _select_dist_module(self) -> Any:
        """The transport for this group's collectives.

        Extension point: return a shared-memory implementation here when every rank of
        the group is on one node (see ``in_the_same_node_as``) and it is available.
        """
        return dist
