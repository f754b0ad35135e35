defmodule VllmBridge.Worker.OSProcess do
  @moduledoc """
  The operating-system side of a worker's Python process: opening its port,
  writing frames to it without ever blocking, reading how much it has sent,
  killing it, and running a failed one again to capture what it prints.

  The commands themselves are built by `VllmBridge.Worker.Command`; the
  worker process (`VllmBridge.Worker.Server`) calls these functions and owns
  the port.
  """

  alias VllmBridge.Worker.Command

  # a failed start is run again to read its stderr: this long at most (ms)
  @diagnosis_timeout 30_000

  @doc """
  Opens the port that runs `executable -m bridge_py.worker` with the
  worker's `spawn` options (`:args`, `:env`, `:cd`) and returns it with the
  OS pid of the process. Raises `ErlangError` or `ArgumentError` when it
  cannot be run.
  """
  @spec open(Path.t(), keyword()) :: {port(), pos_integer()}
  def open(executable, spawn) do
    port = Port.open({:spawn_executable, executable}, Command.port_options(spawn))
    {:os_pid, os_pid} = Port.info(port, :os_pid)
    {port, os_pid}
  end

  @doc """
  Writes `frame` to `port` without waiting on it: a frame that cannot go at
  once (the pipe to a Python that reads nothing is full) is written by a
  process of its own, in the background, so the worker stays free to run its
  health checks. Raises `ArgumentError` when the port is closed.
  """
  @spec write(port(), iodata()) :: true
  def write(port, frame) do
    unless Port.command(port, frame, [:nosuspend]) do
      spawn(fn ->
        try do
          Port.command(port, frame)
        rescue
          ArgumentError -> :ok
        end
      end)
    end

    true
  end

  @doc """
  The count of bytes read from `port` so far (complete frames: every reply
  counts), or `:closed`.
  """
  @spec input_bytes(port()) :: non_neg_integer() | :closed
  def input_bytes(port) do
    case :erlang.port_info(port, :input) do
      {:input, bytes} -> bytes
      :undefined -> :closed
    end
  end

  @doc """
  The count of bytes written to the port so far (0 once it is closed).
  """
  @spec output_bytes(port()) :: non_neg_integer()
  def output_bytes(port) do
    case :erlang.port_info(port, :output) do
      {:output, bytes} -> bytes
      :undefined -> 0
    end
  end

  @doc """
  Kills the process with SIGKILL, and its process group: a stopped or
  wedged process ignores anything milder, and a worker leads a group of its
  own, so that what its exported code started goes with it. (While its port
  is open it cannot have been reaped, so the pid is still its own; a process
  that leads no group is killed alone.)
  """
  @spec kill(pos_integer()) :: :ok
  def kill(os_pid) do
    _ = :os.cmd(~c"kill -KILL -#{os_pid} 2>/dev/null; kill -KILL #{os_pid} 2>/dev/null")
    :ok
  end

  @doc """
  Runs `python -m bridge_py.worker` once more with stdin at end-of-file and
  returns what it printed on stdout and stderr (for at most 30 s; a process
  that runs longer is killed), or a sentence saying why it could not be run.
  """
  @spec rerun(Path.t(), keyword()) :: String.t()
  def rerun(python, spawn) do
    {sh, port_options} = Command.diagnosis_command(python, spawn)
    port = Port.open({:spawn_executable, sh}, port_options)
    deadline = System.monotonic_time(:millisecond) + @diagnosis_timeout
    collect(port, deadline, [])
  rescue
    error in [ErlangError, ArgumentError] ->
      "(could not run it again: #{Exception.message(error)})"
  end

  defp collect(port, deadline, acc) do
    wait = max(deadline - System.monotonic_time(:millisecond), 0)

    receive do
      {^port, {:data, data}} -> collect(port, deadline, [acc, data])
      {^port, {:exit_status, _}} -> IO.iodata_to_binary(acc)
    after
      wait ->
        with {:os_pid, os_pid} <- Port.info(port, :os_pid), do: kill(os_pid)
        Port.close(port)
        IO.iodata_to_binary(acc)
    end
  end
end
