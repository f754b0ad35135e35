defmodule VllmBridge do
  @moduledoc """
  Drive vLLM-style distributed primitives (`StatelessProcessGroup` and
  friends) that run in Python worker processes, from Elixir.

  The bridge is a few small layers, each usable on its own:

    * `VllmBridge.Runtime` - the calls: construct an object, call a method
      or function, read an attribute, release. Start here; the generated
      `Vllm.*` modules are thin wrappers over it.
    * `VllmBridge.Pool` - a supervised set of workers, each one Python
      process (`python -m bridge_py.worker`); placement by index, by ref or
      round-robin. Put one in your supervision tree, or configure a default
      one with `config :vllm_bridge, default_pool: [size: 2]`.
    * `VllmBridge.Worker` - one process owning one port to one Python
      process; routes replies by id, so calls run concurrently.
    * `VllmBridge.Proto` and `VllmBridge.Msgpack` - the wire: protobuf
      envelopes (`proto/bridge.proto`) carrying canonical msgpack values
      (see `docs/protocol.md`).
    * `VllmBridge.Ref`, `VllmBridge.Tensor`, `VllmBridge.Error` - the data
      that crosses: live Python objects, dense tensors, and failures as data.

  Elixir is the control plane only: ranks exchange data among themselves
  with torch.distributed, never through the BEAM.

      children = [{VllmBridge.Pool, name: MyApp.Bridge, size: 2}]
      Supervisor.start_link(children, strategy: :one_for_one)

      {:ok, 3} = VllmBridge.Runtime.ping(3, __runtime__: [pool: MyApp.Bridge])
  """
end
