# The BEAM's work per call, per call shape: counts, not times, so they hold still on
# a loaded machine (see "What each benchmark measures, and why" in bench/README.md).
#
#   mix run bench/elixir/per_call.exs [--quick] [--top N] [--detail]
#
# For each shape, after a warm-up: reductions per call of the calling process and of
# the Worker process (`Process.info(pid, :reductions)` over N calls; the pools' callers
# sleep at once in `receive`, `reply_spin_us: 0`, so that the counts are work, not
# waiting for the reply), and Erlang function calls per call counted by `:cprof`
# (every process; BIFs are not counted), with the modules that make most of them
# (--top, default 8). The raw port echo of the same request bytes
# (bench/python/echo_port.py, the caller owns the port) is the reference row.
# --detail lists, per shape, every function called at least once a call. Part of
# `make bench` (its table is printed, not written to RESULTS.md); it fails only on a
# wrong result.
Code.require_file("common.exs", __DIR__)

defmodule Bench.PerCall do
  alias Vllm.Distributed.StatelessProcessGroup
  alias VllmBridge.{Pool, Proto, Runtime, Worker}

  @pool Bench.PerCallPool
  @dist_pool Bench.PerCallDist

  def run do
    n = if Bench.quick?(), do: 200, else: 5000
    top = top_arg()
    sample = ["--exports", "tests.worker.sample_exports:table"]

    {:ok, _} =
      Supervisor.start_link(
        [
          # Callers that sleep at once: a look for the reply is charged a whole
          # time slice per look (VllmBridge.Worker.Call), waiting that is not work.
          Supervisor.child_spec({Pool, name: @pool, size: 1, args: sample, reply_spin_us: 0},
            id: @pool
          ),
          Supervisor.child_spec({Pool, name: @dist_pool, size: 1, args: [], reply_spin_us: 0},
            id: @dist_pool
          )
        ],
        strategy: :one_for_one
      )

    {:ok, counter} = Runtime.call_class("Counter", [], __runtime__: [pool: @pool])
    group = Bench.one_rank_group(@dist_pool)
    {:ok, worker} = Pool.worker(@pool, 0)
    {:ok, dist_worker} = Pool.worker(@dist_pool, 0)

    {:ok, frame} =
      Proto.encode_request(%{
        id: Worker.new_id(),
        session: "",
        op: {:call, %{handle: counter.id, method: "incr", args: "", kwargs: ""}}
      })

    frame = IO.iodata_to_binary(frame)
    echo = Bench.open_echo()
    rt = [__runtime__: [pool: @dist_pool]]
    text = String.duplicate("façade, 中文 ", 64)

    shapes = [
      {"raw port echo (caller-owned port)", worker, fn _ -> Bench.echo(echo, frame) == frame end},
      {"Runtime.ping(nil, __runtime__: [pool: p])", worker,
       fn _ -> Runtime.ping(nil, __runtime__: [pool: @pool]) == {:ok, nil} end},
      {"Runtime.call_method(counter, \"incr\", [])", worker,
       fn _ -> match?({:ok, _}, Runtime.call_method(counter, "incr", [])) end},
      {"Runtime.call_function(\"echo\", [counter]) (a ref in and out)", worker,
       fn _ ->
         match?(
           {:ok, %{id: id}} when id == counter.id,
           Runtime.call_function("echo", [counter], __runtime__: [pool: @pool])
         )
       end},
      {"Runtime.call_function(\"echo\", [1])", worker,
       fn _ -> Runtime.call_function("echo", [1], __runtime__: [pool: @pool]) == {:ok, 1} end},
      {"Runtime.call_function(\"echo\", [text]) (1 KiB of UTF-8 text, not ASCII)", worker,
       fn _ ->
         Runtime.call_function("echo", [text], __runtime__: [pool: @pool]) == {:ok, text}
       end},
      {"StatelessProcessGroup.rank(group) (getter)", dist_worker,
       fn _ -> StatelessProcessGroup.rank(group) == {:ok, 0} end},
      {"StatelessProcessGroup.broadcast_obj(group, i, 0) (method, args)", dist_worker,
       fn i -> StatelessProcessGroup.broadcast_obj(group, i, 0) == {:ok, i} end},
      {"Vllm.Distributed.model_parallel_is_initialized(rt) (function)", dist_worker,
       fn _ -> Vllm.Distributed.model_parallel_is_initialized(rt) == {:ok, false} end}
    ]

    rows =
      for {what, worker, fun} <- shapes do
        check = fn i -> fun.(i) or raise "wrong result: #{what}" end
        for i <- 1..n, do: check.(i)
        {caller, worker_reds} = reductions(n, worker, check)
        {calls, modules, functions} = cprof(n, check)

        if "--detail" in System.argv() do
          IO.puts("\n#{what}:")
          for {mfa, c} <- functions, do: IO.puts("  #{fmt(c)}  #{inspect(mfa)}")
        end

        {what, caller, worker_reds, calls, modules}
      end

    IO.puts("\n## BEAM work per call (#{n} calls per shape)\n")
    IO.puts("| shape | caller reductions | Worker reductions | cprof calls | top modules |")
    IO.puts("|---|---|---|---|---|")

    for {what, caller, worker_reds, calls, modules} <- rows do
      mods =
        modules
        |> Enum.take(top)
        |> Enum.map_join(", ", fn {m, c} -> "#{inspect(m)} #{fmt(c)}" end)

      IO.puts("| #{what} | #{fmt(caller)} | #{fmt(worker_reds)} | #{fmt(calls)} | #{mods} |")
    end
  end

  defp reductions(n, worker, fun) do
    reds = fn pid -> pid |> Process.info(:reductions) |> elem(1) end
    c0 = reds.(self())
    w0 = reds.(worker)
    for i <- (n + 1)..(2 * n), do: fun.(i)
    {(reds.(self()) - c0) / n, (reds.(worker) - w0) / n}
  end

  defp cprof(n, fun) do
    :cprof.start()
    for i <- (2 * n + 1)..(3 * n), do: fun.(i)
    :cprof.pause()
    {total, modules} = :cprof.analyse()
    :cprof.stop()

    functions =
      for({_m, _c, fs} <- modules, {mfa, c} <- fs, c >= n, do: {mfa, c / n})
      |> Enum.sort_by(&elem(&1, 1), :desc)

    {total / n, for({m, c, _} <- modules, do: {m, c / n}), functions}
  end

  defp fmt(x), do: :erlang.float_to_binary(x / 1, decimals: 1)

  defp top_arg do
    case Enum.drop_while(System.argv(), &(&1 != "--top")) do
      ["--top", k | _] -> String.to_integer(k)
      _ -> 8
    end
  end
end

Bench.PerCall.run()
