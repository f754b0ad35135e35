defmodule VllmBridge.Worker.Call do
  @moduledoc """
  The caller's side of a call to a `VllmBridge.Worker`: what runs in the
  process that calls `VllmBridge.Worker.request/4` (or `send_request/3` and
  `await/2`), not in the worker. Every call a worker answers is made here.

  A call is made through the worker's `t:VllmBridge.Worker.channel/0`,
  which says what the worker takes now: while a Python process runs (or
  starts), its port and the worker's table of pending calls; while none does
  (a failed start backing off, a worker being replaced), the error a call
  gets. With a port, the caller enters its reply address in the worker's
  `VllmBridge.Worker.Pending` table, writes the frame to the port itself,
  and waits for its reply, the worker's exit or its own deadline; with an
  error, it returns the error at once. A worker given by pid or name is
  asked for its channel first (`channel/3`).

  This module also builds the errors a caller gets for a deadline and for a
  worker that is not running.
  """

  alias VllmBridge.Error
  alias VllmBridge.Worker.{LookGate, Pending}

  # One call's steps, compiled into call/4, start/3 and await/2 rather than
  # called (the compiler inlines one level: these call no step of their own).
  @compile {:inline, enter: 4, command: 6, await_reply: 6}

  # What one look for a reply is charged: the VM's time slice (CONTEXT_REDS),
  # see wait/7.
  @look_reductions 4000

  # How long start/3 waits for a worker given by pid or name to hand out its
  # channel (it has no deadline of its own; await/2 has).
  @channel_timeout 5_000

  @typedoc """
  A call in flight, from `start/3` to `await/2`: the worker, its table, the
  request id, the reply address and how long to look for the reply; or the
  call's result, when it had one at once.
  """
  @opaque handle ::
            {:call, pid(), Pending.t(), pos_integer(), reference(), non_neg_integer()}
            | {:done, {:ok, binary()} | {:error, Error.t()}}

  @doc """
  Makes a call: `worker` is a `t:VllmBridge.Worker.channel/0`, or the worker
  (a pid or name) to ask for it. Results as for `VllmBridge.Worker.request/4`.
  """
  @spec call(term(), pos_integer(), iodata(), timeout()) :: {:ok, binary()} | {:error, Error.t()}
  def call({:channel, pid, port, table, spin_us}, id, frame, timeout) when is_port(port) do
    # The monitor's alias is the reply address: it stops taking messages when
    # the monitor goes (alias: :demonitor), so a reply that comes after the
    # deadline is dropped.
    tag = :erlang.monitor(:process, pid, alias: :demonitor)

    with :ok <- enter(table, id, tag, frame),
         written when written in [:written, :closed] <-
           command(port, pid, table, id, tag, frame) do
      # (no look for a reply that only the worker's handling of the closed
      # port brings)
      await_reply(tag, table, id, pid, if(written == :written, do: spin_us, else: 0), timeout)
    end
  end

  def call({:channel, _pid, %Error{} = error, _table, _spin_us}, _id, frame, _timeout),
    do: refused(frame, {:error, error})

  def call(worker, id, frame, timeout) do
    started = if is_integer(timeout), do: :erlang.monotonic_time(:millisecond)

    with {:ok, channel} <- channel(worker, id, timeout) do
      left =
        if started,
          do: max(timeout - (:erlang.monotonic_time(:millisecond) - started), 0),
          else: timeout

      call(channel, id, frame, left)
    end
  end

  @doc """
  Starts a call without waiting for its reply: enters it and writes its frame
  as `call/4` does, and returns a handle for `await/2`. A worker given by pid
  or name is asked for its channel first, for up to #{@channel_timeout} ms.
  """
  @spec start(term(), pos_integer(), iodata()) :: handle()
  def start({:channel, pid, port, table, spin_us}, id, frame) when is_port(port) do
    tag = :erlang.monitor(:process, pid, alias: :demonitor)

    with :ok <- enter(table, id, tag, frame),
         written when written in [:written, :closed] <-
           command(port, pid, table, id, tag, frame) do
      {:call, pid, table, id, tag, if(written == :written, do: spin_us, else: 0)}
    else
      {:error, _} = error -> {:done, error}
    end
  end

  def start({:channel, _pid, %Error{} = error, _table, _spin_us}, _id, frame),
    do: {:done, refused(frame, {:error, error})}

  def start(worker, id, frame) do
    case channel(worker, id, @channel_timeout) do
      {:ok, channel} -> start(channel, id, frame)
      {:error, _} = error -> {:done, error}
    end
  end

  @doc """
  Waits up to `timeout` ms (from now) for the reply to a call that `start/3`
  started, in the same way and with the same results as `call/4`.
  """
  @spec await(handle(), timeout()) :: {:ok, binary()} | {:error, Error.t()}
  def await({:call, pid, table, id, tag, spin_us}, timeout),
    do: await_reply(tag, table, id, pid, spin_us, timeout)

  def await({:done, result}, _timeout), do: result

  @doc """
  Asks the worker (a pid or name) for its `t:VllmBridge.Worker.channel/0`,
  waiting up to `timeout` ms; `id` names the call in a `:timeout` error
  (`nil`: no call). A worker that is not running is a `:worker` error, and
  so is one on another node (its port and table are of no use here).
  """
  @spec channel(term(), pos_integer() | nil, timeout()) :: {:ok, term()} | {:error, Error.t()}
  def channel(worker, id, timeout) do
    case GenServer.call(worker, :channel, timeout) do
      {:channel, pid, _, _, _} = channel when node(pid) == node() -> {:ok, channel}
      {:channel, pid, _, _, _} -> {:error, remote(worker, pid)}
      other -> {:error, not_running(worker, {:not_a_worker, other})}
    end
  catch
    :exit, {:timeout, _} -> {:error, timed_out(worker, id, timeout)}
    :exit, {reason, _} -> {:error, not_running(worker, reason)}
  end

  # A frame that is not iodata is named first, as when it is written.
  defp refused(frame, {:error, _} = error), do: with(:ok <- check_frame(frame), do: error)

  # Enters the call: :ok, or the call's error (an id already in flight; a
  # frame that is not iodata is named first).
  defp enter(table, id, tag, frame) do
    case Pending.enter(table, id, tag, self()) do
      :ok -> :ok
      {:error, _} = error -> forget(tag, refused(frame, error))
    end
  rescue
    # The table went with its worker: the monitor's :DOWN says why.
    ArgumentError -> :ok
  end

  # Writes the frame: :written, :closed (the port had closed: the worker
  # answers the call), or the call's error.
  # Port.command/2 refuses a frame that is not iodata as it refuses a closed
  # port (ArgumentError): the frame is measured only then, to tell which.
  defp command(port, pid, table, id, tag, frame) do
    Port.command(port, frame)
    :written
  rescue
    ArgumentError ->
      case check_frame(frame) do
        # The port closed (Python exited). While it is still the worker's
        # port, the worker's handling of its exit answers the call; if the
        # worker has handled that exit already (a failed start), this tells it
        # to answer the call now (VllmBridge.Worker.Server).
        :ok ->
          send(pid, {:closed_port, port, id})
          :closed

        {:error, _} = error ->
          Pending.delete(table, id)
          forget(tag, error)
      end
  end

  # Look for the reply for up to spin_us before sleeping in `receive` (see
  # "Waiting for a reply" in VllmBridge.Worker, and docs/architecture.md for
  # why: a reply that lands after its caller went to sleep reaches it later),
  # while this is the worker's only call in flight: other calls' replies keep
  # the VM busy, and looking callers would only take turns with the Worker
  # that delivers them. Checked here and on every look: a call that starts
  # with company sleeps at once, without a first look (that pass alone cost
  # concurrent callers throughput). Not with one scheduler: the look would
  # hold the VM's only CPU while Python needs one. bench/README.md has what
  # each of these was measured at.
  # And only while the VM's look gate is open: a look that was away from its
  # CPU too long closes it for a while (VllmBridge.Worker.LookGate).
  defp await_reply(tag, table, id, pid, spin_us, timeout) do
    until =
      if spin_us > 0 and :ets.info(table, :size) == 1 and
           :erlang.system_info(:schedulers_online) > 1 do
        now = :erlang.monotonic_time(:microsecond)
        if LookGate.open?(LookGate.global(), now), do: now + spin_us
      end

    wait(tag, table, id, pid, timeout, until, until && until - spin_us)
  end

  # `until`: while looking, the monotonic microsecond when the look ends;
  # nil once asleep in `receive`. `last`: while looking, when the look last
  # had its turn.
  defp wait(tag, table, id, pid, timeout, until, last) do
    receive do
      {^tag, result} ->
        if until, do: look_ended(last, :erlang.monotonic_time(:microsecond))
        Process.demonitor(tag, [:flush])
        result

      {:DOWN, ^tag, :process, _, reason} ->
        {:error, not_running(pid, reason)}
    after
      if(until, do: 0, else: timeout) ->
        now = if until, do: :erlang.monotonic_time(:microsecond), else: 0

        cond do
          until == nil ->
            Pending.delete(table, id)

            # A reply sent before the alias went is kept: it is the answer.
            forget(tag, {:error, timed_out(pid, id, timeout)})

          now < until and :ets.info(table, :size) == 1 and not LookGate.away?(last, now) ->
            # Any other process of this scheduler (the Worker delivering the
            # reply, for one) runs first. The look is charged a full time
            # slice: a scheduler polls its ports for input once enough
            # reductions have run, and a bare yield counts as few, so the
            # reply used to be seen only every few looks (a call's time rose
            # in steps with its Python time); charged, it is seen on the
            # next look.
            :erlang.bump_reductions(@look_reductions)
            :erlang.yield()
            wait(tag, table, id, pid, timeout, until, now)

          true ->
            look_ended(last, now)
            wait(tag, table, id, pid, timeout, nil, now)
        end
    end
  end

  # A look ended at `now`, its last turn having been at `last`: tell the
  # VM's look gate whether it was away.
  defp look_ended(last, now) do
    if LookGate.away?(last, now),
      do: LookGate.close(LookGate.global(), now),
      else: LookGate.calm(LookGate.global())
  end

  defp forget(tag, error) do
    Process.demonitor(tag, [:flush])

    receive do
      {^tag, result} -> result
    after
      0 -> error
    end
  end

  @doc "`:ok` when `frame` is iodata, else a `:bad_args` error."
  @spec check_frame(term()) :: :ok | {:error, Error.t()}
  def check_frame(frame) do
    _ = :erlang.iolist_size(frame)
    :ok
  rescue
    ArgumentError -> {:error, Error.new(:bad_args, "request frame is not iodata")}
  end

  @doc "The `:timeout` error of a call with no reply by its deadline."
  @spec timed_out(term(), pos_integer() | nil, timeout()) :: Error.t()
  def timed_out(worker, id, timeout) do
    Error.new(:timeout, "no reply from the worker within #{timeout} ms",
      details: %{worker: worker, id: id, timeout: timeout}
    )
  end

  @doc "The `:worker` error of a call to a worker that is not running."
  @spec not_running(term(), term()) :: Error.t()
  def not_running(worker, reason) do
    Error.new(:worker, "worker #{inspect(worker)} is not running (#{inspect(reason)})",
      details: %{worker: worker, reason: reason}
    )
  end

  defp remote(worker, pid) do
    Error.new(
      :worker,
      "worker #{inspect(worker)} runs on node #{inspect(node(pid))}: its port and table of " <>
        "calls are that node's; VllmBridge.Runtime runs calls there (see \"Across nodes\")",
      details: %{worker: worker, node: node(pid)}
    )
  end
end
