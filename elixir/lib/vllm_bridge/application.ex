defmodule VllmBridge.Application do
  @moduledoc """
  The OTP application. It starts a supervisor, and under it a default
  `VllmBridge.Pool` only when configured:

      # config/runtime.exs
      config :vllm_bridge, default_pool: [size: 2]

  The value is the keyword list of `VllmBridge.Pool.start_link/1` (its name
  defaults to `VllmBridge.DefaultPool`, which `VllmBridge.Runtime` uses when
  a call names no pool). Without that setting nothing is started, and
  applications put pools in their own supervision trees.
  """

  use Application

  @impl true
  def start(_type, _args) do
    VllmBridge.Worker.LookGate.install()

    children =
      case Application.get_env(:vllm_bridge, :default_pool) do
        opts when is_list(opts) ->
          if Keyword.keyword?(opts), do: [{VllmBridge.Pool, opts}], else: []

        _ ->
          []
      end

    Supervisor.start_link(children, strategy: :one_for_one, name: VllmBridge.Supervisor)
  end
end
