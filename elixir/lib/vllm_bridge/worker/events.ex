defmodule VllmBridge.Worker.Events do
  @moduledoc """
  The telemetry events a `VllmBridge.Worker` emits about its Python process
  (listed in `VllmBridge.Telemetry`): `[:vllm_bridge, :worker, :started]`
  when a start handshake is answered, `[:vllm_bridge, :worker, :exited]`
  when the process goes, and `[:vllm_bridge, :worker, :restarted]` when a
  new one is started at a pool index that had one before.

  Each function takes the worker's state (its `:pool`, `:index`, `:os_pid`,
  `:python`, `:attempt` and `:spawned_at`) and runs in the worker process,
  whose pid is the `:worker` metadata.
  """

  alias VllmBridge.Telemetry

  @doc "The start handshake was answered: `:duration` since the spawn, native units."
  @spec started(map()) :: :ok
  def started(state) do
    Telemetry.execute(
      [:vllm_bridge, :worker, :started],
      %{
        system_time: System.system_time(),
        duration: System.monotonic_time() - state.spawned_at
      },
      %{
        pool: state.pool,
        index: state.index,
        worker: self(),
        os_pid: state.os_pid,
        python: state.python
      }
    )
  end

  @doc """
  The Python process went: `reason` is `:exit`, `:start_failed`,
  `:unresponsive`, `:replaced` or `:shutdown`; `status` its exit status, if
  known.
  """
  @spec exited(map(), atom(), non_neg_integer() | nil) :: :ok
  def exited(state, reason, status) do
    Telemetry.execute(
      [:vllm_bridge, :worker, :exited],
      %{system_time: System.system_time()},
      %{
        pool: state.pool,
        index: state.index,
        worker: self(),
        os_pid: state.os_pid,
        exit_status: status,
        reason: reason
      }
    )
  end

  @doc """
  A Python process is started again: after a back-off of `delay` ms (the
  state's `:attempt` failed starts), or with `delay` 0 by a new worker
  process at an index that had one before (`attempt` 0).
  """
  @spec restarted(map(), non_neg_integer(), non_neg_integer()) :: :ok
  def restarted(state, delay, attempt) do
    Telemetry.execute(
      [:vllm_bridge, :worker, :restarted],
      %{system_time: System.system_time(), delay: delay},
      %{pool: state.pool, index: state.index, worker: self(), attempt: attempt}
    )
  end

  @doc """
  Counts a worker's start in its pool's array of starts per index (the
  worker's `:starts` option): true when a worker ran at this index before.
  """
  @spec started_before?(:atomics.atomics_ref() | nil, non_neg_integer() | nil) :: boolean()
  def started_before?(starts, index) when is_reference(starts) and is_integer(index),
    do: :atomics.add_get(starts, index + 1, 1) > 1

  def started_before?(_starts, _index), do: false
end
