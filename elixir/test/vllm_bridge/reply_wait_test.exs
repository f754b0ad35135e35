Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fault_helpers.exs", __DIR__)

defmodule VllmBridge.ReplyWaitTest do
  # How a caller waits for its reply (`:reply_spin_us`, "Waiting for a reply"
  # in VllmBridge.Worker), seen from the outside: a spinning caller is
  # scheduled out once per look (it yields between looks), a sleeping one once
  # for the whole wait. Counted with the VM's `:running` trace, not timed.
  # Not async: a look ends early while other tests hold the CPUs (the look
  # gate), so on a loaded test VM even five tries could all end early.
  use ExUnit.Case, async: false

  import VllmBridge.PoolHelpers
  import VllmBridge.FaultHelpers, only: [kill9: 1, pending: 1]

  alias VllmBridge.{Error, Pool, Runtime, Worker}
  alias VllmBridge.Worker.LookGate

  @moduletag timeout: 90_000

  @doc """
  Times the caller was scheduled out while it made `call` (a function of no
  arguments), and the call's result.
  """
  def schedule_outs(call) do
    me = self()
    tracer = spawn_link(fn -> collect(me, 0) end)
    :erlang.trace(me, true, [:running, {:tracer, tracer}])
    result = call.()
    :erlang.trace(me, false, [:running])
    send(tracer, {:done, me})

    receive do
      {:outs, outs} -> {outs, result}
    end
  end

  defp collect(owner, outs) do
    receive do
      {:trace, ^owner, :out, _} -> collect(owner, outs + 1)
      {:trace, ^owner, :in, _} -> collect(owner, outs)
      {:done, ^owner} -> send(owner, {:outs, outs})
    end
  end

  test "a lone call looks for its reply for :reply_spin_us, a time slice per look, then sleeps",
       %{test: test} do
    spinning = start_pool!(:"#{test}_spin", 1, reply_spin_us: 1_000)
    sleeping = start_pool!(:"#{test}_sleep", 1, reply_spin_us: 0)
    reductions = fn -> self() |> Process.info(:reductions) |> elem(1) end

    # A call that takes 20 ms in Python: the spinning caller yields between
    # looks for the whole millisecond of its spin, then sleeps; the other
    # sleeps at once.
    sleep = fn pool -> Runtime.call_function("sleep", [0.02], __runtime__: [pool: pool]) end

    look = fn ->
      before = reductions.()
      {outs, result} = schedule_outs(fn -> sleep.(spinning) end)
      {outs, reductions.() - before, result}
    end

    # A look ends early where something else holds its CPU (see the look gate
    # below), as it may on a test VM running other tests: up to five tries.
    {outs, used, result} =
      Enum.reduce_while(1..5, nil, fn _, _ ->
        case look.() do
          {outs, _, _} = tried when outs >= 5 ->
            {:halt, tried}

          tried ->
            Process.sleep(60)
            {:cont, tried}
        end
      end)

    assert {:ok, 0.02} = result
    assert outs >= 5, "a spinning caller was scheduled out #{outs} times"
    # A scheduler checks its ports for input once enough reductions have run
    # since the last check; a bare yield counts as few, and a reply was then
    # seen only every ~20 looks. Each look is charged a time slice (4,000
    # reductions) instead.
    assert used >= 4_000 * (outs - 2), "#{outs} looks were charged #{used} reductions"

    {outs, result} = schedule_outs(fn -> sleep.(sleeping) end)
    assert {:ok, 0.02} = result
    assert outs <= 2, "a sleeping caller was scheduled out #{outs} times"
  end

  test "looks that find their CPU taken close the look gate", %{test: test} do
    pool = start_pool!(:"#{test}", 1, reply_spin_us: 1_000)
    rt = [__runtime__: [pool: pool]]
    assert gate = LookGate.global(), "the application made no look gate"

    # Two processes per scheduler that never wait: each turn of theirs lasts
    # ~50 us here (a 1,000-element tuple per reduction), so a caller that
    # yields between looks is away longer than a look may be.
    busy =
      for _ <- 1..(2 * :erlang.system_info(:schedulers_online)),
          do: spawn(fn -> keep_busy() end)

    try do
      # Each call that looks closes the gate at its first look, for 200 us and
      # more (VllmBridge.LookGateTest below). Calls that start while it is
      # closed do not look, so the gate may be open again when the last call
      # returns; what shows it closed is its end: later than the first call's
      # start.
      started = :erlang.monotonic_time(:microsecond)
      for _ <- 1..50, do: assert({:ok, +0.0} = Runtime.call_function("sleep", [0.0], rt))

      refute LookGate.open?(gate, started),
             "the look gate never closed in 50 calls beside busy processes"
    after
      Enum.each(busy, &Process.exit(&1, :kill))
    end
  end

  defp keep_busy do
    _ = :erlang.make_tuple(1_000, 0)
    keep_busy()
  end

  test "a call with others in flight on its worker sleeps at once", %{test: test} do
    pool = start_pool!(:"#{test}", 1, reply_spin_us: 1_000)
    rt = [__runtime__: [pool: pool]]

    other = Task.async(fn -> Runtime.call_function("sleep", [1.0], rt) end)
    # the other call is in the worker's table of pending calls
    {:ok, worker} = Pool.worker(pool, 0)
    eventually(fn -> pending(worker) == 1 end)

    {outs, result} = schedule_outs(fn -> Runtime.call_function("sleep", [0.02], rt) end)
    assert {:ok, 0.02} = result
    assert outs <= 2, "a caller with company was scheduled out #{outs} times"
    assert {:ok, 1.0} = Task.await(other, 10_000)
  end

  @tag :capture_log
  test "a spinning caller still gets its timeout and the worker's exit", %{test: test} do
    pool = start_pool!(:"#{test}", 1, reply_spin_us: 1_000)
    rt = fn opts -> [__runtime__: [pool: pool] ++ opts] end

    assert {:error, %Error{category: :timeout}} =
             Runtime.call_function("sleep", [1.0], rt.(timeout: 5))

    {:ok, worker} = Pool.worker(pool, 0)
    {:ok, os_pid} = Worker.os_pid(worker)
    call = Task.async(fn -> Runtime.call_function("sleep", [30.0], rt.([])) end)
    eventually(fn -> pending(worker) == 1 end)
    kill9(os_pid)
    assert {:error, %Error{category: :worker}} = Task.await(call, 10_000)
  end

  test ":reply_spin_us is checked by the pool and the worker" do
    for bad <- [-1, 1_001, 2.5, :fast] do
      assert {:error, %Error{category: :bad_args, details: %{reply_spin_us: ^bad}}} =
               Pool.start_link(name: :reply_spin_pool, reply_spin_us: bad)

      assert {:error, %Error{category: :bad_args, details: %{reply_spin_us: ^bad}}} =
               Worker.start_link(reply_spin_us: bad)
    end
  end
