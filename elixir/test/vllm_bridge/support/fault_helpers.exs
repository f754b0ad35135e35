defmodule VllmBridge.FaultHelpers do
  @moduledoc false
  # OS-level helpers for the fault and soak tests: signals, liveness and memory
  # of OS processes, a quiet Python, a raw port to a Python worker.

  alias VllmBridge.{Proto, Worker}

  @doc "Sends SIGKILL to an OS process."
  def kill9(os_pid) when is_integer(os_pid) do
    System.cmd("kill", ["-9", Integer.to_string(os_pid)], stderr_to_stdout: true)
    :ok
  end

  @doc """
  Whether an OS process is still running. A zombie (exited, not yet reaped:
  the init of a container may never reap orphans) counts as gone.
  """
  def os_alive?(os_pid) when is_integer(os_pid) do
    case File.read("/proc/#{os_pid}/stat") do
      {:ok, stat} ->
        # "pid (comm) S ...": the state follows the last ")"
        state = stat |> String.split(")") |> List.last() |> String.trim_leading()
        not String.starts_with?(state, ["Z", "X"])

      {:error, _} ->
        false
    end
  end

  @doc "The resident set size (VmRSS) of an OS process, in KiB."
  def rss_kib(os_pid) do
    {:ok, status} = File.read("/proc/#{os_pid}/status")
    [_, kib] = Regex.run(~r/^VmRSS:\s+(\d+) kB/m, status)
    String.to_integer(kib)
  end

  @doc "Polls (every 10 ms) until no OS pid in `os_pids` runs, for at most `ms`; true if so."
  def wait_os_exit(os_pids, ms) do
    deadline = System.monotonic_time(:millisecond) + ms
    do_wait_os_exit(os_pids, deadline)
  end

  defp do_wait_os_exit(os_pids, deadline) do
    cond do
      not Enum.any?(os_pids, &os_alive?/1) ->
        true

      System.monotonic_time(:millisecond) > deadline ->
        false

      true ->
        Process.sleep(10)
        do_wait_os_exit(os_pids, deadline)
    end
  end

  @doc "Milliseconds on the monotonic clock."
  def now_ms, do: System.monotonic_time(:millisecond)

  @doc """
  Writes an executable wrapper around the project's Python into `dir` that
  sends the worker's stderr (where everything Python prints goes) to
  /dev/null, so tests that print megabytes keep the test output readable.
  """
  def quiet_python!(dir) do
    python = VllmBridge.TestPython.python!()
    path = Path.join(dir, "quiet_python")
    File.write!(path, "#!/bin/sh\nexec #{python} \"$@\" 2>/dev/null\n")
    File.chmod!(path, 0o755)
    path
  end

  @doc """
  Opens a raw port to `python -m bridge_py.worker` serving the sample table,
  the way `VllmBridge.Worker` does ({:packet, 4}). Returns `{port, os_pid}`.
  """
  def open_raw_worker!(args) do
    python = VllmBridge.TestPython.python!()
    root = VllmBridge.TestPython.root()

    port =
      Port.open({:spawn_executable, python}, [
        :binary,
        {:packet, 4},
        :exit_status,
        :use_stdio,
        :hide,
        args: ["-m", "bridge_py.worker" | args],
        env: [{~c"PYTHONPATH", String.to_charlist(root)}],
        cd: root
      ])

    {:os_pid, os_pid} = Port.info(port, :os_pid)
    {port, os_pid}
  end

  @doc "Encodes a request frame (a binary)."
  def frame!(id, op, session \\ "") do
    {:ok, iodata} = Proto.encode_request(%{id: id, session: session, op: op})
    IO.iodata_to_binary(iodata)
  end

  @doc "A ping frame whose payload is `term`."
  def ping_frame!(id, term) do
    {:ok, payload} = VllmBridge.Msgpack.encode(term)
    frame!(id, {:ping, %{payload: payload}})
  end

  @doc "Worker.info's pending count, or nil when the worker is not running."
  def pending(worker) do
    case Worker.info(worker) do
      {:ok, %{pending: n}} -> n
      _ -> nil
    end
  end
end
