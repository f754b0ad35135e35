"""vLLM's distributed primitives, without vLLM (and ModelOpt's cross-rank gathers).

* ``StatelessProcessGroup`` exchanges picklable metadata between ranks through a
  TCPStore; ``stateless_init_torch_distributed_process_group`` builds a real torch
  ProcessGroup (gloo on CPU, nccl on CUDA) without touching torch.distributed's global
  state.
* ``GroupCoordinator`` and the ``parallel_state`` functions (``init_distributed_environment``,
  ``initialize_model_parallel``, ``get_tp_group`` ...) run a model's collectives on
  torch.distributed, through the device communicators; ``MessageQueue`` broadcasts
  objects through shared memory.
* ``NFSWorkspace``, ``get_configs_parallel`` and ``get_tensors_parallel`` gather configs
  and tensors on one rank, through shared memory or a shared directory.
* What they raise when ranks cannot work together: the ``DistributedError`` hierarchy
  (``bridge_py.distributed.errors``), every class exported here too.

Names, signatures and behaviour follow vLLM (``vllm.distributed``) and ModelOpt
(``modelopt.torch.export.distribute``); where a caller would notice a difference, the
function's documentation says so.
"""

from bridge_py.distributed.errors import (
    AuthenticationError,
    BarrierFailure,
    BarrierStoreError,
    BarrierTimeout,
    CollectiveMismatchError,
    CollectiveTimeout,
    DistributedError,
    GroupTimeout,
    ObjectLoadError,
    PeerGoneError,
    SharedMemoryError,
    StateError,
    StoreError,
    WaitCancelled,
)
from bridge_py.distributed.groups.torch_group import (
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from bridge_py.distributed.spg.group import StatelessProcessGroup

# isort: split
from bridge_py.distributed.communication_op import (
    broadcast_tensor_dict,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
    tensor_model_parallel_reduce_scatter,
)
from bridge_py.distributed.device_communicators import (
    CpuCommunicator,
    CudaCommunicator,
    DeviceCommunicatorBase,
    NaiveAll2AllManager,
)
from bridge_py.distributed.device_communicators.shm_broadcast import Handle, MessageQueue
from bridge_py.distributed.distribute import (
    NFSWorkspace,
    gather_configs,
    gather_tensors,
    get_configs_parallel,
    get_tensors_parallel,
)
from bridge_py.distributed.parallel_state import (
    GraphCaptureContext,
    GroupCoordinator,
    TensorMetadata,
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    get_distributed_init_method,
    get_dp_group,
    get_ep_group,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    graph_capture,
    in_the_same_node_as,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from bridge_py.distributed.utils import (
    divide,
    ensure_divisibility,
    get_pp_indices,
    split_tensor_along_last_dim,
)

__all__ = [
    "AuthenticationError",
    "BarrierFailure",
    "BarrierStoreError",
    "BarrierTimeout",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "CpuCommunicator",
    "CudaCommunicator",
    "DeviceCommunicatorBase",
    "DistributedError",
    "GraphCaptureContext",
    "GroupCoordinator",
    "GroupTimeout",
    "Handle",
    "MessageQueue",
    "NFSWorkspace",
    "NaiveAll2AllManager",
    "ObjectLoadError",
    "PeerGoneError",
    "SharedMemoryError",
    "StateError",
    "StatelessProcessGroup",
    "StoreError",
    "TensorMetadata",
    "WaitCancelled",
    "broadcast_tensor_dict",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "divide",
    "ensure_divisibility",
    "ensure_model_parallel_initialized",
    "gather_configs",
    "gather_tensors",
    "get_configs_parallel",
    "get_distributed_init_method",
    "get_dp_group",
    "get_ep_group",
    "get_pp_group",
    "get_pp_indices",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tensors_parallel",
    "get_tp_group",
    "get_world_group",
    "graph_capture",
    "in_the_same_node_as",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "split_tensor_along_last_dim",
    "stateless_destroy_torch_distributed_process_group",
    "stateless_init_torch_distributed_process_group",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter",
]
