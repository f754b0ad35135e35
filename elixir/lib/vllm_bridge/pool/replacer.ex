defmodule VllmBridge.Pool.Replacer do
  @moduledoc false
  # One per pool, under the pool's supervisor: replaces a worker that went
  # over its :max_calls or :max_memory_mb once it has drained (see "Lifecycle
  # limits" in VllmBridge.Worker). Supervisor.terminate_child/2 and
  # restart_child/2 do not count towards the restart intensity, so a pool
  # that replaces workers often is not taken for one that crashes.

  use GenServer

  alias VllmBridge.Worker

  def start_link(opts), do: GenServer.start_link(__MODULE__, opts)

  @impl true
  def init(opts) do
    # the pool's workers find it in their registry
    {:ok, _} = Registry.register(Keyword.fetch!(opts, :registry), :replacer, nil)
    {:ok, %{pool: Keyword.fetch!(opts, :pool)}}
  end

  @impl true
  def handle_cast({:replace, index, pid}, state) do
    with {:ok, workers} <- workers_supervisor(state.pool),
         true <- running?(workers, index, pid) do
      _ = Supervisor.terminate_child(workers, {Worker, index})
      _ = Supervisor.restart_child(workers, {Worker, index})
    end

    {:noreply, state}
  end

  defp workers_supervisor(pool) do
    case for {:workers, pid, :supervisor, _} <- Supervisor.which_children(pool), do: pid do
      [pid] when is_pid(pid) -> {:ok, pid}
      _ -> :error
    end
  end

  # Only the worker that asked is replaced (not one that replaced it already).
  defp running?(workers, index, pid) do
    Enum.any?(Supervisor.which_children(workers), &match?({{Worker, ^index}, ^pid, _, _}, &1))
  end
end
