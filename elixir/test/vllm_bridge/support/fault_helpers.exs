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
    path = Path.join(dir, "quiet_python")
    File.write!(path, "#!/bin/sh\nexec #{python!()} \"$@\" 2>/dev/null\n")
    File.chmod!(path, 0o755)
    path
  end

  @doc false
  # A real Python that lacks torch: the project's Python without its site
  # directory (-S), given every installed package but torch through
  # PYTHONPATH. With `switch`, it is the full Python until that file exists.
  def torchless_python!(dir, switch \\ nil) do
    python = python!()

    {site, 0} =
      System.cmd(python, [
        "-c",
        "import msgpack, os; print(os.path.dirname(os.path.dirname(msgpack.__file__)))"
      ])

    site = String.trim(site)
    lib = Path.join(dir, "site")
    File.mkdir_p!(lib)

    for entry <- File.ls!(site), not String.starts_with?(entry, ["torch", "functorch"]) do
      File.ln_s!(Path.join(site, entry), Path.join(lib, entry))
    end

    torchless = "PYTHONPATH=\"$PYTHONPATH:#{lib}\" exec #{python} -S \"$@\""

    script =
      case switch do
        nil -> "#!/bin/sh\n#{torchless}\n"
        file -> "#!/bin/sh\nif [ -e #{file} ]; then #{torchless}; fi\nexec #{python} \"$@\"\n"
      end

    path = Path.join(dir, "torchless_python")
    File.write!(path, script)
    File.chmod!(path, 0o755)
    path
  end

  @doc """
  Opens a raw port to `python -m bridge_py.worker` serving the sample table,
  the way `VllmBridge.Worker` does ({:packet, 4}). Returns `{port, os_pid}`.
  """
  def open_raw_worker!(args) do
    root = Worker.project_root()

    port =
      Port.open({:spawn_executable, python!()}, [
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

  @doc "The absolute path of the Python the runtime would use."
  def python! do
    python = Worker.find_python([])

    cond do
      Path.type(python) == :absolute and File.exists?(python) -> python
      exe = System.find_executable(python) -> exe
      true -> raise "no Python found: run `make setup` (or set VLLM_BRIDGE_PYTHON)"
    end
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

defmodule VllmBridge.Soak do
  @moduledoc false
  # The soak driver shared by soak_test.exs and bench/elixir/soak.exs: many
  # concurrent callers, each checking that every answer is its own. Raises on
  # a lost, crossed or wrong reply.

  alias VllmBridge.{Pool, Runtime, Worker}

  @doc """
  Runs about `calls` calls from `callers` concurrent processes across the
  workers of `pool`: pings of `{caller, i}` (3 in 4), `incr` on the caller's
  own Counter (1 in 4), and every 100th step a Counter created, used and
  released in `session`. Returns the number of calls made.
  """
  def run(pool, calls, callers, session, timeout \\ 600_000) do
    {:ok, size} = Pool.size(pool)
    # a step is one call, every 100th is three
    steps = div(calls * 100, 102 * callers) + 1

    1..callers
    |> Enum.map(fn c -> Task.async(fn -> caller(pool, size, c, steps, session) end) end)
    |> Task.await_many(timeout)
    |> Enum.sum()
  end

  defp caller(pool, size, c, steps, session) do
    rt = fn i -> [__runtime__: [pool: pool, worker: rem(i + c, size), session: session]] end
    {:ok, counter} = Runtime.call_class("Counter", [], rt.(0))

    {count, calls} =
      Enum.reduce(1..steps, {0, 1}, fn i, {count, calls} ->
        cond do
          rem(i, 100) == 0 ->
            {:ok, tmp} = Runtime.call_class("Counter", [i], rt.(i))
            check!(Runtime.call_method(tmp, "incr", []), {:ok, i + 1}, c, i)
            check!(Runtime.release(tmp), {:ok, 1}, c, i)
            {count, calls + 3}

          rem(i, 4) == 0 ->
            check!(Runtime.call_method(counter, "incr", []), {:ok, count + 1}, c, i)
            {count + 1, calls + 1}

          true ->
            check!(Runtime.ping({c, i}, rt.(i)), {:ok, {c, i}}, c, i)
            {count, calls + 1}
        end
      end)

    check!(Runtime.get_attr(counter, "value"), {:ok, count}, c, :final)
    check!(Runtime.release(counter), {:ok, 1}, c, :release)

    case Process.info(self(), :messages) do
      {:messages, []} -> :ok
      {:messages, stray} -> raise "caller #{c}: stray messages #{inspect(stray, limit: 5)}"
    end

    calls + 2
  end

  defp check!(got, expected, c, i) do
    if got != expected do
      raise "caller #{c}, step #{inspect(i)}: expected #{inspect(expected)}, got #{inspect(got)}"
    end
  end

  @doc "The Python OS pids of the pool's workers, by index."
  def os_pids(pool) do
    {:ok, workers} = Pool.workers(pool)

    for {_index, pid} <- workers do
      {:ok, os_pid} = Worker.os_pid(pid)
      os_pid
    end
  end

  @doc "The summed VmRSS (KiB) of the pool's Python processes."
  def rss_kib(pool),
    do: pool |> os_pids() |> Enum.map(&VllmBridge.FaultHelpers.rss_kib/1) |> Enum.sum()
end
