"""vLLM's stateless distributed primitives, without vLLM.

``StatelessProcessGroup`` exchanges picklable metadata between ranks through a TCPStore;
``stateless_init_torch_distributed_process_group`` builds a real torch ProcessGroup (gloo on
CPU, nccl on CUDA) without touching torch.distributed's global state. Names, signatures and
behaviour follow ``vllm.distributed.utils``; the module docstrings say where they do better.
"""

from bridge_py.distributed.stateless_process_group import StatelessProcessGroup
from bridge_py.distributed.store import StoreError
from bridge_py.distributed.torch_process_group import (
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)

__all__ = [
    "StatelessProcessGroup",
    "StoreError",
    "stateless_destroy_torch_distributed_process_group",
    "stateless_init_torch_distributed_process_group",
]
