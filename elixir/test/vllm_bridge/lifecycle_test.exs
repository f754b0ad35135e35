Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fault_helpers.exs", __DIR__)
Code.require_file("support/telemetry.exs", __DIR__)

defmodule VllmBridge.LifecycleTest do
  # Worker lifecycle with real Python processes: a Python that cannot import
  # torch (an error at start, then a back-off instead of a crash loop),
  # :max_calls and :max_memory_mb replacements, and the worker telemetry
  # events (through the test-only :telemetry of support/telemetry.exs).
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers
  import VllmBridge.FaultHelpers
  import VllmBridge.TelemetryHelpers

  alias VllmBridge.{Error, Pool, Runtime, Worker}

  @moduletag timeout: 120_000
  @moduletag :tmp_dir
  @moduletag :capture_log

  defp worker_pid(pool, index) do
    case Pool.worker(pool, index) do
      {:ok, pid} -> pid
      {:error, _} -> nil
    end
  end

  describe "a Python without torch" do
    test "Pool.start_link returns an error naming the Python and the missing module",
         %{test: test, tmp_dir: dir} do
      python = torchless_python!(dir)
      pool = :"#{test}"

      assert {:error, %Error{category: :worker, message: message, details: details}} =
               Pool.start_link(name: pool, size: 2, python: python, backoff_min: 50)

      assert message =~ python
      assert message =~ "ModuleNotFoundError: No module named 'torch'"
      assert message =~ "exited with status 1 before answering"
      assert details.missing_module == "torch"
      assert details.python == python
      assert details.exit_status == 1
      assert Enum.any?(details.stderr, &(&1 =~ "ModuleNotFoundError"))
      # what to do about it, and no promise of a next try from a pool that stopped
      assert message =~
               "it is not an environment for vllm_bridge; `mix vllm_bridge.setup` makes one"

      assert message =~ "(the pool was stopped)"
      refute message =~ "next try"
      refute Map.has_key?(details, :retry_in)

      # the pool is stopped, nothing is left running
      assert Process.whereis(pool) == nil
      assert {:error, %Error{category: :worker}} = Pool.size(pool)
    end

    test "the user's supervisor fails to start with that error instead of crash-looping",
         %{test: test, tmp_dir: dir} do
      python = torchless_python!(dir)
      pool = :"#{test}"
      Process.flag(:trap_exit, true)

      assert {:error, {:shutdown, {:failed_to_start_child, ^pool, %Error{} = error}}} =
               Supervisor.start_link([{Pool, name: pool, python: python}], strategy: :one_for_one)

      assert error.details.missing_module == "torch"
    end

    test "a worker whose Python stops starting backs off, keeps its supervisor up, and recovers",
         %{test: test, tmp_dir: dir} do
      switch = Path.join(dir, "no_torch")
      python = torchless_python!(dir, switch)
      pool = :"#{test}"
      forward_events!(pool)

      start_pool!(pool, 1,
        python: python,
        backoff_min: 100,
        backoff_max: 400,
        max_restarts: 1,
        max_seconds: 60
      )

      assert_receive {:telemetry, [:vllm_bridge, :worker, :started], %{duration: d},
                      %{index: 0, os_pid: os_pid, python: ^python}}

      assert d > 0
      worker = worker_pid(pool, 0)
      supervisor = Process.whereis(pool)

      # from now on Python cannot import torch; kill the running one
      File.write!(switch, "")
      kill9(os_pid)

      assert_receive {:telemetry, [:vllm_bridge, :worker, :exited], _,
                      %{os_pid: ^os_pid, exit_status: 137, reason: :exit}},
                     5_000

      # the supervisor restarts the worker after the kill (attempt 0, no
      # delay); then its failed starts are retried by the same worker process
      # after 100, 200, 400, 400 ms
      delays =
        for _ <- 1..5 do
          assert_receive {:telemetry, [:vllm_bridge, :worker, :restarted], %{delay: delay},
                          %{index: 0, attempt: attempt}},
                         20_000

          {attempt, delay}
        end

      assert delays == [{0, 0}, {1, 100}, {2, 200}, {3, 400}, {4, 400}]

      assert_receive {:telemetry, [:vllm_bridge, :worker, :exited], _,
                      %{reason: :start_failed, exit_status: 1}}

      new_worker = worker_pid(pool, 0)
      assert new_worker != worker
      assert Process.alive?(supervisor)

      assert {:error, %Error{category: :worker, details: %{missing_module: "torch"}}} =
               Runtime.ping(:x, __runtime__: [pool: pool])

      # (the call took the last failure from the worker's channel: the worker
      # may be trying again by now, and is back in :backoff after that try)
      assert {:ok, %{phase: :backoff, failed_starts: n}} =
               eventually(fn ->
                 case Worker.info(new_worker) do
                   {:ok, %{phase: :backoff}} = info -> info
                   _ -> false
                 end
               end)

      assert n >= 4

      # torch is back: the next try starts, and the same worker serves again
      File.rm!(switch)

      assert_receive {:telemetry, [:vllm_bridge, :worker, :started], _, %{index: 0}}, 20_000
      assert {:ok, :back} = Runtime.ping(:back, __runtime__: [pool: pool])
      assert worker_pid(pool, 0) == new_worker
      assert Process.alive?(supervisor)
    end
  end

  describe "lifecycle limits" do
    test "max_calls replaces a worker after its calls in flight finish",
         %{test: test} do
      pool = :"#{test}"
      forward_events!(pool)
      start_pool!(pool, 1, max_calls: 3, max_restarts: 1, max_seconds: 60)
      # start_pool!'s warm-up ping was call 1
      rt = [__runtime__: [pool: pool, worker: 0]]
      worker = worker_pid(pool, 0)
      {:ok, os_pid} = Worker.os_pid(worker)

      {:ok, counter} = Runtime.call_class("Counter", [], rt)
      # the way in as a caller that looked the worker up just before sees it
      assert {:ok, 0, ^worker, channel, _} = Pool.route(pool, 0)
      # (long enough for the checks below to run while it is in flight)
      slow = Task.async(fn -> Runtime.call_function("sleep", [3.0], rt) end)
      eventually(fn -> pending(worker) == 1 end)

      # call 3 reaches the limit while the sleep is in flight: the worker
      # takes no new call, but the sleep finishes
      assert {:ok, :third} = Runtime.ping(:third, rt)
      eventually(fn -> match?({:ok, %{phase: :retiring}}, Worker.info(worker)) end)
      assert {:error, %Error{category: :stale_ref}} = Runtime.call_method(counter, "incr", [])
      assert Process.alive?(worker)

      # by pid, its channel now says it is being replaced; a call written with
      # the channel taken before is still answered (the worker drains it)
      frame = fn id -> ping_frame!(id, :late) end
      id = Worker.new_id()

      assert {:error, %Error{category: :worker, message: message}} =
               Worker.request(worker, id, frame.(id), 5_000)

      assert message =~ "is being replaced"
      assert {:ok, {:channel, ^worker, %Error{}, _, _}} = Worker.channel(worker)
      id = Worker.new_id()
      assert {:ok, reply} = Worker.request(channel, id, frame.(id), 5_000)
      assert {:ok, %{id: ^id, result: {:value, _}}} = VllmBridge.Proto.decode_reply(reply)

      assert Task.await(slow, 10_000) == {:ok, 3.0}

      assert_receive {:telemetry, [:vllm_bridge, :worker, :exited], _,
                      %{os_pid: ^os_pid, reason: :replaced, exit_status: nil}},
                     5_000

      assert_receive {:telemetry, [:vllm_bridge, :worker, :restarted], %{delay: 0},
                      %{index: 0, attempt: 0}},
                     5_000

      assert_receive {:telemetry, [:vllm_bridge, :worker, :started], _, %{index: 0}}, 20_000
      refute worker_pid(pool, 0) in [nil, worker]
      assert {:ok, 1} = Runtime.call_function("echo", [1], rt)

      # replacements are not restarts: three more (max_restarts: 1) leave the pool up
      supervisor = Process.whereis(pool)

      for round <- 1..3 do
        old = worker_pid(pool, 0)
        # warm!/1 or the echo above was call 1 of this worker
        for _ <- 1..2, do: assert({:ok, ^round} = Runtime.ping(round, rt))
        eventually(fn -> worker_pid(pool, 0) not in [nil, old] end, 30_000)
        warm!(pool)
      end

      assert Process.alive?(supervisor)
    end

    test "max_memory_mb replaces a worker whose Python is over the limit", %{test: test} do
      pool = :"#{test}"
      forward_events!(pool)
      # torch alone takes more than 1 MB: over after the first call
      start_pool!(pool, 1, max_memory_mb: 1)
      # From the start event: the worker may be replaced before anyone could ask it.
      assert_receive {:telemetry, [:vllm_bridge, :worker, :started], _, %{os_pid: os_pid}}

      assert_receive {:telemetry, [:vllm_bridge, :worker, :exited], _,
                      %{os_pid: ^os_pid, reason: :replaced}},
                     5_000

      assert_receive {:telemetry, [:vllm_bridge, :worker, :started], _, %{os_pid: new_os_pid}},
                     30_000

      assert new_os_pid != os_pid
      assert wait_os_exit([os_pid], 5_000)
    end

    test "a pool refuses invalid limits" do
      assert {:error, %Error{category: :bad_args, message: message}} =
               Pool.start_link(name: :lifecycle_bad, max_calls: 0)

      assert message =~ ":max_calls"

      assert {:error, %Error{category: :bad_args}} =
               Pool.start_link(name: :lifecycle_bad, max_memory_mb: "1G")

      assert {:error, %Error{category: :bad_args}} =
               Pool.start_link(name: :lifecycle_bad, startup_timeout: 0)
    end
  end
end
