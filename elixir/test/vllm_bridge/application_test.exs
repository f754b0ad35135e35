Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.ApplicationTest do
  # Restarts the :vllm_bridge application, so not async.
  use ExUnit.Case, async: false

  alias VllmBridge.{Error, Pool, Runtime}

  @moduletag timeout: 60_000

  @tag :capture_log
  test "no default pool unless configured; a configured one is started and used" do
    assert Process.whereis(VllmBridge.Supervisor)
    assert Process.whereis(VllmBridge.DefaultPool) == nil

    assert {:error, %Error{category: :worker, message: message}} = Runtime.ping(1)
    assert message =~ "VllmBridge.DefaultPool"

    previous = Application.fetch_env(:vllm_bridge, :default_pool)

    on_exit(fn ->
      case previous do
        {:ok, value} -> Application.put_env(:vllm_bridge, :default_pool, value)
        :error -> Application.delete_env(:vllm_bridge, :default_pool)
      end

      Application.stop(:vllm_bridge)
      Application.ensure_all_started(:vllm_bridge)
    end)

    Application.put_env(:vllm_bridge, :default_pool,
      size: 1,
      args: VllmBridge.PoolHelpers.sample_args()
    )

    :ok = Application.stop(:vllm_bridge)
    {:ok, _} = Application.ensure_all_started(:vllm_bridge)

    assert {:ok, 1} = Pool.size(VllmBridge.DefaultPool)
    assert {:ok, {:hi, [1]}} = Runtime.ping({:hi, [1]})
  end
end
