Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.SilentStoreTest do
  # Issue 36: a store whose host accepts connections and never answers (a
  # frozen host, a half-open network) once left a worker with 255 `create`s
  # blocked for good in torch's store handshake, 260 threads, answering health
  # checks while serving nothing. Now each such call ends: its caller gets an
  # error at its timeout, and the worker's thread gives up at the call's
  # deadline (plus the store watchdog's grace), so the worker is back to its
  # few threads and serves a real group afterwards.
  use ExUnit.Case, async: false

  import VllmBridge.PoolHelpers

  alias Vllm.Distributed.StatelessProcessGroup, as: SPG
  alias VllmBridge.{Error, Pool, Ref}

  @moduletag timeout: 120_000
  @pool __MODULE__.Pool
  @calls 200
  @timeout 3_000
  # the store watchdog's grace (bridge_py.distributed.store.watchdog.GRACE), ms
  @grace 2_000

  defp threads(os_pid) do
    "/proc/#{os_pid}/status"
    |> File.read!()
    |> then(&Regex.run(~r/^Threads:\s+(\d+)$/m, &1, capture: :all_but_first))
    |> then(fn [count] -> String.to_integer(count) end)
  end

  test "creates on a store that never answers end, and free the worker's threads" do
    start_supervised!({Pool, name: @pool, size: 1, timeout: 60_000})
    {:ok, worker} = Pool.worker(@pool, 0)
    {:ok, os_pid} = VllmBridge.Worker.os_pid(worker)
    before = threads(os_pid)

    # accepts (the kernel completes connections into the backlog), never answers
    {:ok, silent} =
      :gen_tcp.listen(0, [:binary, active: false, ip: {127, 0, 0, 1}, backlog: 1024])

    {:ok, port} = :inet.port(silent)
    started = System.monotonic_time(:millisecond)

    results =
      1..@calls
      |> Enum.map(fn _ ->
        Task.async(fn ->
          SPG.create(nil, "127.0.0.1", port, 1, 2, [],
            __runtime__: [pool: @pool, timeout: @timeout],
            store_timeout: 60
          )
        end)
      end)
      |> Task.await_many(@timeout + 10_000)

    # every caller has its error by its own timeout (and a loaded machine's bound)
    assert System.monotonic_time(:millisecond) - started < @timeout + 3_000
    assert Enum.all?(results, &match?({:error, %Error{}}, &1)), inspect(Enum.uniq(results))

    # and the worker's threads give up too: back to what it had before
    assert eventually(
             fn -> threads(os_pid) <= before + 2 end,
             @timeout + @grace + 10_000
           ),
           "the worker still has #{threads(os_pid)} threads (#{before} before)"

    :gen_tcp.close(silent)

    # it serves: a real 2-rank group in the same worker
    real = free_tcp_port()

    groups =
      0..1
      |> Enum.map(fn rank ->
        Task.async(fn ->
          SPG.create(nil, "127.0.0.1", real, rank, 2, [],
            __runtime__: [pool: @pool],
            store_timeout: 30
          )
        end)
      end)
      |> Task.await_many(60_000)

    assert [{:ok, %Ref{} = g0}, {:ok, %Ref{} = g1}] = groups
    gathered = Task.async(fn -> SPG.all_gather_obj(g1, :one) end)
    assert {:ok, [:zero, :one]} = SPG.all_gather_obj(g0, :zero)
    assert {:ok, [:zero, :one]} = Task.await(gathered, 30_000)
  end
end
