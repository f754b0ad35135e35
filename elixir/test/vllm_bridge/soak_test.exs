Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fault_helpers.exs", __DIR__)

defmodule VllmBridge.SoakTest do
  # 50,000 calls from 8 concurrent callers over 2 workers: no lost or crossed
  # reply, bounded Python memory, and no handle left behind. The 1,000,000-call
  # version is bench/elixir/soak.exs.
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers

  alias VllmBridge.{Runtime, Soak}

  @calls 50_000
  @callers 8

  setup do
    unless VllmBridge.TestPython.worker_available?() do
      raise "the Python worker (bridge_py.worker) is not available"
    end

    :ok
  end

  @tag timeout: 120_000
  test "50,000 calls from 8 callers over 2 workers: every answer its own, flat memory, no handle left",
       %{test: test} do
    pool = start_pool!(:"#{test}", 2)
    session = "soak"
    os_pids = Soak.os_pids(pool)

    # the release count sees a handle that is left behind
    {:ok, _} = Runtime.call_class("Counter", [], __runtime__: [pool: pool, session: "probe"])
    assert {:ok, 1} = Runtime.release_session("probe", __runtime__: [pool: pool])

    # warm-up, then the measured run
    assert Soak.run(pool, 4_000, @callers, session) >= 4_000
    rss_before = Soak.rss_kib(pool)
    started = System.monotonic_time(:millisecond)
    calls = Soak.run(pool, @calls, @callers, session)
    ms = System.monotonic_time(:millisecond) - started
    rss_after = Soak.rss_kib(pool)

    assert calls >= @calls
    # no worker died on the way (same Python processes)
    assert Soak.os_pids(pool) == os_pids

    assert rss_after < rss_before * 1.10,
           "Python RSS grew from #{rss_before} to #{rss_after} KiB over #{calls} calls"

    # every object was released explicitly: nothing is left in the session
    assert {:ok, 0} = Runtime.release_session(session, __runtime__: [pool: pool])
    assert {:ok, 0} = Runtime.release_session("", __runtime__: [pool: pool])

    IO.puts(
      "\nsoak: #{calls} calls in #{ms} ms (#{div(calls * 1000, max(ms, 1))} calls/s), " <>
        "Python RSS #{rss_before} -> #{rss_after} KiB"
    )
  end
end
