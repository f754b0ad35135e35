Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.DeadlineTest do
  # Issue 19: a :timeout cancels, it does not only abandon. The caller's
  # timeout travels with the request (deadline_ms), and the worker's waits
  # keep to it: a recv_obj the caller gave up on gives up too, takes nothing,
  # and no longer holds its group; a request whose deadline passed before its
  # turn came is not run. Real workers, a real 2-rank group.
  use ExUnit.Case, async: false

  alias Vllm.Distributed.StatelessProcessGroup, as: SPG
  alias VllmBridge.{Error, Pool, Ref}

  @pool __MODULE__.Pool

  setup_all do
    start_supervised!({Pool, name: @pool, size: 2, timeout: 60_000})
    port = VllmBridge.PoolHelpers.free_tcp_port()

    groups =
      0..1
      |> Enum.map(fn rank ->
        Task.async(fn ->
          SPG.create(nil, "127.0.0.1", port, rank, 2, [],
            __runtime__: [pool: @pool, worker: rank],
            store_timeout: 60
          )
        end)
      end)
      |> Task.await_many(90_000)
      |> Enum.map(fn {:ok, %Ref{} = group} -> group end)

    %{groups: groups}
  end

  defp ms_since(start), do: System.monotonic_time(:millisecond) - start

  test "a recv_obj that times out gives up in Python and takes nothing", %{groups: [g0, g1]} do
    start = System.monotonic_time(:millisecond)
    # No Python timeout: without the deadline it would wait the store's 60 s.
    assert {:error, %Error{category: :timeout}} = SPG.recv_obj(g0, 1, __runtime__: [timeout: 500])
    assert ms_since(start) in 400..2_000

    # The abandoned call has given up: the next recv_obj on the group is not
    # queued behind it, and gets the first message sent afterwards.
    start = System.monotonic_time(:millisecond)
    later = Task.async(fn -> SPG.recv_obj(g0, 1, __runtime__: [timeout: 10_000]) end)
    Process.sleep(100)
    assert {:ok, nil} = SPG.send_obj(g1, :first, 0)
    assert {:ok, nil} = SPG.send_obj(g1, :second, 0)
    assert Task.await(later, 15_000) == {:ok, :first}
    assert ms_since(start) < 5_000
    assert SPG.recv_obj(g0, 1, __runtime__: [timeout: 5_000]) == {:ok, :second}
  end

  test "a call whose deadline passed before its turn came is not run", %{groups: [g0, g1]} do
    {:ok, sent_before} = SPG.send_dst_counter(g0)
    # g0's object is busy in a recv_obj; a send_obj on it waits for its turn.
    busy = Task.async(fn -> SPG.recv_obj(g0, 1, __runtime__: [timeout: 10_000]) end)
    # its request is on the port before the send_obj's (frames are taken in order)
    {:ok, worker} = Pool.worker(@pool, 0)

    VllmBridge.PoolHelpers.eventually(fn ->
      match?({:ok, %{pending: 1}}, VllmBridge.Worker.info(worker))
    end)

    assert {:error, %Error{category: :timeout}} =
             SPG.send_obj(g0, :too_late, 1, __runtime__: [timeout: 300])

    # Its turn comes once the recv_obj returns: by then its deadline has passed.
    assert {:ok, nil} = SPG.send_obj(g1, :unblock, 0)
    assert Task.await(busy, 15_000) == {:ok, :unblock}
    assert {:ok, ^sent_before} = SPG.send_dst_counter(g0)

    # Nothing was sent to rank 1: its own 0.5 s timeout (a Python one) runs out.
    assert {:error, %Error{category: :python, python_type: "GroupTimeout"}} =
             SPG.recv_obj(g1, 0, timeout: 0.5)
  end

  test "a create whose caller gave up serves nothing after: a later rank cannot join it" do
    port = VllmBridge.PoolHelpers.free_tcp_port()
    start = System.monotonic_time(:millisecond)

    # Rank 0 alone: its create ends at the caller's deadline, with the worker's
    # own error (how far the join got), not the runtime's "no reply".
    assert {:error, %Error{category: :python, python_type: "StoreError", message: message}} =
             SPG.create(nil, "127.0.0.1", port, 0, 2, [],
               __runtime__: [pool: @pool, worker: 0, timeout: 3_000],
               store_timeout: 60
             )

    assert ms_since(start) in 2_500..3_100
    assert message =~ "1 of 2 ranks joined 127.0.0.1:#{port}"

    # Rank 1 comes later: nobody serves that group any more.
    assert {:error, %Error{python_type: "StoreError", message: message}} =
             SPG.create(nil, "127.0.0.1", port, 1, 2, [],
               __runtime__: [pool: @pool, worker: 1, timeout: 2_000],
               store_timeout: 60
             )

    assert message =~ "could not reach the store at 127.0.0.1:#{port}"

    # Both ranks again, on the same port (free again): a group.
    groups =
      0..1
      |> Enum.map(fn rank ->
        Task.async(fn ->
          SPG.create(nil, "127.0.0.1", port, rank, 2, [],
            __runtime__: [pool: @pool, worker: rank, timeout: 30_000],
            store_timeout: 60
          )
        end)
      end)
      |> Task.await_many(40_000)

    assert [{:ok, %Ref{}}, {:ok, %Ref{}}] = groups
  end
end
