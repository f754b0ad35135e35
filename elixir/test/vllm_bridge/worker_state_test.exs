defmodule VllmBridge.WorkerStateTest do
  # A worker's state as data, and its start-up phases, without a process or
  # Python: VllmBridge.Worker.State and the transitions in
  # VllmBridge.Worker.Startup.
  use ExUnit.Case, async: true

  alias VllmBridge.Error
  alias VllmBridge.Worker.{Pending, Startup, State}

  setup do
    %{table: Pending.new()}
  end

  describe "State.new/2" do
    test "takes the options, and defaults for those not given", %{table: table} do
      state = State.new([python: "/usr/bin/python3", pool: :p, index: 2], table)

      assert %State{
               python: "/usr/bin/python3",
               spawn: [],
               table: ^table,
               pool: :p,
               index: 2,
               registry: nil,
               health_interval: 5_000,
               health_timeout: 5_000,
               max_calls: nil,
               max_memory_mb: nil,
               backoff_min: 500,
               backoff_max: 30_000,
               reply_spin_us: 50
             } = state
    end

    test "is a worker that has not spawned Python yet", %{table: table} do
      state = State.new([python: "python3"], table)

      assert %{phase: :starting, port: nil, os_pid: nil, attempt: 0, last_error: nil} = state
      assert %{waiters: [], output_tail: [], calls: 0, heard: 0, health: nil} = state
      assert %{replace_requested: false, memory_checked: nil, diagnosis: nil} = state
    end

    test "keeps the spawn options and the given timings and limits", %{table: table} do
      opts = [
        python: "python3",
        args: ["--exports", "m:t"],
        env: %{"A" => "1"},
        cd: "/tmp",
        name: :ignored,
        registry: {:reg, 0},
        health_interval: false,
        health_timeout: 7,
        max_calls: 3,
        max_memory_mb: 100,
        backoff_min: 1,
        backoff_max: 2,
        reply_spin_us: 0
      ]

      state = State.new(opts, table)

      assert state.spawn == [args: ["--exports", "m:t"], env: %{"A" => "1"}, cd: "/tmp"]
      assert state.registry == {:reg, 0}

      assert {false, 7, 3, 100, 1, 2, 0} ==
               {state.health_interval, state.health_timeout, state.max_calls, state.max_memory_mb,
                state.backoff_min, state.backoff_max, state.reply_spin_us}
    end
  end

  test "State.info/2 is the snapshot VllmBridge.Worker.info/1 returns", %{table: table} do
    state = %{State.new([python: "python3", pool: :p, index: 1], table) | os_pid: 42, calls: 5}

    assert State.info(%{state | attempt: 2, phase: :backoff}, 3) == %{
             os_pid: 42,
             python: "python3",
             pending: 3,
             pool: :p,
             index: 1,
             health_interval: 5_000,
             health_timeout: 5_000,
             phase: :backoff,
             calls: 5,
             failed_starts: 2,
             max_calls: nil,
             max_memory_mb: nil,
             owners: 0
           }
  end

  describe "Startup phases" do
    setup %{table: table} do
      %{state: State.new([python: "python3"], table)}
    end

    test "spawned/4 starts afresh: nothing heard, printed or pinged yet", %{state: state} do
      port = hd(Port.list())
      before = %{state | heard: 99, output_tail: ["old"], health: {1, make_ref(), false}}

      spawned = Startup.spawned(%{before | phase: :backoff}, port, 1234, "/usr/bin/python3")

      assert %{port: ^port, os_pid: 1234, python: "/usr/bin/python3", phase: :starting} = spawned
      assert %{output_tail: [], heard: 0, health: nil} = spawned
      assert is_integer(spawned.spawned_at)
    end

    test "ready/2 ends a run of failures and notes what was heard", %{state: state} do
      failing = %{
        state
        | attempt: 3,
          last_error: Error.new(:worker, "x"),
          diagnosis: %{stderr: ["x"], missing_module: nil},
          output_tail: ["a line"],
          waiters: [{self(), make_ref()}]
      }

      assert %{
               phase: :ready,
               attempt: 0,
               last_error: nil,
               diagnosis: nil,
               output_tail: [],
               waiters: [],
               heard: 17
             } = Startup.ready(failing, 17)
    end

    test "failed/2 backs off and keeps the failure", %{state: state} do
      error = Error.new(:worker, "could not start")
      diagnosis = %{stderr: ["boom"], missing_module: nil}
      failure = %{attempt: 2, delay: 1_000, diagnosis: diagnosis, error: error}
      port = hd(Port.list())

      starting = %{
        state
        | port: port,
          waiters: [{self(), make_ref()}],
          health: {1, make_ref(), false}
      }

      assert %{
               port: nil,
               phase: :backoff,
               attempt: 2,
               last_error: ^error,
               diagnosis: ^diagnosis,
               waiters: [],
               health: nil
             } = Startup.failed(starting, failure)
    end

    test "printed/2 holds the last 1000 lines only while starting", %{state: state} do
      lines = for n <- 1..1005, do: "line #{n}"

      assert Startup.printed(state, lines).output_tail == Enum.drop(lines, 5)
      assert Startup.printed(%{state | phase: :ready}, lines).output_tail == []
    end
  end

  describe "Pending.answer_id/3" do
    test "takes the entry and answers a caller's alias, once", %{table: table} do
      # (a caller's alias: its monitor's, in a real call)
      tag = :erlang.alias()
      :ok = Pending.enter(table, 1, tag, self())
      assert Pending.answer_id(table, 1, {:ok, "r1"}) == :answered
      assert_received {^tag, {:ok, "r1"}}

      # gone once answered: a second reply with that id finds nothing
      assert Pending.answer_id(table, 1, {:ok, "late"}) == nil
      refute_received {_, {:ok, "late"}}
      assert :ets.info(table, :size) == 0
      :erlang.unalias(tag)
    end

    test "the worker's own requests are taken, not answered", %{table: table} do
      Pending.enter_own(table, 3, :health)
      Pending.enter_own(table, 4, :handshake)
      Pending.enter_own(table, 5, :release)
      assert Pending.answer_id(table, 3, {:ok, "h"}) == :health
      assert Pending.answer_id(table, 4, {:ok, "s"}) == :handshake
      assert Pending.answer_id(table, 5, {:ok, "r"}) == :release
      assert :ets.info(table, :size) == 0
      refute_received _
    end
  end

  describe "Pending.fail/3" do
    test "answers a caller's call in flight with the error, once", %{table: table} do
      tag = :erlang.alias()
      error = VllmBridge.Error.new(:worker, "gone")
      :ok = Pending.enter(table, 1, tag, self())
      assert Pending.fail(table, 1, error) == :ok
      assert_received {^tag, {:error, ^error}}

      # nothing left to answer: no entry, or the worker's own
      assert Pending.fail(table, 1, error) == :ok
      Pending.enter_own(table, 2, :health)
      assert Pending.fail(table, 2, error) == :ok
      assert :ets.lookup(table, 2) == [{2, :health, nil}]
      refute_received _
      :erlang.unalias(tag)
    end
  end
end
