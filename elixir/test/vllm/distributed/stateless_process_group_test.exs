Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.StatelessProcessGroupTest do
  # A 3-rank StatelessProcessGroup formed from Elixir, one rank per worker of a
  # pool of 3, driven through the generated module at every documented arity.
  use ExUnit.Case, async: false

  alias Vllm.Distributed.StatelessProcessGroup, as: SPG
  alias VllmBridge.{Error, Pool, Ref, Runtime, Tensor}

  @pool __MODULE__.Pool
  @size 3

  setup_all do
    start_supervised!({Pool, name: @pool, size: @size, timeout: 60_000})
    groups = form_group(VllmBridge.PoolHelpers.free_tcp_port())
    %{groups: groups}
  end

  defp rt(extra \\ []), do: [__runtime__: [pool: @pool] ++ extra]

  # create/6 on ranks 1.., create/7 (with keyword options) on rank 0; they run
  # concurrently because create returns only once every rank has joined.
  defp form_group(port) do
    0..(@size - 1)
    |> Enum.map(fn rank ->
      Task.async(fn ->
        if rank == 0 do
          SPG.create(
            nil,
            "127.0.0.1",
            port,
            rank,
            @size,
            [],
            rt(worker: rank) ++ [store_timeout: 60]
          )
        else
          SPG.create(nil, "127.0.0.1", port, rank, @size, [3600], rt(worker: rank))
        end
      end)
    end)
    |> Task.await_many(90_000)
    |> Enum.map(fn {:ok, %Ref{class: "StatelessProcessGroup"} = group} -> group end)
  end

  defp on_all(groups, fun), do: VllmBridge.PoolHelpers.on_ranks(groups, fun, 60_000)

  test "each rank lives in its own worker and reports its rank and world size", %{groups: groups} do
    assert groups |> Enum.map(& &1.worker) |> Enum.uniq() |> length() == @size

    for {group, rank} <- Enum.with_index(groups) do
      {:ok, worker} = Pool.worker(@pool, rank)
      assert group.worker == worker
      assert SPG.rank(group) == {:ok, rank}
      assert SPG.world_size(group) == {:ok, @size}
      assert SPG.data_expiration_seconds(group) == {:ok, 3600}
      # A getter takes runtime options like every other call.
      assert SPG.rank(group, __runtime__: [timeout: 5_000]) == {:ok, rank}
      assert {:error, %VllmBridge.Error{category: :bad_args}} = SPG.rank(group, foo: 1)
    end
  end

  test "broadcast_obj/3,4 from every source, counters advance", %{groups: groups} do
    [g0 | _] = groups
    {:ok, sent_before} = SPG.broadcast_send_counter(g0)

    for src <- 0..(@size - 1) do
      results =
        on_all(groups, fn g ->
          {:ok, rank} = SPG.rank(g)
          obj = if rank == src, do: {:from, src}, else: nil

          if rank == 1,
            do: SPG.broadcast_obj(g, obj, src, rt()),
            else: SPG.broadcast_obj(g, obj, src)
        end)

      assert results == List.duplicate({:ok, {:from, src}}, @size)
    end

    assert SPG.broadcast_send_counter(g0) == {:ok, sent_before + 1}
  end

  test "Elixir terms round-trip through broadcast_obj", %{groups: groups} do
    {:ok, tensor} =
      Tensor.new({:f, 32}, {2, 3}, for(x <- 1..6, into: <<>>, do: <<x * 1.5::float-32-little>>))

    {:ok, ints} =
      Tensor.new({:s, 64}, {2}, <<-7::signed-64-little, 1_099_511_627_776::signed-64-little>>)

    term = %{
      "map" => %{1 => "one", :atom_key => [1, 2]},
      "list" => [1, -2, 3.25, nil, true, false],
      "tuple" => {:ok, {1, "nested"}, []},
      "atoms" => [:ok, :error, :"with space"],
      "utf8" => "héllo ✓",
      "bytes" => <<0, 255, 128>>,
      "float" => 1.0e-300,
      "big" => 18_446_744_073_709_551_615,
      "neg" => -9_223_372_036_854_775_808,
      "tensor" => tensor,
      "ints" => ints
    }

    results =
      on_all(groups, fn g ->
        {:ok, rank} = SPG.rank(g)
        SPG.broadcast_obj(g, if(rank == 2, do: term, else: nil), 2)
      end)

    assert results == List.duplicate({:ok, term}, @size)
  end

  test "all_gather_obj/2,3 returns every rank's object in rank order", %{groups: groups} do
    results =
      on_all(groups, fn g ->
        {:ok, rank} = SPG.rank(g)

        if rank == 0,
          do: SPG.all_gather_obj(g, %{rank: rank}, rt()),
          else: SPG.all_gather_obj(g, %{rank: rank})
      end)

    assert results == List.duplicate({:ok, [%{rank: 0}, %{rank: 1}, %{rank: 2}]}, @size)
  end

  test "send_obj/3,4 and recv_obj/2,3: two ranks send to one without colliding", %{groups: groups} do
    [g0, g1, g2] = groups
    r1 = Task.async(fn -> SPG.recv_obj(g0, 1) end)
    r2 = Task.async(fn -> SPG.recv_obj(g0, 2, rt(timeout: 30_000)) end)
    assert SPG.send_obj(g1, "from one", 0) == {:ok, nil}
    assert SPG.send_obj(g2, ["from", 2], 0, rt()) == {:ok, nil}
    assert Task.await(r1, 30_000) == {:ok, "from one"}
    assert Task.await(r2, 30_000) == {:ok, ["from", 2]}
    assert {:ok, %{1 => 1, 2 => 1}} = SPG.recv_src_counter(g0)
    assert {:ok, %{0 => 1}} = SPG.send_dst_counter(g1)
  end

  test "barrier/2,3 and expire_data/1,2", %{groups: groups} do
    assert on_all(groups, &SPG.barrier(&1, [])) == List.duplicate({:ok, nil}, @size)
    assert on_all(groups, &SPG.barrier(&1, [10.0], rt())) == List.duplicate({:ok, nil}, @size)
    [g0 | _] = groups
    assert SPG.expire_data(g0) == {:ok, nil}
    assert SPG.expire_data(g0, rt()) == {:ok, nil}
  end

  # Issue 37: SPG.barrier(g) was undefined, SPG.barrier(g, timeout: 10) sent the
  # keyword list as positional arguments, SPG.barrier(g, 10) spoke of :__args__.
  test "args may be left out, or given as a keyword list of options", %{groups: groups} do
    all_nil = List.duplicate({:ok, nil}, @size)
    assert on_all(groups, &SPG.barrier(&1)) == all_nil
    assert on_all(groups, &SPG.barrier(&1, timeout: 10.0)) == all_nil
    assert on_all(groups, &SPG.barrier(&1, [timeout: 10.0], rt())) == all_nil
    # (a keyword list of options with __runtime__ in it too)
    assert on_all(groups, &SPG.barrier(&1, timeout: 10.0, __runtime__: [timeout: 30_000])) ==
             all_nil

    {:ok, t} = Tensor.from_list([1.0, 2.0], {:f, 32})
    sums = on_all(groups, &SPG.all_reduce(&1, t))

    assert Enum.map(sums, fn {:ok, sum} -> Tensor.to_list(sum) end) ==
             List.duplicate([3.0, 6.0], @size)

    sums = on_all(groups, &SPG.all_reduce(&1, t, op: "max"))

    assert Enum.map(sums, fn {:ok, max} -> Tensor.to_list(max) end) ==
             List.duplicate([1.0, 2.0], @size)

    [g0 | _] = groups

    assert {:error, %Error{category: :bad_args, message: message}} = SPG.barrier(g0, 10)
    assert message =~ "args (the optional positional arguments, in order) must be a list"
    refute message =~ "__args__"
    # the group is in step still
    assert on_all(groups, &SPG.barrier(&1)) == all_nil
  end

  test "new/5,6 build a group on an existing store", %{groups: groups} do
    [g0 | _] = groups
    {:ok, store} = Runtime.get_attr(g0, "store")
    assert %Ref{} = store
    # new/5 and new/6 run next to the store (the worker of the first ref argument).
    assert {:ok, %Ref{worker: worker} = solo} = SPG.new(0, 1, store, nil, [], rt())
    assert worker == g0.worker
    assert SPG.world_size(solo) == {:ok, 1}
    assert {:ok, solo2} = SPG.new(0, 1, store, nil, [42])
    assert SPG.data_expiration_seconds(solo2) == {:ok, 42}
    assert SPG.all_gather_obj(solo2, :alone) == {:ok, [:alone]}
    assert {:ok, 3} = Runtime.release([solo, solo2, store])
  end

  test "bad input gets clear errors and the group keeps working", %{groups: groups} do
    [g0 | _] = groups

    assert {:error, %Error{category: :python, python_type: "ValueError", message: msg}} =
             SPG.broadcast_obj(g0, 1, 7)

    assert msg =~ "src"

    assert {:error, %Error{category: :bad_args, message: msg}} = SPG.send_obj(g0, 1, "zero")
    assert msg =~ "dst"

    assert {:error, %Error{category: :bad_args}} = SPG.barrier(g0, [1.0, 2.0])
    assert {:error, %Error{category: :bad_args}} = SPG.barrier(g0, :not_a_list)
    assert {:error, %Error{category: :bad_args}} = SPG.barrier(g0, [], no_such_option: 1)
    assert {:error, %Error{category: :encode}} = SPG.broadcast_obj(g0, self(), 0)
    assert {:error, %Error{category: :not_exported}} = Runtime.call_method(g0, "__reduce__", [])
    assert {:error, %Error{category: :not_exported}} = Runtime.get_attr(g0, "_waiter")

    assert {:error, %Error{category: :python, python_type: "StoreError"}} =
             SPG.create(nil, "127.0.0.1", 1, 1, 2, [], rt(worker: 0) ++ [store_timeout: 1])

    # The pool and the group still serve.
    assert on_all(groups, &SPG.all_gather_obj(&1, :still_ok)) ==
             List.duplicate({:ok, [:still_ok, :still_ok, :still_ok]}, @size)
  end
end
