"""Device communicators: vLLM-compatible ways for ranks to exchange data.

``DeviceCommunicatorBase`` runs a group's collectives on torch.distributed;
``CpuCommunicator`` (gloo) and ``CudaCommunicator`` (NCCL) are the per-device classes that
``GroupCoordinator`` picks; ``NaiveAll2AllManager`` gives ``dispatch``/``combine`` real work.
``shm_broadcast.MessageQueue`` (shared-memory broadcast) lives in its own modules and is
imported where it is used.
"""

from bridge_py.distributed.device_communicators.agreement import CollectiveMismatchError
from bridge_py.distributed.device_communicators.all2all import (
    AgRsAll2AllManager,
    NaiveAll2AllManager,
)
from bridge_py.distributed.device_communicators.base_device_communicator import (
    All2AllManagerBase,
    DeviceCommunicatorBase,
)
from bridge_py.distributed.device_communicators.cpu_communicator import CpuCommunicator
from bridge_py.distributed.device_communicators.cuda_communicator import CudaCommunicator

__all__ = [
    "AgRsAll2AllManager",
    "All2AllManagerBase",
    "CollectiveMismatchError",
    "CpuCommunicator",
    "CudaCommunicator",
    "DeviceCommunicatorBase",
    "NaiveAll2AllManager",
]
