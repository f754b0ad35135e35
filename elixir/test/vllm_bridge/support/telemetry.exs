defmodule :telemetry do
  @moduledoc false
  # A stand-in for the :telemetry package, which :vllm_bridge does not depend
  # on (and hex.pm is out of reach): the same attach/execute API, enough for
  # VllmBridge.Telemetry to find it and for tests to receive its events.
  # Handlers live in :persistent_term; a handler that raises is detached, as
  # :telemetry does.

  @key {__MODULE__, :handlers}

  def attach(id, event, fun, config), do: attach_many(id, [event], fun, config)

  def attach_many(id, events, fun, config) when is_function(fun, 4) do
    :global.trans({__MODULE__, self()}, fn ->
      handlers = handlers()

      if List.keymember?(handlers, id, 0) do
        {:error, :already_exists}
      else
        :persistent_term.put(@key, [{id, events, fun, config} | handlers])
        :ok
      end
    end)
  end

  def detach(id) do
    :global.trans({__MODULE__, self()}, fn ->
      handlers = handlers()

      if List.keymember?(handlers, id, 0) do
        :persistent_term.put(@key, List.keydelete(handlers, id, 0))
        :ok
      else
        {:error, :not_found}
      end
    end)
  end

  # As :telemetry's: the handlers of events that start with `prefix`.
  def list_handlers(prefix) do
    for {id, events, fun, config} <- handlers(),
        event <- events,
        List.starts_with?(event, prefix),
        do: %{id: id, event_name: event, function: fun, config: config}
  end

  def execute(event, measurements, metadata) when is_map(measurements) and is_map(metadata) do
    for {id, events, fun, config} <- handlers(), event in events do
      try do
        fun.(event, measurements, metadata, config)
      catch
        _kind, _reason -> detach(id)
      end
    end

    :ok
  end

  defp handlers, do: :persistent_term.get(@key, [])
end

defmodule VllmBridge.TelemetryHelpers do
  @moduledoc false
  # Attaches a handler (detached at the test's exit) that forwards every
  # vllm_bridge event of `pool` to the test process as
  # {:telemetry, event, measurements, metadata}.

  import ExUnit.Callbacks, only: [on_exit: 1]

  @events [
    [:vllm_bridge, :call, :start],
    [:vllm_bridge, :call, :stop],
    [:vllm_bridge, :call, :exception],
    [:vllm_bridge, :pool, :saturated],
    [:vllm_bridge, :worker, :started],
    [:vllm_bridge, :worker, :exited],
    [:vllm_bridge, :worker, :restarted]
  ]

  def events, do: @events

  def forward_events!(pool) do
    true = VllmBridge.Telemetry.refresh()
    test = self()
    id = {__MODULE__, pool, make_ref()}

    :ok =
      :telemetry.attach_many(
        id,
        @events,
        fn event, measurements, metadata, _config ->
          if metadata[:pool] == pool, do: send(test, {:telemetry, event, measurements, metadata})
        end,
        nil
      )

    on_exit(fn -> :telemetry.detach(id) end)
    :ok
  end
end
