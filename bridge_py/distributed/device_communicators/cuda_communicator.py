"""CudaCommunicator: collectives of a CUDA group over NCCL, through torch.distributed.

vLLM's CudaCommunicator adds pynccl, custom all-reduce kernels and symmetric memory on top
of NCCL; here every collective is torch.distributed's NCCL one on the device group, which
gives the same results. Argument checks are off by default on CUDA (see ``agreement``);
local validation still raises before anything is sent.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.all2all import NaiveAll2AllManager
from bridge_py.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

__all__ = ["CudaCommunicator"]


class CudaCommunicator(DeviceCommunicatorBase):
    """Device communicator for CUDA tensors (NCCL)."""

    sums_in_place = False  # all_reduce returns a new tensor, as vLLM's CUDA one does

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        *,
        use_all2all: bool = False,
    ) -> None:
        """Initialize self. See help(type(self)) for accurate signature."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if torch.device(device).type != "cuda":
            raise ValueError(f"CudaCommunicator needs a CUDA device, got {device}")
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        if self.use_all2all:
            self.all2all_manager = NaiveAll2AllManager(self.cpu_group, communicator=self)
