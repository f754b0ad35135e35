# A pool of 2 workers from start to first answered call, vs one bare
# `python -c "import torch"` with the same Python, interleaved.
#
#   mix run bench/elixir/startup.exs [--quick]
#
# Ours: the time from Supervisor.start_link of a VllmBridge.Pool (size 2,
# shipped export table) to the first answered call (a ping sent to both
# workers at once; the first reply stops the clock). The row below it is
# informational: until both workers have answered.
Code.require_file("common.exs", __DIR__)

defmodule Bench.Startup do
  alias VllmBridge.{Pool, Runtime, Worker}

  @bench "startup"

  def run do
    rounds = if Bench.quick?(), do: 1, else: 5
    python = Worker.find_python()
    # Warm the page cache so that neither side pays for the first read of torch.
    if not Bench.quick?(), do: import_torch(python)

    {first, both, torch} =
      Enum.reduce(1..rounds, {[], [], []}, fn r, {first, both, torch} ->
        steps = [pool: fn -> pool_start(r) end, torch: fn -> import_torch(python) end]
        steps = if rem(r, 2) == 0, do: Enum.reverse(steps), else: steps
        results = Map.new(steps, fn {k, f} -> {k, f.()} end)
        {f, b} = results.pool
        {[f | first], [b | both], [results.torch | torch]}
      end)

    torch = Bench.median(torch)
    peer = ~s(python -c "import torch")

    Bench.emit("Pool start-up vs importing torch", [
      Bench.time_row(
        @bench,
        "pool of 2 workers: start to first answered call",
        Bench.median(first),
        torch,
        peer,
        at_most: 1.5
      ),
      Bench.time_row(
        @bench,
        "pool of 2 workers: start to both answered",
        Bench.median(both),
        torch,
        peer
      )
    ])
  end

  defp pool_start(r) do
    name = Module.concat(Bench.StartupPool, "P#{r}")
    t0 = System.monotonic_time(:nanosecond)
    {:ok, sup} = Supervisor.start_link([{Pool, name: name, size: 2}], strategy: :one_for_one)
    parent = self()

    for i <- 0..1 do
      spawn_link(fn ->
        result = Runtime.ping(:up, __runtime__: [pool: name, worker: i, timeout: 120_000])
        send(parent, {:pong, i, result, System.monotonic_time(:nanosecond)})
      end)
    end

    times =
      for _ <- 0..1 do
        receive do
          {:pong, i, result, t} ->
            Bench.check!(result == {:ok, :up}, "worker #{i}: ping returned #{inspect(result)}")
            (t - t0) / 1000
        after
          180_000 -> raise "the pool did not answer"
        end
      end

    {:ok, workers} = Pool.workers(name)
    os_pids = for {_, pid} <- workers, {:ok, os_pid} <- [Worker.os_pid(pid)], do: os_pid
    Supervisor.stop(sup)
    # The next measurement starts only once these Python processes have exited.
    Enum.each(os_pids, &wait_gone/1)
    {Enum.min(times), Enum.max(times)}
  end

  defp wait_gone(os_pid, tries \\ 500) do
    if tries > 0 and File.exists?("/proc/#{os_pid}") do
      Process.sleep(10)
      wait_gone(os_pid, tries - 1)
    end
  end

  defp import_torch(python) do
    {us, {_, status}} = Bench.tc(fn -> System.cmd(python, ["-c", "import torch"]) end)
    Bench.check!(status == 0, "python -c 'import torch' exited with #{status}")
    us
  end
end

Bench.Startup.run()
