# The passive node of tests/test_elixir_across_hosts.py, run on its own host:
#
#     elixir --name b@ADDRESS --cookie COOKIE -pa _build/dev/lib/vllm_bridge/ebin \
#       tests/elixir_hosts/node.exs
#
# Starts :vllm_bridge and a pool of 2 workers (:hosts_ranks) under the app's
# supervisor, prints one JSON line (this BEAM's OS pid and its workers'), and
# stays up until it is killed. The driver (driver.exs) places ranks on its pool.

alias VllmBridge.{Pool, Worker}

{:ok, _} = Application.ensure_all_started(:vllm_bridge)
spec = {Pool, name: :hosts_ranks, size: 2, timeout: 90_000}
{:ok, _} = Supervisor.start_child(VllmBridge.Supervisor, spec)

workers =
  for index <- 0..1 do
    {:ok, worker} = Pool.worker(:hosts_ranks, index)
    {:ok, os_pid} = Worker.os_pid(worker)
    os_pid
  end

IO.puts(~s({"beam": #{System.pid()}, "workers": [#{Enum.join(workers, ", ")}]}))
Process.sleep(:infinity)
