Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/multi_node.exs", __DIR__)

defmodule VllmBridge.MultiNodeTest do
  # Two BEAM nodes on loopback, connected with Erlang distribution, each with
  # its own pool of 2 workers (the same pool name on both). Everything is
  # driven from this node through the generated modules: ranks 0-1 live in
  # this node's pool, ranks 2-3 in the peer's, and the ranks' data plane is
  # torch.distributed over TCP (TCPStore and gloo on 127.0.0.1).
  use ExUnit.Case, async: false

  alias Vllm.Distributed, as: D
  alias Vllm.Distributed.GroupCoordinator
  alias Vllm.Distributed.StatelessProcessGroup, as: SPG
  alias VllmBridge.{Error, MultiNode, Pool, PoolHelpers, Ref, Runtime, Tensor}

  @moduletag timeout: 240_000

  # The same name on both nodes: only the node tells them apart.
  @pool __MODULE__.Ranks
  @world 4

  setup_all do
    MultiNode.ensure_distributed!()
    {peer, peer_node} = MultiNode.start_peer!(:vllm_bridge_peer)
    on_exit(fn -> MultiNode.stop_peer(peer) end)

    start_supervised!({Pool, name: @pool, size: 2, timeout: 90_000})
    :ok = MultiNode.start_remote_pool!(peer_node, name: @pool, size: 2, timeout: 90_000)

    # every worker answers (the remote ones through node: placement)
    for rank <- 0..(@world - 1) do
      assert {:ok, :warm} = Runtime.ping(:warm, __runtime__: rt(peer_node, rank))
    end

    %{peer_node: peer_node}
  end

  # Ranks 0-1: this node's pool; ranks 2-3: the peer's pool (as {pool, node}).
  defp rt(_peer_node, rank) when rank < 2, do: [pool: @pool, worker: rank]
  defp rt(peer_node, rank), do: [pool: {@pool, peer_node}, worker: rank - 2]

  defp on_ranks(fun) do
    0..(@world - 1)
    |> Enum.map(&Task.async(fn -> fun.(&1) end))
    |> Task.await_many(120_000)
  end

  defp ok!({:ok, value}), do: value

  defp form_group(peer_node) do
    port = PoolHelpers.free_tcp_port()

    on_ranks(fn rank ->
      SPG.create(nil, "127.0.0.1", port, rank, @world, [],
        __runtime__: rt(peer_node, rank),
        store_timeout: 60
      )
    end)
    |> Enum.map(fn {:ok, %Ref{class: "StatelessProcessGroup"} = group} -> group end)
  end

  test "placement on the peer's pool, and errors that name the node", %{peer_node: peer} do
    {:ok, remote_w0} = :erpc.call(peer, Pool, :worker, [@pool, 0])
    {:ok, local_w0} = Pool.worker(@pool, 0)
    assert node(remote_w0) == peer and node(local_w0) == node()

    # node: and pool: {name, node} are the same placement; a remote pid too
    assert {:ok, {1, "x"}} = Runtime.ping({1, "x"}, __runtime__: [pool: @pool, node: peer])
    assert {:ok, :a} = Runtime.ping(:a, __runtime__: [pool: {@pool, peer}, worker: 1])
    assert {:ok, :b} = Runtime.ping(:b, __runtime__: [pool: @pool, worker: remote_w0])
    assert {:ok, %{} = table} = Runtime.describe(__runtime__: [pool: @pool, node: peer])
    assert map_size(table) > 0

    # errors from the remote node are data, and say which node
    assert {:error, %Error{category: :worker, message: message}} =
             Runtime.ping(1, __runtime__: [pool: NoSuchPool, node: peer])

    assert message =~ "NoSuchPool" and message =~ inspect(peer)

    assert {:error, %Error{category: :bad_args}} =
             Runtime.ping(1, __runtime__: [pool: {@pool, peer}, node: node()])

    assert {:error, %Error{category: :bad_args}} =
             Runtime.ping(1, __runtime__: [pool: {@pool, "peer"}])

    assert {:error, %Error{category: :worker, message: message}} =
             Runtime.ping(1, __runtime__: [pool: @pool, node: :"nobody@127.0.0.1"])

    assert message =~ "nobody@127.0.0.1" and message =~ "down or unreachable"

    # the worker's own API is for this node's workers: a channel (its port and
    # table) is only of use on its node, and the runtime above runs the call there
    frame = fn id ->
      {:ok, frame} =
        VllmBridge.Proto.encode_request(%{id: id, session: "", op: {:ping, %{payload: ""}}})

      frame
    end

    id = VllmBridge.Worker.new_id()

    assert {:error, %Error{category: :worker, details: %{node: ^peer}}} =
             VllmBridge.Worker.request(remote_w0, id, frame.(id), 5_000)

    assert {:error, %Error{category: :worker, details: %{node: ^peer}}} =
             VllmBridge.Worker.channel(remote_w0)

    assert {:ok, {:channel, ^remote_w0, _, _, _}} =
             :erpc.call(peer, VllmBridge.Worker, :channel, [remote_w0])
  end

  test "a 4-rank StatelessProcessGroup across both nodes", %{peer_node: peer} do
    groups = form_group(peer)

    # refs of ranks 2-3 came back from the peer with its worker pids
    assert Enum.map(groups, &Ref.node/1) == [node(), node(), peer, peer]
    assert Enum.map(groups, &Ref.local?/1) == [true, true, false, false]

    for {group, rank} <- Enum.with_index(groups) do
      assert SPG.rank(group) == {:ok, rank}
      assert SPG.world_size(group) == {:ok, @world}
    end

    # broadcast_obj from a local and from a remote source
    for src <- [0, 3] do
      results =
        on_ranks(fn rank ->
          obj = if rank == src, do: %{"from" => src, "t" => {:ok, [1.5, nil]}}, else: nil
          SPG.broadcast_obj(Enum.at(groups, rank), obj, src)
        end)

      assert results == List.duplicate({:ok, %{"from" => src, "t" => {:ok, [1.5, nil]}}}, @world)
    end

    # all_gather_obj: every rank's object, in rank order, on every rank
    expected = for rank <- 0..(@world - 1), do: {:rank, rank, "node#{div(rank, 2)}"}

    assert on_ranks(fn rank ->
             SPG.all_gather_obj(Enum.at(groups, rank), {:rank, rank, "node#{div(rank, 2)}"})
           end) == List.duplicate({:ok, expected}, @world)

    # barrier with and without its optional timeout
    assert on_ranks(&SPG.barrier(Enum.at(groups, &1), [])) == List.duplicate({:ok, nil}, @world)
    assert on_ranks(&SPG.barrier(Enum.at(groups, &1), [30])) == List.duplicate({:ok, nil}, @world)

    # send_obj / recv_obj across the nodes, both ways: 1 -> 2 and 3 -> 0
    [g0, g1, g2, g3] = groups
    recv2 = Task.async(fn -> SPG.recv_obj(g2, 1) end)
    recv0 = Task.async(fn -> SPG.recv_obj(g0, 3) end)
    assert {:ok, nil} = SPG.send_obj(g1, %{"to" => 2, "bytes" => <<0, 255>>}, 2)
    assert {:ok, nil} = SPG.send_obj(g3, [:to, 0], 0)
    assert Task.await(recv2, 60_000) == {:ok, %{"to" => 2, "bytes" => <<0, 255>>}}
    assert Task.await(recv0, 60_000) == {:ok, [:to, 0]}

    # a ref-valued result of a remote ref keeps the peer's worker, and
    # release/1 splits the refs by node
    assert {:ok, %Ref{} = store} = SPG.store(g2)
    assert store.worker == g2.worker
    assert {:ok, 5} = Runtime.release([store | groups])
    assert {:error, %Error{category: :not_found}} = SPG.rank(g3)
  end

  test "a 4-rank GroupCoordinator across both nodes: all_reduce", %{peer_node: peer} do
    port = PoolHelpers.free_tcp_port()

    assert on_ranks(fn rank ->
             D.init_distributed_environment([],
               world_size: @world,
               rank: rank,
               distributed_init_method: "tcp://127.0.0.1:#{port}",
               local_rank: rem(rank, 2),
               backend: "gloo",
               __runtime__: rt(peer, rank)
             )
           end) == List.duplicate({:ok, nil}, @world)

    try do
      worlds = on_ranks(&ok!(D.get_world_group(__runtime__: rt(peer, &1))))
      assert Enum.map(worlds, &Ref.node/1) == [node(), node(), peer, peer]

      for {world, rank} <- Enum.with_index(worlds) do
        assert GroupCoordinator.rank_in_group(world) == {:ok, rank}
        assert GroupCoordinator.world_size(world) == {:ok, @world}
      end

      # rank r contributes [[r, r + 1, r + 2], [10 r, 10 r + 1, 10 r + 2]]
      input = fn rank ->
        ok!(
          Tensor.from_list(
            [for(j <- 0..2, do: rank + j), for(j <- 0..2, do: 10 * rank + j)],
            {:f, 32}
          )
        )
      end

      ranks = Enum.to_list(0..(@world - 1))

      expected = [
        for(j <- 0..2, do: Enum.sum(for r <- ranks, do: r + j) * 1.0),
        for(j <- 0..2, do: Enum.sum(for r <- ranks, do: 10 * r + j) * 1.0)
      ]

      results = on_ranks(&GroupCoordinator.all_reduce(Enum.at(worlds, &1), input.(&1)))

      for {:ok, %Tensor{} = sum} <- results do
        assert sum.type == {:f, 32} and sum.shape == {2, 3}
        assert Tensor.to_list(sum) == expected
      end

      assert length(results) == @world

      # integers too
      ints =
        on_ranks(fn rank ->
          GroupCoordinator.all_reduce(
            Enum.at(worlds, rank),
            ok!(Tensor.from_list([rank, 1], {:s, 64}))
          )
        end)

      assert Enum.map(ints, fn {:ok, t} -> Tensor.to_list(t) end) ==
               List.duplicate([Enum.sum(ranks), @world], @world)
    after
      assert on_ranks(&D.destroy_distributed_environment(__runtime__: rt(peer, &1))) ==
               List.duplicate({:ok, nil}, @world)
    end
  end

  test "a call on a ref of a node that stopped returns an error, neither crash nor hang" do
    {peer, peer_node} = MultiNode.start_peer!(:vllm_bridge_doomed)

    try do
      :ok =
        MultiNode.start_remote_pool!(peer_node,
          name: __MODULE__.Doomed,
          size: 1,
          args: PoolHelpers.sample_args(),
          timeout: 60_000
        )

      placement = [__runtime__: [pool: {__MODULE__.Doomed, peer_node}]]

      assert {:ok, %Ref{class: "Counter"} = counter} =
               Runtime.call_class("Counter", [5], placement)

      assert Ref.node(counter) == peer_node
      assert {:ok, 6} = Runtime.call_method(counter, "incr", [])
      assert {:ok, 6} = Runtime.get_attr(counter, "value")

      # the remote node's own timeout, reported with its name
      assert {:error, %Error{category: :timeout, message: message}} =
               Runtime.call_method(counter, "wait_gate", [10.0], __runtime__: [timeout: 200])

      assert message =~ inspect(peer_node)
      # a ref among the arguments places the function next to it, on the peer
      assert {:ok, nil} = Runtime.call_function("open_gate", [counter])

      # the stale-ref check runs where the worker lives
      Process.exit(counter.worker, :kill)

      PoolHelpers.eventually(fn ->
        not :erpc.call(peer_node, Process, :alive?, [counter.worker])
      end)

      assert {:error, %Error{category: :stale_ref, message: message}} =
               Runtime.call_method(counter, "incr", [])

      assert message =~ inspect(peer_node)

      :ok = MultiNode.stop_peer(peer)
      refute peer_node in Node.list()

      {us, result} = :timer.tc(fn -> Runtime.call_method(counter, "incr", []) end)
      assert {:error, %Error{category: :worker, message: message, details: details}} = result
      assert message =~ inspect(peer_node) and message =~ "down or unreachable"
      assert details.node == peer_node
      assert us < 10_000_000

      assert {:error, %Error{category: :worker}} = Runtime.get_attr(counter, "value")
      assert {:error, %Error{category: :worker}} = Runtime.ping(1, placement)
      # nothing can reach those objects any more: they count as released
      assert {:ok, 0} = Runtime.release(counter)
    after
      MultiNode.stop_peer(peer)
    end
  end
end
