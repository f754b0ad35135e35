Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.DistributeTest do
  # ModelOpt-style gathers across 2 workers (one rank each), from Elixir: the
  # Python context managers become one call that returns the gathered list and
  # cleans up before returning.
  use ExUnit.Case, async: false

  alias Vllm.Distributed, as: D
  alias Vllm.Distributed.{NFSWorkspace, StatelessProcessGroup}
  alias VllmBridge.{Error, Pool, Tensor}

  @pool __MODULE__.Pool
  @moduletag timeout: 120_000

  setup_all do
    start_supervised!({Pool, name: @pool, size: 2, timeout: 60_000})
    port = VllmBridge.PoolHelpers.free_tcp_port()

    groups =
      both(fn r ->
        {:ok, g} =
          StatelessProcessGroup.create(nil, "127.0.0.1", port, r, 2, [],
            store_timeout: 60,
            __runtime__: rt(r)
          )

        g
      end)

    %{groups: groups}
  end

  defp rt(rank), do: [pool: @pool, worker: rank]

  defp both(fun), do: VllmBridge.PoolHelpers.on_ranks([0, 1], fun, 60_000)

  defp t(list, type \\ {:f, 32}) do
    {:ok, tensor} = Tensor.from_list(list, type)
    tensor
  end

  defp shm_segments, do: File.ls!("/dev/shm") |> Enum.filter(&String.starts_with?(&1, "bpd"))

  test "get_tensors_parallel: the first rank of ranks gets every tensor", %{groups: groups} do
    before = shm_segments()

    results =
      both(fn r ->
        tensor = t([[r * 1.0, r + 0.5]])
        D.get_tensors_parallel(tensor, [1, 0], [Enum.at(groups, r)])
      end)

    assert [{:ok, []}, {:ok, [first, second]}] = results
    assert Tensor.to_list(first) == [[1.0, 1.5]]
    assert Tensor.to_list(second) == [[0.0, 0.5]]
    assert shm_segments() -- before == []
  end

  test "get_configs_parallel over shared memory and over a workspace directory", %{groups: groups} do
    workspace =
      Path.join(System.tmp_dir!(), "vllm_bridge_ws_#{System.unique_integer([:positive])}")

    on_exit(fn -> File.rm_rf!(workspace) end)

    config = fn r -> %{"layer" => r, "nested" => %{"dims" => [r, r + 1]}, "none" => nil} end

    for args <- [[], [workspace]] do
      results =
        both(fn r -> D.get_configs_parallel(config.(r), [0, 1], Enum.at(groups, r), args) end)

      assert [{:ok, [c0, c1]}, {:ok, []}] = results
      assert c0 == config.(0) and c1 == config.(1)
    end

    # The per-call state is gone: the workspace holds no state files.
    assert Path.wildcard(Path.join(workspace, "**/*.pth")) == []
  end

  test "NFSWorkspace: each rank writes, any rank reads", %{groups: groups} do
    workspace =
      Path.join(System.tmp_dir!(), "vllm_bridge_nfs_#{System.unique_integer([:positive])}")

    on_exit(fn -> File.rm_rf!(workspace) end)

    spaces = both(fn r -> elem(NFSWorkspace.new([workspace], rank: r, __runtime__: rt(r)), 1) end)

    assert both(fn r -> NFSWorkspace.is_initialized(Enum.at(spaces, r)) end) == [
             {:ok, true},
             {:ok, true}
           ]

    assert both(fn r ->
             NFSWorkspace.write_configs_and_weights(
               Enum.at(spaces, r),
               %{"rank" => r},
               %{"w" => t([r * 1.0, 2.0])}
             )
           end) == [{:ok, nil}, {:ok, nil}]

    assert both(fn r -> StatelessProcessGroup.barrier(Enum.at(groups, r), [10.0]) end) ==
             [{:ok, nil}, {:ok, nil}]

    assert {:ok, {%{"rank" => 1}, %{"w" => w}}} =
             NFSWorkspace.read_configs_and_weights_from_rank(Enum.at(spaces, 0), 1)

    assert Tensor.to_list(w) == [1.0, 2.0]

    # A rank that wrote nothing has no state: (None, None), as documented.
    assert NFSWorkspace.read_configs_and_weights_from_rank(Enum.at(spaces, 1), 7) ==
             {:ok, {nil, nil}}

    # Without a path the workspace is not initialised, and reading is a clear error.
    {:ok, unset} = NFSWorkspace.new([], __runtime__: rt(0))
    assert NFSWorkspace.is_initialized(unset) == {:ok, false}

    assert {:error, %Error{category: :python, python_type: "ValueError"}} =
             NFSWorkspace.read_configs_and_weights_from_rank(unset, 0)
  end
end