end

defmodule VllmBridge.ReplyWaitOneSchedulerTest do
  # With one scheduler online the look would hold the VM's only CPU while
  # Python needs one, so a caller sleeps at once. Not async: it takes the
  # VM's other schedulers offline for the duration.
  use ExUnit.Case, async: false

  import VllmBridge.PoolHelpers

  alias VllmBridge.Runtime

  @moduletag timeout: 90_000

  test "a caller on a VM with one scheduler online sleeps at once", %{test: test} do
    pool = start_pool!(:"#{test}", 1, reply_spin_us: 1_000)
    online = :erlang.system_info(:schedulers_online)

    try do
      :erlang.system_flag(:schedulers_online, 1)

      {outs, result} =
        VllmBridge.ReplyWaitTest.schedule_outs(fn ->
          Runtime.call_function("sleep", [0.02], __runtime__: [pool: pool])
        end)

      assert {:ok, 0.02} = result
      assert outs <= 2, "a caller with one scheduler was scheduled out #{outs} times"
    after
      :erlang.system_flag(:schedulers_online, online)
    end
  end
end

defmodule VllmBridge.LookGateTest do
  # The look gate's bookkeeping, with the times given: when it closes, for how
  # long, and when it forgets.
  use ExUnit.Case, async: true

  alias VllmBridge.Worker.LookGate

  doctest LookGate

  test "a look away more than 20 us is away" do
    refute LookGate.away?(1_000, 1_020)
    assert LookGate.away?(1_000, 1_021)
  end

  test "closings with no calm between double, up to 50 ms; 64 calm looks bring back 200 us" do
    gate = LookGate.new()
    assert LookGate.open?(gate, -5_000_000)

    closed_for = fn now ->
      :ok = LookGate.close(gate, now)

      Enum.find([200, 400, 800, 1_600, 3_200, 6_400, 12_800, 25_600, 50_000], fn us ->
        not LookGate.open?(gate, now + us - 1) and LookGate.open?(gate, now + us)
      end)
    end

    assert Enum.map(1..11, &closed_for.(&1 * 1_000_000)) ==
             [200, 400, 800, 1_600, 3_200, 6_400, 12_800, 25_600, 50_000, 50_000, 50_000]

    # 63 looks in a row that were not away are not yet a calm
    for _ <- 1..63, do: :ok = LookGate.calm(gate)
    assert closed_for.(20_000_000) == 50_000

    for _ <- 1..64, do: :ok = LookGate.calm(gate)
    assert closed_for.(30_000_000) == 200
    assert closed_for.(31_000_000) == 400
  end

  test "without a gate (the application not started) every look may start" do
    assert LookGate.open?(nil, 0)
    assert :ok = LookGate.close(nil, 0)
    assert :ok = LookGate.calm(nil)
  end
end
