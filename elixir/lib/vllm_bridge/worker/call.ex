defmodule VllmBridge.Worker.Call do
  @moduledoc """
  The caller's side of a call to a `VllmBridge.Worker`: what runs in the
  process that calls `VllmBridge.Worker.request/4`, not in the worker.

  A call through the worker's channel is made here from start to end: the
  caller enters its reply address in the worker's `VllmBridge.Worker.Pending`
  table, writes the frame to the port itself, and waits for its reply, the
  worker's exit or its own deadline. This module also builds the errors a
  caller gets for a deadline and for a worker that is not running, the same
  for both ways in.
  """

  alias VllmBridge.Error
  alias VllmBridge.Worker.{LookGate, Pending}

  # One call's steps, compiled into through_channel/7 rather than called.
  @compile {:inline, enter: 3, command: 8, await_reply: 6}

  # What one look for a reply is charged: the VM's time slice (CONTEXT_REDS),
  # see wait/6.
  @look_reductions 4000

  @doc """
  Makes a call through a worker's channel: `pid` is the worker, `port` its
  port, `table` its pending calls and `spin_us` how long to look for the
  reply before sleeping (see "Waiting for a reply" in `VllmBridge.Worker`).
  Results as for `VllmBridge.Worker.request/4`.
  """
  @spec through_channel(
          pid(),
          port(),
          Pending.t(),
          non_neg_integer(),
          pos_integer(),
          iodata(),
          timeout()
        ) :: {:ok, binary()} | {:error, Error.t()}
  def through_channel(pid, port, table, spin_us, id, frame, timeout) do
    # The monitor's alias is the reply address: it stops taking messages when
    # the monitor goes (alias: :demonitor), so a reply that comes after the
    # deadline is dropped, as it is for GenServer.call.
    tag = :erlang.monitor(:process, pid, alias: :demonitor)

    case enter(table, id, tag) do
      :ok ->
        command(port, frame, table, id, tag, pid, spin_us, timeout)

      {:error, _} = error ->
        # a frame that is not iodata is named first
        forget(tag, with(:ok <- check_frame(frame), do: error))
    end
  end

  defp enter(table, id, tag) do
    Pending.enter(table, id, tag, self())
  rescue
    # The table went with its worker: the monitor's :DOWN says why.
    ArgumentError -> :ok
  end

  # Port.command/2 refuses a frame that is not iodata as it refuses a closed
  # port (ArgumentError): the frame is measured only then, to tell which.
  defp command(port, frame, table, id, tag, pid, spin_us, timeout) do
    Port.command(port, frame)
    await_reply(tag, table, id, pid, spin_us, timeout)
  rescue
    ArgumentError ->
      case check_frame(frame) do
        # The port closed (Python exited): the worker's exit notice is on its
        # way (or, for a Python that failed to start, the worker answers the
        # entry on its next health tick or start: see "Start-up").
        :ok ->
          await_reply(tag, table, id, pid, 0, timeout)

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
  @spec timed_out(term(), pos_integer(), timeout()) :: Error.t()
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
end
