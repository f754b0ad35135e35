defmodule VllmBridge.Worker.Health do
  @moduledoc """
  A worker's health checks of its Python process (see "Health checks" in
  `VllmBridge.Worker`).

  On every tick the worker looks whether anything came from Python since
  the last look, by the port's count of bytes read: any reply is proof of
  life, so a busy worker is never pinged. When nothing came, it writes a
  `Ping` of its own (entered in the `VllmBridge.Worker.Pending` table as a
  `:health` entry) and starts a timer; when the timer fires and still
  nothing came, Python is unresponsive and the worker kills it.

  Unless it is still taking in what it was sent: a large request (a 1 GiB
  argument) keeps Python busy without a word for seconds, decoding it and
  encoding its reply while it holds the GIL, and no ping can be answered
  meanwhile. So when the timer fires with nothing heard but 1 MiB or more
  written to Python since the time before it last spoke (the port's count of
  bytes written; the time before, since its last words may have been on their
  way when the frame was written), the ping gets more time, once: 1 s per
  32 MiB of that backlog, before Python is called unresponsive.

  These functions take and return the worker's state: its `:port`,
  `:table`, `:health_interval`, `:health_timeout`, `:heard` (the byte count
  read at the last look), `:told` (the byte counts written to Python when
  something was heard from it the last time but one, and the last time) and
  `:health` (the ping in flight, `{id, timer, extended}`, `extended` once
  given more time, or `nil`). They run in the worker process, whose mailbox
  gets the `:health_tick` and `{:health_timeout, id}` messages.
  """

  alias VllmBridge.Proto
  alias VllmBridge.Worker.{OSProcess, Pending}

  # the sweep of dead callers' entries when health checks are off
  @sweep_interval 5_000
  # the least time a Python process that has not answered anything yet (it is
  # starting: importing torch) gets to answer the first health ping
  @startup_grace 60_000
  # a backlog this large (bytes written to Python since it last spoke) earns
  # a ping more time: one ms per @bytes_per_ms bytes (32 MiB/s)
  @large_backlog 1_048_576
  @bytes_per_ms div(32 * 1_048_576, 1000)

  @doc """
  The `Ping` request frame under `id` that the worker writes as its health
  ping and as its start handshake.
  """
  @spec ping_frame(pos_integer()) :: binary()
  def ping_frame(id) do
    {:ok, frame} = Proto.encode_request(%{id: id, session: "", op: {:ping, %{payload: ""}}})
    frame
  end

  @doc """
  Sends the next `:health_tick` to the calling process: after
  `:health_interval` ms, or after #{@sweep_interval} ms with checks off (the
  tick also sweeps dead callers' entries).
  """
  @spec schedule_tick(map()) :: map()
  def schedule_tick(%{health_interval: false} = state) do
    Process.send_after(self(), :health_tick, @sweep_interval)
    state
  end

  def schedule_tick(%{health_interval: interval} = state) do
    Process.send_after(self(), :health_tick, interval)
    state
  end

  @doc """
  The health part of a tick: unless there is no port, checks are off or a
  ping is in flight, notes what came from Python since the last look, and
  pings it when nothing did.
  """
  @spec tick(map()) :: map()
  def tick(%{port: nil} = state), do: state
  def tick(%{health_interval: false} = state), do: state

  def tick(%{health: nil} = state) do
    case OSProcess.input_bytes(state.port) do
      heard when heard != state.heard -> heard(state, heard)
      _same -> ping(state)
    end
  end

  def tick(state), do: state

  defp ping(state) do
    id = VllmBridge.Worker.new_id()
    Pending.enter_own(state.table, id, :health)

    try do
      OSProcess.write(state.port, ping_frame(id))
    rescue
      # the port closed: its exit notice is on its way
      ArgumentError -> :ok
    end

    timer = Process.send_after(self(), {:health_timeout, id}, ping_wait(state))
    %{state | health: {id, timer, false}}
  end

  @doc "The reply to the health ping came: Python is alive; the next tick looks again."
  @spec answered(map()) :: map()
  def answered(%{health: {_id, timer, _extended}} = state) do
    Process.cancel_timer(timer)
    heard(%{state | health: nil}, OSProcess.input_bytes(state.port))
  end

  def answered(state), do: state

  @doc "Cancels the timer of the ping in flight, if any."
  @spec cancel(map()) :: non_neg_integer() | false
  def cancel(%{health: {_id, timer, _extended}}), do: Process.cancel_timer(timer)
  def cancel(_state), do: false

  # Python spoke: note how much it had been sent by then.
  defp heard(%{told: {_older, last}} = state, heard),
    do: %{state | heard: heard, told: {last, OSProcess.output_bytes(state.port)}}

  @doc """
  The ping's time is up: returns `{:alive, state}` when something came from
  Python meanwhile; `{:alive, state}` with the ping given more time (once)
  when Python is still taking in a large backlog (see the module
  documentation); else `:unresponsive`. The ping's entry is forgotten unless
  it was given more time.
  """
  @spec timed_out(map()) :: {:alive, map()} | :unresponsive
  def timed_out(%{health: {id, _timer, extended}} = state) do
    heard = OSProcess.input_bytes(state.port)
    backlog = OSProcess.output_bytes(state.port) - elem(state.told, 0)

    cond do
      heard != state.heard ->
        Pending.delete(state.table, id)
        {:alive, heard(%{state | health: nil}, heard)}

      not extended and backlog >= @large_backlog ->
        timer = Process.send_after(self(), {:health_timeout, id}, div(backlog, @bytes_per_ms))
        {:alive, %{state | health: {id, timer, true}}}

      true ->
        Pending.delete(state.table, id)
        :unresponsive
    end
  end

  @doc """
  How long a health ping waits: `:health_timeout`, but at least
  #{div(@startup_grace, 1000)} s for a Python that has not answered anything
  yet (it is still starting).
  """
  @spec ping_wait(map()) :: pos_integer()
  def ping_wait(%{heard: 0} = state), do: max(state.health_timeout, @startup_grace)
  def ping_wait(state), do: state.health_timeout
end
