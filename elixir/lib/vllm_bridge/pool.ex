defmodule VllmBridge.Pool do
  @moduledoc """
  A fixed set of `VllmBridge.Worker`s, each with its own Python process,
  under one supervisor.

      children = [
        {VllmBridge.Pool, name: MyApp.Ranks, size: 2}
      ]

  A pool is a supervision tree:

      VllmBridge.Pool (Supervisor, :rest_for_one)
      ├── Registry  (name: <pool>.Registry, keys: worker index)
      ├── Supervisor (:one_for_one)
      │   ├── VllmBridge.Worker 0
      │   └── VllmBridge.Worker ...
      └── VllmBridge.Pool.Replacer (replaces workers over their limits)

  A pool's state is its own, and goes with it: its `Registry` holds the
  running workers (each under its index, with its channel as the value,
  see `VllmBridge.Worker`), and a table named after the pool, owned by its
  supervisor, holds what every call reads (the registry, size, default
  timeout and round-robin counter). `route/2` places a call: one read of
  that table and one registry lookup, in the caller, without a process.
  `worker/2` and `workers/1` are the same lookups for callers that want
  pids.

  Workers are independent Python processes: objects (and the handles of
  `VllmBridge.Ref`s) live in exactly one of them. A worker that dies is
  restarted at the same index with a fresh Python process; refs into the old
  one become stale (see `VllmBridge.Runtime`).

  `start_link/1` returns once every worker's Python process has answered
  (see "Start-up" in `VllmBridge.Worker`), or returns the first worker's
  start failure as `{:error, %VllmBridge.Error{category: :worker}}`, which
  names the Python executable and the module it could not import, after
  stopping the pool. A worker whose Python fails to start later (after a
  crash) tries again with a bounded exponential back-off instead of crashing.

  With `:max_calls` or `:max_memory_mb`, a worker over its limit is replaced
  by a fresh one once its calls in flight have finished (never in the middle
  of one); the objects in its Python process are lost, as on a restart (see
  "Lifecycle limits" in `VllmBridge.Worker`).

  A pool on another node is reached with Erlang distribution: name its node
  in the call's placement (`__runtime__: [pool: name, node: node]`), or call
  a ref, which carries its worker's pid; `VllmBridge.Runtime` then runs the
  call on that node (see its "Across nodes" section and `docs/deploy.md`).
  """

  use Supervisor

  alias VllmBridge.{Error, Worker}

  @default_name VllmBridge.DefaultPool
  @default_timeout 120_000
  @startup_timeout 120_000

  @typedoc "A pool's registered name."
  @type name :: atom()

  @doc "The name used when none is given: `#{inspect(@default_name)}`."
  @spec default_name() :: name()
  def default_name, do: @default_name

  @doc """
  Returns a child specification (the child id is the pool name).
  """
  @spec child_spec(keyword()) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{
      id: Keyword.get(opts, :name, @default_name),
      start: {__MODULE__, :start_link, [opts]},
      type: :supervisor
    }
  end

  @doc """
  Starts a pool.

  ## Options

    * `:name` - the pool's name (default `#{inspect(@default_name)}`)
    * `:size` - how many workers (default `1`)
    * `:python` - the Python executable (see `VllmBridge.Worker.find_python/1`)
    * `:env` - extra environment variables for the Python processes
    * `:cd` - working directory of the Python processes
    * `:args` - extra command-line arguments for `python -m bridge_py.worker`
      (e.g. `["--exports", "my_module:table"]`)
    * `:timeout` - default per-call timeout in ms of calls on this pool
      (default `#{@default_timeout}`)
    * `:max_restarts`, `:max_seconds` - restart intensity of the workers'
      supervisor (defaults 3 and 5, as for any supervisor)
    * `:health_interval`, `:health_timeout` - health checks of each worker
      (ms; defaults 5000 and 5000; `health_interval: false` turns them off):
      a Python process that answers nothing, not even a ping, for that long is
      killed, its callers get `:worker` errors, and the worker restarts (see
      "Health checks" in `VllmBridge.Worker`)
    * `:max_calls` - replace a worker once it has answered this many calls
      (default `nil`, never)
    * `:max_memory_mb` - replace a worker once its Python process's resident
      memory is over this many MB (default `nil`, never); objects in a
      replaced worker are lost, as on a restart
    * `:backoff_min`, `:backoff_max` - ms before a worker starts Python again
      after a failed start, doubled per failure in a row (defaults 500 and
      30_000)
    * `:reply_spin_us` - how long, in microseconds, a caller keeps looking
      for its reply before it sleeps, while its call is the only one in
      flight on its worker (default 50, at most 1000; `0`: never; see
      "Waiting for a reply" in `VllmBridge.Worker`)
    * `:startup_timeout` - ms `start_link/1` waits for every worker's Python
      to answer (default `#{@startup_timeout}`; `:infinity` allowed)

  Invalid options are `{:error, %VllmBridge.Error{category: :bad_args}}`; a
  Python that cannot start is the `:worker` error of its first failed start
  (see `VllmBridge.Worker.await_started/2`), and one that does not answer
  within `:startup_timeout` a `:timeout` error; either way the pool is
  stopped before `start_link/1` returns.
  """
  @spec start_link(keyword()) :: Supervisor.on_start()
  def start_link(opts \\ []) do
    # the workers' options first (a keyword list of them, each valid), then the pool's
    with :ok <- Worker.Options.check_all(opts),
         :ok <- Worker.Options.check_pool(opts),
         do: start(opts)
  end

  defp start(opts) do
    name = Keyword.get(opts, :name, @default_name)
    size = Keyword.get(opts, :size, 1)

    opts =
      Keyword.merge(opts,
        name: name,
        size: size,
        timeout: Keyword.get(opts, :timeout, @default_timeout)
      )

    with {:ok, sup} <- Supervisor.start_link(__MODULE__, opts, name: name) do
      case await_workers(name, size, Keyword.get(opts, :startup_timeout, @startup_timeout)) do
        :ok ->
          {:ok, sup}

        {:error, _} = error ->
          Process.unlink(sup)
          Supervisor.stop(sup, :shutdown)
          error
      end
    end
  end

  # A failed start as the pool reports it: the pool stops, so no next try.
  defp gave_up(%Error{details: %{why: why} = details} = error),
    do: %{
      error
      | message: "#{why} (the pool was stopped)",
        details: Map.delete(details, :retry_in)
    }

  defp gave_up(error), do: error

  # Waits for every worker's start handshake, all at once; the first failure.
  defp await_workers(pool, size, timeout) do
    deadline = if timeout == :infinity, do: :infinity, else: now() + timeout

    0..(size - 1)
    |> Enum.map(fn index ->
      with {:ok, pid} <- __MODULE__.worker(pool, index),
           do: {index, :gen_server.send_request(pid, :await_started)}
    end)
    |> Enum.reduce_while(:ok, fn
      {:error, _} = error, :ok ->
        {:halt, error}

      {index, request}, :ok ->
        wait = if deadline == :infinity, do: :infinity, else: max(deadline - now(), 0)

        case :gen_server.receive_response(request, wait) do
          {:reply, :ok} ->
            {:cont, :ok}

          {:reply, {:error, error}} ->
            {:halt, {:error, gave_up(error)}}

          :timeout ->
            {:halt,
             {:error,
              Error.new(
                :timeout,
                "worker #{index} of pool #{inspect(pool)} did not start within #{timeout} ms " <>
                  "(:startup_timeout)",
                details: %{pool: pool, index: index, timeout: timeout}
              )}}

          {:error, {reason, _}} ->
            {:halt,
             {:error,
              Error.new(
                :worker,
                "worker #{index} of pool #{inspect(pool)} stopped while starting " <>
                  "(#{inspect(reason)})",
                details: %{pool: pool, index: index, reason: reason}
              )}}
        end
    end)
  end

  defp now, do: System.monotonic_time(:millisecond)

  @impl true
  def init(opts) do
    name = Keyword.fetch!(opts, :name)
    size = Keyword.fetch!(opts, :size)
    registry = Module.concat(name, Registry)

    worker_opts =
      Keyword.take(opts, [
        :python,
        :env,
        :cd,
        :args,
        :health_interval,
        :health_timeout,
        :max_calls,
        :max_memory_mb,
        :backoff_min,
        :backoff_max,
        :reply_spin_us
      ])

    # starts per index, for the worker restarted event (VllmBridge.Telemetry)
    starts = :atomics.new(size, signed: false)

    workers =
      for index <- 0..(size - 1) do
        Supervisor.child_spec(
          {Worker,
           [
             name: {:via, Registry, {registry, index}},
             registry: {registry, index},
             pool: name,
             index: index,
             starts: starts
           ] ++ worker_opts},
          id: {Worker, index}
        )
      end

    workers_sup = %{
      id: :workers,
      type: :supervisor,
      start:
        {Supervisor, :start_link,
         [
           workers,
           [
             strategy: :one_for_one,
             max_restarts: Keyword.get(opts, :max_restarts, 3),
             max_seconds: Keyword.get(opts, :max_seconds, 5)
           ]
         ]}
    }

    # What every call reads (settings/1): a table named after the pool, owned
    # by this supervisor, so it goes when the pool stops.
    :ets.new(name, [:named_table, :protected, read_concurrency: true])
    counter = :atomics.new(1, signed: false)
    true = :ets.insert(name, {:settings, registry, size, Keyword.fetch!(opts, :timeout), counter})

    Supervisor.init(
      [
        {Registry, keys: :unique, name: registry},
        workers_sup,
        {VllmBridge.Pool.Replacer, registry: registry, pool: name}
      ],
      strategy: :rest_for_one
    )
  end

  @doc """
  Where a call goes: `{:ok, index, pid, via, timeout}`, where `via` is the
  worker's `t:VllmBridge.Worker.channel/0` (its pid in the moment between
  its registration and the end of its start, before it has published its
  channel; `VllmBridge.Worker.request/4` takes either) and `timeout` the
  pool's default per-call timeout. `to` is:

    * `:next` - the next worker in round-robin order; a worker that is
      restarting is skipped, and the error is `:worker` only when no worker
      runs;
    * an index - the worker at that index (`:bad_args` outside the pool,
      `:worker` while it restarts);
    * a pid - that worker, found by pid (`:worker` when it is not a running
      worker of the pool: it died, was replaced, or never belonged);
    * `{index, pid}` - that worker, checked in one lookup (what a ref knows).

  One read of the pool's table and one registry lookup, in the caller's
  process. A worker that has just died is still registered for a moment: a
  request to it then fails with a `:worker` error (`details.reason`
  `:noproc`).
  """
  @spec route(name(), :next | non_neg_integer() | pid() | {non_neg_integer(), pid()}) ::
          {:ok, non_neg_integer(), pid(), Worker.channel() | pid(), timeout()}
          | {:error, Error.t()}
  def route(pool, to) do
    case settings(pool) do
      {registry, size, timeout, counter} -> route(pool, to, registry, size, timeout, counter)
      nil -> {:error, no_pool(pool)}
    end
  rescue
    # the registry went away between the two reads: the pool is stopping
    ArgumentError -> {:error, no_pool(pool)}
  end

  defp route(pool, :next, registry, size, timeout, counter) do
    first_running(pool, registry, timeout, :atomics.add_get(counter, 1, 1), size, size)
  end

  defp route(pool, index, registry, size, timeout, _counter) when is_integer(index) do
    if index >= 0 and index < size do
      case Registry.lookup(registry, index) do
        [{pid, via}] -> {:ok, index, pid, via || pid, timeout}
        [] -> {:error, not_running(pool, index)}
      end
    else
      {:error,
       Error.new(
         :bad_args,
         "worker index #{index} is outside pool #{inspect(pool)} (size #{size})",
         details: %{pool: pool, index: index}
       )}
    end
  end

  defp route(pool, {index, pid}, registry, _size, timeout, _counter)
       when is_integer(index) and is_pid(pid) do
    case Registry.values(registry, index, pid) do
      [via] -> {:ok, index, pid, via || pid, timeout}
      [] -> {:error, not_a_worker(pool, pid)}
    end
  end

  defp route(pool, pid, registry, _size, timeout, _counter) when is_pid(pid) do
    with true <- node(pid) != node() or Process.alive?(pid),
         [index] <- Registry.keys(registry, pid),
         [via] <- Registry.values(registry, index, pid) do
      {:ok, index, pid, via || pid, timeout}
    else
      _ -> {:error, not_a_worker(pool, pid)}
    end
  end

  defp route(pool, to, _registry, _size, _timeout, _counter) do
    {:error,
     Error.new(
       :bad_args,
       "a worker is :next, an index, a pid or {index, pid}, got #{inspect(to)}",
       details: %{pool: pool}
     )}
  end

  defp first_running(pool, _registry, _timeout, _n, _size, 0) do
    {:error,
     Error.new(:worker, "no worker of pool #{inspect(pool)} is running", details: %{pool: pool})}
  end

  defp first_running(pool, registry, timeout, n, size, tries) do
    index = rem(n, size)

    case Registry.lookup(registry, index) do
      [{pid, via}] -> {:ok, index, pid, via || pid, timeout}
      [] -> first_running(pool, registry, timeout, n + 1, size, tries - 1)
    end
  end

  @doc """
  The pid of the worker at `index` (`route/2` with an index, for a caller
  that wants only the pid). Errors as for `route/2`.
  """
  @spec worker(name(), non_neg_integer()) :: {:ok, pid()} | {:error, Error.t()}
  def worker(pool, index) when is_integer(index) do
    with {:ok, _index, pid, _via, _timeout} <- route(pool, index), do: {:ok, pid}
  end

  def worker(pool, index) do
    {:error,
     Error.new(:bad_args, "worker index must be an integer, got #{inspect(index)}",
       details: %{pool: pool}
     )}
  end

  @doc """
  The running workers as `{index, pid}`, by index (a restarting worker is
  missing).
  """
  @spec workers(name()) :: {:ok, [{non_neg_integer(), pid()}]} | {:error, Error.t()}
  def workers(pool) do
    case settings(pool) do
      {registry, size, _timeout, _counter} ->
        {:ok,
         for(
           index <- 0..(size - 1),
           [{pid, _}] <- [Registry.lookup(registry, index)],
           do: {index, pid}
         )}

      nil ->
        {:error, no_pool(pool)}
    end
  rescue
    ArgumentError -> {:error, no_pool(pool)}
  end

  @doc "The number of workers of a pool."
  @spec size(name()) :: {:ok, pos_integer()} | {:error, Error.t()}
  def size(pool), do: setting(pool, 1)

  @doc "The pool's default per-call timeout in ms (or `:infinity`)."
  @spec timeout(name()) :: {:ok, timeout()} | {:error, Error.t()}
  def timeout(pool), do: setting(pool, 2)

  defp setting(pool, at) do
    case settings(pool) do
      nil -> {:error, no_pool(pool)}
      settings -> {:ok, elem(settings, at)}
    end
  end

  defp no_pool(pool) do
    Error.new(:worker, "no pool named #{inspect(pool)} is running", details: %{pool: pool})
  end

  defp not_running(pool, index) do
    Error.new(:worker, "worker #{index} of pool #{inspect(pool)} is not running",
      details: %{pool: pool, index: index}
    )
  end

  defp not_a_worker(pool, pid) do
    Error.new(:worker, "#{inspect(pid)} is not a running worker of pool #{inspect(pool)}",
      details: %{pool: pool, worker: pid}
    )
  end

  # What every call needs to know of a pool, in one read of the pool's table
  # (see init/1): {registry, size, default timeout, round-robin counter}; nil
  # when no pool of that name runs.
  @compile {:inline, settings: 1}
  defp settings(pool) when is_atom(pool) do
    case :ets.lookup(pool, :settings) do
      [{:settings, registry, size, timeout, counter}] -> {registry, size, timeout, counter}
      [] -> nil
    end
  rescue
    ArgumentError -> nil
  end

  defp settings(_pool), do: nil
end
