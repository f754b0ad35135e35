defmodule VllmBridge.TestPython do
  @moduledoc false
  # Finds the Python the runtime would use, for cross-checks against the
  # Python implementation. Tests that need it skip their Python part when
  # there is none.

  @root Path.expand("../../../..", __DIR__)

  def root, do: @root

  def python do
    python = VllmBridge.Worker.find_python([])

    cond do
      Path.type(python) == :absolute and File.exists?(python) -> python
      exe = System.find_executable(python) -> exe
      true -> nil
    end
  end

  @doc "The Python the runtime would use; fails the test when there is none (make setup)."
  def python! do
    python() || raise "no Python found: run `make setup` (or set VLLM_BRIDGE_PYTHON)"
  end

  def has_module?(python, module) do
    match?({_, 0}, System.cmd(python, ["-c", "import #{module}"], stderr_to_stdout: true))
  end

  # The Python worker package is present (the colleague's side has landed).
  def worker_available? do
    python = python()

    python != nil and File.exists?(Path.join(@root, "bridge_py/worker/__main__.py")) and
      match?(
        {_, 0},
        System.cmd(python, ["-c", "import bridge_py.worker"],
          cd: @root,
          stderr_to_stdout: true,
          env: [{"PYTHONPATH", @root}]
        )
      )
  end
end

defmodule VllmBridge.PoolHelpers do
  @moduledoc false
  # Helpers for tests against real Python workers.

  import ExUnit.Callbacks, only: [start_supervised!: 1]
  import ExUnit.Assertions

  alias VllmBridge.{Pool, Runtime}

  @sample_args ["--exports", "tests.worker.sample_exports:table"]

  def sample_args, do: @sample_args

  @doc """
  A pool of one worker named after `test`, for tests that watch that worker:
  %{pool: name, worker: pid, os_pid: its Python's OS pid}.
  """
  def one_worker_pool!(test) do
    unless VllmBridge.TestPython.worker_available?() do
      raise "the Python worker (bridge_py.worker) is not available"
    end

    pool = start_pool!(:"#{test}", 1)
    {:ok, worker} = Pool.worker(pool, 0)
    {:ok, os_pid} = VllmBridge.Worker.os_pid(worker)
    %{pool: pool, worker: worker, os_pid: os_pid}
  end

  @doc "Starts a pool under the test supervisor and waits until every worker answers."
  def start_pool!(name, size, opts \\ []) do
    opts = Keyword.merge([name: name, size: size, args: @sample_args, timeout: 60_000], opts)
    start_supervised!(Supervisor.child_spec({Pool, opts}, id: name))
    warm!(name)
    name
  end

  def warm!(pool) do
    {:ok, size} = Pool.size(pool)

    for index <- 0..(size - 1) do
      assert {:ok, :warm} = Runtime.ping(:warm, __runtime__: [pool: pool, worker: index])
    end

    pool
  end

  @doc """
  A pool of one worker (`--max-threads 3`) with two of its threads blocked in
  calls for 2 s, so that the next call that may block is refused as :busy.
  Returns `{pool, counter, blocked}`: a Counter ref on that worker and the two
  blocked calls' tasks (each ends `{:ok, false}`).
  """
  def saturated_pool!(name) do
    pool = start_pool!(name, 1, args: @sample_args ++ ["--max-threads", "3"])
    rt = [__runtime__: [pool: pool]]
    {:ok, counter} = Runtime.call_class("Counter", [], rt)
    gates = for _ <- 1..2, do: elem(Runtime.call_class("Counter", [], rt), 1)

    # two calls hold two threads; the third reads on with nobody behind it
    blocked =
      for gate <- gates, do: Task.async(fn -> Runtime.call_method(gate, "wait_gate", [2.0]) end)

    Process.sleep(500)
    {pool, counter, blocked}
  end

  @doc "Polls `fun` every 20 ms until it returns a truthy value, for at most `ms`."
  def eventually(fun, ms \\ 10_000) do
    deadline = System.monotonic_time(:millisecond) + ms
    do_eventually(fun, deadline)
  end

  defp do_eventually(fun, deadline) do
    case fun.() do
      result when result not in [nil, false] ->
        result

      _ ->
        if System.monotonic_time(:millisecond) > deadline do
          flunk("condition not met in time")
        else
          Process.sleep(20)
          do_eventually(fun, deadline)
        end
    end
  end

  # Runs `fun.(rank)` for every rank at once (each in a task: collectives need every
  # rank inside them together) and returns the results in rank order.
  def on_ranks(ranks, fun, timeout \\ 90_000) do
    ranks |> Enum.map(&Task.async(fn -> fun.(&1) end)) |> Task.await_many(timeout)
  end

  # A port free now that no outgoing connection will take: ports from listen(0)
  # come from the kernel's ephemeral range, which outgoing connections (gloo's, a
  # store client's) draw from too, so one could take it before the test binds it.
  # So the port is drawn at random below that range and checked to be free.
  def free_tcp_port(tries \\ 200)

  def free_tcp_port(0), do: raise("no free TCP port below the ephemeral range")

  def free_tcp_port(tries) do
    low = ephemeral_low()
    port = if low > 11_000, do: 10_000 + :rand.uniform(low - 10_001), else: 0

    case :gen_tcp.listen(port, ip: {127, 0, 0, 1}) do
      {:ok, socket} ->
        {:ok, port} = :inet.port(socket)
        :gen_tcp.close(socket)
        port

      {:error, _} ->
        free_tcp_port(tries - 1)
    end
  end

  defp ephemeral_low do
    with {:ok, text} <- File.read("/proc/sys/net/ipv4/ip_local_port_range"),
         [low | _] <- String.split(text),
         {low, ""} <- Integer.parse(low) do
      low
    else
      _ -> 32_768
    end
  end
end
