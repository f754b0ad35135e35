Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.PoolTest do
  # Pools and workers with real Python processes: crashes, restarts, blocking
  # collectives, the raw worker API. Each test has its own pool.
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers

  alias VllmBridge.{Error, Pool, Proto, Ref, Runtime, Worker}

  @moduletag timeout: 90_000

  setup do
    unless VllmBridge.TestPython.worker_available?() do
      raise "the Python worker (bridge_py.worker) is not available"
    end

    :ok
  end

  test "a pool's state goes when it stops", %{test: test} do
    pool = start_pool!(:"#{test}", 1)
    assert {:ok, 0, _pid, _via, _timeout} = Pool.route(pool, :next)
    assert :ets.info(pool, :owner) == Process.whereis(pool)

    stop_supervised!(pool)

    assert :ets.info(pool) == :undefined
    assert Process.whereis(Module.concat(pool, Registry)) == nil
    assert for({{VllmBridge.Pool, _}, _} = entry <- :persistent_term.get(), do: entry) == []
    assert {:error, %Error{message: "no pool named " <> _}} = Pool.route(pool, :next)
  end

  test "pool functions", %{test: test} do
    pool = start_pool!(:"#{test}", 2)

    assert {:ok, 2} = Pool.size(pool)
    assert {:ok, 60_000} = Pool.timeout(pool)
    assert {:ok, [{0, w0}, {1, w1}]} = Pool.workers(pool)
    assert w0 != w1
    assert {:ok, ^w0} = Pool.worker(pool, 0)
    assert {:ok, 1, ^w1, _via, 60_000} = Pool.route(pool, w1)
    assert {:ok, 1, ^w1, _via, 60_000} = Pool.route(pool, {1, w1})
    assert {:error, %Error{category: :worker}} = Pool.route(pool, self())
    assert {:error, %Error{category: :worker}} = Pool.route(pool, {0, w1})
    assert {:error, %Error{category: :bad_args}} = Pool.worker(pool, 2)
    assert {:error, %Error{category: :bad_args}} = Pool.worker(pool, -1)
    assert {:error, %Error{category: :bad_args}} = Pool.worker(pool, :zero)
    assert {:error, %Error{category: :worker}} = Pool.worker(:no_such_pool, 0)
    assert {:error, %Error{category: :worker}} = Pool.route(:no_such_pool, :next)
    assert {:error, %Error{category: :worker}} = Pool.size("not an atom")
    # the lookups the runtime places calls with answer wrong arguments, not raise
    assert {:error, %Error{category: :bad_args}} = Pool.route(pool, :zero)
    assert {:error, %Error{category: :bad_args}} = Pool.route(pool, {:zero, w0})
    assert {:error, %Error{category: :bad_args}} = Pool.route(pool, 2)
    assert {:error, %Error{category: :worker}} = Pool.route(1.5, 0)
    assert {:error, %Error{category: :worker}} = Pool.route({:not, :a, :name}, {0, w0})
    assert {:error, %Error{category: :worker}} = Pool.workers(:no_such_pool)

    picks =
      for _ <- 1..4 do
        {:ok, _index, pid, _via, _timeout} = Pool.route(pool, :next)
        pid
      end

    assert Enum.frequencies(picks) == %{w0 => 2, w1 => 2}

    # the pool's own options, checked as the workers' are: each named in its error
    for {key, _} = opt <- [
          size: 0,
          name: "x",
          name: nil,
          timeout: -1,
          startup_timeout: 0,
          max_restarts: -1,
          max_seconds: 0
        ] do
      assert {:error, %Error{category: :bad_args, message: message, details: details}} =
               Pool.start_link(Keyword.merge([name: :bad_pool], [opt]))

      assert message =~ "#{inspect(key)} must be", message
      assert details == Map.new([opt])
    end

    # times in ms past the longest wait the BEAM can time (4294967295 ms)
    for {key, _} = opt <- [
          timeout: 4_294_967_296,
          startup_timeout: 4_294_967_296,
          health_interval: 4_294_967_296,
          health_timeout: 4_294_967_296,
          backoff_min: 4_294_967_296,
          backoff_max: 4_294_967_296
        ] do
      assert {:error, %Error{category: :bad_args, message: message}} =
               Pool.start_link([opt, name: :bad_pool])

      assert message =~ "#{key}" and message =~ "at most 4294967295"
    end

    # what the Python process is started with: refused before anything starts
    # (a bad :env or :python crashed the worker's init, and the caller with it)
    for {key, _} = opt <- [
          env: :debug,
          env: "A=1",
          env: [{"A=B", "1"}],
          env: [{"", "1"}],
          env: [{"A", "a\0b"}],
          env: [:not_a_pair],
          python: 5,
          python: "",
          args: :bad,
          args: [1, 2],
          args: ["--x" | "y"],
          cd: 5
        ] do
      assert {:error, %Error{category: :bad_args, message: message}} =
               Pool.start_link([opt, name: :bad_pool])

      assert message =~ "#{inspect(key)} must be"
      assert {:error, %Error{category: :bad_args}} = Worker.start_link([opt])
    end

    for opts <- [:not_a_list, [1, 2], [{:name, :bad_pool} | :tail]] do
      assert {:error, %Error{category: :bad_args, message: message}} = Pool.start_link(opts)
      assert message =~ "options must be a keyword list"
      assert {:error, %Error{category: :bad_args}} = Worker.start_link(opts)
    end

    refute Process.whereis(:bad_pool)
  end

  @tag :capture_log
  test "a killed Python process: pending callers get :worker errors, the worker restarts",
       %{test: test} do
    pool = start_pool!(:"#{test}", 2)
    {:ok, old} = Pool.worker(pool, 0)
    {:ok, other} = Pool.worker(pool, 1)
    {:ok, os_pid} = Worker.os_pid(old)
    assert is_integer(os_pid)

    {:ok, counter} = Runtime.call_class("Counter", [], __runtime__: [pool: pool, worker: 0])

    waiters =
      for _ <- 1..2,
          do:
            Task.async(fn ->
              Runtime.call_function("sleep", [30.0], __runtime__: [pool: pool, worker: 0])
            end)

    blocked = Task.async(fn -> Runtime.call_method(counter, "wait_gate", [30.0]) end)
    eventually(fn -> match?({:ok, %{pending: 3}}, Worker.info(old)) end)

    monitor = Process.monitor(old)
    {_, 0} = System.cmd("kill", ["-9", Integer.to_string(os_pid)])

    for task <- [blocked | waiters] do
      assert {:error, %Error{category: :worker, message: message}} = Task.await(task, 5_000)
      assert message =~ "exited"
    end

    assert_receive {:DOWN, ^monitor, :process, ^old, _}, 5_000

    # a fresh worker (and Python process) takes index 0; the other is untouched
    new =
      eventually(fn ->
        match?({:ok, pid} when pid != old, Pool.worker(pool, 0)) && elem(Pool.worker(pool, 0), 1)
      end)

    assert {:ok, new_os_pid} = Worker.os_pid(new)
    assert new_os_pid != os_pid
    assert {:ok, ^other} = Pool.worker(pool, 1)
    assert {:ok, :alive} = Runtime.ping(:alive, __runtime__: [pool: pool, worker: 0])

    # refs into the dead process are stale, never sent to the new one
    assert {:error, %Error{category: :stale_ref, message: message}} =
             Runtime.call_method(counter, "incr", [])

    assert message =~ "Counter handle #{counter.id}"
  end

  test "a barrier blocks one call while the same worker keeps answering", %{test: test} do
    # the shipped export table: StatelessProcessGroup over a TCPStore
    pool = start_pool!(:"#{test}", 2, args: [])
    port = free_tcp_port()

    create = fn rank ->
      Task.async(fn ->
        Runtime.call_function(
          "StatelessProcessGroup.create",
          ["127.0.0.1", port, rank, 2],
          store_timeout: 30,
          __runtime__: [pool: pool, worker: rank]
        )
      end)
    end

    [t0, t1] = Enum.map([0, 1], create)
    assert {:ok, %Ref{class: "StatelessProcessGroup"} = g0} = Task.await(t0, 40_000)
    assert {:ok, %Ref{class: "StatelessProcessGroup"} = g1} = Task.await(t1, 40_000)
    assert {:ok, w0} = Pool.worker(pool, 0)
    assert g0.worker == w0
    assert {:ok, 0} = Runtime.get_attr(g0, "rank")
    assert {:ok, 2} = Runtime.get_attr(g1, "world_size")

    # rank 0 enters the barrier; rank 1 has not arrived, so it blocks
    barrier0 = Task.async(fn -> Runtime.call_method(g0, "barrier", [], timeout: 20) end)

    for i <- 1..10 do
      assert {:ok, {:pong, ^i}} = Runtime.ping({:pong, i}, __runtime__: [pool: pool, worker: 0])
    end

    assert Task.yield(barrier0, 200) == nil

    assert {:ok, nil} = Runtime.call_method(g1, "barrier", [], timeout: 20)
    assert {:ok, nil} = Task.await(barrier0, 20_000)

    # and the group carries objects between ranks
    b0 = Task.async(fn -> Runtime.call_method(g0, "broadcast_obj", [%{"k" => [1, 2]}, 0]) end)
    assert {:ok, %{"k" => [1, 2]}} = Runtime.call_method(g1, "broadcast_obj", [nil, 0])
    assert {:ok, %{"k" => [1, 2]}} = Task.await(b0, 20_000)

    assert {:ok, 1} = Runtime.release(g1)
    assert {:ok, 1} = Runtime.release(g0)
  end

  describe "Worker" do
    test "raw requests, duplicate ids, info" do
      worker = start_supervised!({Worker, args: sample_args()})
      {:ok, info} = Worker.info(worker)
      assert %{pending: 0, pool: nil} = info
      assert is_integer(info.os_pid)

      id = Worker.new_id()

      {:ok, frame} =
        Proto.encode_request(%{id: id, session: "", op: {:ping, %{payload: <<0xC3>>}}})

      assert {:ok, reply} = Worker.request(worker, id, frame, 30_000)
      assert {:ok, %{id: ^id, result: {:value, <<0xC3>>}}} = Proto.decode_reply(reply)

      # the same id twice while in flight is refused
      id = Worker.new_id()
      {:ok, args} = VllmBridge.Msgpack.encode([0.3])

      {:ok, frame} =
        Proto.encode_request(%{
          id: id,
          session: "",
          op: {:call_function, %{function: "sleep", args: args, kwargs: ""}}
        })

      first = Worker.send_request(worker, id, frame)
      assert {:error, %Error{category: :bad_args}} = Worker.request(worker, id, frame, 5_000)
      assert {:ok, _reply} = Worker.await(first, 5_000)

      # not iodata
      assert {:error, %Error{category: :bad_args}} =
               Worker.request(worker, Worker.new_id(), [:nope], 5_000)
    end

    test "releasing the refs of one worker goes through its channel", %{test: test} do
      pool = start_pool!(:"#{test}", 1)
      {:ok, worker} = Pool.worker(pool, 0)
      {:ok, counter} = Runtime.call_class("Counter", [], __runtime__: [pool: pool])
      :erlang.trace(worker, true, [:receive])
      assert {:ok, 1} = Runtime.release(counter)
      :erlang.trace(worker, false, [:receive])
      # written by the caller: the Worker process saw only the reply (and the
      # question of how many holds the caller's ref had)
      assert_received {:trace, ^worker, :receive, {:"$gen_call", _, {:disown, "", _}}}
      refute_received {:trace, ^worker, :receive, {:"$gen_call", _, _}}
      assert_received {:trace, ^worker, :receive, {_port, {:data, _reply}}}
      assert {:ok, 0} = Runtime.release(counter)
    end

    test "the channel: requests written to the port by the caller, with the same results",
         %{test: test} do
      pool = start_pool!(:"#{test}", 1)
      {:ok, worker} = Pool.worker(pool, 0)
      # the worker published its channel in the pool's registry
      assert {:ok, 0, ^worker, channel, _timeout} = Pool.route(pool, {0, worker})
      refute channel == worker
      assert {:error, _} = Pool.route(pool, {1, worker})
      assert {:error, _} = Pool.route(pool, {0, self()})

      id = Worker.new_id()
      {:ok, frame} = Proto.encode_request(%{id: id, session: "", op: {:ping, %{payload: <<7>>}}})
      :erlang.trace(worker, true, [:receive])
      assert {:ok, reply} = Worker.request(channel, id, frame, 30_000)
      assert {:ok, %{id: ^id, result: {:value, <<7>>}}} = Proto.decode_reply(reply)
      # the request did not pass through the worker process; only its reply did
      refute_received {:trace, ^worker, :receive, {:"$gen_call", _, _}}
      assert_received {:trace, ^worker, :receive, {_port, {:data, ^reply}}}
      :erlang.trace(worker, false, [:receive])

      # an id in flight is refused whether the worker is given by channel or by pid
      # (the first call waits on a gate, so it stays in flight until the test opens
      # it; a gate opens for good: one counter per round)
      rt = [__runtime__: [pool: pool, worker: 0]]
      {:ok, args} = VllmBridge.Msgpack.encode([30.0])

      for {first_way, second_way} <- [{channel, worker}, {worker, channel}, {channel, channel}] do
        {:ok, gated} = Runtime.call_class("Counter", [], rt)
        id = Worker.new_id()
        op = {:call, %{handle: gated.id, method: "wait_gate", args: args, kwargs: ""}}
        {:ok, frame} = Proto.encode_request(%{id: id, session: "", op: op})
        first = Task.async(fn -> Worker.request(first_way, id, frame, 60_000) end)
        eventually(fn -> match?({:ok, %{pending: 1}}, Worker.info(worker)) end)

        assert {:error, %Error{category: :bad_args}} =
                 Worker.request(second_way, id, frame, 5_000)

        assert {:ok, nil} = Runtime.call_function("open_gate", [gated], rt)
        assert {:ok, reply} = Task.await(first, 60_000)
        assert {:ok, %{id: ^id, result: {:value, value}}} = Proto.decode_reply(reply)
        assert VllmBridge.Msgpack.decode(value) == {:ok, true}
      end

      assert {:ok, %{pending: 0}} = Worker.info(worker)

      # not iodata (refused by the port, then named; its table entry goes too).
      # The VM may also print "Bad value on output port" for it: its own report,
      # sent with no group leader, which capture_log cannot take.
      assert {:error, %Error{category: :bad_args, message: "request frame is not iodata"}} =
               Worker.request(channel, Worker.new_id(), [:nope], 5_000)

      assert {:ok, %{pending: 0}} = Worker.info(worker)

      # the channel of a worker that has stopped: a :worker error, not a hang
      ref = Process.monitor(worker)
      GenServer.stop(worker)
      assert_receive {:DOWN, ^ref, :process, ^worker, _}

      assert {:error, %Error{category: :worker}} =
               Worker.request(channel, Worker.new_id(), frame, 5_000)

      assert {:messages, []} = Process.info(self(), :messages)
    end

    @tag :capture_log
    test "a Python that cannot start is an error at start" do
      worker = start_supervised!({Worker, python: "/nonexistent/python", backoff_min: 50})

      assert {:error, %Error{category: :worker, message: message}} =
               Worker.await_started(worker, 5_000)

      assert message =~ "/nonexistent/python"
      assert {:ok, %{phase: :backoff}} = Worker.info(worker)
    end

    @tag :capture_log
    test "while a start has failed, every call gets its error at once, by channel with no message",
         %{test: test} do
      registry = :"#{test}.Registry"
      start_supervised!({Registry, keys: :unique, name: registry})

      spec =
        {Worker,
         python: "/nonexistent/python",
         backoff_min: 60_000,
         name: {:via, Registry, {registry, 0}},
         registry: {registry, 0}}

      worker = start_supervised!(spec)
      assert {:error, %Error{category: :worker} = error} = Worker.await_started(worker, 5_000)

      # the channel published and the one handed out carry the start's error
      assert [{:channel, ^worker, ^error, _, _} = channel] = Registry.values(registry, 0, worker)
      assert {:ok, ^channel} = Worker.channel(worker)

      id = Worker.new_id()
      {:ok, frame} = Proto.encode_request(%{id: id, session: "", op: {:ping, %{payload: ""}}})
      :erlang.trace(worker, true, [:receive])
      assert {:error, ^error} = Worker.request(channel, id, frame, 5_000)
      assert {:error, ^error} = channel |> Worker.send_request(id, frame) |> Worker.await(5_000)
      # a frame that is not iodata is named first
      assert {:error, %Error{category: :bad_args}} = Worker.request(channel, id, [:nope], 5_000)
      assert traced(worker) -- [:health_tick] == []

      # by pid: the worker hands out its channel, and that is all it sees
      assert {:error, ^error} = Worker.request(worker, id, frame, 5_000)
      assert {:error, ^error} = worker |> Worker.send_request(id, frame) |> Worker.await(5_000)
      :erlang.trace(worker, false, [:receive])

      assert [{:"$gen_call", _, :channel}, {:"$gen_call", _, :channel}] =
               traced(worker) -- [:health_tick]

      assert {:ok, %{pending: 0, phase: :backoff}} = Worker.info(worker)
    end

    test "a worker that is not running is a :worker error" do
      assert {:error, %Error{category: :worker}} = Worker.request(:no_such_worker, 1, "", 1_000)

      assert {:error, %Error{category: :worker}} =
               :no_such_worker |> Worker.send_request(1, "") |> Worker.await(1_000)

      assert {:error, %Error{category: :worker}} = Worker.channel(:no_such_worker)
      assert {:error, %Error{category: :worker}} = Worker.os_pid(:no_such_worker)
    end
  end

  # The messages `worker` received while traced (every one delivered by now).
  defp traced(worker) do
    ref = :erlang.trace_delivered(worker)
    assert_receive {:trace_delivered, ^worker, ^ref}, 5_000
    collect_traced(worker)
  end

  defp collect_traced(worker) do
    receive do
      {:trace, ^worker, :receive, message} -> [message | collect_traced(worker)]
    after
      0 -> []
    end
  end
end
