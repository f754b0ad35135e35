# Run by faults_test.exs in a BEAM of its own, with the compiled project on the
# code path:
#
#     elixir -pa _build/test/lib/vllm_bridge/ebin elixir/test/vllm_bridge/support/orphan_beam.exs
#
# Starts a pool of 2 (the sample export table), leaves a call blocked in Python
# in each worker, has worker 1 start a child and a grandchild, prints "BEAM <os
# pid>", "PYTHON <os pid> <os pid>" and "CHILDREN <os pid> <os pid>", and waits
# to be killed.

alias VllmBridge.{Pool, Runtime, Worker}

{:ok, _} = Application.ensure_all_started(:logger)
root = Worker.project_root()

{:ok, _} =
  Pool.start_link(
    name: :orphan_pool,
    size: 2,
    cd: root,
    args: ["--exports", "tests.worker.sample_exports:table"]
  )

os_pids =
  for index <- 0..1 do
    rt = [__runtime__: [pool: :orphan_pool, worker: index, timeout: 60_000]]
    {:ok, :up} = Runtime.ping(:up, rt)
    spawn(fn -> Runtime.call_function("sleep", [600.0], rt) end)
    {:ok, worker} = Pool.worker(:orphan_pool, index)
    # the call is in flight before the pid is printed
    Stream.repeatedly(fn -> Worker.info(worker) end)
    |> Enum.find(fn {:ok, info} -> info.pending == 1 || (Process.sleep(10) && false) end)

    {:ok, os_pid} = Worker.os_pid(worker)
    os_pid
  end

# a child and a grandchild that worker 1's exported code started
rt = [__runtime__: [pool: :orphan_pool, worker: 1, timeout: 60_000]]
{:ok, children} = Runtime.call_function("spawn_descendants", [], rt)

IO.puts("BEAM #{System.pid()}")
IO.puts("PYTHON #{Enum.join(os_pids, " ")}")
IO.puts("CHILDREN #{Enum.join(children, " ")}")
Process.sleep(:infinity)
