defmodule VllmBridge.Worker.State do
  @moduledoc """
  A worker's state, as data: the struct that the `VllmBridge.Worker.Server`
  process keeps (`t:t/0`), made from the worker's options by `new/2`, and
  the snapshot of it that `VllmBridge.Worker.info/1` returns (`info/2`).

  The other parts of the worker take this state and return data or a new
  state, each for its own fields: `VllmBridge.Worker.Startup` (the start-up
  phases), `VllmBridge.Worker.Health` (`:heard`, `:health`) and
  `VllmBridge.Worker.Limits` (`:memory_checked`); the server counts
  `:calls` and moves a worker to `:retiring` and `:gone` itself.

  A worker's phase (`:phase`) is `:starting` (waiting for the start
  handshake), `:ready`, `:backoff` (a start failed; the next one is
  scheduled), `:retiring` (over a limit, draining its calls) or `:gone` (the
  Python process is gone and reported; the worker stops).
  """

  alias VllmBridge.Error
  alias VllmBridge.Worker.{Command, Options, Owners, Pending, Startup}

  @typedoc "Where the worker is in its Python process's life (see the module documentation)."
  @type phase :: :starting | :ready | :backoff | :retiring | :gone

  @typedoc """
  A worker's state: the options it started with (`:python` is the
  executable, `:spawn` its `:args`, `:env` and `:cd`), and what it keeps
  about its Python process.
  """
  @type t :: %__MODULE__{
          python: Path.t(),
          spawn: keyword(),
          pool: atom() | nil,
          index: non_neg_integer() | nil,
          registry: {Registry.registry(), Registry.key()} | nil,
          health_interval: pos_integer() | false,
          health_timeout: pos_integer(),
          max_calls: pos_integer() | nil,
          max_memory_mb: pos_integer() | nil,
          backoff_min: pos_integer(),
          backoff_max: pos_integer(),
          # published in the channel: how long its callers look for a reply (us)
          reply_spin_us: non_neg_integer(),
          # the calls in flight; outlives the Python processes of failed starts
          table: Pending.t(),
          # the Python process, while one runs
          port: port() | nil,
          os_pid: pos_integer() | nil,
          phase: phase(),
          # consecutive failed starts, the last one's error, and why they failed
          attempt: non_neg_integer(),
          last_error: Error.t() | nil,
          diagnosis: Startup.diagnosis() | nil,
          # callers of VllmBridge.Worker.await_started/2 while :starting
          waiters: [GenServer.from()],
          # when the Python process was spawned (monotonic, native units)
          spawned_at: integer() | nil,
          # the lines Python printed while :starting (output frames), held
          output_tail: [String.t()],
          # calls answered, and when memory was last read (monotonic ms)
          calls: non_neg_integer(),
          memory_checked: integer() | nil,
          # a :retiring worker asked its pool to replace it
          replace_requested: boolean(),
          # the port's count of bytes read from Python at the last look
          heard: non_neg_integer() | :closed,
          # the port's count of bytes written when Python was heard from the
          # last time but one, and the last time
          told: {non_neg_integer(), non_neg_integer()},
          # the health ping in flight, {id, its timeout's timer, whether it was
          # given more time for a large backlog}, if any
          health: {pos_integer(), reference(), boolean()} | nil,
          # the processes that own refs to objects here, and their holds
          owners: Owners.t()
        }

  @enforce_keys [:python, :spawn, :table]
  defstruct python: nil,
            spawn: [],
            pool: nil,
            index: nil,
            registry: nil,
            health_interval: nil,
            health_timeout: nil,
            max_calls: nil,
            max_memory_mb: nil,
            backoff_min: nil,
            backoff_max: nil,
            reply_spin_us: nil,
            table: nil,
            port: nil,
            os_pid: nil,
            phase: :starting,
            attempt: 0,
            last_error: nil,
            diagnosis: nil,
            waiters: [],
            spawned_at: nil,
            output_tail: [],
            calls: 0,
            memory_checked: nil,
            replace_requested: false,
            heard: 0,
            told: {0, 0},
            health: nil,
            owners: Owners.new()

  @doc """
  The state of a new worker started with `opts` (those of
  `VllmBridge.Worker.start_link/1`, already checked), whose pending calls go
  in `table`: `:starting`, with no Python process yet. A missing option
  takes its default (`VllmBridge.Worker.Options.defaults/0`).
  """
  @spec new(keyword(), Pending.t()) :: t()
  def new(opts, table) do
    defaults = Options.defaults()

    %__MODULE__{
      python: Command.find_python(opts),
      spawn: Keyword.take(opts, [:args, :env, :cd]),
      table: table,
      pool: opts[:pool],
      index: opts[:index],
      registry: opts[:registry],
      health_interval: Keyword.get(opts, :health_interval, defaults[:health_interval]),
      health_timeout: Keyword.get(opts, :health_timeout, defaults[:health_timeout]),
      max_calls: Keyword.get(opts, :max_calls),
      max_memory_mb: Keyword.get(opts, :max_memory_mb),
      backoff_min: Keyword.get(opts, :backoff_min, defaults[:backoff_min]),
      backoff_max: Keyword.get(opts, :backoff_max, defaults[:backoff_max]),
      reply_spin_us: Keyword.get(opts, :reply_spin_us, defaults[:reply_spin_us])
    }
  end

  @doc """
  The snapshot of `state` that `VllmBridge.Worker.info/1` returns, with
  `pending` the count of callers' calls in flight
  (`VllmBridge.Worker.Pending.pending/1`).
  """
  @spec info(t(), non_neg_integer()) :: map()
  def info(state, pending) do
    %{
      os_pid: state.os_pid,
      python: state.python,
      pending: pending,
      pool: state.pool,
      index: state.index,
      health_interval: state.health_interval,
      health_timeout: state.health_timeout,
      phase: state.phase,
      calls: state.calls,
      failed_starts: state.attempt,
      max_calls: state.max_calls,
      max_memory_mb: state.max_memory_mb,
      owners: Owners.count(state.owners)
    }
  end
end
