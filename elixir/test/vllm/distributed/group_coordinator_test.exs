Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.GroupCoordinatorTest do
  # A 2-rank GroupCoordinator driven from Elixir: each worker process is one rank
  # (init_distributed_environment runs through the bridge in each), every
  # documented function is called at its documented arity, and the results are
  # checked against values computed here in Elixir.
  use ExUnit.Case, async: false

  alias Vllm.Distributed, as: D
  alias Vllm.Distributed.{DeviceCommunicatorBase, GroupCoordinator}
  alias VllmBridge.{Error, Pool, Ref, Tensor}

  @pool __MODULE__.Pool
  @moduletag timeout: 180_000

  setup_all do
    start_supervised!({Pool, name: @pool, size: 2, timeout: 90_000})
    port = VllmBridge.PoolHelpers.free_tcp_port()

    both(fn r ->
      {:ok, nil} =
        D.init_distributed_environment([],
          world_size: 2,
          rank: r,
          distributed_init_method: "tcp://127.0.0.1:#{port}",
          local_rank: r,
          backend: "gloo",
          __runtime__: rt(r)
        )

      {:ok, nil} = D.initialize_model_parallel([2], __runtime__: rt(r))
    end)

    groups = both(fn r -> ok!(D.get_tp_group(__runtime__: rt(r))) end)
    %{tp: groups}
  end

  defp rt(rank), do: [pool: @pool, worker: rank]

  defp both(fun), do: VllmBridge.PoolHelpers.on_ranks([0, 1], fun, 90_000)

  defp ok!({:ok, value}), do: value

  defp t(list, type \\ {:f, 32}), do: ok!(Tensor.from_list(list, type))

  # Rank r's input: [[r*10 + 0, r*10 + 1, ...], ...] of the given shape.
  defp input(r, rows, cols, type \\ {:f, 32}) do
    for(i <- 0..(rows - 1), do: for(j <- 0..(cols - 1), do: r * 10 + i * cols + j))
    |> then(fn list -> if type in [{:f, 32}, {:f, 64}], do: floats(list), else: list end)
    |> t(type)
  end

  defp floats(list), do: Enum.map(list, fn row -> Enum.map(row, &(&1 * 1.0)) end)

  defp rows(tensor), do: Tensor.to_list(tensor)

  test "rank properties and fields", %{tp: [g0, g1]} do
    for {g, r} <- [{g0, 0}, {g1, 1}] do
      assert GroupCoordinator.rank_in_group(g) == {:ok, r}
      assert GroupCoordinator.world_size(g) == {:ok, 2}
      assert GroupCoordinator.ranks(g) == {:ok, [0, 1]}
      assert GroupCoordinator.first_rank(g) == {:ok, 0}
      assert GroupCoordinator.last_rank(g) == {:ok, 1}
      assert GroupCoordinator.next_rank(g) == {:ok, 1 - r}
      assert GroupCoordinator.prev_rank(g) == {:ok, 1 - r}
      assert GroupCoordinator.is_first_rank(g) == {:ok, r == 0}
      assert GroupCoordinator.is_last_rank(g) == {:ok, r == 1}
      assert {:ok, "cpu"} = GroupCoordinator.device(g)
      assert {:ok, name} = GroupCoordinator.unique_name(g)
      assert name =~ "tp"
    end
  end

  test "all_reduce and the out-of-place forms", %{tp: groups} do
    expected = for i <- 0..1, do: for(j <- 0..2, do: 0 + 10 + 2.0 * (i * 3 + j))

    results =
      both(fn r ->
        g = Enum.at(groups, r)
        x = input(r, 2, 3)

        {ok!(GroupCoordinator.all_reduce(g, x)),
         ok!(GroupCoordinator._all_reduce_out_place(g, x, []))}
      end)

    for {a, b} <- results do
      assert rows(a) == expected
      assert rows(b) == expected
    end
  end

  test "a 1 MiB all_reduce, twice with the same value: the sum each time", %{tp: groups} do
    # Large enough that the worker reads the tensor where its frame landed and sums into
    # it (as vLLM's CPU all_reduce does): the next call must not see that sum.
    n = 262_144
    value = fn r, i -> (rem(i, 97) + r) * 1.0 end
    bytes = fn f -> for i <- 0..(n - 1), into: <<>>, do: <<f.(i)::float-32-little>> end
    expected = bytes.(fn i -> value.(0, i) + value.(1, i) end)

    results =
      both(fn r ->
        {:ok, x} = Tensor.new({:f, 32}, {n}, bytes.(&value.(r, &1)))
        g = Enum.at(groups, r)
        [ok!(GroupCoordinator.all_reduce(g, x)), ok!(GroupCoordinator.all_reduce(g, x))]
      end)

    for sums <- results, sum <- sums do
      assert sum.shape == {n} and sum.data == expected
    end
  end

  test "all_gather on dims 0 and -1, and all_gatherv with uneven sizes", %{tp: groups} do
    results =
      both(fn r ->
        g = Enum.at(groups, r)
        x = input(r, 2, 2)

        {ok!(GroupCoordinator.all_gather(g, x, [0])), ok!(GroupCoordinator.all_gather(g, x, [])),
         ok!(GroupCoordinator._all_gather_out_place(g, x, 0)),
         ok!(GroupCoordinator.all_gatherv(g, input(r, r + 1, 2), [0], sizes: [1, 2]))}
      end)

    for {dim0, last, out_place, v} <- results do
      assert rows(dim0) == [[0.0, 1.0], [2.0, 3.0], [10.0, 11.0], [12.0, 13.0]]
      assert rows(last) == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]
      assert rows(out_place) == rows(dim0)
      assert rows(v) == [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]]
    end
  end

  test "reduce_scatter, reduce_scatterv and the out-of-place form", %{tp: groups} do
    results =
      both(fn r ->
        g = Enum.at(groups, r)
        x = input(r, 4, 2)

        {ok!(GroupCoordinator.reduce_scatter(g, x, [0])),
         ok!(GroupCoordinator._reduce_scatter_out_place(g, x, 0)),
         ok!(GroupCoordinator.reduce_scatterv(g, x, [0], sizes: [1, 3])),
         ok!(GroupCoordinator.reduce_scatter(g, input(r, 2, 4), []))}
      end)

    sum = for i <- 0..3, do: for(j <- 0..1, do: 10.0 + 2 * (i * 2 + j))
    sum_t = for i <- 0..1, do: for(j <- 0..3, do: 10.0 + 2 * (i * 4 + j))

    for {r, {rs, out_place, v, last}} <- Enum.with_index(results, fn x, i -> {i, x} end) do
      assert rows(rs) == Enum.slice(sum, r * 2, 2)
      assert rows(out_place) == rows(rs)
      assert rows(v) == if(r == 0, do: Enum.take(sum, 1), else: Enum.drop(sum, 1))
      assert rows(last) == Enum.map(sum_t, &Enum.slice(&1, r * 2, 2))
    end
  end

  test "gather and broadcast", %{tp: groups} do
    results =
      both(fn r ->
        g = Enum.at(groups, r)
        x = input(r, 1, 2)

        {ok!(GroupCoordinator.gather(g, x, [1, 0])),
         ok!(GroupCoordinator.broadcast(g, input(r, 1, 2, {:s, 64}), [1]))}
      end)

    [{nil, b0}, {gathered, b1}] = results
    assert rows(gathered) == [[0.0, 1.0], [10.0, 11.0]]
    assert rows(b0) == [[10, 11]] and rows(b1) == [[10, 11]]
    assert b0.type == {:s, 64}
  end

  test "objects: broadcast_object, broadcast_object_list, send_object/recv_object", %{
    tp: [g0, g1] = groups
  } do
    obj = %{"layers" => [1, 2], "name" => "tp"}

    assert both(fn r ->
             g = Enum.at(groups, r)
             GroupCoordinator.broadcast_object(g, obj: if(r == 0, do: obj), src: 0)
           end) == [{:ok, obj}, {:ok, obj}]

    assert both(fn r ->
             GroupCoordinator.broadcast_object_list(Enum.at(groups, r), [r, :x, "y"], [1])
           end) == [{:ok, [1, :x, "y"]}, {:ok, [1, :x, "y"]}]

    receiver = Task.async(fn -> GroupCoordinator.recv_object(g1, 0) end)
    assert GroupCoordinator.send_object(g0, {:hello, [1.5]}, 1) == {:ok, nil}
    assert Task.await(receiver, 60_000) == {:ok, {:hello, [1.5]}}
  end

  test "send and recv of tensors, dtype given Nx-style", %{tp: [g0, g1]} do
    for {type, list} <- [
          {{:f, 32}, [1.5, -2.0]},
          {{:bf, 16}, [0.5, 4.0]},
          {{:s, 8}, [-3, 7]},
          {{:pred, 8}, [true, false]}
        ] do
      receiver = Task.async(fn -> GroupCoordinator.recv(g1, [2], type, [0]) end)
      assert GroupCoordinator.send(g0, t(list, type), [1]) == {:ok, nil}
      assert {:ok, got} = Task.await(receiver, 60_000)
      assert got.type == type and Tensor.to_list(got) == list
    end
  end

  test "tensor dicts: send/recv and broadcast, with non-tensor values", %{tp: [g0, g1] = groups} do
    dict = %{"hidden" => t([[1.0, 2.0]]), "step" => 3, "ids" => t([5, 6], {:s, 64}), "tag" => "x"}
    receiver = Task.async(fn -> GroupCoordinator.recv_tensor_dict(g1, [0]) end)
    assert {:ok, _} = GroupCoordinator.send_tensor_dict(g0, dict, [1])
    assert Task.await(receiver, 60_000) == {:ok, dict}

    assert both(fn r ->
             g = Enum.at(groups, r)
             GroupCoordinator.broadcast_tensor_dict(g, [if(r == 0, do: dict, else: nil), 0])
           end) == [{:ok, dict}, {:ok, dict}]

    # The TP group broadcasts objects through its message queue, which (as in vLLM)
    # serves src 0 only: src 1 is a clear error on every rank, then src 0 works.
    assert [{:error, %Error{message: msg}}, {:error, _}] =
             both(fn r ->
               D.broadcast_tensor_dict([if(r == 1, do: dict, else: nil), 1], __runtime__: rt(r))
             end)

    assert msg =~ "src=0"

    assert both(fn r ->
             D.broadcast_tensor_dict([if(r == 0, do: dict, else: nil), 0], __runtime__: rt(r))
           end) ==
             [{:ok, dict}, {:ok, dict}]
  end

  test "barrier, dispatch/combine, graph_capture, mq broadcasters, buffers", %{tp: groups} do
    assert both(fn r -> GroupCoordinator.barrier(Enum.at(groups, r)) end) == [
             {:ok, nil},
             {:ok, nil}
           ]

    assert both(fn r -> GroupCoordinator.barrier(Enum.at(groups, r), []) end) == [
             {:ok, nil},
             {:ok, nil}
           ]

    results =
      both(fn r ->
        g = Enum.at(groups, r)
        {:ok, {h, l}} = GroupCoordinator.dispatch(g, input(r, 2, 2), input(r, 2, 1), [])
        {:ok, c} = GroupCoordinator.combine(g, h, [])
        ids = input(r, 2, 1, {:s, 64})
        {:ok, {_, w, i}} = GroupCoordinator.dispatch(g, h, input(r, 2, 1), ids, [], [])
        {rows(h), rows(l), rows(c), rows(w), rows(i)}
      end)

    for {r, {h, l, c, w, i}} <- Enum.with_index(results, fn x, i -> {i, x} end) do
      # Without an all-to-all manager dispatch and combine leave tokens where they are.
      assert h == rows(input(r, 2, 2))
      assert l == rows(input(r, 2, 1))
      assert c == h
      assert w == l and i == rows(input(r, 2, 1, {:s, 64}))
    end

    assert [{:ok, %Ref{}}, {:ok, %Ref{}}] =
             both(fn r -> GroupCoordinator.graph_capture(Enum.at(groups, r), []) end)

    assert [{:ok, %Ref{class: mq}}, {:ok, %Ref{}}] =
             both(fn r -> GroupCoordinator.create_mq_broadcaster(Enum.at(groups, r), []) end)

    assert mq =~ "MessageQueue"

    assert [{:ok, _}, {:ok, _}] =
             both(fn r ->
               GroupCoordinator.create_single_reader_mq_broadcasters(Enum.at(groups, r), [])
             end)

    assert both(fn r ->
             GroupCoordinator.prepare_communication_buffer_for_model(Enum.at(groups, r), nil)
           end) ==
             [{:ok, nil}, {:ok, nil}]
  end

  test "dispatch/5 (router logits) and dispatch/6 (top-k) gather an EP group's tokens" do
    eps =
      both(fn r ->
        opts = [group_name: "ep", use_all2all: true, __runtime__: rt(r)]
        ok!(GroupCoordinator.new([[0, 1]], r, "gloo", true, [], opts))
      end)

    # Rank r has r + 1 tokens (uneven), its rows from input/4; every rank gets all of them.
    all = fn cols, type -> Enum.flat_map(0..1, &rows(input(&1, &1 + 1, cols, type))) end

    results =
      both(fn r ->
        g = Enum.at(eps, r)
        comm = ok!(GroupCoordinator.device_communicator(g))
        {hidden, logits} = {input(r, r + 1, 2), input(r, r + 1, 3)}
        {weights, ids} = {input(r, r + 1, 2), input(r, r + 1, 2, {:s, 64})}
        {:ok, {h, l}} = GroupCoordinator.dispatch(g, hidden, logits)

        {:ok, {_, _, [x]}} =
          GroupCoordinator.dispatch(g, hidden, logits, [false], extra_tensors: [ids])

        {:ok, {h6, w, i}} = GroupCoordinator.dispatch(g, hidden, weights, ids, [], [])

        {:ok, {_, _, _, [x6]}} =
          GroupCoordinator.dispatch(g, hidden, weights, ids, [false], extra_tensors: [logits])

        {:ok, {hd, ld}} = DeviceCommunicatorBase.dispatch(comm, hidden, logits)
        {:ok, {_, wd, id}} = DeviceCommunicatorBase.dispatch(comm, hidden, weights, ids, [], [])
        # Each rank's "experts" scale every token; combine sums and keeps this rank's rows.
        scaled = t(Enum.map(rows(h), fn row -> Enum.map(row, &(&1 * (r + 1))) end))
        {:ok, c} = GroupCoordinator.combine(g, scaled)
        Enum.map([h, l, x, h6, w, i, x6, hd, ld, wd, id, c], &rows/1)
      end)

    for {[h, l, x, h6, w, i, x6, hd, ld, wd, id, c], r} <- Enum.with_index(results) do
      assert h == all.(2, {:f, 32}) and h6 == h and hd == h
      assert l == all.(3, {:f, 32}) and x6 == l and ld == l
      assert w == all.(2, {:f, 32}) and wd == w
      assert i == all.(2, {:s, 64}) and x == i and id == i
      assert c == Enum.map(rows(input(r, r + 1, 2)), fn row -> Enum.map(row, &(&1 * 3)) end)
    end

    assert both(fn r -> GroupCoordinator.destroy(Enum.at(eps, r)) end) == [{:ok, nil}, {:ok, nil}]
  end

  test "module functions", %{tp: [g0, _]} do
    assert D.get_tensor_model_parallel_world_size(__runtime__: rt(0)) == {:ok, 2}
    assert D.get_tensor_model_parallel_rank(__runtime__: rt(1)) == {:ok, 1}
    assert D.model_parallel_is_initialized(__runtime__: rt(0)) == {:ok, true}
    assert D.get_node_count(__runtime__: rt(0)) == {:ok, 1}
    assert D.get_pipeline_model_parallel_rank(__runtime__: rt(1)) == {:ok, 0}
    assert D.is_global_first_rank(__runtime__: rt(0)) == {:ok, true}
    assert D.is_global_first_rank(__runtime__: rt(1)) == {:ok, false}
    assert D.is_local_first_rank(__runtime__: rt(1)) == {:ok, false}
    assert {:ok, tp} = D.get_tp_group(__runtime__: rt(0))
    assert Ref.same_object?(tp, g0) and tp.owner == self()
    assert {:ok, %Ref{class: "GroupCoordinator"}} = D.get_world_group(__runtime__: rt(0))
    assert D.divide(12, 4, __runtime__: rt(0)) == {:ok, 3}
    assert {:error, %Error{category: :python}} = D.ensure_divisibility(5, 2, __runtime__: rt(0))

    assert D.get_distributed_init_method("127.0.0.1", 1234, __runtime__: rt(1)) ==
             {:ok, "tcp://127.0.0.1:1234"}

    assert D.get_pp_indices(8, 1, 2, __runtime__: rt(0)) == {:ok, {4, 8}}

    assert {:ok, {a, b}} =
             D.split_tensor_along_last_dim(t([[1.0, 2.0, 3.0, 4.0]]), 2, [], __runtime__: rt(0))

    assert rows(a) == [[1.0, 2.0]] and rows(b) == [[3.0, 4.0]]

    sums =
      both(fn r ->
        ok!(D.tensor_model_parallel_all_reduce(t([r * 1.0, 1.0]), __runtime__: rt(r)))
      end)

    assert Enum.map(sums, &rows/1) == [[1.0, 2.0], [1.0, 2.0]]

    gathered =
      both(fn r ->
        ok!(D.tensor_model_parallel_all_gather(t([r * 1.0]), [0], __runtime__: rt(r)))
      end)

    assert Enum.map(gathered, &rows/1) == [[0.0, 1.0], [0.0, 1.0]]
  end

  test "a new GroupCoordinator and a DeviceCommunicatorBase on its cpu_group", %{tp: _} do
    coordinators =
      both(fn r ->
        ok!(GroupCoordinator.new([[0, 1]], r, "gloo", false, [], __runtime__: rt(r)))
      end)

    comms =
      both(fn r ->
        {:ok, cpu_group} = GroupCoordinator.cpu_group(Enum.at(coordinators, r))
        ok!(DeviceCommunicatorBase.new(cpu_group, [], unique_name: "extra"))
      end)

    sums =
      both(fn r -> ok!(DeviceCommunicatorBase.all_reduce(Enum.at(comms, r), t([r + 1.0]))) end)

    assert Enum.map(sums, &rows/1) == [[3.0], [3.0]]

    gathered =
      both(fn r ->
        ok!(DeviceCommunicatorBase.all_gather(Enum.at(comms, r), t([[r * 1.0]]), [0]))
      end)

    assert Enum.map(gathered, &rows/1) == [[[0.0], [1.0]], [[0.0], [1.0]]]

    assert both(fn r -> DeviceCommunicatorBase.destroy(Enum.at(comms, r)) end) == [
             {:ok, nil},
             {:ok, nil}
           ]

    assert both(fn r -> GroupCoordinator.destroy(Enum.at(coordinators, r)) end) == [
             {:ok, nil},
             {:ok, nil}
           ]
  end

  test "bad input gives clear errors and the group keeps working", %{tp: [g0, _] = groups} do
    assert {:error, %Error{category: :python, message: msg}} =
             GroupCoordinator.send(g0, t([1.0]), [5])

    assert msg =~ "5"
    assert {:error, %Error{category: :bad_args}} = GroupCoordinator.recv(g0, [1], {:f, 7}, [1])

    assert {:error, %Error{category: :bad_args}} =
             GroupCoordinator.all_reduce(g0, t([1.0]), no_such: 1)

    results =
      both(fn r ->
        GroupCoordinator.reduce_scatter(Enum.at(groups, r), t([1.0, 2.0, 3.0]), [0])
      end)

    assert Enum.all?(results, &match?({:error, %Error{}}, &1))

    sums = both(fn r -> ok!(GroupCoordinator.all_reduce(Enum.at(groups, r), t([1.0]))) end)
    assert Enum.map(sums, &rows/1) == [[2.0], [2.0]]
  end
end
