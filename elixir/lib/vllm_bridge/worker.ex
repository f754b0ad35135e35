defmodule VllmBridge.Worker do
  @moduledoc """
  A process that owns one Python worker (`python -m bridge_py.worker`) through
  one Erlang port, and routes replies back to the callers that wait for them.

  The worker does as little as possible: it does not encode or decode
  anything but a reply's id. A caller encodes its `Request`
  (`VllmBridge.Proto`) in its own process and calls `request/4`; when a
  `Reply` frame comes back, the worker reads its id with
  `VllmBridge.Proto.reply_id/1` and hands the still-encoded reply to the
  caller waiting under that id, who decodes it. Encoding and decoding cost
  therefore spreads over the callers instead of queueing in the worker.

  ## Two ways in

  `request/4` takes either the worker (a pid or name) or its `t:channel/0`.

    * Through the worker: the caller sends the frame to this process, which
      remembers the caller and writes the frame to the port.
    * Through the channel: the caller writes the frame to the port itself,
      after leaving its reply address in the worker's table of pending calls
      (a public ETS table the worker owns). A call then passes through this
      process once (the reply) instead of twice, which saves a message and a
      wake-up per call. The worker publishes its channel as its value in the
      `Registry` named by `:registry` once its port is open;
      `VllmBridge.Pool.route/3` hands it to `VllmBridge.Runtime`.

  Both give the same results, timeouts and errors.

  ## Concurrency and ordering

  Python answers requests in any order (a blocking call such as a barrier
  runs on its own thread while later requests are answered), so any number of
  requests can be in flight on one worker, and each caller gets its own reply.

  ## Timeouts

  `request/4` returns `{:error, %VllmBridge.Error{category: :timeout}}` at the
  caller's deadline. The reply that Python sends later is dropped: the call
  went through a process alias that is deactivated at the deadline, and the
  worker forgets the pending entry. The Python call itself is not cancelled.

  ## Crashes

  When the Python process exits, every pending caller at once gets
  `{:error, %VllmBridge.Error{category: :worker}}` and this process stops;
  under a `VllmBridge.Pool` it is restarted with a fresh Python process. All
  objects that lived in the old one are gone, and refs to them are stale.
  When this process stops, it closes the port; the Python worker exits when
  its stdin closes.

  ## Which Python

  `find_python/1`: the `:python` option, else the `VLLM_BRIDGE_PYTHON`
  environment variable, else `.venv/bin/python` of the project when it exists,
  else `python3` from `PATH`. The project root is prepended to `PYTHONPATH`,
  so `bridge_py` imports without being installed.
  """

  use GenServer

  require Logger

  alias VllmBridge.{Error, Proto}

  @project_root Path.expand("../../..", __DIR__)

  @typedoc "A running worker: its pid or a registered name."
  @type server :: GenServer.server()

  @typedoc """
  A running worker's port and table of pending calls, for callers that write
  requests to the port themselves (see "Two ways in"). Take it from
  `VllmBridge.Pool.route/3`; do not build one.
  """
  @opaque channel :: {:channel, pid(), port(), :ets.tid()}

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
      `t:channel/0` there as the key's value once its port is open
  """
  @spec start_link([option()]) :: GenServer.on_start()
  def start_link(opts) when is_list(opts) do
    case Keyword.fetch(opts, :name) do
      {:ok, name} -> GenServer.start_link(__MODULE__, opts, name: name)
      :error -> GenServer.start_link(__MODULE__, opts)
    end
  end

  @doc """
  Returns a fresh request id: unique in this VM, positive, never 0.
  """
  @spec new_id() :: pos_integer()
  def new_id, do: System.unique_integer([:positive, :monotonic])

  @doc """
  Sends one encoded `Request` frame whose id is `id` and waits up to
  `timeout` ms for the encoded `Reply` with that id.

  `worker` is the worker or its `t:channel/0` (see "Two ways in").

  Returns `{:ok, reply_binary}`, or an error of category `:timeout` (no reply
  by the deadline; a late reply is dropped), `:worker` (the worker is not
  running or its Python process died meanwhile) or `:bad_args` (an id that is
  already in flight, or a frame that is not iodata).
  """
  @spec request(server() | channel(), pos_integer(), iodata(), timeout()) ::
          {:ok, binary()} | {:error, Error.t()}
  def request({:channel, pid, port, table}, id, frame, timeout) do
    with :ok <- check_frame(frame) do
      # The monitor's alias is the reply address: it stops taking messages when
      # the monitor goes (alias: :demonitor), so a reply that comes after the
      # deadline is dropped, as it is for GenServer.call.
      tag = :erlang.monitor(:process, pid, alias: :demonitor)

      case enter(table, id, tag) do
        :ok -> command(port, frame, table, id, tag, pid, timeout)
        {:error, _} = error -> forget(tag, error)
      end
    end
  end

  def request(worker, id, frame, timeout) do
    with :ok <- check_frame(frame) do
      GenServer.call(worker, {:request, id, frame}, timeout)
    end
  catch
    :exit, {:timeout, _} ->
      GenServer.cast(worker, {:cancel, id})

      {:error, timed_out(worker, id, timeout)}

    :exit, {reason, _} ->
      {:error, not_running(worker, reason)}
  end

  @doc """
  Like `request/4`, but returns at once with a request handle for
  `await/2`, so one process can have requests in flight on several workers.
  """
  @spec send_request(server(), pos_integer(), iodata()) ::
          {server(), pos_integer(), term() | {:error, Error.t()}}
  def send_request(worker, id, frame) do
    case check_frame(frame) do
      :ok -> {worker, id, :gen_server.send_request(worker, {:request, id, frame})}
      {:error, _} = error -> {worker, id, error}
    end
  end

  @doc """
  Waits for the reply to a `send_request/3`, with the same results as
  `request/4`.
  """
  @spec await({server(), pos_integer(), term()}, timeout()) ::
          {:ok, binary()} | {:error, Error.t()}
  def await({_worker, _id, {:error, _} = error}, _timeout), do: error

  def await({worker, id, request_id}, timeout) do
    case :gen_server.receive_response(request_id, timeout) do
      {:reply, reply} ->
        reply

      :timeout ->
        GenServer.cast(worker, {:cancel, id})

        {:error, timed_out(worker, id, timeout)}

      {:error, {reason, _}} ->
        {:error, not_running(worker, reason)}
    end
  end

  defp enter(table, id, tag) do
    if :ets.insert_new(table, {id, tag}),
      do: :ok,
      else: {:error, Error.new(:bad_args, "request id #{id} is already in flight")}
  rescue
    # The table went with its worker: the monitor's :DOWN says why.
    ArgumentError -> :ok
  end

  defp command(port, frame, table, id, tag, pid, timeout) do
    Port.command(port, frame)
    await_reply(tag, table, id, pid, timeout)
  rescue
    # The port closed (Python exited): the worker's exit notice is on its way.
    ArgumentError -> await_reply(tag, table, id, pid, timeout)
  end

  defp await_reply(tag, table, id, pid, timeout) do
    receive do
      {^tag, result} ->
        Process.demonitor(tag, [:flush])
        result

      {:DOWN, ^tag, :process, _, reason} ->
        {:error, not_running(pid, reason)}
    after
      timeout ->
        leave(table, id)

        # A reply sent before the alias went is kept: it is the answer.
        forget(
          tag,
          {:error, timed_out(pid, id, timeout)}
        )
    end
  end

  defp leave(table, id) do
    :ets.delete(table, id)
  rescue
    ArgumentError -> true
  end

  defp forget(tag, error) do
    Process.demonitor(tag, [:flush])

    receive do
      {^tag, result} -> result
    after
      0 -> error
    end
  end

  defp timed_out(worker, id, timeout) do
    Error.new(:timeout, "no reply from the worker within #{timeout} ms",
      details: %{worker: worker, id: id, timeout: timeout}
    )
  end

  defp not_running(worker, reason) do
    Error.new(:worker, "worker #{inspect(worker)} is not running (#{inspect(reason)})",
      details: %{worker: worker, reason: reason}
    )
  end

  defp check_frame(frame) do
    _ = :erlang.iolist_size(frame)
    :ok
  rescue
    ArgumentError -> {:error, Error.new(:bad_args, "request frame is not iodata")}
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
  (requests in flight), `:pool` and `:index`.
  """
  @spec info(server()) :: {:ok, map()} | {:error, Error.t()}
  def info(worker) do
    {:ok, GenServer.call(worker, :info)}
  catch
    :exit, {reason, _} ->
      {:error,
       Error.new(:worker, "worker #{inspect(worker)} is not running (#{inspect(reason)})")}
  end

  @doc """
  The Python executable a worker started with `opts` uses (see the module
  documentation).
  """
  @spec find_python(keyword()) :: Path.t()
  def find_python(opts \\ []) do
    venv = Path.join(@project_root, ".venv/bin/python")

    cond do
      python = opts[:python] -> python
      (python = System.get_env("VLLM_BRIDGE_PYTHON")) not in [nil, ""] -> python
      File.exists?(venv) -> venv
      true -> "python3"
    end
  end

  @doc "The project root, where `bridge_py` lives (fixed at compile time)."
  @spec project_root() :: Path.t()
  def project_root, do: @project_root

  ## Server ------------------------------------------------------------------

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    python = find_python(opts)

    executable =
      if Path.type(python) == :absolute, do: python, else: System.find_executable(python)

    port_opts =
      [
        :binary,
        {:packet, 4},
        :exit_status,
        :use_stdio,
        :hide,
        args: ["-m", "bridge_py.worker" | Keyword.get(opts, :args, [])],
        env: port_env(Keyword.get(opts, :env, []))
      ] ++ if(cd = opts[:cd], do: [cd: cd], else: [])

    try do
      if executable == nil, do: raise(ErlangError, original: :enoent)
      port = Port.open({:spawn_executable, executable}, port_opts)
      {:os_pid, os_pid} = Port.info(port, :os_pid)
      # Calls in flight, request id -> reply address: the caller's alias for
      # a call through the channel, its GenServer `from` for one through here.
      table = :ets.new(__MODULE__, [:set, :public, write_concurrency: true])
      publish(opts[:registry], {:channel, self(), port, table})

      {:ok,
       %{
         port: port,
         os_pid: os_pid,
         python: executable,
         table: table,
         pool: opts[:pool],
         index: opts[:index]
       }}
    rescue
      error in [ErlangError, ArgumentError] ->
        {:stop, {:python_not_started, python, Exception.message(error)}}
    end
  end

  defp publish(nil, _channel), do: :ok

  defp publish({registry, key}, channel) do
    {_new, _old} = Registry.update_value(registry, key, fn _ -> channel end)
    :ok
  end

  @impl true
  def handle_call({:request, id, frame}, from, state) do
    if :ets.insert_new(state.table, {id, from}) do
      try do
        Port.command(state.port, frame)
        {:noreply, state}
      rescue
        ArgumentError ->
          # Port.command also fails on a port that closed because Python exited
          # (the exit message is still behind this request in the mailbox).
          :ets.delete(state.table, id)
          {:reply, {:error, command_error(state)}, state}
      end
    else
      {:reply, {:error, Error.new(:bad_args, "request id #{id} is already in flight")}, state}
    end
  end

  def handle_call(:info, _from, state) do
    info = %{
      os_pid: state.os_pid,
      python: state.python,
      pending: :ets.info(state.table, :size),
      pool: state.pool,
      index: state.index
    }

    {:reply, info, state}
  end

  @impl true
  def handle_cast({:cancel, id}, state) do
    :ets.delete(state.table, id)
    {:noreply, state}
  end

  @impl true
  def handle_info({port, {:data, reply}}, %{port: port} = state) do
    case Proto.reply_id(reply) do
      {:ok, 0} ->
        Logger.warning(
          "#{describe(state)}: the Python worker could not read a request: " <>
            error_text(reply)
        )

        {:noreply, state}

      {:ok, id} ->
        # No entry: the caller timed out and went away; drop the late reply.
        with [{_id, to}] <- :ets.take(state.table, id), do: answer(to, {:ok, reply})
        {:noreply, state}

      {:error, error} ->
        Logger.warning("#{describe(state)}: unreadable reply: #{error.message}")
        {:noreply, state}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    message = "the Python worker (os pid #{state.os_pid}) exited with status #{status}"
    Logger.error("#{describe(state)}: #{message}")
    fail_pending(state, message, %{exit_status: status})
    {:stop, {:shutdown, {:exit_status, status}}, %{state | port: nil}}
  end

  def handle_info({:EXIT, port, reason}, %{port: port} = state) do
    message = "the port to the Python worker closed (#{inspect(reason)})"
    fail_pending(state, message, %{reason: reason})
    {:stop, {:shutdown, {:port_closed, reason}}, %{state | port: nil}}
  end

  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, %{port: port} = state) do
    fail_pending(state, "the worker is shutting down", %{})

    if port != nil do
      try do
        Port.close(port)
      rescue
        ArgumentError -> :ok
      end
    end

    :ok
  end

  # A reply address is a caller's alias (through the channel) or a `from`.
  defp answer(tag, result) when is_reference(tag), do: send(tag, {tag, result})
  defp answer(from, result), do: GenServer.reply(from, result)

  defp fail_pending(state, message, details) do
    error =
      Error.new(:worker, message,
        details: Map.merge(details, %{pool: state.pool, index: state.index, os_pid: state.os_pid})
      )

    # (taken one by one: terminate/2 sweeps again, and each caller hears once)
    for {id, _to} <- :ets.tab2list(state.table),
        [{_id, to}] <- [:ets.take(state.table, id)],
        do: answer(to, {:error, error})

    :ok
  end

  defp command_error(state) do
    if Port.info(state.port) == nil do
      Error.new(:worker, "the Python worker (os pid #{state.os_pid}) has exited",
        details: %{pool: state.pool, index: state.index, os_pid: state.os_pid}
      )
    else
      Error.new(:bad_args, "request frame is not iodata")
    end
  end

  defp describe(%{pool: nil}), do: "VllmBridge.Worker #{inspect(self())}"
  defp describe(%{pool: pool, index: index}), do: "#{inspect(pool)} worker #{index}"

  defp error_text(reply) do
    case Proto.decode_reply(reply) do
      {:ok, %{result: {:error, %{message: message}}}} -> message
      _ -> "(undecodable reply)"
    end
  end

  defp port_env(env) do
    env = Enum.map(env, fn {k, v} -> {to_string(k), v && to_string(v)} end)

    pythonpath =
      case List.keyfind(env, "PYTHONPATH", 0) do
        {_, value} when value not in [nil, ""] -> value
        _ -> System.get_env("PYTHONPATH")
      end

    pythonpath =
      if pythonpath in [nil, ""],
        do: @project_root,
        else: @project_root <> ":" <> pythonpath

    env
    |> List.keystore("PYTHONPATH", 0, {"PYTHONPATH", pythonpath})
    |> Enum.map(fn
      {k, nil} -> {String.to_charlist(k), false}
      {k, v} -> {String.to_charlist(k), String.to_charlist(v)}
    end)
  end
end
