Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fault_helpers.exs", __DIR__)

defmodule VllmBridge.FaultsTest do
  # Faults with real Python processes: SIGKILLed workers, timeouts, garbage on
  # the wire, Python that prints to the protocol's fd, a SIGKILLed BEAM, and
  # a rank that dies inside a collective. Each test has its own pool.
  use ExUnit.Case, async: true

  import Bitwise
  import VllmBridge.PoolHelpers
  import VllmBridge.FaultHelpers

  alias VllmBridge.{Error, Msgpack, Pool, Proto, Ref, Runtime, Worker}
  alias Vllm.Distributed.StatelessProcessGroup, as: SPG

  @moduletag timeout: 120_000
  @moduletag :tmp_dir

  setup do
    unless VllmBridge.TestPython.worker_available?() do
      raise "the Python worker (bridge_py.worker) is not available"
    end

    :ok
  end

  # A task that returns {result, monotonic ms when the result came}.
  defp timed_task(fun) do
    Task.async(fn ->
      result = fun.()
      {result, now_ms()}
    end)
  end

  defp wait_pending(worker, n), do: eventually(fn -> pending(worker) == n end)

  # A pool of one worker named after the test, its runtime options, that
  # worker, and a Counter in it.
  defp counter_in_one_worker(test) do
    pool = start_pool!(:"#{test}", 1)
    rt = [__runtime__: [pool: pool, worker: 0]]
    {:ok, worker} = Pool.worker(pool, 0)
    {:ok, counter} = Runtime.call_class("Counter", [], rt)
    {pool, rt, worker, counter}
  end

  # The pid at `index` once it is another than `old`.
  defp replacement(pool, index, old) do
    eventually(fn ->
      case Pool.worker(pool, index) do
        {:ok, pid} when pid != old -> pid
        _ -> false
      end
    end)
  end

  @tag :capture_log
  @tag timeout: 60_000
  test "SIGKILL mid-call: pending callers fail at once, a new worker, stale refs, others unaffected",
       %{test: test} do
    pool = start_pool!(:"#{test}", 2)
    rt = fn index -> [__runtime__: [pool: pool, worker: index]] end
    {:ok, w0} = Pool.worker(pool, 0)
    {:ok, w1} = Pool.worker(pool, 1)
    {:ok, os_pid} = Worker.os_pid(w0)

    # objects in the doomed worker: the gated one, and a plain one
    {:ok, gated} = Runtime.call_class("Counter", [], rt.(0))
    {:ok, stale} = Runtime.call_class("Counter", [], rt.(0))
    assert {:ok, 1} = Runtime.call_method(stale, "incr", [])

    # and in the other worker, calls that are in flight across the kill
    {:ok, survivor} = Runtime.call_class("Counter", [], rt.(1))

    doomed = [
      timed_task(fn -> Runtime.call_method(gated, "wait_gate", [30.0]) end),
      timed_task(fn -> Runtime.call_function("sleep", [30.0], rt.(0)) end),
      timed_task(fn -> Runtime.call_function("sleep", [30.0], rt.(0)) end)
    ]

    others = [
      Task.async(fn -> Runtime.call_method(survivor, "wait_gate", [30.0]) end),
      Task.async(fn -> Runtime.call_function("sleep", [1.0], rt.(1)) end)
    ]

    wait_pending(w0, 3)
    wait_pending(w1, 2)

    monitor = Process.monitor(w0)
    killed_at = now_ms()
    kill9(os_pid)

    # At once: the port's exit fails them, not their 30 s calls or a timeout (the
    # bound is slack for a loaded machine, far below both).
    for task <- doomed do
      assert {{:error, %Error{category: :worker}}, at} = Task.await(task, 5_000)
      assert at - killed_at < 3_000, "a pending caller waited #{at - killed_at} ms"
    end

    assert_receive {:DOWN, ^monitor, :process, ^w0, _}, 1_000

    # a new worker at index 0 with a new Python process; index 1 untouched
    new = replacement(pool, 0, w0)
    assert {:ok, new_os_pid} = Worker.os_pid(new)
    assert new_os_pid != os_pid
    assert {:ok, :pong} = Runtime.ping(:pong, rt.(0))
    assert {:ok, ^w1} = Pool.worker(pool, 1)

    # the other worker's in-flight calls complete normally
    assert {:ok, nil} = Runtime.call_function("open_gate", [survivor], rt.(1))
    assert [{:ok, true}, {:ok, 1.0}] = Task.await_many(others, 10_000)
    assert {:ok, 1} = Runtime.call_method(survivor, "incr", [])

    # objects in the new worker until one has the stale ref's handle id
    fresh =
      Enum.find_value(1..(stale.id + 1), fn _ ->
        {:ok, ref} = Runtime.call_class("Counter", [100], rt.(0))
        ref.id == stale.id && ref
      end)

    assert %Ref{worker: ^new} = fresh, "the new worker never reused handle #{stale.id}"

    # the stale ref is refused without a request: the new object is unchanged
    assert {:error, %Error{category: :stale_ref, message: message}} =
             Runtime.call_method(stale, "incr", [])

    assert message =~ "Counter handle #{stale.id}"
    assert {:error, %Error{category: :stale_ref}} = Runtime.get_attr(stale, "value")

    assert {:error, %Error{category: :stale_ref}} =
             Runtime.call_function("open_gate", [stale], [])

    assert {:ok, 0} = Runtime.release(stale)
    assert {:ok, 100} = Runtime.get_attr(fresh, "value")
    assert {:ok, 101} = Runtime.call_method(fresh, "incr", [])
  end

  @tag :capture_log
  @tag timeout: 60_000
  test "send_request/3 and await/2: a request written after Python died is a :worker error" do
    worker =
      start_supervised!(Supervisor.child_spec({Worker, args: sample_args()}, restart: :temporary))

    # Python runs (a Python that dies before answering its start handshake is
    # a failed start, retried by the same worker: see "Start-up" in Worker)
    :ok = Worker.await_started(worker)
    {:ok, os_pid} = Worker.os_pid(worker)
    # a worker outside a pool hands out its channel
    assert {:ok, {:channel, ^worker, port, _, _} = channel} = Worker.channel(worker)

    # Python dies and its port closes while the worker cannot act on it; the
    # request then finds a closed port, and hears from the worker once it can
    :sys.suspend(worker)
    monitor = Process.monitor(worker)
    kill9(os_pid)
    eventually(fn -> Port.info(port) == nil end, 5_000)
    id = Worker.new_id()
    request = Worker.send_request(channel, id, ping_frame!(id, :late))
    :sys.resume(worker)

    assert {:error, %Error{category: :worker, message: message}} = Worker.await(request, 5_000)
    assert message =~ "exited with status"
    assert_receive {:DOWN, ^monitor, :process, ^worker, _}, 5_000

    # by pid once the worker has gone: a :worker error naming why
    assert {:error, %Error{category: :worker, details: %{reason: :noproc}}} =
             worker |> Worker.send_request(Worker.new_id(), "") |> Worker.await(5_000)

    assert {:messages, []} = Process.info(self(), :messages)
  end

  @tag :capture_log
  @tag timeout: 60_000
  test "a request written with the channel of a start that failed gets that start's error at once",
       %{test: test, tmp_dir: dir} do
    # A "Python" that exits before answering its start handshake: a failed start
    python = Path.join(dir, "python_that_dies")
    File.write!(python, "#!/bin/sh\nsleep 1\nexit 3\n")
    File.chmod!(python, 0o755)

    registry = :"#{test}.Registry"
    start_supervised!({Registry, keys: :unique, name: registry})

    spec =
      {Worker,
       python: python,
       name: {:via, Registry, {registry, 0}},
       registry: {registry, 0},
       backoff_min: 60_000,
       health_interval: 60_000}

    worker = start_supervised!(spec)
    # while it starts, the channel is its port
    assert [{:channel, ^worker, port, _, _} = channel] = Registry.values(registry, 0, worker)
    assert is_port(port)

    assert {:error, %Error{category: :worker} = error} = Worker.await_started(worker, 20_000)
    assert {:ok, %{phase: :backoff}} = Worker.info(worker)
    # the worker handled the exit, and its channel is now the start's error
    assert [{:channel, ^worker, ^error, _, _}] = Registry.values(registry, 0, worker)

    # A caller that took the channel before the start failed writes to the
    # closed port: the worker answers it at once (no health tick or new
    # start for a minute), with the start's error
    id = Worker.new_id()
    started = now_ms()
    assert {:error, ^error} = Worker.request(channel, id, ping_frame!(id, :late), 30_000)
    assert now_ms() - started < 10_000
    assert {:ok, %{pending: 0}} = Worker.info(worker)

    # the channel of now: the error, without a message to the worker
    :erlang.trace(worker, true, [:receive])
    [now] = Registry.values(registry, 0, worker)
    assert {:error, ^error} = Worker.request(now, Worker.new_id(), ping_frame!(1, :x), 5_000)
    :erlang.trace(worker, false, [:receive])
    assert traced(worker) -- [:health_tick] == []
  end

  @tag :capture_log
  @tag timeout: 60_000
  test "through the channel: a request written after Python died is a :worker error",
       %{test: test} do
    # a registry of the test's own, where the worker publishes its channel
    registry = :"#{test}.Registry"
    start_supervised!({Registry, keys: :unique, name: registry})
    name = {:via, Registry, {registry, 0}}
    spec = {Worker, args: sample_args(), name: name, registry: {registry, 0}}
    worker = start_supervised!(Supervisor.child_spec(spec, restart: :temporary))
    :ok = Worker.await_started(worker)

    {:ok, os_pid} = Worker.os_pid(worker)
    assert [{:channel, ^worker, port, _, _} = channel] = Registry.values(registry, 0, worker)

    # Python dies and its port closes while the worker cannot act on it; the
    # request then finds a closed port, and hears from the worker once it can
    :sys.suspend(worker)
    monitor = Process.monitor(worker)
    kill9(os_pid)
    eventually(fn -> Port.info(port) == nil end, 5_000)
    id = Worker.new_id()
    call = Task.async(fn -> Worker.request(channel, id, ping_frame!(id, :late), 5_000) end)
    assert Task.yield(call, 200) == nil
    :sys.resume(worker)

    assert {:error, %Error{category: :worker, message: message}} = Task.await(call)
    assert message =~ "exited with status"
    assert_receive {:DOWN, ^monitor, :process, ^worker, _}, 5_000
  end

  @tag :capture_log
  @tag timeout: 60_000
  test "a ref whose worker died a moment ago is stale, before the pool has noticed",
       %{test: test} do
    {pool, rt, worker, counter} = counter_in_one_worker(test)

    # Hold the moment: the pool cannot restart the worker, and its registry
    # still lists the dead one (the runtime does not ask whether it is alive).
    [registry_partition] =
      for {_, pid, _, _} <- Supervisor.which_children(Module.concat(pool, Registry)), do: pid

    [workers_sup] = for {:workers, pid, _, _} <- Supervisor.which_children(pool), do: pid
    :sys.suspend(registry_partition)
    :sys.suspend(workers_sup)

    try do
      monitor = Process.monitor(worker)
      Process.exit(worker, :kill)
      assert_receive {:DOWN, ^monitor, :process, ^worker, :killed}, 5_000
      assert {:ok, 0, ^worker, _, _} = Pool.route(pool, {0, worker})

      assert {:error, %Error{category: :stale_ref, message: message}} =
               Runtime.call_method(counter, "incr", [])

      assert message =~ "Counter handle #{counter.id}"
    after
      :sys.resume(workers_sup)
      :sys.resume(registry_partition)
    end

    # the pool goes on with a new worker; the ref stays stale
    replacement(pool, 0, worker)
    assert {:ok, :up} = Runtime.ping(:up, rt)
    assert {:error, %Error{category: :stale_ref}} = Runtime.call_method(counter, "incr", [])
  end

  # A ref crosses the wire as a bare handle id: the runtime checks every ref
  # among the arguments against the worker the call goes to, so a ref of
  # another worker, or a stale one, never names another object there.
  @tag :capture_log
  @tag timeout: 60_000
  test "a ref passed as an argument never resolves in another worker", %{test: test} do
    pool = start_pool!(:"#{test}", 2)
    rt = fn index -> [__runtime__: [pool: pool, worker: index]] end
    {:ok, c0} = Runtime.call_class("Counter", [0], rt.(0))
    {:ok, c1} = Runtime.call_class("Counter", [1000], rt.(1))
    assert c0.id == c1.id

    # worker 1's object, in a call placed on worker 0, must not name c0
    assert {:error, %Error{category: :bad_args}} = Runtime.call_function("echo", [c1], rt.(0))

    assert {:error, %Error{category: :bad_args}} =
             Runtime.call_function("echo", [%{"nested" => [c1]}], rt.(0))

    # a stale ref, placed at its old index (where a new worker now runs)
    {:ok, w0} = Pool.worker(pool, 0)
    {:ok, os_pid} = Worker.os_pid(w0)
    monitor = Process.monitor(w0)
    kill9(os_pid)
    assert_receive {:DOWN, ^monitor, :process, ^w0, _}, 5_000
    _new = replacement(pool, 0, w0)
    {:ok, fresh} = Runtime.call_class("Counter", [100], rt.(0))
    assert fresh.id == c0.id

    assert {:error, %Error{category: :stale_ref}} = Runtime.call_function("echo", [c0], rt.(0))

    assert {:error, %Error{category: :stale_ref}} =
             Runtime.call_function("open_gate", [c0], rt.(0))

    assert {:error, %Error{category: :stale_ref}} = Runtime.call_method(fresh, "incr", [c0])
    assert {:ok, 100} = Runtime.get_attr(fresh, "value")
  end

  @tag timeout: 30_000
  test "a call past its deadline: :timeout at the deadline, the late reply is dropped",
       %{test: test} do
    {_pool, rt, worker, counter} = counter_in_one_worker(test)

    # watch what the worker receives, to see the late reply arrive
    :erlang.trace(worker, true, [:receive])

    # The runtime writes the request to the port itself (the worker's channel)
    # and waits in the worker's table of pending calls: a watcher reports the
    # request's id from there while this process waits.
    table = :sys.get_state(worker).table
    me = self()

    spawn_link(fn ->
      [{late_id, _alias, _caller}] =
        eventually(fn -> :ets.tab2list(table) != [] and :ets.tab2list(table) end)

      send(me, {:late_id, late_id})
    end)

    started = now_ms()

    assert {:error, %Error{category: :timeout}} =
             Runtime.call_method(counter, "wait_gate", [10.0], __runtime__: [timeout: 300])

    elapsed = now_ms() - started
    # at the deadline, not after the 10 s wait (the bound leaves room for a loaded machine)
    assert elapsed >= 300 and elapsed < 3_000, "timed out after #{elapsed} ms"

    # the request that timed out: it did not pass through the worker process,
    # and the caller left the table of pending calls at its deadline
    assert_receive {:late_id, late_id}
    refute_received {:trace, ^worker, :receive, {:"$gen_call", _, _}}
    assert :ets.tab2list(table) == []

    # the worker keeps serving while that call is still blocked in Python
    assert {:ok, {:other, 1}} = Runtime.ping({:other, 1}, rt)
    assert {:ok, nil} = Runtime.call_function("open_gate", [counter], rt)

    # the late reply reaches the worker: the call returned after its deadline, so
    # Python dropped its result (true) and says so ...
    late_reply = traced_reply(worker, late_id)

    assert {:ok, %{id: ^late_id, result: {:error, %{category: "timeout", message: message}}}} =
             Proto.decode_reply(late_reply)

    assert message =~ "after the caller's deadline; its result was dropped"
    :erlang.trace(worker, false, [:receive])
    # ... is handled (a synchronous call is answered after it) ...
    assert {:ok, %{pending: 0}} = Worker.info(worker)
    flush_traces()

    # ... and never delivered: a later request from this process gets its own
    # answer, and nothing stray is in the mailbox
    assert {:ok, {:mine, 2}} = Runtime.ping({:mine, 2}, rt)
    assert {:ok, 2} = Runtime.call_method(counter, "incr", [2])
    assert {:messages, []} = Process.info(self(), :messages)

    # the same through Worker.send_request/3 and await/2 (as release/2 waits)
    {:ok, gated} = Runtime.call_class("Counter", [], rt)
    {:ok, args} = Msgpack.encode([10.0])
    id = Worker.new_id()
    frame = frame!(id, {:call, %{handle: gated.id, method: "wait_gate", args: args, kwargs: ""}})
    :erlang.trace(worker, true, [:receive])
    started = now_ms()

    assert {:error, %Error{category: :timeout}} =
             worker |> Worker.send_request(id, frame) |> Worker.await(300)

    elapsed = now_ms() - started
    # at the deadline, not after the 10 s wait (the bound leaves room for a loaded machine)
    assert elapsed >= 300 and elapsed < 3_000, "timed out after #{elapsed} ms"
    assert {:ok, nil} = Runtime.call_function("open_gate", [gated], rt)
    assert {:ok, %{id: ^id}} = worker |> traced_reply(id) |> Proto.decode_reply()
    :erlang.trace(worker, false, [:receive])
    assert {:ok, %{pending: 0}} = Worker.info(worker)
    flush_traces()
    assert {:ok, {:mine, 3}} = Runtime.ping({:mine, 3}, rt)
    assert {:messages, []} = Process.info(self(), :messages)
  end

  @tag :capture_log
  @tag timeout: 120_000
  test "10,000 malformed or random frames: a reply each, no hang, bounded memory, still serving" do
    seed = {:exsss, [1, 2, 3]}
    :rand.seed(:exsss, {1, 2, 3})
    {port, os_pid} = open_raw_worker!(sample_args())
    on_exit(fn -> kill9(os_pid) end)

    # the worker is up (torch imported) before memory is measured
    port_roundtrip!(port, ping_frame!(1, :up), 60_000)
    frames = fuzz_frames(10_000)
    {warm_up, rest} = Enum.split(frames, 500)
    warm_stats = send_batches(port, warm_up)
    rss_before = rss_kib(os_pid)
    stats = send_batches(port, rest)

    case {warm_stats, stats} do
      {%{exited: nil}, %{exited: nil}} ->
        rss_after = rss_kib(os_pid)

        assert rss_after - rss_before < 50 * 1024,
               "worker RSS grew from #{rss_before} to #{rss_after} KiB (seed #{inspect(seed)})"

        categories = Map.merge(warm_stats.categories, stats.categories, fn _, a, b -> a + b end)
        assert Enum.sum(Map.values(categories)) == 10_000
        # garbage is refused as garbage, and nothing is unknown to the runtime
        assert categories[:protocol] > 1_000
        known = [:value | VllmBridge.Error.categories()]
        assert Map.keys(categories) -- known == []

        # a valid request still works on this worker
        assert {:ok, %{id: 42, result: {:value, value}}} =
                 port_roundtrip!(port, ping_frame!(42, {:still, "here"}), 5_000)
                 |> Proto.decode_reply()

        assert {:ok, {:still, "here"}} = Msgpack.decode(value)

      {_, _} ->
        # The worker died on some frame (a finding for the Python side): a pool
        # worker fed the same batch dies too, and the pool starts a new one.
        batch = warm_stats.exited || stats.exited
        pool = start_pool!(:fuzz_exit_pool, 1)
        {:ok, worker} = Pool.worker(pool, 0)
        monitor = Process.monitor(worker)
        for frame <- batch, do: Worker.send_request(worker, Worker.new_id(), frame)
        assert_receive {:DOWN, ^monitor, :process, ^worker, _}, 10_000
        _new = replacement(pool, 0, worker)
        assert {:ok, :pong} = Runtime.ping(:pong, __runtime__: [pool: pool, worker: 0])
        flunk("the Python worker exited on a fuzzed frame of #{inspect(batch, limit: 5)}")
    end
  end

  @tag timeout: 120_000
  @tag :capture_log
  test "megabytes printed from Python and from C to fd 1 never corrupt a frame",
       %{test: test, tmp_dir: dir} do
    pool = start_pool!(:"#{test}", 1, python: quiet_python!(dir))
    rt = [__runtime__: [pool: pool, worker: 0]]
    {:ok, counter} = Runtime.call_class("Counter", [], rt)
    mb = 2_000_000

    noisy =
      for _ <- 1..3 do
        {:ok, loud} = Runtime.call_class("Counter", [], rt)
        Task.async(fn -> Runtime.call_method(loud, "noisy", [mb]) end)
      end

    # payloads that look like frames: length prefixes, reply tags, printable bytes
    quiet =
      for i <- 1..60 do
        payload = %{"i" => i, "bin" => <<0, 0, 0, 8, 0x08, i, "pppp", 0xFF>>, "s" => "cc\n"}

        Task.async(fn ->
          {Runtime.call_function("echo", [payload], rt), Runtime.ping({:ping, i}, rt),
           Runtime.call_method(counter, "incr", [])}
        end)
      end

    for {task, i} <- Enum.with_index(quiet, 1) do
      assert {{:ok, echoed}, {:ok, {:ping, ^i}}, {:ok, n}} = Task.await(task, 60_000)
      assert echoed["i"] == i and echoed["bin"] == <<0, 0, 0, 8, 0x08, i, "pppp", 0xFF>>
      assert n in 1..60
    end

    assert Task.await_many(noisy, 60_000) == [{:ok, mb}, {:ok, mb}, {:ok, mb}]
    assert {:ok, 60} = Runtime.get_attr(counter, "value")
    assert {:ok, :after} = Runtime.ping(:after, rt)
  end

  @tag timeout: 60_000
  # Both workers of the BEAM under test have a call blocked in Python (sleep)
  # when it is killed, and worker 0's input pipe is held open by another
  # process as well, so that it never reads end of input: only noticing that
  # its parent is gone can make it exit.
  test "a BEAM killed with SIGKILL leaves no Python worker behind, even blocked with stdin held open" do
    elixir = System.find_executable("elixir") || flunk("no elixir executable on PATH")
    ebin = Path.dirname(:code.which(VllmBridge.Pool))
    script = Path.join(__DIR__, "support/orphan_beam.exs")

    beam =
      Port.open({:spawn_executable, elixir}, [
        :binary,
        :exit_status,
        {:line, 1024},
        args: ["-pa", ebin, script],
        cd: VllmBridge.TestPython.root()
      ])

    {:os_pid, launcher} = Port.info(beam, :os_pid)
    started = %{launcher: launcher, beam: nil, python: [], holder: nil}
    {:ok, agent} = Agent.start(fn -> started end)

    on_exit(fn ->
      %{launcher: launcher, beam: beam_pid, python: python, holder: holder} =
        Agent.get(agent, & &1)

      Agent.stop(agent)

      for pid <- [launcher, beam_pid, holder | python],
          is_integer(pid),
          os_alive?(pid),
          do: kill9(pid)
    end)

    beam_pid = read_line(beam, "BEAM") |> hd()
    Agent.update(agent, &%{&1 | beam: beam_pid})
    python = read_line(beam, "PYTHON")
    children = read_line(beam, "CHILDREN")
    Agent.update(agent, &%{&1 | python: python ++ children})
    assert length(python) == 2 and Enum.all?(python, &os_alive?/1)
    {holder_port, holder} = hold_input_pipes!(hd(python))
    Agent.update(agent, &%{&1 | holder: holder})

    killed_at = now_ms()
    kill9(beam_pid)

    # bounded from the kill: 2 s
    assert wait_os_exit(python, killed_at + 2_000 - now_ms()),
           "Python workers #{inspect(Enum.filter(python, &os_alive?/1))} outlived the BEAM " <>
             "by more than 2 s"

    # and what worker 1's exported code started went with it
    assert wait_os_exit(children, killed_at + 3_000 - now_ms()),
           "#{inspect(Enum.filter(children, &os_alive?/1))} outlived the BEAM"

    assert_receive {^beam, {:exit_status, _}}, 5_000
    assert os_alive?(holder), "the process holding the input pipe open is gone"
    Port.close(holder_port)
  end

  # Starts a process that opens, for writing, every pipe the Python process
  # `os_pid` reads from (its input, the port's pipe, among them), and holds
  # them open. Returns {port, os pid} once it holds them.
  defp hold_input_pipes!(os_pid) do
    fd_dir = "/proc/#{os_pid}/fd"

    paths =
      for fd <- File.ls!(fd_dir),
          {:ok, "pipe:" <> _} <- [File.read_link(Path.join(fd_dir, fd))],
          {:ok, info} <- [File.read("/proc/#{os_pid}/fdinfo/#{fd}")],
          [_, flags] <- [Regex.run(~r/^flags:\s+([0-7]+)/m, info)],
          # O_ACCMODE is 0 (O_RDONLY): the read end
          (String.to_integer(flags, 8) &&& 3) == 0,
          do: Path.join(fd_dir, fd)

    assert paths != [], "Python #{os_pid} reads from no pipe"

    holder =
      "import os, sys, time\n" <>
        "fds = [os.open(path, os.O_WRONLY) for path in sys.argv[1:]]\n" <>
        "print('HELD', os.getpid(), len(fds), flush=True)\n" <>
        "time.sleep(120)\n"

    port =
      Port.open({:spawn_executable, python!()}, [
        :binary,
        {:line, 1024},
        args: ["-c", holder | paths]
      ])

    [pid, count] = read_line(port, "HELD")
    assert count == length(paths)
    {port, pid}
  end

  @tag timeout: 60_000
  test "a stopped pool leaves no Python worker behind, even with calls blocked in Python",
       %{test: test} do
    pool = start_pool!(:"#{test}", 2)
    os_pids = for {_, pid} <- elem(Pool.workers(pool), 1), do: elem(Worker.os_pid(pid), 1)

    blocked =
      for index <- 0..1 do
        Task.async(fn ->
          Runtime.call_function("sleep", [600.0], __runtime__: [pool: pool, worker: index])
        end)
      end

    for {_, pid} <- elem(Pool.workers(pool), 1), do: wait_pending(pid, 1)
    stopped_at = now_ms()
    :ok = stop_supervised(pool)

    for task <- blocked, do: assert({:error, %Error{category: :worker}} = Task.await(task, 5_000))

    assert wait_os_exit(os_pids, stopped_at + 2_500 - now_ms()),
           "Python workers #{inspect(Enum.filter(os_pids, &os_alive?/1))} outlived their pool"
  end

  @tag :capture_log
  @tag timeout: 90_000
  test "a rank whose worker dies during a barrier: the others fail within the barrier's timeout",
       %{test: test, tmp_dir: dir} do
    pool = start_pool!(:"#{test}", 3, args: [], python: quiet_python!(dir))
    groups = create_groups(pool, 3)
    [g0, g1, g2] = groups
    {:ok, w2} = Pool.worker(pool, 2)
    {:ok, os_pid2} = Worker.os_pid(w2)

    # the group works
    assert [{:ok, nil}, {:ok, nil}, {:ok, nil}] =
             groups
             |> Enum.map(&Task.async(fn -> SPG.barrier(&1, [5.0]) end))
             |> Task.await_many(20_000)

    started = now_ms()
    waiting = for g <- [g0, g1], do: timed_task(fn -> SPG.barrier(g, [5.0]) end)
    for g <- [g0, g1], do: wait_pending(g.worker, 1)
    kill9(os_pid2)

    for task <- waiting do
      assert {{:error, %Error{category: :python} = error}, at} = Task.await(task, 20_000)
      assert error.message =~ "barrier"
      assert at - started < 5_000 + 3_000, "the barrier failed after #{at - started} ms"
    end

    # the surviving ranks' workers keep serving; rank 2's ref is stale
    assert {:ok, 0} = SPG.rank(g0)
    assert {:ok, 1} = SPG.rank(g1)
    assert {:error, %Error{category: :stale_ref}} = SPG.rank(g2)
  end

  @tag timeout: 60_000
  test "after a barrier one rank skipped, both ranks refuse every call at once",
       %{test: test} do
    pool = start_pool!(:"#{test}", 2, args: [])
    [g0, g1] = create_groups(pool, 2)

    # Rank 0 waits 1 s in barrier 0; rank 1's driver never calls it.
    assert {:error, %Error{python_type: "BarrierTimeout"}} = SPG.barrier(g0, [1.0])

    # The driver retries on both ranks: no call waits out its 10 s again.
    for _ <- 1..2, {g, rank} <- [{g0, 0}, {g1, 1}] do
      {micros, {:error, %Error{} = error}} = :timer.tc(fn -> SPG.barrier(g, [10.0]) end)
      assert micros < 1_000_000, error.message

      assert error.message =~ "barrier 0 failed on rank #{rank}" or
               error.python_type == "StateError"
    end

    for {g, rank} <- [{g0, 0}, {g1, 1}] do
      assert {:error, %Error{python_type: "StateError", message: message}} =
               SPG.all_gather_obj(g, [rank])

      assert message =~ "all_gather_obj on rank #{rank}"
      assert message =~ "barrier 0 failed on it"
      assert message =~ "create it again on every rank"
    end
  end

  @tag :capture_log
  @tag timeout: 90_000
  test "a rank whose worker dies before sending: recv_obj and broadcast_obj fail within their timeout",
       %{test: test, tmp_dir: dir} do
    pool = start_pool!(:"#{test}", 3, args: [], python: quiet_python!(dir))
    [g0, g1, _g2] = create_groups(pool, 3)
    {:ok, w2} = Pool.worker(pool, 2)
    {:ok, os_pid2} = Worker.os_pid(w2)

    started = now_ms()

    waiting = [
      timed_task(fn -> SPG.recv_obj(g0, 2, timeout: 5) end),
      timed_task(fn -> SPG.broadcast_obj(g1, nil, 2, timeout: 5) end)
    ]

    for g <- [g0, g1], do: wait_pending(g.worker, 1)
    kill9(os_pid2)

    for task <- waiting do
      # The peer's exit is noticed (PeerGoneError) or the wait runs out (GroupTimeout):
      # both are RuntimeErrors in Python, as vLLM's are.
      assert {{:error, %Error{category: :python, python_type: type}}, at} =
               Task.await(task, 20_000)

      assert type in ["PeerGoneError", "GroupTimeout"]

      assert at - started < 5_000 + 3_000, "the receive failed after #{at - started} ms"
    end

    assert {:ok, 0} = SPG.rank(g0)
  end

  # The reply frame with id `id` that the traced `worker` receives from its port.
  defp traced_reply(worker, id) do
    receive do
      {:trace, ^worker, :receive, {_port, {:data, data}}} ->
        if match?({:ok, ^id}, Proto.reply_id(data)), do: data, else: traced_reply(worker, id)
    after
      5_000 -> flunk("the late reply #{id} never reached the worker")
    end
  end

  # Forms a group of `size` ranks, rank i on worker i of `pool`.
  defp create_groups(pool, size) do
    port = free_tcp_port()

    0..(size - 1)
    |> Enum.map(fn rank ->
      Task.async(fn ->
        SPG.create(nil, "127.0.0.1", port, rank, size, [],
          store_timeout: 30,
          __runtime__: [pool: pool, worker: rank]
        )
      end)
    end)
    |> Task.await_many(60_000)
    |> Enum.map(fn {:ok, %Ref{} = group} -> group end)
  end

  # The integers on the line that starts with `tag` (other lines are skipped).
  defp read_line(port, tag) do
    receive do
      {^port, {:data, {:eol, line}}} ->
        case String.split(line) do
          [^tag | ints] -> Enum.map(ints, &String.to_integer/1)
          _ -> read_line(port, tag)
        end

      {^port, {:exit_status, status}} ->
        flunk("the BEAM under test exited with status #{status}")
    after
      60_000 -> flunk("no #{tag} line from the BEAM under test")
    end
  end

  defp port_roundtrip!(port, frame, timeout) do
    Port.command(port, frame)

    receive do
      {^port, {:data, reply}} -> reply
      {^port, {:exit_status, status}} -> flunk("the worker exited with status #{status}")
    after
      timeout -> flunk("no reply from the raw worker within #{timeout} ms")
    end
  end

  # Sends frames in batches of 250 and waits (bounded) for one reply per frame.
  # Returns %{categories: %{category | :value => count}, exited: nil | batch}.
  defp send_batches(port, frames) do
    frames
    |> Enum.chunk_every(250)
    |> Enum.reduce_while(%{categories: %{}, exited: nil}, fn batch, acc ->
      Enum.each(batch, &Port.command(port, &1))

      case collect_replies(port, length(batch), acc.categories) do
        {:ok, categories} -> {:cont, %{acc | categories: categories}}
        :exited -> {:halt, %{acc | exited: batch}}
      end
    end)
  end

  defp collect_replies(_port, 0, categories), do: {:ok, categories}

  defp collect_replies(port, n, categories) do
    receive do
      {^port, {:data, reply}} ->
        category =
          case Proto.decode_reply(reply) do
            {:ok, %{result: {:value, _}}} -> :value
            {:ok, %{result: {:error, error}}} -> VllmBridge.Error.from_reply(error).category
            {:error, _} -> flunk("undecodable reply #{inspect(reply, limit: 20)}")
          end

        collect_replies(port, n - 1, Map.update(categories, category, 1, &(&1 + 1)))

      {^port, {:exit_status, _}} ->
        :exited
    after
      10_000 -> flunk("the worker hung: #{n} replies missing")
    end
  end

  # Valid requests to mutate (none of them can block or allocate much when
  # mutated), crafted hostile payloads, and random bytes.
  defp fuzz_frames(n) do
    enc = fn term ->
      {:ok, bin} = Msgpack.encode(term)
      bin
    end

    tensor = %VllmBridge.Tensor{type: {:f, 32}, shape: {2, 3}, data: <<0::size(6 * 32)>>}

    bases = [
      ping_frame!(11, %{"a" => [1, 2.5, "x", <<0xFF>>], "t" => {:t, nil, true}}),
      frame!(12, {:describe, %{}}),
      frame!(
        13,
        {:create, %{class_name: "Counter", args: enc.([5]), kwargs: enc.(%{"step" => 2})}}
      ),
      frame!(14, {:call, %{handle: 1, method: "incr", args: enc.([3]), kwargs: ""}}),
      frame!(15, {:get_attr, %{handle: 1, name: "value"}}),
      frame!(16, {:call_function, %{function: "echo", args: enc.([[1, {1, :a}]]), kwargs: ""}}),
      frame!(17, {:call_function, %{function: "double", args: enc.([tensor]), kwargs: ""}}),
      frame!(18, {:release, %{handles: [1, 2, 3]}}),
      frame!(19, {:release_session, %{}}, "s")
    ]

    hostile =
      for payload <- [
            # containers and strings that claim 4 G elements or bytes
            <<0xDD, 0xFF, 0xFF, 0xFF, 0xFF>>,
            <<0xDF, 0xFF, 0xFF, 0xFF, 0xFF>>,
            <<0xDB, 0xFF, 0xFF, 0xFF, 0xFF, "x">>,
            <<0xC6, 0xFF, 0xFF, 0xFF, 0xFF>>,
            <<0xC9, 0xFF, 0xFF, 0xFF, 0xFF, 1>>,
            # a tensor whose shape claims 2^64 elements, with 4 bytes of data
            <<0xC7, 23, 1, ?f, 32, 2, 0xFFFFFFFFFFFFFFFF::64, 2::64, 0::32>>,
            # a ref with handle 2^64 - 1, an atom that is not UTF-8, deep nesting
            <<0xD7, 2, 0xFFFFFFFFFFFFFFFF::64>>,
            <<0xD4, 3, 0xFF>>,
            :binary.copy(<<0x91>>, 100_000) <> <<0xC0>>,
            # a tuple ext holding garbage, a float cut short
            <<0xD5, 4, 0x91, 0xC1>>,
            <<0xCB, 1, 2>>
          ],
          into: [] do
        frame!(20, {:ping, %{payload: payload}})
      end

    # envelopes whose length-delimited fields claim more than the frame holds
    envelopes = [
      <<0x08, 1, 0x12, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F>>,
      <<0x08, 1, 0x8A, 0x01, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F>>,
      <<0x08, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01>>,
      <<>>
    ]

    fixed = hostile ++ envelopes

    for i <- 1..n do
      case rem(i, 10) do
        0 -> Enum.random(fixed)
        k when k in [1, 2] -> :crypto.strong_rand_bytes(:rand.uniform(80) - 1)
        _ -> mutate(Enum.random(bases))
      end
    end
  end

  defp mutate(frame) do
    size = byte_size(frame)
    at = :rand.uniform(size) - 1

    case :rand.uniform(5) do
      1 ->
        Enum.reduce(1..:rand.uniform(4), frame, fn _, acc ->
          at = :rand.uniform(size) - 1
          <<head::binary-size(at), _, tail::binary>> = acc
          <<head::binary, :rand.uniform(256) - 1, tail::binary>>
        end)

      2 ->
        binary_part(frame, 0, at)

      3 ->
        <<head::binary-size(at), tail::binary>> = frame
        head <> :crypto.strong_rand_bytes(:rand.uniform(8)) <> tail

      4 ->
        <<head::binary-size(at), tail::binary>> = frame
        cut = min(byte_size(tail), :rand.uniform(6))
        head <> binary_part(tail, cut, byte_size(tail) - cut)

      5 ->
        <<head::binary-size(at), tail::binary>> = frame
        head <> <<Enum.random([0x00, 0x7F, 0x80, 0xFF])>> <> tail
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

  defp flush_traces do
    receive do
      {:trace, _, _, _} -> flush_traces()
    after
      0 -> :ok
    end
  end
end
