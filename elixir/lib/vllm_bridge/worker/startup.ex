defmodule VllmBridge.Worker.Startup do
  @moduledoc """
  The start-up of a `VllmBridge.Worker`'s Python process: the worker's
  state as it spawns one, when its start handshake is answered and when it
  fails, and what a failed start means: why it failed, the error its callers
  get, and how long to wait before the next try (see "Start-up" in
  `VllmBridge.Worker`).

  Why comes from Python's own words: the last lines it printed before it
  exited (sent as output frames, kept by the worker while it starts). A
  Python that printed nothing that way never got as far as `bridge_py` (the
  package or the interpreter itself is broken), so it is run once more with
  stdin at end-of-file and its stderr read (`VllmBridge.Worker.OSProcess.rerun/2`),
  once per run of failures.

  Apart from that re-run, everything here is pure: it takes the worker's
  state (`t:VllmBridge.Worker.State.t/0`) and returns data or a new state.
  """

  alias VllmBridge.Error
  alias VllmBridge.Worker.OSProcess

  # this many of the last lines a failed start printed are kept in its error
  @stderr_lines 8
  # at most this many lines printed while starting are held (Python's burst)
  @held_lines 1000
  # what an environment made for vllm_bridge has (bridge_py and its requirements)
  @environment ~w(bridge_py torch msgpack numpy grpc)

  @typedoc """
  Why a start failed: the last lines Python printed, and the module it could
  not import, if it said so.
  """
  @type diagnosis :: %{stderr: [String.t()], missing_module: String.t() | nil}

  @typedoc "A failed start, as `failure/4` sees it."
  @type failure :: %{
          attempt: pos_integer(),
          delay: pos_integer(),
          diagnosis: diagnosis() | nil,
          error: Error.t()
        }

  @doc """
  The delay in ms before start number `attempt + 1`, after `attempt` failed
  starts in a row: `min`, doubled per failure after the first, at most `max`.

  ## Examples

      iex> for attempt <- 1..5, do: VllmBridge.Worker.Startup.backoff(500, 3_000, attempt)
      [500, 1000, 2000, 3000, 3000]
  """
  @spec backoff(pos_integer(), pos_integer(), pos_integer()) :: pos_integer()
  def backoff(min, max, attempt) do
    min(max, min * Integer.pow(2, min(attempt - 1, 20)))
  end

  @doc """
  The state of a worker that has just spawned its Python process `os_pid`
  behind `port`, running `executable`: `:starting`, with nothing heard from
  Python yet, no lines printed and no health ping in flight.
  """
  @spec spawned(map(), port(), pos_integer(), Path.t()) :: map()
  def spawned(state, port, os_pid, executable) do
    %{
      state
      | port: port,
        os_pid: os_pid,
        python: executable,
        phase: :starting,
        spawned_at: System.monotonic_time(),
        output_tail: [],
        heard: 0,
        told: {0, 0},
        health: nil
    }
  end

  @doc """
  The state of a worker whose start handshake was answered: `:ready`, its
  run of failures over, its waiters answered (by the worker), and `heard`
  the port's count of bytes read so far (`told`: written so far, twice).
  """
  @spec ready(map(), non_neg_integer() | :closed) :: map()
  def ready(state, heard) do
    %{
      state
      | phase: :ready,
        attempt: 0,
        last_error: nil,
        diagnosis: nil,
        output_tail: [],
        waiters: [],
        heard: heard,
        told: {OSProcess.output_bytes(state.port), OSProcess.output_bytes(state.port)}
    }
  end

  @doc """
  The state of a worker after the failed start `failure` (from `failure/4`):
  `:backoff`, with no port, no health ping, its waiters answered (by the
  worker), and the failure's count, error and diagnosis kept for the next
  try.
  """
  @spec failed(map(), failure()) :: map()
  def failed(state, %{attempt: attempt, error: error, diagnosis: diagnosis}) do
    %{
      state
      | port: nil,
        phase: :backoff,
        attempt: attempt,
        last_error: error,
        diagnosis: diagnosis,
        waiters: [],
        health: nil
    }
  end

  @doc """
  Holds the `lines` Python printed while the worker is `:starting` (the last
  #{@held_lines}): the worker logs them once Python has started, and a
  failed start is diagnosed from them, not logged line by line. In any other
  phase the state is returned as it is.
  """
  @spec printed(map(), [String.t()]) :: map()
  def printed(%{phase: :starting} = state, lines),
    do: %{state | output_tail: Enum.take(state.output_tail ++ lines, -@held_lines)}

  def printed(state, _lines), do: state

  @doc """
  Builds what the worker does with a failed start. `state` is the worker's
  state: its `:pool`, `:index`, `:python`, `:spawn`, `:attempt`,
  `:backoff_min`, `:backoff_max`, and the `:output_tail` and earlier
  `:diagnosis` to diagnose from. `status` is Python's exit status (`nil`
  when it could not be run at all, `reason` then says why), `prefix` names
  the worker in the message.
  """
  @spec failure(map(), non_neg_integer() | nil, String.t() | nil, String.t()) :: failure()
  def failure(state, status, reason, prefix) do
    attempt = state.attempt + 1
    {diagnosis, summary} = if reason, do: {nil, reason}, else: diagnosis(state)
    delay = backoff(state.backoff_min, state.backoff_max, attempt)

    what =
      if status,
        do: "#{state.python} -m bridge_py.worker exited with status #{status} before answering: ",
        else: ""

    why = "#{prefix}: the Python worker could not start: #{what}#{summary}"
    message = "#{why} (failed starts in a row: #{attempt}; next try in #{delay} ms)"

    details = %{
      pool: state.pool,
      index: state.index,
      python: state.python,
      exit_status: status,
      attempt: attempt,
      retry_in: delay,
      # the message without the next try, for a pool that gives up instead
      why: why
    }

    details =
      case diagnosis do
        %{} -> Map.merge(details, diagnosis)
        nil -> details
      end

    %{
      attempt: attempt,
      delay: delay,
      diagnosis: diagnosis,
      error: Error.new(:worker, message, details: details)
    }
  end

  # Why Python did not start: from the lines it printed, else the earlier
  # diagnosis of this run of failures, else from running it again.
  defp diagnosis(%{output_tail: [_ | _] = lines}), do: diagnose(Enum.join(lines, "\n"))
  defp diagnosis(%{diagnosis: %{} = diagnosis}), do: {diagnosis, summary(diagnosis)}
  defp diagnosis(state), do: diagnose(OSProcess.rerun(state.python, state.spawn))

  defp diagnose(output) do
    diagnosis = parse(output)
    {diagnosis, summary(diagnosis)}
  end

  @doc """
  Reads a failed Python's output: its last #{@stderr_lines} lines, and the
  module it could not import (the last `No module named '...'`).

  ## Examples

      iex> VllmBridge.Worker.Startup.parse("Traceback ...\\nModuleNotFoundError: No module named 'torch'\\n")
      %{stderr: ["Traceback ...", "ModuleNotFoundError: No module named 'torch'"], missing_module: "torch"}
  """
  @spec parse(String.t()) :: diagnosis()
  def parse(output) do
    lines =
      output
      |> String.split("\n", trim: true)
      |> Enum.take(-@stderr_lines)

    missing =
      case Regex.scan(~r/No module named '([^']+)'/, output) do
        [] -> nil
        found -> found |> List.last() |> Enum.at(1)
      end

    %{stderr: lines, missing_module: missing}
  end

  @doc """
  A diagnosis in one line, for the error's message.

  ## Examples

      iex> VllmBridge.Worker.Startup.summary(%{stderr: [], missing_module: nil})
      "it printed nothing on stderr"

      iex> VllmBridge.Worker.Startup.summary(%{stderr: ["ImportError: x "], missing_module: "x"})
      "ImportError: x (Python cannot import 'x')"
  """
  @spec summary(diagnosis()) :: String.t()
  def summary(%{stderr: []}), do: "it printed nothing on stderr"

  def summary(%{missing_module: module, stderr: lines}) when module in @environment,
    do:
      "#{String.trim(List.last(lines))} (Python cannot import '#{module}': it is not an " <>
        "environment for vllm_bridge; `mix vllm_bridge.setup` makes one, or point the " <>
        "pool's :python option or VLLM_BRIDGE_PYTHON at one)"

  def summary(%{missing_module: module, stderr: lines}) when is_binary(module),
    do: "#{String.trim(List.last(lines))} (Python cannot import '#{module}')"

  def summary(%{stderr: lines}), do: String.trim(List.last(lines))
end
