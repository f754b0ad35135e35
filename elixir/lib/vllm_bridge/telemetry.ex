defmodule VllmBridge.Telemetry do
  @moduledoc """
  Telemetry events, sent through `:telemetry` when it is loaded, and not at
  all otherwise.

  `:vllm_bridge` does not depend on the `:telemetry` package: when your
  application has it (most do, through Phoenix or Ecto), the events below are
  sent with `:telemetry.execute/3`; when it does not, nothing is sent and a
  call pays one `:persistent_term` read to find that out. Whether `:telemetry`
  is there is looked up once (`Code.ensure_loaded?/1` and
  `function_exported?/3`) and remembered; `refresh/0` looks again.

  Durations are in `:native` time units (`System.convert_time_unit/3`), as in
  `:telemetry.span/3`.

  ## Calls

    * `[:vllm_bridge, :call, :start]` - a call is about to be sent to a worker.
      Measurements: `:system_time`, `:monotonic_time`.
    * `[:vllm_bridge, :call, :stop]` - its reply (or error) came back.
      Measurements: `:duration`, `:monotonic_time`. Metadata adds `:result`,
      `:ok` or `{:error, category}`, and `:error`, the `VllmBridge.Error` or
      `nil`.
    * `[:vllm_bridge, :call, :exception]` - the call raised or exited (the
      runtime returns errors as data, so this is a bug or a killed caller).
      Measurements: `:duration`, `:monotonic_time`. Metadata adds `:kind`,
      `:reason` and `:stacktrace`.

  Metadata of all three: `:pool`, `:index` (the worker's index in the pool),
  `:worker` (its pid), `:operation` (`:call_class`, `:call_method`,
  `:call_function`, `:get_attr`, `:ping`, `:describe`, `:release` or
  `:release_session`), `:name` (the class, `"Class.method"`, function or
  attribute name; `nil` for the others) and `:session`.

  Events are sent on the node whose worker runs the call: a call forwarded to
  another node (see "Across nodes" in `VllmBridge.Runtime`) is seen there.

  ## Pool

    * `[:vllm_bridge, :pool, :saturated]` - a call came back `:busy`: its
      worker refused it without running it because every one of the Python
      worker's call threads was blocked in an earlier call (a barrier, a
      `recv`). The runtime does not retry it elsewhere (a call on a ref can
      only run where its object lives), so this is the moment the pool had no
      room for that call. Measurements: `:system_time`. Metadata: that of the
      call, with `:error`.

  ## Workers

    * `[:vllm_bridge, :worker, :started]` - a Python process answered its
      first request (the start handshake, see "Start-up" in
      `VllmBridge.Worker`). Measurements: `:system_time`, `:duration` (from
      spawning it). Metadata: `:pool`, `:index`, `:worker`, `:os_pid`,
      `:python`.
    * `[:vllm_bridge, :worker, :exited]` - a Python process is gone.
      Measurements: `:system_time`. Metadata: `:pool`, `:index`, `:worker`,
      `:os_pid`, `:exit_status` (an integer, or `nil` when the worker closed
      or killed it and did not wait for its status) and `:reason`: `:exit`
      (it exited by itself), `:start_failed` (before answering its start
      handshake), `:unresponsive` (killed by a health check), `:replaced`
      (retired by `:max_calls` or `:max_memory_mb`) or `:shutdown`.
    * `[:vllm_bridge, :worker, :restarted]` - a new Python process is being
      started at an index where one ran before (after an exit, a kill, a
      replacement, or a failed start). Measurements: `:system_time`,
      `:delay` (ms waited first, the back-off; 0 when none). Metadata:
      `:pool`, `:index`, `:worker`, `:attempt` (consecutive failed starts
      before this one).
  """

  # No compile-time dependency on :telemetry: every call to it is guarded by
  # enabled?/0.
  @compile {:no_warn_undefined, :telemetry}

  @key {__MODULE__, :enabled?}

  @doc """
  Whether events are sent: `:telemetry` is loaded and exports `execute/3`.
  Looked up once and remembered.
  """
  @spec enabled?() :: boolean()
  def enabled? do
    case :persistent_term.get(@key, nil) do
      nil -> refresh()
      enabled -> enabled
    end
  end

  @doc """
  Looks again whether `:telemetry` is loaded (for code loaded after the
  first event) and remembers the answer.
  """
  @spec refresh() :: boolean()
  def refresh do
    enabled = Code.ensure_loaded?(:telemetry) and function_exported?(:telemetry, :execute, 3)
    :persistent_term.put(@key, enabled)
    enabled
  end

  @doc """
  Sends one event through `:telemetry.execute/3` when telemetry is enabled;
  otherwise does nothing.
  """
  @spec execute([atom()], map(), map()) :: :ok
  def execute(event, measurements, metadata) do
    if enabled?(), do: :telemetry.execute(event, measurements, metadata)
    :ok
  end

  @doc false
  # Runs `fun` (a call, which returns {:ok, _} or {:error, _}) between the
  # call's start and stop (or exception) events, and sends pool saturated for
  # a :busy result. Callers check enabled?/0 first.
  @spec span_call(map(), (() -> result)) :: result when result: term()
  def span_call(metadata, fun) do
    start = call_start(metadata)

    try do
      fun.()
    catch
      kind, reason ->
        call_exception(start, metadata, kind, reason, __STACKTRACE__)
        :erlang.raise(kind, reason, __STACKTRACE__)
    else
      result -> call_stop(start, metadata, result)
    end
  end

  @doc false
  # The start event of a call; returns its monotonic start time.
  @spec call_start(map()) :: integer()
  def call_start(metadata) do
    start = System.monotonic_time()

    :telemetry.execute(
      [:vllm_bridge, :call, :start],
      %{system_time: System.system_time(), monotonic_time: start},
      metadata
    )

    start
  end

  @doc false
  # The stop event of a call (and saturated for a :busy error); returns result.
  @spec call_stop(integer(), map(), result) :: result when result: term()
  def call_stop(start, metadata, result) do
    stop = System.monotonic_time()

    {kind, error} =
      case result do
        {:error, %VllmBridge.Error{category: category} = error} -> {{:error, category}, error}
        {:error, other} -> {{:error, nil}, other}
        _ok -> {:ok, nil}
      end

    :telemetry.execute(
      [:vllm_bridge, :call, :stop],
      %{duration: stop - start, monotonic_time: stop},
      Map.merge(metadata, %{result: kind, error: error})
    )

    if kind == {:error, :busy} do
      :telemetry.execute(
        [:vllm_bridge, :pool, :saturated],
        %{system_time: System.system_time()},
        Map.put(metadata, :error, error)
      )
    end

    result
  end

  defp call_exception(start, metadata, kind, reason, stacktrace) do
    stop = System.monotonic_time()

    :telemetry.execute(
      [:vllm_bridge, :call, :exception],
      %{duration: stop - start, monotonic_time: stop},
      Map.merge(metadata, %{kind: kind, reason: reason, stacktrace: stacktrace})
    )
  end
end
