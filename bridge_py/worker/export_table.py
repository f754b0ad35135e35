"""The export table of the shipped worker: what `python -m bridge_py.worker` serves.

Add a class or function here (and run ``make codegen``) to make it reachable from
Elixir and gRPC; nothing else in the worker needs to change.
"""

from __future__ import annotations

from bridge_py.worker.exports import ExportedClass, ExportedFunction, ExportTable


def default_exports() -> ExportTable:
    """The shipped table (imports the distributed layer, and so torch)."""
    from bridge_py import distributed as d

    return ExportTable.build(
        module_docs={"Vllm.Distributed": d.__doc__ or ""},
        classes=[
            ExportedClass(
                name="StatelessProcessGroup",
                cls=d.StatelessProcessGroup,
                elixir_module="Vllm.Distributed.StatelessProcessGroup",
                methods=(
                    "all_gather_obj",
                    "barrier",
                    "broadcast_obj",
                    "expire_data",
                    "recv_obj",
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
                ),
            ),
        ],
        functions=[
            ExportedFunction(
                name="stateless_init_torch_distributed_process_group",
                fn=d.stateless_init_torch_distributed_process_group,
                elixir_module="Vllm.Distributed",
            ),
            ExportedFunction(
                name="stateless_destroy_torch_distributed_process_group",
                fn=d.stateless_destroy_torch_distributed_process_group,
                elixir_module="Vllm.Distributed",
            ),
        ],
    )
