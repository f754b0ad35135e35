defmodule VllmBridge.Worker.LookGate do
  @moduledoc """
  Whether a caller may look for its reply before it sleeps ("Waiting for a
  reply" in `VllmBridge.Worker`): one gate for the whole VM, which closes for
  a while each time a look finds its CPU taken.

  A look keeps its scheduler's thread running where it would otherwise sleep,
  so it pays only while a CPU is free for it. A look that was away for more
  than 20 microseconds between two of its turns found its CPU taken: by
  another process of its scheduler, or by another thread of the machine that
  the kernel ran in its place (a Python worker, another program). Either way
  the look gains nothing there, and it holds a CPU that others need (what
  that costs is in bench/README.md, "Where the time goes today").

  Such a look ends, and the gate closes for 200 microseconds, twice as long
  each time it closes again before 64 looks in a row have ended without
  being away (up to 50,000), and 200 again after such a calm. So where a CPU
  is free the gate is open nearly all the time, and where every CPU is taken
  it stays closed but for a look now and then.

  The state is three `:atomics` cells, read by every caller and written when
  a look is away, and while the gate is on its way back to the first length,
  once per look; callers race on it harmlessly (at worst a closing is a step
  too long or short). All times are monotonic microseconds, passed in by the
  caller, so the gate is pure bookkeeping apart from its cells.
  """

  @key {__MODULE__, :gate}
  @gap_us 20
  @first_quiet_us 200
  @longest_quiet_us 50_000
  @calm_looks 64
  @never -0x8000000000000000

  @typedoc """
  A gate: closed until cell 1; the last closing lasted cell 2; cell 3 counts
  the looks since then that were not away (up to #{@calm_looks}).
  """
  @type t :: :atomics.atomics_ref()

  @doc "A new gate, open, and calm."
  @spec new() :: t()
  def new do
    gate = :atomics.new(3, signed: true)
    :atomics.put(gate, 1, @never)
    :atomics.put(gate, 2, @first_quiet_us)
    :atomics.put(gate, 3, @calm_looks)
    gate
  end

  @doc """
  Makes the VM's gate, which `global/0` returns. Called once, when the
  application starts.
  """
  @spec install() :: :ok
  def install, do: :persistent_term.put(@key, new())

  @doc "The VM's gate, or nil before the application has started (looks are then never stopped)."
  @spec global() :: t() | nil
  def global, do: :persistent_term.get(@key, nil)

  @doc """
  Whether a look may start at `now`: the gate is open, or there is none.

      iex> gate = VllmBridge.Worker.LookGate.new()
      iex> VllmBridge.Worker.LookGate.open?(gate, 1_000)
      true
  """
  @spec open?(t() | nil, integer()) :: boolean()
  def open?(nil, _now), do: true
  def open?(gate, now), do: now >= :atomics.get(gate, 1)

  @doc """
  Whether a look that last had its turn at `last` was away too long to go on
  at `now`.
  """
  @spec away?(integer(), integer()) :: boolean()
  def away?(last, now), do: now - last > @gap_us

  @doc """
  Closes the gate at `now`, after a look was away: for #{@first_quiet_us} us
  after a calm (#{@calm_looks} looks in a row not away), else for twice the
  last closing (at most #{@longest_quiet_us} us).

      iex> gate = VllmBridge.Worker.LookGate.new()
      iex> VllmBridge.Worker.LookGate.close(gate, 1_000)
      iex> VllmBridge.Worker.LookGate.open?(gate, 1_100)
      false
      iex> VllmBridge.Worker.LookGate.open?(gate, 1_200)
      true
  """
  @spec close(t() | nil, integer()) :: :ok
  def close(nil, _now), do: :ok

  def close(gate, now) do
    quiet =
      if :atomics.get(gate, 3) >= @calm_looks,
        do: @first_quiet_us,
        else: min(2 * :atomics.get(gate, 2), @longest_quiet_us)

    :atomics.put(gate, 3, 0)
    :atomics.put(gate, 2, quiet)
    :atomics.put(gate, 1, now + quiet)
  end

  @doc """
  Counts a look that ended (its reply came, or its time ran out) without
  being away. Writes nothing once the gate is calm.
  """
  @spec calm(t() | nil) :: :ok
  def calm(nil), do: :ok

  def calm(gate) do
    if :atomics.get(gate, 3) < @calm_looks, do: :atomics.add(gate, 3, 1), else: :ok
  end
end
