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

  Each worker registers under its index (`0..size-1`), with its channel
  (see `VllmBridge.Worker`) as the value, so `worker/2` is one ETS lookup.
  What every call needs of the pool (its registry, size, default timeout and
  a round-robin counter, an `:atomics` array) is one `:persistent_term`
  read, so placing a call (`route/3`, `route_at/2`, `next_route/1`) is that
  read and one registry lookup, lock-free and without a process. `size/1`
  and `timeout/1` read the same settings once the pool's Registry answers
  (so they also tell whether the pool is running).

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
    with :ok <- Worker.Options.check_all(opts), do: start(opts)
  end

  defp start(opts) do
    name = Keyword.get(opts, :name, @default_name)
    size = Keyword.get(opts, :size, 1)
    timeout = Keyword.get(opts, :timeout, @default_timeout)
    startup = Keyword.get(opts, :startup_timeout, @startup_timeout)

    cond do
      not is_atom(name) or name == nil ->
        {:error, Error.new(:bad_args, "pool name must be an atom, got #{inspect(name)}")}

      not (is_integer(size) and size > 0) ->
        {:error,
         Error.new(:bad_args, "pool size must be a positive integer, got #{inspect(size)}")}

      not Worker.Options.timeout?(timeout, 0) ->
        {:error,
         Error.new(
           :bad_args,
           "timeout must be ms (at most 4294967295) or :infinity, got #{inspect(timeout)}"
         )}

      not Worker.Options.timeout?(startup, 1) ->
        {:error,
         Error.new(
           :bad_args,
           ":startup_timeout must be a positive integer (ms, at most 4294967295) or " <>
             ":infinity, got #{inspect(startup)}"
         )}

      true ->
        opts = Keyword.merge(opts, name: name, size: size, timeout: timeout)

        with {:ok, sup} <- Supervisor.start_link(__MODULE__, opts, name: name) do
          case await_workers(name, size, startup) do
            :ok ->
              {:ok, sup}

            {:error, _} = error ->
              Process.unlink(sup)
              Supervisor.stop(sup, :shutdown)
              error
          end
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
      with {:ok, pid} <- lookup(pool, index),
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
    registry = registry(name)

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

    workers =
      for index <- 0..(size - 1) do
        Supervisor.child_spec(
          {Worker,
           [
             name: {:via, Registry, {registry, index}},
             registry: {registry, index},
             pool: name,
             index: index
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

    # starts per index, for the worker restarted event (VllmBridge.Telemetry)
    starts = :atomics.new(size, signed: false)
    timeout = Keyword.fetch!(opts, :timeout)
    :ok = remember(name, registry, size, timeout)
    meta = [starts: starts]

    Supervisor.init(
      [
        {Registry, keys: :unique, name: registry, meta: meta},
        workers_sup,
        {VllmBridge.Pool.Replacer, registry: registry, pool: name}
      ],
      strategy: :rest_for_one
    )
  end

  @doc """
  The pid of the worker at `index`.

  Errors: `:bad_args` for an index outside the pool, `:worker` when the pool
  does not exist or that worker is restarting.
  """
  @spec worker(name(), non_neg_integer()) :: {:ok, pid()} | {:error, Error.t()}
  def worker(pool, index) when is_integer(index) do
    with {:ok, size} <- size(pool) do
      if index >= 0 and index < size do
        lookup(pool, index)
      else
        {:error,
         Error.new(
           :bad_args,
           "worker index #{index} is outside pool #{inspect(pool)} (size #{size})",
           details: %{pool: pool, index: index}
         )}
      end
    end
  end

  def worker(pool, index) do
    {:error,
     Error.new(:bad_args, "worker index must be an integer, got #{inspect(index)}",
       details: %{pool: pool}
     )}
  end

  @doc """
  The next worker in round-robin order. A worker that is restarting is
  skipped; the error is `:worker` only when no worker is running.
  """
  @spec next_worker(name()) :: {:ok, pid()} | {:error, Error.t()}
  def next_worker(pool) do
    with {:ok, {_index, pid}} <- next_worker_at(pool), do: {:ok, pid}
  end

  @doc """
  Like `next_worker/1`, with the worker's index: `{:ok, {index, pid}}`.
  """
  @spec next_worker_at(name()) :: {:ok, {non_neg_integer(), pid()}} | {:error, Error.t()}
  def next_worker_at(pool) do
    with {:ok, index, pid, _via, _timeout} <- next_route(pool), do: {:ok, {index, pid}}
  end

  @doc """
  Where the next call in round-robin order goes, in one read of the pool's
  settings and one registry lookup: `{:ok, index, pid, via, timeout}`, where
  `via` is as for `route/3` and `timeout` is the pool's default per-call
  timeout. A worker that is restarting is skipped; errors as for
  `next_worker_at/1`.
  """
  @spec next_route(name()) ::
          {:ok, non_neg_integer(), pid(), Worker.channel() | pid(), timeout()}
          | {:error, Error.t()}
  def next_route(pool) do
    case settings(pool) do
      {registry, size, timeout, counter} ->
        start = :atomics.add_get(counter, 1, 1)
        first_running(pool, registry, timeout, start, size, size)

      nil ->
        {:error, no_pool(pool)}
    end
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
  rescue
    ArgumentError -> {:error, no_pool(pool)}
  end

  @doc """
  Where a call to the worker at `index` goes: `{:ok, pid, via, timeout}` as
  for `next_route/1`, in one read of the pool's settings and one registry
  lookup. Errors as for `worker/2`.
  """
  @spec route_at(name(), non_neg_integer()) ::
          {:ok, pid(), Worker.channel() | pid(), timeout()} | {:error, Error.t()}
  def route_at(pool, index) when is_integer(index) do
    case settings(pool) do
      {registry, size, timeout, _counter} when index >= 0 and index < size ->
        case Registry.lookup(registry, index) do
          [{pid, via}] -> {:ok, pid, via || pid, timeout}
          [] -> lookup(pool, index)
        end

      _ ->
        # outside the pool, or no such pool: worker/2 says which
        __MODULE__.worker(pool, index)
    end
  rescue
    ArgumentError -> {:error, no_pool(pool)}
  end

  def route_at(pool, index), do: __MODULE__.worker(pool, index)

  @doc """
  Whether `pid` is the running worker at `index` of `pool`: `index_of/2` for a
  caller that knows the index, at the cost of one registry lookup instead of a
  search of the registry by pid.
  """
  @spec worker_at?(name(), non_neg_integer(), pid()) :: boolean()
  def worker_at?(pool, index, pid) when is_integer(index) and is_pid(pid) do
    (node(pid) != node() or Process.alive?(pid)) and lookup(pool, index) == {:ok, pid}
  end

  def worker_at?(_pool, _index, _pid), do: false

  @doc """
  Where a caller sends requests for the worker `pid` at `index`, and the
  pool's default per-call timeout: `{:ok, via, timeout}`, where `via` is the
  worker's `t:VllmBridge.Worker.channel/0` once it has published one, else
  `pid` (both are taken by `VllmBridge.Worker.request/4`). `:error` when
  `pid` is not registered at `index`, so one read of the pool's settings and
  one registry read both check a ref and find its way in.

  Unlike `worker_at?/3` it does not ask whether `pid` is alive (a signal
  round trip to the worker): a worker that has just died is still registered
  for a moment, and a request to it then fails with a `:worker` error whose
  `details.reason` is `:noproc`.
  """
  @spec route(name(), non_neg_integer(), pid()) ::
          {:ok, Worker.channel() | pid(), timeout()} | :error
  def route(pool, index, pid) when is_integer(index) and is_pid(pid) do
    case settings(pool) do
      {registry, _size, timeout, _counter} ->
        case Registry.values(registry, index, pid) do
          [nil] -> {:ok, pid, timeout}
          [channel] -> {:ok, channel, timeout}
          [] -> :error
        end

      nil ->
        :error
    end
  rescue
    ArgumentError -> :error
  end

  def route(_pool, _index, _pid), do: :error

  @doc "The number of workers of a pool."
  @spec size(name()) :: {:ok, pos_integer()} | {:error, Error.t()}
  def size(pool), do: setting(pool, 1)

  @doc "The pool's default per-call timeout in ms (or `:infinity`)."
  @spec timeout(name()) :: {:ok, timeout()} | {:error, Error.t()}
  def timeout(pool), do: setting(pool, 2)

  @doc """
  The running workers as `{index, pid}`, by index (a restarting worker is
  missing).
  """
  @spec workers(name()) :: {:ok, [{non_neg_integer(), pid()}]} | {:error, Error.t()}
  def workers(pool) do
    with {:ok, size} <- size(pool) do
      workers = for index <- 0..(size - 1), {:ok, pid} <- [lookup(pool, index)], do: {index, pid}

      {:ok, workers}
    end
  end

  @doc """
  The index of the worker `pid` in `pool`, or `:error` when `pid` is not one
  of the pool's running workers (it died, was replaced, or never belonged).
  """
  @spec index_of(name(), pid()) :: {:ok, non_neg_integer()} | :error
  def index_of(pool, pid) when is_pid(pid) do
    if node(pid) == node() and not Process.alive?(pid) do
      :error
    else
      case Registry.keys(registry(pool), pid) do
        [index] -> {:ok, index}
        _ -> :error
      end
    end
  rescue
    ArgumentError -> :error
  end

  def index_of(_pool, _pid), do: :error

  defp lookup(pool, index) do
    case Registry.lookup(registry(pool), index) do
      [{pid, _}] ->
        {:ok, pid}

      [] ->
        {:error,
         Error.new(:worker, "worker #{index} of pool #{inspect(pool)} is not running",
           details: %{pool: pool, index: index}
         )}
    end
  rescue
    ArgumentError -> {:error, no_pool(pool)}
  end

  # Element `at` of the pool's settings (see remember/4), while the pool runs:
  # its registry, which the settings outlive, must answer.
  defp setting(pool, at) when is_atom(pool) do
    case Registry.meta(registry(pool), :starts) do
      {:ok, _starts} -> {:ok, elem(settings(pool), at)}
      :error -> {:error, no_pool(pool)}
    end
  rescue
    ArgumentError -> {:error, no_pool(pool)}
  end

  defp setting(pool, _at), do: {:error, no_pool(pool)}

  defp no_pool(pool) do
    Error.new(:worker, "no pool named #{inspect(pool)} is running", details: %{pool: pool})
  end

  # What every call needs to know of a pool, in one :persistent_term read:
  # {registry, size, default timeout, round-robin counter}. Written when the
  # pool starts; a restart with the same settings keeps the same term (and
  # counter, reset), so it stores nothing new.
  defp remember(name, registry, size, timeout) do
    counter =
      case settings(name) do
        {^registry, ^size, _timeout, counter} ->
          :atomics.put(counter, 1, 0)
          counter

        _ ->
          :atomics.new(1, signed: false)
      end

    settings = {registry, size, timeout, counter}
    if settings(name) != settings, do: :persistent_term.put({__MODULE__, name}, settings)
    :ok
  end

  @compile {:inline, settings: 1}
  defp settings(pool), do: :persistent_term.get({__MODULE__, pool}, nil)

  defp registry(pool) do
    case settings(pool) do
      {registry, _size, _timeout, _counter} -> registry
      nil when is_atom(pool) -> Module.concat(pool, Registry)
      # (every caller turns an ArgumentError into its "no such pool" answer)
      nil -> raise ArgumentError, "not a pool name: #{inspect(pool)}"
    end
  end
end
