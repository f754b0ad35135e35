defmodule VllmBridge.DemoTest do
  # `mix vllm_bridge.demo` (what `make demo` runs), run in the test VM as mix
  # would run it: every step is printed once, in order, with its time, and
  # every check passes. Not async: the demo's pool has a fixed name.
  use ExUnit.Case, async: false

  @moduletag timeout: 300_000

  @steps [
    "start a pool of 3 Python workers: os pids",
    "form a 3-rank StatelessProcessGroup",
    "broadcast_obj from rank 0: every rank got",
    "all_gather_obj of {rank, rank * 1.5}: [{0, 0.0}, {1, 1.5}, {2, 3.0}]",
    "barrier: all 3 ranks passed",
    "send_obj a tensor 0 -> 1, recv_obj on 1: rank 1 got",
    "init_distributed_environment (gloo) on every worker, get_world_group",
    "GroupCoordinator.all_reduce of [r + 1, 10 * (r + 1)] on rank r: every rank got [6.0, 60.0]",
    ~s(MessageQueue from create_mq_broadcaster: rank 0 broadcasts 3 terms: ranks 1..2 read [%{step: 1}, [0.5, 1.5, 2.5], "done"]),
    ~s(a PyNcclCommunicator on "cpu" over each rank's group: 3 ranks),
    "rank 0 broadcasts 3 weight tensors, then a barrier: ranks 1..2 hold embed, qkv, step",
    "kill -9 rank 2's Python process while the others wait in a barrier",
    "rank 0: BarrierFailure: barrier 2 failed on rank 0: ranks [2] exited",
    "rank 1: BarrierFailure: barrier 2 failed on rank 1: ranks [2] exited",
    "the pool restarts worker 2; a fresh Python answers",
    "refs into the killed worker are :stale_ref",
    "a new 3-rank group with the fresh worker: all_gather_obj of the ranks: [0, 1, 2]",
    "release the groups, each rank 0 (the store's server) last: 5 handles released",
    "all checks passed"
  ]

  @tag :capture_log
  test "the demo runs every step, timed and checked" do
    Mix.shell(Mix.Shell.Process)
    on_exit(fn -> Mix.shell(Mix.Shell.IO) end)

    Mix.Tasks.VllmBridge.Demo.run([])

    output = Enum.join(printed(), "\n")
    lines = String.split(output, "\n")

    Enum.reduce(@steps, 0, fn step, from ->
      found = for {line, i} <- Enum.with_index(lines), String.contains?(line, step), do: i
      assert [at] = found, "#{inspect(step)} is not printed once in:\n#{output}"
      assert at >= from, "#{inspect(step)} is out of order in:\n#{output}"
      at
    end)

    timed = Enum.filter(lines, &Regex.match?(~r/^\s+\d+\.\d ms  /, &1))
    assert length(timed) == 15, output
  end

  test "a demo that cannot run its checks says so and stops" do
    Mix.shell(Mix.Shell.Process)
    on_exit(fn -> Mix.shell(Mix.Shell.IO) end)

    assert_raise Mix.Error, ~r/--size must be at least 2/, fn ->
      Mix.Tasks.VllmBridge.Demo.run(["--size", "1"])
    end
  end

  defp printed do
    receive do
      {:mix_shell, :info, [line]} -> [line | printed()]
    after
      0 -> []
    end
  end
end
