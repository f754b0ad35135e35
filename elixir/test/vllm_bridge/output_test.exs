Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fault_helpers.exs", __DIR__)

defmodule VllmBridge.OutputTest do
  # What a real Python worker prints (Python and C, stdout and stderr) comes
  # back as output frames and is logged, attributed to the worker; bounded.
  use ExUnit.Case, async: true

  import ExUnit.CaptureLog
  import VllmBridge.PoolHelpers
  import VllmBridge.FaultHelpers

  alias VllmBridge.{Error, Runtime, Worker}

  @moduletag timeout: 120_000
  @moduletag :tmp_dir

  @log [format: "[$level] $metadata| $message\n", metadata: [:pool, :index, :os_pid]]

  defp lines(log, pattern), do: log |> String.split("\n") |> Enum.filter(&(&1 =~ pattern))

  test "prints from Python and from C are logged with the worker's index; the reply is intact",
       %{test: test} do
    pool = :"#{test}"

    log =
      capture_log(@log, fn ->
        start_pool!(pool, 2)
        rt = [__runtime__: [pool: pool, worker: 1]]
        {:ok, os_pid} = Worker.os_pid(elem(VllmBridge.Pool.worker(pool, 1), 1))
        {:ok, counter} = Runtime.call_class("Counter", [], rt)
        assert {:ok, 12} = Runtime.call_method(counter, "noisy", [12])
        assert {:ok, :after} = Runtime.ping(:after, rt)
        # the output frames may come after the reply (a loaded machine: well after)
        Process.sleep(1_000)
        send(self(), {:os_pid, os_pid})
      end)

    assert_received {:os_pid, os_pid}
    prefix = "#{inspect(pool)} worker 1 (os pid #{os_pid}): "

    for text <- [String.duplicate("p", 12), String.duplicate("c", 12)] do
      assert [line] = lines(log, prefix <> text)
      assert line =~ "[warning]"
      assert line =~ "pool=#{pool}"
      assert line =~ "index=1"
      assert line =~ "os_pid=#{os_pid}"
    end
  end

  test "a flood of output is bounded, the drops are logged, the worker keeps answering",
       %{test: test} do
    pool = :"#{test}"

    log =
      capture_log(@log, fn ->
        start_pool!(pool, 1)
        rt = [__runtime__: [pool: pool, worker: 0]]
        {:ok, counter} = Runtime.call_class("Counter", [], rt)

        # 2 MB lines from Python and C: cut to 4096 bytes each
        assert {:ok, 2_000_000} = Runtime.call_method(counter, "noisy", [2_000_000])

        # 2 lines per call, 6000 lines in all: over the burst of 1000
        send(self(), {:flood_started, System.monotonic_time(:millisecond)})

        for i <- 1..3000 do
          assert {:ok, 3} = Runtime.call_method(counter, "noisy", [3])
          if rem(i, 500) == 0, do: assert({:ok, ^i} = Runtime.ping(i, rt))
        end

        assert {:ok, 1} = Runtime.call_method(counter, "incr", [])
        send(self(), {:flood_ended, System.monotonic_time(:millisecond)})
        # dropped lines are reported within a second of the last output (on a loaded
        # machine, later)
        Process.sleep(3_000)
      end)

    # Only this pool's lines: tests running beside this one log theirs too.
    log = log |> lines("pool=#{pool} ") |> Enum.join("\n")
    cut = lines(log, "more bytes of this line left out]")
    assert length(cut) == 2

    assert Enum.all?(
             cut,
             &(&1 |> String.split("): ", parts: 2) |> List.last() |> byte_size() < 4_200)
           )

    assert [_ | _] =
             drops = lines(log, ~r/\d+ more lines printed by the Python worker were dropped/)

    dropped =
      drops
      |> Enum.map(fn line ->
        [n] = Regex.run(~r/: (\d+) more lines/, line, capture: :all_but_first)
        String.to_integer(n)
      end)
      |> Enum.sum()

    logged = length(lines(log, ~r/: (ppp|ccc)$/))
    assert logged + dropped == 6000
    # The burst of 1000, then 100 lines a second for as long as the flood lasted (a
    # loaded machine makes it last longer); far below the 6000 printed.
    assert_received {:flood_started, started}
    assert_received {:flood_ended, ended}
    assert logged <= 1_000 + 100 * (div(ended - started, 1000) + 1)
  end

  test "a Python that fails at start logs one error naming the missing module, no traceback",
       %{tmp_dir: dir} do
    python = torchless_python!(dir)

    log =
      capture_log(@log, fn ->
        {:ok, worker} =
          Worker.start_link(python: python, args: sample_args(), backoff_min: 60_000)

        assert {:error, %Error{category: :worker, details: details}} =
                 Worker.await_started(worker)

        assert details.missing_module == "torch"
        assert Enum.any?(details.stderr, &(&1 =~ "No module named 'torch'"))
        GenServer.stop(worker)
        send(self(), {:worker, worker})
      end)

    # Only this worker's lines: tests running beside this one start torchless Pythons too.
    assert_received {:worker, worker}
    log = log |> lines(inspect(worker)) |> Enum.join("\n")
    assert lines(log, ~r/Traceback|File "/) == []
    assert [error] = lines(log, ~r/No module named 'torch'/)
    assert error =~ "[error]"
    assert error =~ "could not start"
    assert error =~ "`mix vllm_bridge.setup` makes one"
  end

  test "what Python prints while it starts is logged once it has started", %{tmp_dir: dir} do
    File.write!(Path.join(dir, "printing_exports.py"), """
    print("loading the export table", flush=True)
    from bridge_py.worker.export_table import default_exports
    """)

    log =
      capture_log(@log, fn ->
        {:ok, worker} =
          Worker.start_link(
            args: ["--exports", "printing_exports:default_exports"],
            env: [{"PYTHONPATH", dir}]
          )

        assert :ok = Worker.await_started(worker)
        GenServer.stop(worker)
        send(self(), {:worker, worker})
      end)

    assert_received {:worker, worker}
    log = log |> lines(inspect(worker) <> " ") |> Enum.join("\n")
    assert [_] = lines(log, ~r/\(os pid \d+\): loading the export table$/)
  end

  test "a Python that cannot import bridge_py at all is still diagnosed", %{tmp_dir: dir} do
    # -I -S: neither PYTHONPATH nor site-packages, so bridge_py is not found and nothing comes
    # through output frames: the start is run again (stdin at /dev/null) to
    # read its stderr. (The first run's stderr, the BEAM's, is kept quiet.)
    path = Path.join(dir, "isolated_python")

    File.write!(path, """
    #!/bin/sh
    cd /
    if [ "$(readlink /proc/$$/fd/0)" = /dev/null ]; then exec #{python!()} -I -S "$@"; fi
    exec #{python!()} -I -S "$@" 2>/dev/null
    """)

    File.chmod!(path, 0o755)

    capture_log(fn ->
      {:ok, worker} = Worker.start_link(python: path, backoff_min: 60_000)

      assert {:error, %Error{category: :worker, details: details}} = Worker.await_started(worker)

      assert details.missing_module == "bridge_py"
      GenServer.stop(worker)
    end)
  end
end
