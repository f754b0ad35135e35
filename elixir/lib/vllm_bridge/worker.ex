defmodule VllmBridge.Worker do
  @moduledoc """
  A process that owns one Python worker (`python -m bridge_py.worker`) through
  one Erlang port, and routes each reply to the caller that waits for it.

  A caller encodes its `Request` (`VllmBridge.Proto`) itself and calls
  `request/4`; the reply comes back still encoded, for the caller to decode.
  Most code reaches workers through `VllmBridge.Runtime` and
  `VllmBridge.Pool` instead of calling this module.

  ## One way in

  Every call goes through the worker's `t:channel/0`, which says what the
  worker takes at this moment:

    * while its Python process starts or runs: its port and its table of
      pending calls. The caller enters its reply address in the table under
      the request id and writes the frame to the port itself; the reply comes
      back through this process, which hands it to the caller. Requests
      written while Python starts wait behind the start handshake and are
      answered once it runs;
    * while no Python process serves calls (a failed start backing off, see
      "Start-up"; a worker being replaced, see "Lifecycle limits"): the error
      every call gets then, which the caller returns at once, without a
      message to this process.

  The worker publishes its channel from its start on, and again at each of
  those changes, as its value in the `Registry` named by `:registry`;
  `VllmBridge.Pool.route/2` hands it to `VllmBridge.Runtime`. `request/4`
  and `send_request/3` take the channel, or the worker (a pid or name), which
  they ask for its channel first (`channel/2`); either way the call itself is
  the same. A channel is only valid on the worker's node: a worker on another
  node is reached through `VllmBridge.Runtime` ("Across nodes" there).

  Whatever a caller does, this process sees every call: its entry in the
  table (counted in `info/1`, swept when its caller dies, answered with an
  error when Python exits), and its reply (proof of life for the health
  checks, counted for `:max_calls`, its refs released when the caller has
  gone).

  ## Concurrency and ordering

  Python answers requests in any order (a blocking call such as a barrier
  runs on its own thread while later requests are answered), so any number of
  requests can be in flight on one worker, and each caller gets its own reply.

  ## Waiting for a reply

  A caller, while its call is the only one in flight on this worker and the
  VM has more than one scheduler online, looks for its reply for up to
  `:reply_spin_us` microseconds (default 50) before it sleeps in `receive`,
  letting the other processes of its scheduler run between looks. The look ends as soon as another call is entered on the
  worker. It keeps the caller's scheduler busy for at most `:reply_spin_us`
  per call, which is also the most a call's timeout can be overrun by, and
  each look is charged a full time slice of reductions (it shows in the
  caller's `:reductions`). `reply_spin_us: 0` turns it off.

  After a look finds its CPU taken by someone else, no caller in the VM looks
  for a while (`VllmBridge.Worker.LookGate`), so callers do not spin where
  every CPU has work. Why the look pays is in docs/architecture.md ("The
  Worker process"); what it gains and costs, in bench/README.md.

  ## Timeouts

  `request/4` returns `{:error, %VllmBridge.Error{category: :timeout}}` at the
  caller's deadline (`await/2` at the deadline it was given, counted from
  when it is called). The caller removes its entry from the worker's table
  and the reply that Python sends later is dropped: the reply address is a
  process alias that is deactivated at the deadline. The Python call itself
  is not cancelled.

  ## Crashes

  When the Python process exits (or is killed for not answering, see "Health
  checks"), every pending caller at once gets
  `{:error, %VllmBridge.Error{category: :worker}}` and this process stops;
  so does a caller whose write finds the port closed. A caller whose worker
  stops while it waits gets a `:worker` error naming the exit reason;
  under a `VllmBridge.Pool` it is restarted with a fresh Python process. All
  objects that lived in the old one are gone, and refs to them are stale.
  When this process stops, it closes the port; the Python worker exits when
  its stdin closes.

  ## Health checks

  A Python process that stops answering without exiting (stopped, wedged,
  starved) would otherwise hold its callers until their deadlines, and the
  worker forever. So every `:health_interval` ms (default 5000) the worker
  checks whether anything has come from Python since the last check (any
  reply is proof of life; nothing is added to a call's path), and when
  nothing has, it pings Python with a request of its own. When nothing at
  all arrives within `:health_timeout` ms (default 5000) after that ping, the
  worker logs an error naming the pool, index and OS pid, kills the Python
  process (SIGKILL), answers every pending caller with
  `{:error, %VllmBridge.Error{category: :worker}}` saying that the worker
  stopped answering, and stops; under a pool it is restarted with a fresh
  Python process, and refs into the old one are stale.

  A call that blocks in Python (a barrier, a sleep) does not make a worker
  unhealthy: the Python worker answers other requests, the ping included,
  while calls block. A call that holds Python's GIL for longer than
  `:health_timeout` does: raise the timeout for such work, or turn the checks
  off with `health_interval: false`. Two cases get more time. A ping
  unanswered while 1 MiB or more was recently written to Python (a large
  request, whose decoding holds the GIL) gets, once, 1 s more per 32 MiB
  written (`VllmBridge.Worker.Health`). Until Python has answered anything at
  all (it is still starting, importing torch), the first ping waits at least
  60 s.

  On the same tick, the worker forgets pending entries whose caller process
  has died; with `health_interval: false` this sweep still runs every
  5000 ms.

  ## Refs and their owners

  Python counts each time it hands a handle out; each such hold belongs to
  the process the ref was made for (see "Lifetime" in `VllmBridge.Ref`). The
  worker monitors those processes, and when one exits it releases all of
  that owner's holds in Python. A reply that arrives after its caller gave
  up is not lost either: the refs in it are released at once (in the default
  session; the reply does not say which session its request named).

  ## Start-up

  The worker spawns its Python process and at once writes a start handshake
  (a ping) to it; calls may be written behind it and are answered once Python
  runs. When the handshake is answered, the worker is `:ready`
  (`await_started/2` returns `:ok`). When Python exits before answering (it
  cannot import `bridge_py`, torch or an `--exports` module) or cannot be run
  at all, that is a failed start: the worker builds a `:worker` error naming
  the executable, the exit status and the missing module
  (`details.missing_module`, and the last lines Python printed under
  `details.stderr`). Callers that were waiting get that error, and so does
  every call until a start succeeds (the worker's channel carries it).

  A failed start is not a crash: the worker process stays up (its supervisor
  sees no restart) and starts Python again after a back-off, `:backoff_min` ms
  doubled for each failure in a row, at most `:backoff_max` ms (default
  30 s). A Python that cannot start is therefore tried at most once per
  `:backoff_max` once the back-off has grown, never in a crash loop that
  brings the supervision tree down.

  ## Output

  Whatever the Python process writes on its stdout or stderr, Python and C
  code alike (a `print`, a traceback, torch's C++ warnings), is logged here,
  line by line, at the `:warning` level, as `"<pool> worker <index> (os pid
  <pid>): <line>"` with Logger metadata `:pool`, `:index` and `:os_pid`.
  It never mixes with replies (docs/protocol.md, "Output"). Python bounds
  it: a line keeps its first 4096 bytes, and past a burst of 1000 lines at
  most 100 lines a second are sent; the others are dropped, and the count of
  dropped lines is logged. What Python prints while it starts is held until
  it has started, then logged; a Python that fails to start logs one error,
  whose `details.stderr` holds the last lines it printed (a traceback's end)
  and whose message names the cause.

  ## Lifecycle limits

  With `:max_calls`, a worker is replaced once it has answered that many
  calls; with `:max_memory_mb`, once the resident memory of its Python process
  (VmRSS, read after a call at most once a second, and on each health tick)
  is over that many MB. Both are looked at between calls, never in the middle
  of one: the worker leaves the pool's registry at once (new calls go to the
  other workers, and calls on its refs answer `:stale_ref`), the calls already
  in flight finish and get their replies, and then the pool stops this worker
  and starts a fresh one at the same index. As on a restart, every object of
  the old Python process is lost. The replacement does not count towards the
  pool's restart intensity (`:max_restarts`).

  ## Which Python

  `find_python/1`: the `:python` option, else the `VLLM_BRIDGE_PYTHON`
  environment variable, else `.venv/bin/python` of the project when it exists,
  else `python3` from `PATH`. The project root is prepended to `PYTHONPATH`,
  so `bridge_py` imports without being installed.
  """

  alias VllmBridge.Error
  alias VllmBridge.Worker.{Call, Command, Options, Server}

  @defaults Options.defaults()

  @typedoc "A running worker: its pid or a registered name."
  @type server :: GenServer.server()

  @typedoc """
  The way into a worker (see "One way in"): while its Python process starts
  or runs, its port and table of pending calls; while none serves calls, the
  error a call gets. Take it from `VllmBridge.Pool.route/2` or `channel/2`;
  do not build one.
  """
  @opaque channel ::
            {:channel, pid(), port() | Error.t(), :ets.tid(), non_neg_integer()}

  @typedoc "A request in flight, from `send_request/3` to `await/2`."
  @opaque request_handle :: Call.handle()

  @typedoc "Options for `start_link/1`."
  @type option ::
          {:python, Path.t()}
          | {:env, [{String.t(), String.t() | nil}] | %{String.t() => String.t() | nil}}
          | {:cd, Path.t()}
          | {:args, [String.t()]}
          | {:name, GenServer.name()}
          | {:pool, atom()}
          | {:index, non_neg_integer()}
          | {:registry, {Registry.registry(), Registry.key()}}
          | {:starts, :atomics.atomics_ref()}
          | {:health_interval, pos_integer() | false}
          | {:health_timeout, pos_integer()}
          | {:max_calls, pos_integer() | nil}
          | {:max_memory_mb, pos_integer() | nil}
          | {:backoff_min, pos_integer()}
          | {:backoff_max, pos_integer()}
          | {:reply_spin_us, non_neg_integer()}

  @doc """
  Returns a child specification; `opts` as in `start_link/1`.
  """
  @spec child_spec([option()]) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{id: Keyword.get(opts, :id, __MODULE__), start: {__MODULE__, :start_link, [opts]}}
  end

  @doc """
  Starts a worker and its Python process.

  ## Options

    * `:python` - the Python executable (see `find_python/1`)
    * `:env` - extra environment variables for Python, `{name, value}` pairs
      (a `nil` value unsets the variable); `PYTHONPATH` gets the project root
      prepended
    * `:cd` - the working directory of the Python process (default: the
      current one)
    * `:args` - extra command-line arguments for `bridge_py.worker`, e.g.
      `["--exports", "my_module:table"]` to serve another export table
    * `:name` - a name to register this process under
    * `:pool`, `:index` - where this worker sits, for log messages
    * `:registry` - `{registry, key}`, the `Registry` key this worker is
      registered under (through `:name`): the worker stores its
      `t:channel/0` there as the key's value, from its start on (see "One
      way in")
    * `:starts` - an `:atomics` array that counts the starts at each index
      of a pool (the pool sets it): a worker that is not the first at its
      `:index` emits the `[:vllm_bridge, :worker, :restarted]` event
    * `:health_interval` - ms of silence from Python after which the worker
      pings it, or `false` for no health checks (default `#{@defaults[:health_interval]}`;
      see "Health checks")
    * `:health_timeout` - ms to wait for anything from Python after that ping
      before the Python process is killed (default `#{@defaults[:health_timeout]}`)
    * `:max_calls` - replace the worker once it has answered this many calls
      (default `nil`, never; see "Lifecycle limits")
    * `:max_memory_mb` - replace the worker once its Python process's resident
      memory is over this many MB (default `nil`, never)
    * `:backoff_min`, `:backoff_max` - the delay in ms before starting Python
      again after a failed start: `:backoff_min` (default `#{@defaults[:backoff_min]}`),
      doubled for each failure in a row, at most `:backoff_max` (default
      `#{@defaults[:backoff_max]}`); see "Start-up"
    * `:reply_spin_us` - how long, in microseconds, a caller keeps looking
      for its reply before it sleeps, while its call is the only one in
      flight here (default `#{@defaults[:reply_spin_us]}`,
      at most 1000; `0`: never; see "Waiting for a reply")

  The worker starts at once; its Python process starts in the background
  (`await_started/2` waits for it). Invalid options are
  `{:error, %VllmBridge.Error{category: :bad_args}}`.
  """
  @spec start_link([option()]) :: GenServer.on_start() | {:error, Error.t()}
  def start_link(opts) do
    with :ok <- Options.check_all(opts) do
      case Keyword.fetch(opts, :name) do
        {:ok, name} -> GenServer.start_link(Server, opts, name: name)
        :error -> GenServer.start_link(Server, opts)
      end
    end
  end

  @doc """
  Checks the `:health_interval` and `:health_timeout` options of `opts`
  (the others are ignored): `:ok` or a `:bad_args` error naming the option.
  `VllmBridge.Pool.start_link/1` checks a pool's options with it.

  ## Examples

      iex> VllmBridge.Worker.check_health_options(health_interval: false)
      :ok

      iex> {:error, error} = VllmBridge.Worker.check_health_options(health_timeout: 0)
      iex> error.message
      ":health_timeout must be a positive integer (ms, at most 4294967295), got 0"
  """
  @spec check_health_options(keyword()) :: :ok | {:error, Error.t()}
  def check_health_options(opts) when is_list(opts), do: Options.check_health(opts)

  @doc """
  Checks the `:max_calls`, `:max_memory_mb`, `:backoff_min` and
  `:backoff_max` options of `opts` (the others are ignored): `:ok` or a
  `:bad_args` error naming the option.

  ## Examples

      iex> VllmBridge.Worker.check_lifecycle_options(max_calls: 1_000, max_memory_mb: nil)
      :ok

      iex> {:error, error} = VllmBridge.Worker.check_lifecycle_options(max_memory_mb: 0)
      iex> error.message
      ":max_memory_mb must be a positive integer (MB) or nil, got 0"
  """
  @spec check_lifecycle_options(keyword()) :: :ok | {:error, Error.t()}
  def check_lifecycle_options(opts) when is_list(opts), do: Options.check_lifecycle(opts)

  @doc """
  Checks the `:reply_spin_us` option of `opts` (the others are ignored):
  `:ok` or a `:bad_args` error naming the option.

  ## Examples

      iex> VllmBridge.Worker.check_call_options(reply_spin_us: 0)
      :ok

      iex> {:error, error} = VllmBridge.Worker.check_call_options(reply_spin_us: 2.5)
      iex> error.details
      %{reply_spin_us: 2.5}
  """
  @spec check_call_options(keyword()) :: :ok | {:error, Error.t()}
  def check_call_options(opts) when is_list(opts), do: Options.check_calls(opts)

  @doc """
  Waits until the worker's Python process has answered its start handshake.

  Returns `:ok`, or the `:worker` error of a failed start, which names the
  Python executable, its exit status, and the module Python could not import
  (`details.missing_module`, with the last lines of its stderr under
  `details.stderr`); see "Start-up". A worker whose start has failed answers
  at once with the last failure, even while it tries again.
  `VllmBridge.Pool.start_link/1` waits for every worker this way.
  """
  @spec await_started(server(), timeout()) :: :ok | {:error, Error.t()}
  def await_started(worker, timeout \\ 60_000) do
    GenServer.call(worker, :await_started, timeout)
  catch
    :exit, {:timeout, _} ->
      {:error,
       Error.new(:timeout, "the Python worker did not start within #{timeout} ms",
         details: %{worker: worker, timeout: timeout}
       )}

    :exit, {reason, _} ->
      {:error, Call.not_running(worker, reason)}
  end

  @doc """
  Returns a fresh request id: unique in this VM, positive, never 0.
  """
  @spec new_id() :: pos_integer()
  def new_id, do: System.unique_integer([:positive, :monotonic])

  @doc """
  Sends one encoded `Request` frame whose id is `id` and waits up to
  `timeout` ms for the encoded `Reply` with that id.

  `worker` is the worker's `t:channel/0`, or the worker (a pid or name),
  which is asked for its channel first (within the same `timeout`); see "One
  way in".

  Returns `{:ok, reply_binary}`, or an error of category `:timeout` (no reply
  by the deadline; a late reply is dropped), `:worker` (the worker is not
  running or is on another node, its Python process could not start, it is
  being replaced, or its Python process died or was killed for not answering
  meanwhile; see "Health checks") or `:bad_args` (an id that is already in
  flight, or a frame that is not iodata).
  """
  @spec request(server() | channel(), pos_integer(), iodata(), timeout()) ::
          {:ok, binary()} | {:error, Error.t()}
  def request(worker, id, frame, timeout), do: Call.call(worker, id, frame, timeout)

  @doc """
  Like `request/4`, but returns once the frame is written, with a handle for
  `await/2`, so one process can have requests in flight on several workers.
  A worker given by pid or name is asked for its channel first (for up to
  5 s). An error found before anything was written (a frame that is not
  iodata, an id already in flight, a worker that takes no calls) comes back
  from `await/2`.
  """
  @spec send_request(server() | channel(), pos_integer(), iodata()) :: request_handle()
  def send_request(worker, id, frame), do: Call.start(worker, id, frame)

  @doc """
  Waits up to `timeout` ms for the reply to a `send_request/3`, in the same
  way and with the same results as `request/4`. Call it from the process
  that called `send_request/3`.
  """
  @spec await(request_handle(), timeout()) :: {:ok, binary()} | {:error, Error.t()}
  def await(handle, timeout), do: Call.await(handle, timeout)

  @doc """
  The worker's `t:channel/0` as it is now, asked of the worker (a pid or
  name) within `timeout` ms: for a worker outside a pool, or when the pool's
  `Registry` is not at hand. A worker under a pool publishes it there as well
  (see "One way in"). Errors: `:worker` when the worker is not running or is
  on another node, `:timeout` when it does not answer in time.
  """
  @spec channel(server(), timeout()) :: {:ok, channel()} | {:error, Error.t()}
  def channel(worker, timeout \\ 5_000), do: Call.channel(worker, nil, timeout)

  @doc """
  Records that `ids` (handles of `session`, one per ref, repeats included)
  were handed to `owner`, which the worker then monitors: when it exits, the
  worker gives those holds back to Python (see "Refs and their owners").
  `VllmBridge.Runtime` calls this for every reply with refs.
  """
  @spec own(pid(), pid(), String.t(), [non_neg_integer()]) :: :ok
  def own(worker, owner, session, ids), do: GenServer.cast(worker, {:own, owner, session, ids})

  @doc """
  Takes back the holds of each `{owner, id}` pair on handles of `session`:
  returns the handles to release in Python, each as many times as its owner
  held it (`[]` when none, or when the worker is gone, with its objects).
  `VllmBridge.Runtime.release/2` calls this for refs with an owner.
  """
  @spec disown(pid(), String.t(), [{pid(), non_neg_integer()}]) :: [non_neg_integer()]
  def disown(_worker, _session, []), do: []

  def disown(worker, session, pairs) do
    GenServer.call(worker, {:disown, session, pairs})
  catch
    :exit, _ -> []
  end

  @doc """
  The OS pid of the worker's Python process.
  """
  @spec os_pid(server()) :: {:ok, pos_integer()} | {:error, Error.t()}
  def os_pid(worker) do
    with {:ok, info} <- info(worker), do: {:ok, info.os_pid}
  end

  @doc """
  A snapshot of the worker: `:os_pid`, `:python` (the executable), `:pending`
  (callers' requests in flight; a health ping is not one), `:pool`, `:index`,
  `:health_interval`, `:health_timeout`, `:phase` (`:starting`, `:ready`,
  `:backoff` after a failed start, `:retiring` when over a limit), `:calls`
  (calls answered), `:failed_starts` (in a row), `:max_calls` and
  `:max_memory_mb`, and `:owners` (how many processes own refs to objects
  here; see "Refs and their owners").
  """
  @spec info(server()) :: {:ok, map()} | {:error, Error.t()}
  def info(worker) do
    {:ok, GenServer.call(worker, :info)}
  catch
    :exit, {reason, _} -> {:error, Call.not_running(worker, reason)}
  end

  @doc """
  The Python executable a worker started with `opts` uses (see the module
  documentation).
  """
  @spec find_python(keyword()) :: Path.t()
  def find_python(opts \\ []), do: Command.find_python(opts)

  @doc "The project root, where `bridge_py` lives (fixed at compile time)."
  @spec project_root() :: Path.t()
  def project_root, do: Command.project_root()
end
