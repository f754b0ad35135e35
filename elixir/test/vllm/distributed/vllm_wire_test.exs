Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.VllmWireTest do
  # Issue 35: a worker joins a group whose other ranks run vLLM's own
  # StatelessProcessGroup (from vLLM 0.34.0's released wheel, in processes of
  # their own, `tests/distributed/vllm_rank.py`), and pushes weights into them
  # as an RL trainer does: the state dict's metadata, each tensor, a barrier.
  use ExUnit.Case, async: false

  alias Vllm.Distributed.StatelessProcessGroup, as: SPG
  alias VllmBridge.{Pool, Ref, Tensor, TestPython}

  @pool __MODULE__.Pool
  @moduletag timeout: 180_000

  setup_all do
    start_supervised!({Pool, name: @pool, size: 1, timeout: 60_000})
    :ok
  end

  # One vLLM rank, bounded by `timeout` (coreutils) so that nothing outlives the test.
  defp vllm_rank(port, rank) do
    Task.async(fn ->
      args = ["90", TestPython.python!(), "-m", "tests.distributed.vllm_rank"]
      args = args ++ ["0.34.0", "#{port}", "#{rank}", "3", "2"]

      System.cmd("timeout", args,
        cd: TestPython.root(),
        env: [{"PYTHONPATH", TestPython.root()}],
        stderr_to_stdout: true
      )
    end)
  end

  test "a worker whose operator requires auth keys refuses the vLLM wire from its callers" do
    env = [{"VLLM_BRIDGE_REQUIRE_AUTH_KEY", "1"}]
    start_supervised!({Pool, name: __MODULE__.Strict, size: 1, env: env}, id: :strict)
    port = VllmBridge.PoolHelpers.free_tcp_port()
    runtime = [__runtime__: [pool: __MODULE__.Strict]]

    assert {:error, %VllmBridge.Error{python_type: "AuthenticationError", message: message}} =
             SPG.create(nil, "127.0.0.1", port, 0, 1, [], [wire: "vllm"] ++ runtime)

    assert message =~ "VLLM_BRIDGE_ALLOW_VLLM_WIRE=1"

    # The worker goes on serving: the same call with a key on the default wire works.
    assert {:ok, %Ref{}} =
             SPG.create(nil, "127.0.0.1", port, 0, 1, [], [auth_key: "k"] ++ runtime)
  end

  test "a worker joins vLLM's ranks on vLLM's wire and pushes a state dict into them" do
    port = VllmBridge.PoolHelpers.free_tcp_port()
    ranks = Enum.map([0, 1], &vllm_rank(port, &1))

    assert {:ok, %Ref{} = group} =
             SPG.create(nil, "127.0.0.1", port, 2, 3, [],
               __runtime__: [pool: @pool, timeout: 90_000],
               wire: "vllm",
               store_timeout: 60
             )

    assert {:ok, "vllm"} = SPG.wire(group)
    # From vLLM's rank 0 to us, through the allow-list.
    assert {:ok, %{"expects" => ["w", "b"]}} = SPG.broadcast_obj(group, nil, 0)

    {:ok, w} = Tensor.from_list([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], {:f, 32})
    {:ok, b} = Tensor.from_list([7, 8], {:s, 64})
    metadata = %{"w" => ["float32", [2, 3]], "b" => ["int64", [2]]}
    assert {:ok, _} = SPG.broadcast_obj(group, metadata, 2)
    assert {:ok, _} = SPG.broadcast(group, b, 2)
    assert {:ok, _} = SPG.broadcast(group, w, 2)
    assert {:ok, nil} = SPG.barrier(group, [30])

    for {output, status} <- Task.await_many(ranks, 120_000) do
      assert status == 0, output
      line = output |> String.split("\n", trim: true) |> List.last()
      assert line == ~s({"b": [7, 8], "w": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
    end
  end
end
