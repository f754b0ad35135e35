Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/telemetry.exs", __DIR__)

defmodule VllmBridge.TelemetryTest do
  # Events through a test-only :telemetry module (support/telemetry.exs) from
  # real workers. Other async tests' pools send events too: the handler
  # forwards only this test's pool.
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers
  import VllmBridge.TelemetryHelpers

  alias VllmBridge.{Error, Runtime, Telemetry}

  @moduletag timeout: 60_000

  defp flush_events do
    receive do
      {:telemetry, _, _, _} -> flush_events()
    after
      0 -> :ok
    end
  end

  test "telemetry is found at run time" do
    assert Telemetry.refresh()
    assert Telemetry.enabled?()
  end

  describe "call events" do
    test "start and stop with pool, index, operation and result", %{test: test} do
      pool = start_pool!(:"#{test}", 2)
      forward_events!(pool)
      rt = [__runtime__: [pool: pool, worker: 1, session: "s1"]]

      assert {:ok, counter} = Runtime.call_class("Counter", [5], rt)

      assert_receive {:telemetry, [:vllm_bridge, :call, :start],
                      %{system_time: t, monotonic_time: _},
                      %{
                        pool: ^pool,
                        index: 1,
                        operation: :call_class,
                        name: "Counter",
                        session: "s1"
                      } = start_meta}

      assert is_integer(t)
      assert is_pid(start_meta.worker)

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], %{duration: duration},
                      %{pool: ^pool, index: 1, operation: :call_class, result: :ok, error: nil}}

      assert is_integer(duration) and duration > 0

      assert {:ok, 6} = Runtime.call_method(counter, "incr", [])

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], _,
                      %{
                        operation: :call_method,
                        name: "Counter.incr",
                        index: 1,
                        session: "s1",
                        result: :ok
                      }}

      assert {:error, %Error{category: :python}} = Runtime.call_method(counter, "fail", ["no"])

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], _,
                      %{
                        operation: :call_method,
                        name: "Counter.fail",
                        result: {:error, :python},
                        error: %Error{python_type: "ValueError"}
                      }}

      assert {:ok, 2.0} =
               Runtime.call_function("double", [1.0], __runtime__: [pool: pool, worker: 0])

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], _,
                      %{operation: :call_function, name: "double", index: 0, result: :ok}}

      assert {:ok, 6} = Runtime.get_attr(counter, "value")

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], _,
                      %{operation: :get_attr, name: "value", result: :ok}}

      assert {:ok, 1} = Runtime.release(counter)

      assert_receive {:telemetry, [:vllm_bridge, :call, :start], _,
                      %{operation: :release, name: nil, index: 1}}

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], _,
                      %{operation: :release, result: :ok}}

      assert {:error, %Error{category: :not_found}} = Runtime.call_method(counter, "incr", [])

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], _,
                      %{name: "Counter.incr", result: {:error, :not_found}}}

      # refused before anything is sent: no call, no event
      flush_events()
      assert {:error, %Error{category: :bad_args}} = Runtime.call_function("", [], rt)
      refute_receive {:telemetry, _, _, _}, 100
    end

    test "an exception inside a call is an exception event, and is raised again" do
      metadata = %{pool: :p, index: 0, operation: :ping, name: nil}
      forward_events!(:p)

      assert_raise RuntimeError, "boom", fn ->
        Telemetry.span_call(metadata, fn -> raise "boom" end)
      end

      assert_receive {:telemetry, [:vllm_bridge, :call, :start], _, %{pool: :p}}

      assert_receive {:telemetry, [:vllm_bridge, :call, :exception], %{duration: _},
                      %{
                        pool: :p,
                        kind: :error,
                        reason: %RuntimeError{message: "boom"},
                        stacktrace: [_ | _]
                      }}
    end

    test "a :busy call is pool saturated", %{test: test} do
      {pool, counter, blocked} = saturated_pool!(:"#{test}")
      forward_events!(pool)

      assert {:error, %Error{category: :busy}} = Runtime.call_method(counter, "incr", [])

      assert_receive {:telemetry, [:vllm_bridge, :call, :stop], _,
                      %{name: "Counter.incr", result: {:error, :busy}}}

      assert_receive {:telemetry, [:vllm_bridge, :pool, :saturated], %{system_time: _},
                      %{
                        pool: ^pool,
                        index: 0,
                        operation: :call_method,
                        name: "Counter.incr",
                        error: %Error{category: :busy}
                      }}

      Task.await_many(blocked, 10_000)

      refute_received {:telemetry, [:vllm_bridge, :pool, :saturated], _,
                       %{name: "Counter.wait_gate"}}
    end
  end
end
