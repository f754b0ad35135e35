"""The export table of the shipped worker: what `python -m bridge_py.worker` serves.

Add a class or function here (and run ``make codegen``) to make it reachable from
Elixir and gRPC; nothing else in the worker needs to change.
"""

from __future__ import annotations

from bridge_py.worker.exports import ExportedClass, ExportedFunction, ExportTable

_DISTRIBUTED = "Vllm.Distributed"

_GROUP_COORDINATOR_METHODS = (
    "_all_gather_out_place",
    "_all_reduce_out_place",
    "_reduce_scatter_out_place",
    "all_gather",
    "all_gatherv",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "broadcast_tensor_dict",
    "combine",
    "create_mq_broadcaster",
    "create_single_reader_mq_broadcasters",
    "destroy",
    "dispatch",
    "dispatch_router_logits",
    "gather",
    "graph_capture",
    "prepare_communication_buffer_for_model",
    "recv",
    "recv_object",
    "recv_tensor_dict",
    "reduce_scatter",
    "reduce_scatterv",
    "send",
    "send_object",
    "send_tensor_dict",
)

# The seeds' dispatch(hidden_states, router_logits, ...) is vLLM 0.34's
# dispatch_router_logits; vLLM 0.34's dispatch (top-k weights and ids) is dispatch/6.
_DISPATCH_ALIASES = (("dispatch", "dispatch_router_logits"),)

_DEVICE_COMMUNICATOR_METHODS = (
    "all_gather",
    "all_gatherv",
    "all_reduce",
    "combine",
    "destroy",
    "dispatch",
    "dispatch_router_logits",
    "gather",
    "prepare_communication_buffer_for_model",
    "recv",
    "reduce_scatter",
    "reduce_scatterv",
    "send",
)


