defmodule Mix.Tasks.VllmBridge.Demo do
  @shortdoc "A pool of 3 Python ranks driven from Elixir: groups, all_reduce, a queue, a kill"
  @moduledoc """
  A tour of the bridge in one command (`make demo`). From Elixir, with one rank
  per Python worker of a pool, it:

    1. starts a pool of 3 Python workers,
    2. forms a 3-rank `StatelessProcessGroup` (one `create` per worker), broadcasts
       an Elixir term from rank 0, all-gathers one term per rank, runs a barrier
       and sends a tensor point to point,
    3. runs `init_distributed_environment` (gloo) on every worker and takes
       `get_world_group/1`, a `GroupCoordinator`, whose `all_reduce` of
       `[r + 1, 10 * (r + 1)]` on rank r must give the sums on every rank,
    4. makes a shared-memory `MessageQueue` with
       `GroupCoordinator.create_mq_broadcaster/3` and broadcasts three terms from
       rank 0 through it,
    5. makes a `PyNcclCommunicator` on `"cpu"` over each rank's group and
       broadcasts three weight tensors from rank 0 (the trainer's weight sync),
       then a barrier,
    6. kills the last rank's Python process (`kill -9`, its OS pid from
       `VllmBridge.Worker.os_pid/1`) while the others wait in a barrier with a
       30 s timeout: they must fail within seconds with a `BarrierFailure` that
       names the missing rank,
    7. waits for the pool to restart that worker, shows that a fresh Python
       process answers, that refs into the old one are stale, and forms a new
       3-rank group with it.

  Each step is printed with its time and checked; a failed check stops the demo
  with an error (a non-zero exit).

  Options: `--size N` (ranks, at least 2, default 3).
  """

  use Mix.Task

  alias Vllm.Distributed, as: D
  alias Vllm.Distributed.GroupCoordinator, as: GC
  alias Vllm.Distributed.MessageQueue, as: MQ
  alias Vllm.Distributed.PyNcclCommunicator, as: Comm
  alias Vllm.Distributed.StatelessProcessGroup, as: SPG
  alias VllmBridge.{Error, Pool, Runtime, Tensor, Worker}

  @pool VllmBridge.Demo.Pool
  @barrier_timeout 30.0
  @call_timeout 60_000

  @impl Mix.Task
  def run(argv) do
    {opts, _, _} = OptionParser.parse(argv, strict: [size: :integer])
    size = Keyword.get(opts, :size, 3)
    if size < 2, do: Mix.raise("--size must be at least 2, got #{size}")
    Mix.Task.run("app.start")

    sup =
      step("start a pool of #{size} Python workers", fn ->
        {:ok, sup} =
          Supervisor.start_link([{Pool, name: @pool, size: size, timeout: @call_timeout}],
            strategy: :one_for_one
          )

        {:value, sup, "os pids #{inspect(Enum.map(0..(size - 1), &os_pid!/1))}"}
      end)

    try do
      tour(size)
    after
      Supervisor.stop(sup)
    end
  end

  defp tour(size) do
    ranks = Enum.to_list(0..(size - 1))
    groups = stateless_group(ranks)
    world = group_coordinator(ranks)
    message_queue(world)
    weight_broadcast(groups)
    {victim, _} = killed = kill_in_barrier(groups)
    fresh = recover(groups, killed)
    release([fresh, List.delete(groups, victim)])
    Mix.shell().info("all checks passed")
  end

  defp stateless_group(ranks) do
    size = length(ranks)

    groups =
      step("form a #{size}-rank StatelessProcessGroup", fn ->
        {:value, create_groups(ranks), "rank r on worker r"}
      end)

    payload = %{model: "demo", layers: [1, 2, 3], dtype: {:bf, 16}, ok?: true}

    step("broadcast_obj from rank 0", fn ->
      results = on_all(groups, fn g -> SPG.broadcast_obj(g, payload, 0) end)
      check!(results, Enum.map(ranks, fn _ -> payload end))
      "every rank got #{inspect(payload)}"
    end)

    step("all_gather_obj of {rank, rank * 1.5}", fn ->
      results =
        groups
        |> Enum.with_index()
        |> on_all(fn {g, r} -> SPG.all_gather_obj(g, {r, r * 1.5}) end)

      expected = for r <- ranks, do: {r, r * 1.5}
      check!(results, Enum.map(ranks, fn _ -> expected end))
      inspect(expected)
    end)

    step("barrier", fn ->
      check!(on_all(groups, fn g -> SPG.barrier(g, [10.0]) end), Enum.map(ranks, fn _ -> nil end))
      "all #{size} ranks passed"
    end)

    step("send_obj a tensor 0 -> 1, recv_obj on 1", fn ->
      tensor = ok!(Tensor.from_list([[1.0, 2.0], [3.0, 4.0]], {:f, 32}))
      [g0, g1 | _] = groups
      receiver = Task.async(fn -> SPG.recv_obj(g1, 0) end)
      ok!(SPG.send_obj(g0, tensor, 1))
      check!([Task.await(receiver, @call_timeout)], [tensor])
      "rank 1 got #{inspect(tensor, limit: 4) |> String.replace(~r/\s+/, " ")}"
    end)

    groups
  end

  defp group_coordinator(ranks) do
    size = length(ranks)

    world =
      step("init_distributed_environment (gloo) on every worker, get_world_group", fn ->
        port = free_port()

        world =
          on_all(ranks, fn r ->
            with {:ok, nil} <-
                   D.init_distributed_environment([],
                     world_size: size,
                     rank: r,
                     local_rank: r,
                     backend: "gloo",
                     distributed_init_method: "tcp://127.0.0.1:#{port}",
                     __runtime__: rt(r)
                   ),
                 do: D.get_world_group(__runtime__: rt(r))
          end)
          |> Enum.map(&ok!/1)

        check!(Enum.map(world, &GC.rank_in_group/1), ranks)
        {:value, world, "a #{size}-rank GroupCoordinator, one per worker"}
      end)

    step("GroupCoordinator.all_reduce of [r + 1, 10 * (r + 1)] on rank r", fn ->
      results =
        world
        |> Enum.with_index()
        |> Enum.map(fn {g, r} ->
          {g, ok!(Tensor.from_list([r + 1.0, 10.0 * (r + 1)], {:f, 32}))}
        end)
        |> on_all(fn {g, t} -> GC.all_reduce(g, t) end)

      sum = Enum.sum(Enum.map(ranks, &(&1 + 1))) * 1.0
      sums = Enum.map(results, &Tensor.to_list(ok!(&1)))
      check!(sums, Enum.map(ranks, fn _ -> [sum, 10 * sum] end))
      "every rank got #{inspect([sum, 10 * sum])}"
    end)

    world
  end

  defp message_queue(world) do
    messages = [%{step: 1}, [0.5, 1.5, 2.5], "done"]

    step("MessageQueue from create_mq_broadcaster: rank 0 broadcasts 3 terms", fn ->
      queues = world |> on_all(&GC.create_mq_broadcaster(&1, [])) |> Enum.map(&ok!/1)

      received =
        queues
        |> Enum.with_index()
        |> on_all(fn {mq, r} ->
          results =
            for message <- messages do
              MQ.broadcast_object(mq, obj: if(r == 0, do: message), timeout: @barrier_timeout)
            end

          {results, MQ.close(mq)}
        end)

      for {results, closed} <- received, do: check!([closed | results], [nil | messages])
      "ranks 1..#{length(world) - 1} read #{inspect(messages)}"
    end)
  end

  # What an RL trainer does after each step: rank 0 (the trainer) broadcasts its
  # weights tensor by tensor through a PyNcclCommunicator on the group (on "cpu" here:
  # shared memory between the workers; a CUDA device uses NCCL), then a barrier.
  defp weight_broadcast(groups) do
    size = length(groups)

    comms =
      step("a PyNcclCommunicator on \"cpu\" over each rank's group", fn ->
        {:value, groups |> on_all(&Comm.new(&1, "cpu", [])) |> Enum.map(&ok!/1), "#{size} ranks"}
      end)

    weights = [
      {"embed", [[0.5, -1.0], [2.0, 4.0]], {:f, 32}},
      {"qkv", [1.5, -2.5, 8.0], {:bf, 16}},
      {"step", [42], {:s, 64}}
    ]

    step("rank 0 broadcasts #{length(weights)} weight tensors, then a barrier", fn ->
      for {_name, values, type} <- weights do
        results =
          comms
          |> Enum.with_index()
          |> on_all(fn {comm, r} ->
            mine = if r == 0, do: values, else: zeros(values)

            with {:ok, t} <- Comm.broadcast(comm, ok!(Tensor.from_list(mine, type)), 0, []) do
              {:ok, Tensor.to_list(t)}
            end
          end)

        check!(results, Enum.map(comms, fn _ -> values end))
      end

      check!(on_all(groups, &SPG.barrier(&1, [10.0])), Enum.map(groups, fn _ -> nil end))
      Enum.each(comms, &ok!(Runtime.release(&1)))
      "ranks 1..#{size - 1} hold #{Enum.map_join(weights, ", ", &elem(&1, 0))}"
    end)
  end

  defp zeros(values) when is_list(values), do: Enum.map(values, &zeros/1)
  defp zeros(value), do: value * 0

  defp kill_in_barrier(groups) do
    {survivors, [victim]} = Enum.split(groups, -1)
    index = length(survivors)

    step("kill -9 rank #{index}'s Python process while the others wait in a barrier", fn ->
      old_pid = os_pid!(index)

      waiting =
        for g <- survivors do
          Task.async(fn ->
            result = SPG.barrier(g, [@barrier_timeout])
            {result, System.monotonic_time(:millisecond)}
          end)
        end

      # The survivors' calls have reached their workers, and Python is in the barrier.
      for g <- survivors, do: eventually!(fn -> pending(g.worker) >= 1 end, "the barrier calls")
      Process.sleep(500)
      killed_at = System.monotonic_time(:millisecond)
      System.cmd("kill", ["-9", Integer.to_string(old_pid)])

      failures =
        for task <- waiting do
          {result, at} = Task.await(task, round(@barrier_timeout * 1000) + 10_000)

          case result do
            {:error, %Error{category: :python, python_type: "BarrierFailure", message: message}} ->
              if not (message =~ ~r/ranks? \[?#{index}\b/),
                do: fail!("the barrier's error does not name rank #{index}: #{message}")

              {at - killed_at, message}

            other ->
              fail!("a survivor's barrier returned #{inspect(other)}, not a BarrierFailure")
          end
        end

      slowest = failures |> Enum.map(&elem(&1, 0)) |> Enum.max()

      if slowest > 10_000,
        do: fail!("the survivors failed #{slowest} ms after the kill, not fast")

      lines =
        for {{_, message}, r} <- Enum.with_index(failures) do
          "\n            rank #{r}: #{message |> String.split("\n") |> hd()}"
        end

      summary =
        "os pid #{old_pid} killed; every survivor failed within #{slowest} ms " <>
          "(timeout #{@barrier_timeout} s)" <> Enum.join(lines)

      {:value, {victim, old_pid}, summary}
    end)
  end

  defp recover(groups, {victim, old_pid}) do
    size = length(groups)
    index = size - 1

    step("the pool restarts worker #{index}; a fresh Python answers", fn ->
      {:ok, new_pid} =
        eventually!(
          fn ->
            with {:ok, w} <- Pool.worker(@pool, index),
                 {:ok, pid} <- Worker.os_pid(w),
                 true <- pid != old_pid,
                 {:ok, :hello} <- Runtime.ping(:hello, __runtime__: rt(index)) do
              {:ok, pid}
            else
              _ -> false
            end
          end,
          "a fresh worker #{index}"
        )

      case SPG.rank(victim) do
        {:error, %Error{category: :stale_ref}} -> :ok
        other -> fail!("a ref into the killed worker answered #{inspect(other)}, not :stale_ref")
      end

      "os pid #{new_pid} answers ping; refs into the killed worker are :stale_ref"
    end)

    step("a new #{size}-rank group with the fresh worker", fn ->
      fresh = create_groups(Enum.to_list(0..index))
      ranks = Enum.to_list(0..index)
      gathered = fresh |> Enum.zip(ranks) |> on_all(fn {g, r} -> SPG.all_gather_obj(g, r) end)
      check!(gathered, Enum.map(ranks, fn _ -> ranks end))
      {:value, fresh, "all_gather_obj of the ranks: #{inspect(ranks)}"}
    end)
  end

  # Rank 0 of a group serves its store: releasing it last lets the other ranks
  # clean up their keys while the store still answers.
  defp release(groups) do
    step("release the groups, each rank 0 (the store's server) last", fn ->
      n =
        groups
        |> Enum.flat_map(&Enum.reverse/1)
        |> Enum.map(&ok!(Runtime.release(&1)))
        |> Enum.sum()

      "#{n} handles released"
    end)
  end

  defp create_groups(ranks) do
    port = free_port()
    size = length(ranks)

    ranks
    |> on_all(fn rank ->
      SPG.create(nil, "127.0.0.1", port, rank, size, [], store_timeout: 60, __runtime__: rt(rank))
    end)
    |> Enum.map(&ok!/1)
  end

  defp rt(rank), do: [pool: @pool, worker: rank, timeout: @call_timeout]

  defp on_all(items, fun) do
    items |> Enum.map(&Task.async(fn -> fun.(&1) end)) |> Task.await_many(@call_timeout + 5_000)
  end

  defp os_pid!(index) do
    {:ok, worker} = Pool.worker(@pool, index)
    ok!(Worker.os_pid(worker))
  end

  defp pending(worker), do: ok!(Worker.info(worker)).pending

  defp eventually!(fun, what, ms \\ 30_000) do
    deadline = System.monotonic_time(:millisecond) + ms

    Stream.repeatedly(fn ->
      result = fun.()

      cond do
        result not in [false, nil] -> {:done, result}
        System.monotonic_time(:millisecond) > deadline -> fail!("#{what}: not within #{ms} ms")
        true -> Process.sleep(50)
      end
    end)
    |> Enum.find_value(fn
      {:done, result} -> result
      _ -> nil
    end)
  end

  defp check!(results, expected) do
    got =
      Enum.map(results, fn
        {:ok, value} -> value
        other -> other
      end)

    if got != expected, do: fail!("expected #{inspect(expected)}, got #{inspect(results)}")
    :ok
  end

  defp ok!({:ok, value}), do: value
  defp ok!(other), do: fail!("expected {:ok, _}, got #{inspect(other)}")

  defp fail!(message), do: Mix.raise("demo check failed: " <> message)

  defp step(title, fun) do
    {micros, result} = :timer.tc(fun)

    {value, summary} =
      case result do
        {:value, value, summary} -> {value, summary}
        summary -> {nil, summary}
      end

    ms = :erlang.float_to_binary(micros / 1000, decimals: 1)
    summary = if is_binary(summary), do: ": " <> summary, else: ""
    Mix.shell().info(String.pad_leading(ms, 9) <> " ms  " <> title <> summary)
    value
  end

  defp free_port do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :gen_tcp.close(socket)
    port
  end
end
