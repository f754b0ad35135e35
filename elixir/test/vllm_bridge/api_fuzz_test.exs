Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fuzz.exs", __DIR__)

defmodule VllmBridge.ApiFuzzTest do
  # The public API of VllmBridge.Runtime fed random terms, hostile ones among
  # them, as arguments, keyword arguments, runtime options, objects and refs,
  # against a real worker: every call must return {:ok, _} or
  # {:error, %VllmBridge.Error{}}, never raise in the caller, and the worker
  # must serve on. (Forged refs and a 2**64 ms timeout once raised here.)
  #
  # VLLM_BRIDGE_FUZZ_FRAMES / 50 calls (default 2,000), from seed
  # VLLM_BRIDGE_FUZZ_SEED (default 15); `mix test --only fuzz` runs these too.
  use ExUnit.Case, async: true

  import Bitwise
  import VllmBridge.Fuzz, only: [seed!: 2, between: 2, term: 1]
  import VllmBridge.PoolHelpers

  alias VllmBridge.{Error, Pool, Ref, Runtime, Worker}

  @moduletag :fuzz
  @moduletag timeout: 1_800_000

  setup %{test: test}, do: one_worker_pool!(test)

  defp calls do
    frames = String.to_integer(System.get_env("VLLM_BRIDGE_FUZZ_FRAMES", "100000"))
    max(div(frames, 50), 1)
  end

  defp seed, do: String.to_integer(System.get_env("VLLM_BRIDGE_FUZZ_SEED", "15"))

  # A term the bridge can carry, or, one time in three, something it cannot:
  # processes, functions, bitstrings, structs, improper lists, forged refs.
  defp hostile(depth) do
    case :rand.uniform(if depth > 0, do: 12, else: 9) do
      n when n <= 3 -> hostile_leaf()
      10 -> for _ <- 1..between(0, 3)//1, do: hostile(depth - 1)
      11 -> [hostile(depth - 1) | hostile(depth - 1)]
      12 -> Map.new(1..between(0, 3)//1, fn _ -> {hostile(depth - 1), hostile(depth - 1)} end)
      _ -> term(min(depth, 2))
    end
  end

  defp hostile_leaf do
    Enum.random([
      self(),
      make_ref(),
      fn -> :ok end,
      <<1::3>>,
      %URI{},
      %{__struct__: Ref},
      %{__struct__: Ref, id: between(0, 10)},
      %{__struct__: VllmBridge.Tensor, type: {:f, 32}},
      -(1 <<< 70),
      1 <<< 70,
      :"an atom",
      {}
    ])
  end

  defp hostile_opts(pool) do
    runtime =
      for _ <- 1..between(0, 3)//1 do
        {Enum.random([:pool, :worker, :timeout, :node, :session, :unknown]),
         Enum.random([
           pool,
           0,
           1,
           -1,
           1 <<< 32,
           1 <<< 64,
           :infinity,
           nil,
           :no_pool,
           "s",
           self(),
           %{__struct__: Ref},
           :nonode@nowhere,
           hostile(1)
         ])}
      end

    # keep most calls on the pool (and quick), so that they reach the worker
    runtime = Keyword.merge([pool: pool, timeout: 10_000], runtime)

    case :rand.uniform(6) do
      1 -> hostile(1)
      2 -> [{:__runtime__, hostile(1)}]
      3 -> [{Enum.random([:x, :y]), hostile(2)}, {:__runtime__, runtime}]
      _ -> [__runtime__: runtime]
    end
  end

  defp object(counter) do
    case :rand.uniform(4) do
      1 -> hostile(1)
      _ -> counter
    end
  end

  defp name do
    Enum.random(["incr", "echo", "value", "", "nope", "__class__", "_private", :incr, nil, 7])
  end

  defp args do
    case :rand.uniform(5) do
      1 -> hostile(1)
      _ -> for _ <- 1..between(0, 3)//1, do: hostile(2)
    end
  end

  test "Runtime functions given random and hostile terms return results or errors, never raise",
       %{pool: pool, os_pid: os_pid} do
    seed = seed()
    seed!(seed, 21)
    {:ok, counter} = Runtime.call_class("Counter", [], __runtime__: [pool: pool])

    results =
      Enum.reduce(1..calls(), %{}, fn i, acc ->
        opts = hostile_opts(pool)

        {name, call} =
          Enum.random([
            {:call_function, fn -> Runtime.call_function(name(), args(), opts) end},
            {:call_method, fn -> Runtime.call_method(object(counter), name(), args(), opts) end},
            {:get_attr, fn -> Runtime.get_attr(object(counter), name(), opts) end},
            {:call_class, fn -> Runtime.call_class(name(), args(), opts) end},
            {:call_static, fn -> Runtime.call_static(object(counter), name(), args(), opts) end},
            {:ping, fn -> Runtime.ping(hostile(3), opts) end},
            {:release, fn -> Runtime.release(hostile(1), opts) end}
          ])

        result =
          try do
            call.()
          rescue
            error -> {:raised, Exception.format(:error, error, __STACKTRACE__)}
          catch
            kind, reason -> {:raised, Exception.format(kind, reason, __STACKTRACE__)}
          end

        case result do
          {:ok, _} ->
            Map.update(acc, :ok, 1, &(&1 + 1))

          {:error, %Error{category: category}} ->
            Map.update(acc, category, 1, &(&1 + 1))

          other ->
            flunk("""
            call #{i}, #{name}: #{inspect(other, limit: 20, printable_limit: 2_000)}
            options: #{inspect(opts, limit: 10, structs: false)}
            reproduce with VLLM_BRIDGE_FUZZ_SEED=#{seed}: mix test --only fuzz
            """)
        end
      end)

    # the fuzz reached the worker, and it serves on, the same process
    assert results[:ok] > 0 and results[:bad_args] > 0
    assert {:ok, :still_here} = Runtime.ping(:still_here, __runtime__: [pool: pool])
    {:ok, worker} = Pool.worker(pool, 0)
    assert {:ok, ^os_pid} = Worker.os_pid(worker)
  end
end
