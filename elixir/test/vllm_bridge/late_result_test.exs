Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.LateResultTest do
  # Issue 40: a call that returned an object after its caller had given up
  # left the object held in the worker, under a handle nobody had. Now a
  # result that comes after the call's deadline is dropped, not kept: the
  # worker answers with a :timeout error saying so.
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers

  alias VllmBridge.{Error, Runtime}

  @moduletag timeout: 60_000

  test "objects returned after the caller's timeout are not kept", %{test: test} do
    pool = start_pool!(:"#{test}", 1)
    rt = [__runtime__: [pool: pool, worker: 0, timeout: 30_000]]
    {:ok, before} = Runtime.call_function("live_counters", [], rt)
    late = [__runtime__: [pool: pool, worker: 0, timeout: 300]]

    results =
      for _ <- 1..5 do
        Task.async(fn -> Runtime.call_function("counter_after", [0.6], late) end)
      end
      |> Task.await_many(5_000)

    assert Enum.all?(results, &match?({:error, %Error{category: :timeout}}, &1))

    # once the calls have returned in Python (0.6 s), their Counters are gone
    assert eventually(fn -> Runtime.call_function("live_counters", [], rt) == {:ok, before} end)

    # a call that returns in time still gets its object
    assert {:ok, %VllmBridge.Ref{class: "Counter"}} =
             Runtime.call_function("counter_after", [0.0], rt)
  end
end
