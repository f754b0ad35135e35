Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.PyNcclCommunicatorTest do
  # Weight sync driven from Elixir, as an RL trainer does it: two pool workers join one
  # StatelessProcessGroup, each makes a PyNcclCommunicator on "cpu" (no GPU needed), and
  # rank 0 broadcasts weights that rank 1 receives.
  use ExUnit.Case, async: false

  alias Vllm.Distributed.PyNcclCommunicator, as: Comm
  alias Vllm.Distributed.StatelessProcessGroup, as: SPG
  alias VllmBridge.{Error, Pool, Ref, Tensor}

  @pool __MODULE__.Pool
  @moduletag timeout: 180_000

  setup_all do
    start_supervised!({Pool, name: @pool, size: 2, timeout: 90_000})
    port = VllmBridge.PoolHelpers.free_tcp_port()
    # create/7 and new/4 are collectives: every rank calls them at the same time.
    groups = both(fn r -> ok!(SPG.create(nil, "127.0.0.1", port, r, 2, [], rt(r))) end)
    comms = both(fn r -> ok!(Comm.new(Enum.at(groups, r), "cpu", [])) end)
    %{groups: groups, comms: comms}
  end

  defp rt(rank), do: [__runtime__: [pool: @pool, worker: rank]]

  defp both(fun), do: VllmBridge.PoolHelpers.on_ranks([0, 1], fun, 90_000)

  defp ok!({:ok, value}), do: value

  defp t(list, type), do: ok!(Tensor.from_list(list, type))

  test "each rank's communicator is enabled, on the cpu, in its own worker", %{comms: comms} do
    for {comm, rank} <- Enum.with_index(comms) do
      assert %Ref{class: "PyNcclCommunicator"} = comm
      assert Comm.rank(comm) == {:ok, rank}
      assert Comm.world_size(comm) == {:ok, 2}
      assert Comm.available(comm) == {:ok, true}
      assert Comm.disabled(comm) == {:ok, false}
      assert Comm.device(comm) == {:ok, "cpu"}
      assert {:ok, %Ref{class: "StatelessProcessGroup"}} = Comm.group(comm)
    end
  end

  test "rank 0 broadcasts a state dict and rank 1 receives every tensor", %{
    groups: groups,
    comms: comms
  } do
    weights = %{
      "embed" => {[[1.5, -2.0], [3.25, 4.0]], {:f, 32}},
      "qkv" => {[0.5, -8.0, 2.0], {:bf, 16}},
      "ids" => {[7, -3], {:s, 64}}
    }

    for {name, {values, type}} <- weights do
      zeros = Enum.map(values, fn v -> if is_list(v), do: Enum.map(v, &(&1 * 0)), else: v * 0 end)

      [{:ok, sent}, {:ok, got}] =
        both(fn r ->
          Comm.broadcast(Enum.at(comms, r), t(if(r == 0, do: values, else: zeros), type), 0, [])
        end)

      assert Tensor.to_list(sent) == values, name
      assert got.type == type and Tensor.to_list(got) == values, name
    end

    # The trainer's pattern ends with a barrier on the group.
    assert both(fn r -> SPG.barrier(Enum.at(groups, r), [30]) end) == [{:ok, nil}, {:ok, nil}]
  end

  test "all_reduce sums, and a mismatch is an error on both ranks naming them", %{comms: comms} do
    sums = both(fn r -> Comm.all_reduce(Enum.at(comms, r), t([r + 1.0, 10.0], {:f, 32}), []) end)
    assert Enum.map(sums, fn {:ok, s} -> Tensor.to_list(s) end) == [[3.0, 20.0], [3.0, 20.0]]

    errors =
      both(fn r ->
        Comm.broadcast(Enum.at(comms, r), t(List.duplicate(1.0, 3 + r), {:f, 32}), 0, [])
      end)

    for {:error, %Error{message: message}} <- errors do
      assert message =~ "rank 0" and message =~ "rank 1" and message =~ "(4,)"
    end

    assert length(for {:error, _} <- errors, do: :error) == 2
  end

  test "reduce sums into the root's tensor; a suspended communicator refuses it", %{
    comms: comms
  } do
    reduce = fn r ->
      Comm.reduce(Enum.at(comms, r), t([0.0, 0.0], {:f, 32}), t([r + 1.0, 5.0], {:f, 32}), 1, [])
    end

    assert Enum.map(both(reduce), fn {:ok, out} -> Tensor.to_list(out) end) ==
             [[0.0, 0.0], [3.0, 10.0]]

    assert both(fn r -> Comm.suspend(Enum.at(comms, r), []) end) == [{:ok, nil}, {:ok, nil}]

    assert [{:error, %Error{message: m0}}, {:error, %Error{message: m1}}] = both(reduce)
    assert m0 =~ "rank 0" and m1 =~ "rank 1" and m0 =~ "suspended" and m1 =~ "resume()"

    assert both(fn r -> Comm.resume(Enum.at(comms, r), []) end) == [{:ok, nil}, {:ok, nil}]
    assert [{:ok, _}, {:ok, out}] = both(reduce)
    assert Tensor.to_list(out) == [3.0, 10.0]
  end
end
