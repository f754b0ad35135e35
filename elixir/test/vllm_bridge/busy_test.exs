Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.BusyTest do
  # A worker whose threads are all blocked in calls still answers: calls are
  # refused as :busy (not run), pings and attribute reads are served, and calls
  # run again once a blocked one returns.
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers

  alias VllmBridge.{Error, Runtime}

  @moduletag timeout: 60_000

  test "with every thread blocked, a call is :busy, a ping is answered, and calls resume",
       %{test: test} do
    {pool, counter, blocked} = saturated_pool!(:"#{test}")
    rt = [__runtime__: [pool: pool]]

    assert {:ok, :still_here} = Runtime.ping(:still_here, rt)
    assert {:ok, 0} = Runtime.get_attr(counter, "value")

    assert {:error, %Error{category: :busy, message: message}} =
             Runtime.call_method(counter, "incr", [])

    assert message =~ "2 calls blocked"
    assert {:ok, 0} = Runtime.get_attr(counter, "value")

    assert Task.await_many(blocked, 10_000) == [{:ok, false}, {:ok, false}]

    assert eventually(fn -> Runtime.call_method(counter, "incr", []) == {:ok, 1} end)
  end
end
