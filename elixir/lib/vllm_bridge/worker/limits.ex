defmodule VllmBridge.Worker.Limits do
  @moduledoc """
  A worker's lifecycle limits, `:max_calls` and `:max_memory_mb`: whether a
  worker is over one, and the resident memory of its Python process (see
  "Lifecycle limits" in `VllmBridge.Worker`).

  The functions take the worker's state (its `:calls`, `:max_calls`,
  `:max_memory_mb`, `:os_pid` and `:memory_checked`) and say why the worker
  is over a limit; retiring it is the worker's business. Memory is read at
  most once a second after calls, since reading it costs a file read (or a
  `ps`) per call otherwise.
  """

  # memory is read at most this often after calls (ms)
  @memory_interval 1_000

  @doc """
  `{:over, why}` when the worker has answered `:max_calls` calls, else `:ok`.

  ## Examples

      iex> VllmBridge.Worker.Limits.calls(%{calls: 10, max_calls: 10})
      {:over, "it answered 10 calls (max_calls)"}

      iex> VllmBridge.Worker.Limits.calls(%{calls: 10, max_calls: nil})
      :ok
  """
  @spec calls(map()) :: :ok | {:over, String.t()}
  def calls(%{calls: calls, max_calls: max}) when is_integer(max) and calls >= max,
    do: {:over, "it answered #{calls} calls (max_calls)"}

  def calls(_state), do: :ok

  @doc """
  Reads the Python process's resident memory when it is due (at most once a
  second, or at once with `now`), and returns the state with the time of
  that reading, with `{:over, why, state}` when the memory is over
  `:max_memory_mb`.
  """
  @spec memory(map(), boolean()) :: {:ok, map()} | {:over, String.t(), map()}
  def memory(state, now) do
    time = System.monotonic_time(:millisecond)

    if now or state.memory_checked == nil or time - state.memory_checked >= @memory_interval do
      state = %{state | memory_checked: time}

      case rss_mb(state.os_pid) do
        mb when is_integer(mb) and mb > state.max_memory_mb ->
          {:over, "its Python process uses #{mb} MB (max_memory_mb #{state.max_memory_mb})",
           state}

        _ ->
          {:ok, state}
      end
    else
      {:ok, state}
    end
  end

  @doc """
  The resident memory (VmRSS) of the process `os_pid` in MB, from
  `/proc/<pid>/status`, else from `ps`; `nil` when it cannot be read.
  """
  @spec rss_mb(pos_integer() | nil) :: non_neg_integer() | nil
  def rss_mb(nil), do: nil

  def rss_mb(os_pid) do
    case File.read("/proc/#{os_pid}/status") do
      {:ok, status} ->
        case Regex.run(~r/^VmRSS:\s+(\d+) kB/m, status) do
          [_, kib] -> div(String.to_integer(kib), 1024)
          nil -> nil
        end

      {:error, _} ->
        case System.cmd("ps", ["-o", "rss=", "-p", Integer.to_string(os_pid)]) do
          {kib, 0} -> div(String.to_integer(String.trim(kib)), 1024)
          _ -> nil
        end
    end
  rescue
    _ -> nil
  end
end
