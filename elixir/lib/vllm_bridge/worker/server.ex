defmodule VllmBridge.Worker.Server do
  @moduledoc """
  The process behind `VllmBridge.Worker`: the `GenServer` that owns one
  Python process's port and the table of calls pending on it, and keeps a
  `VllmBridge.Worker.State`.

  `VllmBridge.Worker.start_link/1` starts it and the other functions of
  `VllmBridge.Worker` talk to it; nothing else calls this module. What a
  worker does is described there ("Start-up", "Health checks", "Crashes",
  "Lifecycle limits"). The decisions are made by the parts it is built from,
  which take its state and return data or a new state:

    * `VllmBridge.Worker.State` - the state itself, and the snapshot
      `VllmBridge.Worker.info/1` returns;
    * `VllmBridge.Worker.Startup` - the start-up phases, and what a failed
      start means (its error and back-off);
    * `VllmBridge.Worker.Health` - health ticks and pings;
    * `VllmBridge.Worker.Limits` - `:max_calls` and `:max_memory_mb`;
    * `VllmBridge.Worker.Pending` - the table of pending calls;
    * `VllmBridge.Worker.Owners` - which processes own which refs;
    * `VllmBridge.Worker.Output` - what Python printed, and how log
      messages name the worker;
    * `VllmBridge.Worker.Events` - telemetry;
    * `VllmBridge.Worker.Command` and `VllmBridge.Worker.OSProcess` - the
      command line, and the port and OS process it runs.

  This module does what only the process can: it handles the messages
  (calls, the port's data and exit, its own timers), answers callers, logs,
  hands out its channel (the one way in, see "One way in" in
  `VllmBridge.Worker`), publishes it in the pool's `Registry` whenever it
  changes and leaves the registry, and stops. Callers enter their calls and
  write their frames themselves (`VllmBridge.Worker.Call`); no call's
  request passes through this process.
  """

  use GenServer

  require Logger

  alias VllmBridge.{Error, Msgpack, Proto, Worker}

  alias VllmBridge.Worker.{
    Command,
    Events,
    Health,
    Limits,
    OSProcess,
    Output,
    Owners,
    Pending,
    Startup,
    State
  }

  # a reply's bookkeeping, compiled into handle_info/2
  @compile {:inline, after_call: 1}

  # a retiring worker waits this long for callers that had already looked it up
  @drain_grace 50

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    state = State.new(opts, Pending.new())

    if Events.started_before?(opts[:starts], opts[:index]), do: Events.restarted(state, 0, 0)

    {:ok, state |> spawn_python() |> Health.schedule_tick()}
  end

  # Spawns the Python process and writes the start handshake (a ping); calls
  # may be written behind it at once, Python answers them once it runs.
  defp spawn_python(state) do
    python = state.python
    # entries of callers that wrote to the port of a failed start
    if state.last_error, do: fail_all(state, state.last_error)

    executable = Command.executable(python)

    try do
      if executable == nil, do: raise(ErlangError, original: :enoent)
      {port, os_pid} = OSProcess.open(executable, state.spawn)
      id = Worker.new_id()
      Pending.enter_own(state.table, id, :handshake)
      OSProcess.write(port, Health.ping_frame(id))
      state |> Startup.spawned(port, os_pid, executable) |> publish()
    rescue
      error in [ErlangError, ArgumentError] ->
        start_failed(state, nil, "cannot run #{python}: #{Exception.message(error)}")
    end
  end

  # The channel of a worker in `state` (see "One way in" in
  # VllmBridge.Worker): while a Python process starts or runs, its port; else
  # the error every call gets.
  defp channel(%{phase: phase, port: port} = state)
       when phase in [:starting, :ready] and is_port(port),
       do: {:channel, self(), port, state.table, state.reply_spin_us}

  defp channel(state),
    do: {:channel, self(), unavailable(state), state.table, state.reply_spin_us}

  # Stores the channel of `state` as this worker's value in the pool's
  # Registry (at each change of what it says); returns `state`.
  defp publish(%{registry: nil} = state), do: state

  defp publish(%{registry: {registry, key}} = state) do
    channel = channel(state)
    {_new, _old} = Registry.update_value(registry, key, fn _ -> channel end)
    state
  end

  @impl true
  def handle_call(:channel, _from, state), do: {:reply, channel(state), state}

  def handle_call(:await_started, from, state) do
    case state do
      %{phase: phase} when phase in [:ready, :retiring] -> {:reply, :ok, state}
      %{phase: :starting, attempt: 0} -> {:noreply, %{state | waiters: [from | state.waiters]}}
      _failed -> {:reply, {:error, state.last_error}, state}
    end
  end

  def handle_call(:info, _from, state) do
    {:reply, State.info(state, Pending.pending(state.table)), state}
  end

  # Holds on handles taken back by VllmBridge.Runtime.release/2 (see Owners).
  def handle_call({:disown, session, pairs}, _from, state) do
    {ids, monitors, owners} = Owners.disown(state.owners, session, pairs)
    Enum.each(monitors, &Process.demonitor(&1, [:flush]))
    {:reply, ids, %{state | owners: owners}}
  end

  # A caller decoded refs that Python counted as handed to `owner`.
  @impl true
  def handle_cast({:own, owner, session, ids}, state) do
    owners = Owners.add(state.owners, owner, session, ids, fn -> Process.monitor(owner) end)
    {:noreply, %{state | owners: owners}}
  end

  @impl true
  def handle_info({port, {:data, reply}}, %{port: port} = state) do
    case Proto.reply_id(reply) do
      {:ok, 0} ->
        {:noreply, Startup.printed(state, Output.unsolicited(state, reply))}

      {:ok, id} ->
        case Pending.answer_id(state.table, id, {:ok, reply}) do
          :answered ->
            after_call(state)

          :health ->
            {:noreply, Health.answered(state)}

          :handshake ->
            {:noreply, started(state)}

          # The answer to a release of the worker's own: nothing to do.
          :release ->
            {:noreply, state}

          # No entry: the caller timed out and went away. Python counted the
          # refs in the late reply as handed out; nobody will hold them.
          nil ->
            give_back(state, orphaned(reply))
            {:noreply, state}
        end

      {:error, error} ->
        Logger.warning("#{describe(state)}: unreadable reply: #{error.message}")
        {:noreply, state}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{port: port, phase: :starting} = state) do
    {:noreply, start_failed(%{state | port: nil}, status, nil)}
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    message = "the Python worker (os pid #{state.os_pid}) exited with status #{status}"
    Logger.error("#{describe(state)}: #{message}")
    exited(state, :exit, status)
    fail_pending(state, message, %{exit_status: status})
    {:stop, {:shutdown, {:exit_status, status}}, %{state | port: nil, phase: :gone}}
  end

  def handle_info({:EXIT, port, reason}, %{port: port} = state) do
    message = "the port to the Python worker closed (#{inspect(reason)})"
    exited(state, :exit, nil)
    fail_pending(state, message, %{reason: reason})
    {:stop, {:shutdown, {:port_closed, reason}}, %{state | port: nil, phase: :gone}}
  end

  # A caller found `port` closed when it wrote its call `id`
  # (VllmBridge.Worker.Call). While `port` is this worker's, its exit notice is
  # still to come, and answers that call with the others.
  def handle_info({:closed_port, port, _id}, %{port: port} = state), do: {:noreply, state}

  # This worker handled that port's exit before the call was entered (a failed
  # start: the caller had the channel from before it): nothing else would
  # answer the call before the next tick or start.
  def handle_info({:closed_port, _port, id}, state) do
    Pending.fail(state.table, id, state.last_error || exited_before(state))
    {:noreply, state}
  end

  # The back-off after a failed start is over: start Python again.
  def handle_info({:retry, delay}, %{phase: :backoff} = state) do
    Events.restarted(state, delay, state.attempt)

    {:noreply, spawn_python(state)}
  end

  def handle_info(:drain_check, %{phase: :retiring} = state), do: drain(state)

  # Every tick: sweep; then, unless checks are off or a ping is in flight,
  # ping Python if nothing came from it since the last tick.
  def handle_info(:health_tick, state) do
    Pending.sweep(state.table)
    if state.phase == :backoff, do: fail_all(state, state.last_error)

    state = state |> Health.tick() |> Health.schedule_tick()

    # a worker that is idle is checked for memory here, between calls
    case state do
      %{phase: :ready, max_memory_mb: mb} when is_integer(mb) -> check_memory(state, true)
      _ -> {:noreply, state}
    end
  end

  def handle_info({:health_timeout, id}, %{health: {id, _timer, _extended}} = state) do
    case Health.timed_out(state) do
      {:alive, state} -> {:noreply, state}
      :unresponsive -> unresponsive(state)
    end
  end

  # An owner of refs exited: give its holds back to Python.
  def handle_info({:DOWN, _ref, :process, pid, _reason}, state) do
    {by_session, owners} = Owners.take(state.owners, pid)
    give_back(state, by_session)
    {:noreply, %{state | owners: owners}}
  end

  def handle_info(_other, state), do: {:noreply, state}

  ## Start-up and back-off -----------------------------------------------------

  # The start handshake came back: Python runs and reads requests.
  defp started(state) do
    for from <- state.waiters, do: GenServer.reply(from, :ok)

    Events.started(state)

    if state.attempt > 0 do
      Logger.info("#{describe(state)}: the Python worker started after #{state.attempt} failures")
    end

    Output.log_lines(state, state.output_tail)

    Startup.ready(state, OSProcess.input_bytes(state.port))
  end

  # Python could not start (no executable: status nil and a reason) or exited
  # before answering its start handshake: every waiting caller gets the
  # error, and the next start is scheduled after a back-off.
  defp start_failed(state, status, reason) do
    %{delay: delay, error: error} =
      failure = Startup.failure(state, status, reason, describe(state))

    Logger.error(error.message)
    if status, do: exited(state, :start_failed, status)

    for from <- state.waiters, do: GenServer.reply(from, {:error, error})
    fail_all(state, error)
    Health.cancel(state)
    Process.send_after(self(), {:retry, delay}, delay)

    state |> Startup.failed(failure) |> publish()
  end

  # What a call gets while no Python process serves calls (in the channel).
  defp unavailable(%{phase: :retiring} = state) do
    Error.new(
      :worker,
      "#{describe(state)} is being replaced (over its :max_calls or :max_memory_mb) and " <>
        "takes no new calls",
      details: %{pool: state.pool, index: state.index}
    )
  end

  defp unavailable(%{last_error: %Error{} = error}), do: error

  defp unavailable(state) do
    Error.new(:worker, "#{describe(state)} has no Python process to take calls",
      details: %{pool: state.pool, index: state.index}
    )
  end

  ## Lifecycle limits ------------------------------------------------------------

  # After a caller's reply: count it, then look at the limits (between calls).
  defp after_call(%{phase: :retiring} = state), do: drain(%{state | calls: state.calls + 1})

  # (no limit set, nothing to look at)
  defp after_call(%{max_calls: nil, max_memory_mb: nil, calls: calls} = state),
    do: {:noreply, %{state | calls: calls + 1}}

  defp after_call(state) do
    state = %{state | calls: state.calls + 1}

    case Limits.calls(state) do
      {:over, why} -> {:noreply, retire(state, why)}
      :ok when is_integer(state.max_memory_mb) -> check_memory(state, false)
      :ok -> {:noreply, state}
    end
  end

  # Reads the Python process's resident memory (at most once a second unless
  # `now`) and retires the worker when it is over :max_memory_mb.
  defp check_memory(state, now) do
    case Limits.memory(state, now) do
      {:ok, state} -> {:noreply, state}
      {:over, why, state} -> {:noreply, retire(state, why)}
    end
  end

  # Over a limit: leave the registry (no new call is routed here; refs into
  # this worker are stale from now on), let the calls in flight finish, then
  # have the pool replace this worker.
  defp retire(state, why) do
    Logger.info("#{describe(state)}: replacing the worker once its calls finish: #{why}")

    case state.registry do
      {registry, key} -> Registry.unregister(registry, key)
      nil -> :ok
    end

    # a caller that looked the worker up just before may still write its call
    Process.send_after(self(), :drain_check, @drain_grace)
    %{state | phase: :retiring}
  end

  defp drain(%{replace_requested: true} = state), do: {:noreply, state}

  defp drain(state) do
    cond do
      Pending.callers(state.table) > 0 ->
        {:noreply, state}

      replacer = replacer(state.registry) ->
        GenServer.cast(replacer, {:replace, state.index, self()})
        {:noreply, %{state | replace_requested: true}}

      true ->
        {:stop, {:shutdown, :replaced}, state}
    end
  end

  defp replacer({registry, _key}) do
    case Registry.lookup(registry, :replacer) do
      [{pid, nil}] -> pid
      [] -> nil
    end
  rescue
    ArgumentError -> nil
  end

  defp replacer(nil), do: nil

  defp exited(state, reason, status), do: Events.exited(state, reason, status)

  ## Health checks -------------------------------------------------------------

  defp unresponsive(state) do
    waited = Health.ping_wait(state)

    message =
      "the Python worker (os pid #{state.os_pid}) stopped answering: nothing came from it " <>
        "for #{waited} ms after a health ping, so it was killed"

    Logger.error("#{describe(state)} (os pid #{state.os_pid}): #{message}")
    OSProcess.kill(state.os_pid)
    exited(state, :unresponsive, nil)
    fail_pending(state, message, %{reason: :unresponsive})
    {:stop, {:shutdown, :unresponsive}, %{state | phase: :gone}}
  end

  @impl true
  def terminate(_reason, %{port: port} = state) do
    if port != nil and state.phase != :gone,
      do: exited(state, if(state.phase == :retiring, do: :replaced, else: :shutdown), nil)

    for from <- state.waiters do
      GenServer.reply(from, {:error, Error.new(:worker, "the worker is shutting down")})
    end

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

  defp fail_pending(state, message, details) do
    error =
      Error.new(:worker, message,
        details: Map.merge(details, %{pool: state.pool, index: state.index, os_pid: state.os_pid})
      )

    fail_all(state, error)
  end

  # (taken one by one: terminate/2 sweeps again, and each caller hears once)
  defp fail_all(state, error), do: Pending.fail_all(state.table, error)

  # What a call written to a Python process that had exited gets, when no
  # failed start says why.
  defp exited_before(state) do
    Error.new(
      :worker,
      "#{describe(state)}: the Python process the call was written to had exited",
      details: %{pool: state.pool, index: state.index}
    )
  end

  defp describe(state), do: Output.describe(state)

  ## Holds given back ----------------------------------------------------------

  # One release per session (and per Proto.max_repeated/0 handles), written to
  # the port as a request of the worker's own, whose answer is not waited for.
  # Without a port the objects are gone.
  defp give_back(%{port: port} = state, by_session) when port != nil do
    for {session, ids} <- by_session, chunk <- Enum.chunk_every(ids, Proto.max_repeated()) do
      id = Worker.new_id()
      request = %{id: id, session: session, op: {:release, %{handles: chunk}}}
      {:ok, frame} = Proto.encode_request(request)
      Pending.enter_own(state.table, id, :release)

      try do
        OSProcess.write(port, frame)
      rescue
        ArgumentError -> Pending.delete(state.table, id)
      end
    end

    :ok
  end

  defp give_back(_state, _by_session), do: :ok

  # The handles of the refs in a reply nobody waits for any more, as holds of
  # the default session: the reply does not say which session its request
  # named, and in another one releasing them there does nothing.
  defp orphaned(reply) do
    with {:ok, %{result: {:value, value}}} <- Proto.decode_reply(reply),
         {:ok, _term} <- Msgpack.decode(value, ref: [owner: self()]) do
      case Msgpack.take_handed() do
        [] -> %{}
        ids -> %{"" => ids}
      end
    else
      _ ->
        Msgpack.take_handed()
        %{}
    end
  end
end