def default_exports() -> ExportTable:
    """The shipped table (imports the distributed layer, and so torch)."""
    from bridge_py import distributed as d
    from bridge_py.distributed import communication_op, distribute, parallel_state, utils
    from bridge_py.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )
    from bridge_py.distributed.device_communicators.pynccl import PyNcclCommunicator
    from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
    from bridge_py.distributed.distribute.nfs import NFSWorkspace

    def functions(module: object, names: tuple[str, ...]) -> list[ExportedFunction]:
        return [ExportedFunction(name, getattr(module, name), _DISTRIBUTED) for name in names]

    return ExportTable.build(
        module_docs={_DISTRIBUTED: d.__doc__ or ""},
        classes=[
            ExportedClass(
                name="StatelessProcessGroup",
                cls=d.StatelessProcessGroup,
                elixir_module=f"{_DISTRIBUTED}.StatelessProcessGroup",
                methods=(
                    "all_gather_obj",
                    "all_reduce",
                    "barrier",
                    "broadcast",
                    "broadcast_obj",
                    "expire_data",
                    "recv",
                    "recv_obj",
                    "send",
                    "send_obj",
                ),
                static_methods=("create",),
                attributes=(
                    "rank",
                    "world_size",
                    "store",
                    "data_expiration_seconds",
                    "broadcast_send_counter",
                    "send_dst_counter",
                    "recv_src_counter",
                    "broadcast_recv_src_counter",
                    "wire",
                ),
            ),
            ExportedClass(
                name="GroupCoordinator",
                cls=parallel_state.GroupCoordinator,
                elixir_module=f"{_DISTRIBUTED}.GroupCoordinator",
                methods=_GROUP_COORDINATOR_METHODS,
                elixir_aliases=_DISPATCH_ALIASES,
                attributes=(
                    "rank",
                    "ranks",
                    "world_size",
                    "local_rank",
                    "rank_in_group",
                    "unique_name",
                    "device",
                    "cpu_group",
                    "device_group",
                    "device_communicator",
                    "mq_broadcaster",
                    "first_rank",
                    "last_rank",
                    "next_rank",
                    "prev_rank",
                    "is_first_rank",
                    "is_last_rank",
                ),
            ),
            ExportedClass(
                name="DeviceCommunicatorBase",
                cls=DeviceCommunicatorBase,
                elixir_module=f"{_DISTRIBUTED}.DeviceCommunicatorBase",
                methods=_DEVICE_COMMUNICATOR_METHODS,
                elixir_aliases=_DISPATCH_ALIASES,
                attributes=("rank", "world_size", "ranks", "rank_in_group", "unique_name"),
            ),
            ExportedClass(
                name="PyNcclCommunicator",
                cls=PyNcclCommunicator,
                elixir_module=f"{_DISTRIBUTED}.PyNcclCommunicator",
                # (batch_isend_irecv is not exported: its P2POps hold Python functions.)
                methods=(
                    "all_gather",
                    "all_gatherv",
                    "all_reduce",
                    "all_to_all_single",
                    "broadcast",
                    "destroy",
                    "recv",
                    "reduce",
                    "reduce_scatter",
                    "reduce_scatterv",
                    "resume",
                    "scatter",
                    "send",
                    "suspend",
                ),
                static_methods=("from_unique_id_bytes",),
                attributes=("rank", "world_size", "available", "disabled", "device", "group"),
            ),
            ExportedClass(
                name="TensorMetadata",
                cls=parallel_state.TensorMetadata,
                elixir_module=f"{_DISTRIBUTED}.TensorMetadata",
                attributes=("device", "dtype", "size"),
            ),
            ExportedClass(
                name="GraphCaptureContext",
                cls=parallel_state.GraphCaptureContext,
                elixir_module=f"{_DISTRIBUTED}.GraphCaptureContext",
                attributes=("stream",),
            ),
            ExportedClass(
                name="MessageQueue",
                cls=MessageQueue,
                elixir_module=f"{_DISTRIBUTED}.MessageQueue",
                methods=(
                    "broadcast_object",
                    "close",
                    "dequeue",
                    "enqueue",
                    "export_handle",
                    "shutdown",
                    "wait_until_ready",
                ),
                static_methods=("create_from_handle", "create_from_process_group", "recv"),
                attributes=("shutting_down",),
                unordered=("shutdown",),  # it exists to end a wait on the queue
            ),
            ExportedClass(
                name="NFSWorkspace",
                cls=NFSWorkspace,
                elixir_module=f"{_DISTRIBUTED}.NFSWorkspace",
                methods=("read_configs_and_weights_from_rank", "write_configs_and_weights"),
                attributes=("is_initialized",),
            ),
        ],
        functions=[
            *functions(
                d,
                (
                    "stateless_init_torch_distributed_process_group",
                    "stateless_destroy_torch_distributed_process_group",
                ),
            ),
            *functions(
                parallel_state,
                (
                    "init_distributed_environment",
                    "initialize_model_parallel",
                    "ensure_model_parallel_initialized",
                    "model_parallel_is_initialized",
                    "get_world_group",
                    "get_tp_group",
                    "get_pp_group",
                    "get_dp_group",
                    "get_ep_group",
                    "get_tensor_model_parallel_rank",
                    "get_tensor_model_parallel_world_size",
                    "get_pipeline_model_parallel_rank",
                    "get_node_count",
                    "is_global_first_rank",
                    "is_local_first_rank",
                    "destroy_model_parallel",
                    "destroy_distributed_environment",
                    "in_the_same_node_as",
                    "get_distributed_init_method",
                ),
            ),
            *functions(
                communication_op,
                (
                    "tensor_model_parallel_all_reduce",
                    "tensor_model_parallel_all_gather",
                    "tensor_model_parallel_gather",
                    "tensor_model_parallel_reduce_scatter",
                    "broadcast_tensor_dict",
                ),
            ),
            *functions(
                utils,
                ("split_tensor_along_last_dim", "divide", "ensure_divisibility", "get_pp_indices"),
            ),
            # Context managers in Python; one call that gathers, cleans up and returns the
            # list from Elixir (and gRPC).
            ExportedFunction("get_configs_parallel", distribute.gather_configs, _DISTRIBUTED),
            ExportedFunction("get_tensors_parallel", distribute.gather_tensors, _DISTRIBUTED),
        ],
    )
