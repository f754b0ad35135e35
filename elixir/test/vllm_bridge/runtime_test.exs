Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.RuntimeTest do
  # Against real Python workers serving tests/worker/sample_exports.py, one
  # 3-worker pool for the whole module (tests that kill workers have their
  # own pools, in pool_test.exs).
  use ExUnit.Case, async: true

  import Bitwise
  import VllmBridge.PoolHelpers

  alias VllmBridge.{Error, Pool, Ref, Runtime, Tensor, Worker}

  @pool VllmBridge.RuntimeTest.Pool
  @moduletag timeout: 60_000

  setup_all do
    if VllmBridge.TestPython.worker_available?() do
      start_pool!(@pool, 3)
      :ok
    else
      raise "the Python worker (bridge_py.worker) is not available"
    end
  end

  defp rt(extra \\ []), do: [__runtime__: Keyword.merge([pool: @pool], extra)]

  defp counter!(start \\ 0, opts \\ []) do
    assert {:ok, %Ref{class: "Counter"} = ref} =
             Runtime.call_class("Counter", [start], Keyword.merge(rt(), opts))

    ref
  end

  test "ping round-trips assorted terms" do
    {:ok, tensor} = Tensor.from_list([[1.5, -2.0], [0.25, 8.0]], {:f, 32})
    {:ok, bf} = Tensor.from_list([1.0, 2.0], {:bf, 16})
    {:ok, flags} = Tensor.from_list([true, false], {:pred, 8})

    terms = [
      nil,
      true,
      0,
      -1,
      1 <<< 63,
      -(1 <<< 63),
      1.5e300,
      "héllo",
      <<0, 255, 1>>,
      String.duplicate("x", 100_000),
      [],
      [1, [2, [3, []]]],
      %{},
      %{"a" => 1, 2 => [:ok], {1, 2} => nil},
      :an_atom,
      {},
      {:ok, {1, "two", [3.0]}},
      tensor,
      bf,
      flags,
      %Tensor{type: {:s, 64}, shape: {}, data: <<7::64-little>>},
      %{"nested" => [tensor, {tensor}]}
    ]

    for term <- terms do
      assert Runtime.ping(term, rt()) === {:ok, term}, inspect(term, limit: 5)
    end
  end

  test "a 16 MiB tensor goes through a function and back" do
    data = :binary.copy(<<1.0::float-32-little>>, 4 * 1024 * 1024)
    tensor = %Tensor{type: {:f, 32}, shape: {1024, 4096}, data: data}

    assert {:ok, %Tensor{type: {:f, 32}, shape: {1024, 4096}, data: doubled}} =
             Runtime.call_function("double", [tensor], rt())

    assert doubled == :binary.copy(<<2.0::float-32-little>>, 4 * 1024 * 1024)
  end

  test "constructors, methods, keyword arguments, :__args__ and attributes" do
    counter = counter!(5, step: 2)
    assert {:ok, 7} = Runtime.call_method(counter, "incr", [], rt())
    assert {:ok, 17} = Runtime.call_method(counter, "incr", [], __args__: [10])
    assert {:ok, 20} = Runtime.call_method(counter, "incr", [], by: 3)
    assert {:ok, 20} = Runtime.get_attr(counter, "value")
    assert {:ok, 2} = Runtime.get_attr(counter, "step")
    assert {:ok, 1} = Runtime.release(counter)
  end

  test "unencodable results come back as refs; values as values" do
    assert {:ok, %Ref{class: class, pool: @pool, worker: pid}} =
             Runtime.call_function("make_unencodable", [], rt())

    assert class =~ "lock"
    assert is_pid(pid)
    assert {:ok, {1, :x, <<255>>}} = Runtime.call_function("echo", [{1, :x, <<255>>}], rt())
  end

  test "ping, describe, release and release_session take their options plainly" do
    assert {:ok, :x} = Runtime.ping(:x, pool: @pool, worker: 1, timeout: 5_000)
    assert {:ok, :y} = Runtime.ping(:y, pool: @pool, __runtime__: [worker: 2])
    assert {:ok, %{} = table} = Runtime.describe(pool: @pool)
    assert map_size(table) > 0
    ref = counter!()
    assert {:ok, 1} = Runtime.release(ref, pool: @pool, timeout: 5_000)
    assert {:ok, 0} = Runtime.release_session("no such session", pool: @pool)

    # a Python keyword argument is no option of theirs: named, not sent
    assert {:error, %Error{category: :bad_args, message: message}} =
             Runtime.ping(:x, pool: @pool, store_timeout: 5)

    assert message =~ "ping/2 takes only runtime options" and message =~ ":store_timeout"
  end

  test "describe lists the export table" do
    assert {:ok, %{"classes" => _, "functions" => _}} = Runtime.describe(rt())
  end

  test "round-robin spreads constructors over the 3 workers" do
    {:ok, workers} = Pool.workers(@pool)
    assert length(workers) == 3

    refs = for _ <- 1..6, do: counter!()
    pids = Enum.map(refs, & &1.worker)
    assert Enum.sort(Enum.uniq(pids)) == Enum.sort(for {_, pid} <- workers, do: pid)
    # in order: every worker once per cycle
    assert Enum.take(pids, 3) == Enum.drop(pids, 3)
    assert {:ok, 6} = Runtime.release(refs)
  end

  test "placement by index, by ref, and by ref arguments" do
    {:ok, w2} = Pool.worker(@pool, 2)
    counter = counter!(0, rt(worker: 2))
    assert counter.worker == w2

    # worker: ref places next to that object
    other = counter!(0, rt(worker: counter))
    assert other.worker == w2

    # a ref among the arguments places the call next to it (open_gate(counter))
    for _ <- 1..3, do: assert({:ok, nil} = Runtime.call_function("open_gate", [counter], rt()))

    # call_static/4: a ref first, for placement only (generated static methods)
    for _ <- 1..3 do
      assert {:ok, %Ref{worker: ^w2}} = Runtime.call_static(counter, "make_unencodable", [], rt())
    end

    assert {:ok, 5} = Runtime.call_static(nil, "echo", [5], rt())
    assert {:error, %Error{category: :bad_args}} = Runtime.call_static(:x, "echo", [5], rt())

    # an explicit worker: pid must belong to the pool
    assert {:ok, _} = Runtime.ping(1, rt(worker: w2))
    assert {:error, %Error{category: :bad_args}} = Runtime.ping(1, rt(worker: self()))

    assert {:ok, 2} = Runtime.release([counter, other])
  end

  test "replies come back out of order: pings are answered while a call blocks" do
    counter = counter!(0, rt(worker: 0))
    waiter = Task.async(fn -> Runtime.call_method(counter, "wait_gate", [20.0]) end)
    sleeper = Task.async(fn -> Runtime.call_function("sleep", [1.0], rt(worker: 0)) end)

    # many pings on the same worker while both are in flight
    for i <- 1..20 do
      {us, result} = :timer.tc(fn -> Runtime.ping(i, rt(worker: 0)) end)
      assert result == {:ok, i}
      assert us < 2_000_000
    end

    assert Task.yield(waiter, 0) == nil
    assert {:ok, info} = Worker.info(counter.worker)
    assert info.pending >= 1

    assert {:ok, nil} = Runtime.call_function("open_gate", [counter], rt())
    assert {:ok, true} = Task.await(waiter, 10_000)
    assert {:ok, 1.0} = Task.await(sleeper, 10_000)
    assert {:ok, 1} = Runtime.release(counter)
  end

  test "a per-call timeout returns at the deadline; the late reply goes nowhere" do
    {:ok, pid} = Pool.worker(@pool, 1)

    {us, result} =
      :timer.tc(fn -> Runtime.call_function("sleep", [2.5], rt(worker: 1, timeout: 200)) end)

    # at the deadline, not after the 2.5 s sleep (room for a loaded machine)
    assert {:error, %Error{category: :timeout}} = result
    assert us < 2_000_000
    # the caller took its entry out of the table at its deadline
    assert {:ok, %{pending: 0}} = Worker.info(pid)

    # the worker keeps serving, and after the late reply arrives a later caller
    # still gets its own reply
    Process.sleep(2_600)
    assert {:ok, :mine} = Runtime.ping(:mine, rt(worker: 1))
    assert {:ok, 0.01} = Runtime.call_function("sleep", [0.01], rt(worker: 1))
    refute_received _
  end

  test "Python errors carry type, message and traceback; the worker keeps serving" do
    counter = counter!()

    assert {:error, %Error{category: :python} = error} =
             Runtime.call_method(counter, "fail", ["boom"])

    assert error.python_type == "ValueError"
    assert error.message =~ "boom"
    assert error.python_traceback =~ "Traceback"

    assert {:error, %Error{category: :not_exported}} = Runtime.call_method(counter, "secret", [])

    assert {:error, %Error{category: :not_exported}} = Runtime.get_attr(counter, "__dict__")
    assert {:error, %Error{category: :not_exported}} = Runtime.call_class("Nope", [], rt())
    assert {:error, %Error{category: :not_exported}} = Runtime.call_function("nope", [], rt())
    assert {:error, %Error{category: :bad_args}} = Runtime.call_method(counter, "incr", [1, 2, 3])

    assert {:ok, 1} = Runtime.call_method(counter, "incr", [])
    assert {:ok, 1} = Runtime.release(counter)
  end

  test "unknown handles, released handles and other sessions are not_found" do
    counter = counter!()
    bogus = %{counter | id: 987_654}
    assert {:error, %Error{category: :not_found}} = Runtime.call_method(bogus, "incr", [])

    assert {:error, %Error{category: :not_found}} =
             Runtime.call_method(counter, "incr", [], __runtime__: [session: "someone-else"])

    assert {:ok, 1} = Runtime.release(counter)
    assert {:ok, 0} = Runtime.release(counter)
    assert {:error, %Error{category: :not_found}} = Runtime.call_method(counter, "incr", [])
  end

  test "a release of more handles than one request may name goes in several" do
    # The worker refuses a repeated field of more than 1,048,576 values (a request
    # naming 100 million handles took gigabytes); the runtime splits a longer release.
    counter = counter!()
    others = for id <- 1..1_048_576, do: %{counter | id: counter.id + id}
    assert {:ok, 1} = Runtime.release([counter | others])
    assert {:error, %Error{category: :not_found}} = Runtime.call_method(counter, "incr", [])
  end

  test "a ref carries its worker's place in the pool, and a wrong place is stale" do
    for index <- 0..2 do
      {:ok, pid} = Pool.worker(@pool, index)
      ref = counter!(0, rt(worker: index))
      assert %Ref{worker: ^pid, index: ^index, pool: @pool} = ref
      assert {:ok, 1} = Runtime.call_method(ref, "incr", [])

      # the same pid recorded at another place: refused, nothing sent
      moved = %{ref | index: rem(index + 1, 3)}
      assert {:error, %Error{category: :stale_ref}} = Runtime.call_method(moved, "incr", [])
      assert {:ok, 1} = Runtime.get_attr(ref, "value")
    end
  end

  test "a ref whose worker is gone is stale and nothing is sent" do
    dead = spawn(fn -> :ok end)
    ref = Process.monitor(dead)
    assert_receive {:DOWN, ^ref, _, _, _}

    stale = %Ref{id: 3, class: "Counter", pool: @pool, worker: dead, session: ""}

    assert {:error, %Error{category: :stale_ref, message: message}} =
             Runtime.call_method(stale, "incr", [])

    assert message =~ "Counter handle 3"
    assert {:error, %Error{category: :stale_ref}} = Runtime.get_attr(stale, "value")

    assert {:error, %Error{category: :stale_ref}} =
             Runtime.call_class("Counter", [], rt(worker: stale))

    # releasing a stale ref is a no-op: its object is gone already
    assert {:ok, 0} = Runtime.release(stale)

    # a live process that is not a worker of the pool is not accepted either
    assert {:error, %Error{category: :stale_ref}} =
             Runtime.call_method(%{stale | worker: self()}, "incr", [])
  end

  test "bad input is a :bad_args or :encode error, never a raise" do
    counter = counter!()

    bad = [
      fn -> Runtime.call_class("Counter", :not_a_list, rt()) end,
      fn -> Runtime.call_class("Counter", [], [:not_keyword]) end,
      fn -> Runtime.call_class("Counter", [], __args__: :nope) end,
      fn -> Runtime.call_class("Counter", [], __runtime__: [pool: @pool, nope: 1]) end,
      fn -> Runtime.call_class("Counter", [], __runtime__: [pool: @pool, timeout: -5]) end,
      fn -> Runtime.call_class("Counter", [], __runtime__: [pool: @pool, session: 1]) end,
      fn -> Runtime.call_class("Counter", [], __runtime__: [pool: @pool, worker: 3]) end,
      fn -> Runtime.call_class("Counter", [], __runtime__: [pool: @pool, worker: "x"]) end,
      fn -> Runtime.call_class(:Counter, [], rt()) end,
      fn -> Runtime.call_method(:not_a_ref, "incr", []) end,
      fn -> Runtime.call_method(%Ref{id: 1}, "incr", []) end,
      fn -> Runtime.call_method(counter, "", []) end,
      fn -> Runtime.get_attr(counter, "value", extra: 1) end,
      fn -> Runtime.release([counter, :x]) end,
      fn -> Runtime.release_session(:s, rt()) end
    ]

    for fun <- bad do
      assert {:error, %Error{category: :bad_args}} = fun.()
    end

    assert {:error, %Error{category: :encode, message: message}} =
             Runtime.call_method(counter, "incr", [self()])

    assert message =~ "#PID"

    assert {:error, %Error{category: :encode}} = Runtime.call_function("echo", [1 <<< 64], rt())

    assert {:error, %Error{category: :worker}} =
             Runtime.ping(1, __runtime__: [pool: :no_such_pool])

    # the pool keeps serving
    assert {:ok, 1} = Runtime.call_method(counter, "incr", [])
    assert {:ok, 1} = Runtime.release(counter)
  end

  test "release_session frees a session's handles in every worker" do
    session = "job-#{System.unique_integer([:positive])}"
    refs = for i <- 0..2, do: counter!(0, rt(worker: i, session: session))
    assert Enum.all?(refs, &(&1.session == session))
    assert {:ok, 1} = Runtime.call_method(hd(refs), "incr", [])

    assert {:ok, 3} = Runtime.release_session(session, rt())

    for ref <- refs do
      assert {:error, %Error{category: :not_found}} = Runtime.call_method(ref, "incr", [])
    end

    assert {:ok, 0} = Runtime.release_session(session, rt())
  end
end
