defmodule Mix.Tasks.VllmBridge.Demo do
  @shortdoc "Forms a 3-rank StatelessProcessGroup from Elixir and exercises it"
  @moduledoc """
  A tour of the bridge in one command (`make demo`):

    1. starts a pool of 3 Python workers (one rank each),
    2. forms a 3-rank `StatelessProcessGroup` from Elixir, one `create` per worker,
    3. broadcasts an Elixir term from rank 0, all-gathers one term per rank,
       runs a barrier, sends a tensor point to point,
    4. prints what each step returned and how long it took.

  Options: `--size N` (ranks, default 3).
  """

  use Mix.Task

  alias Vllm.Distributed.StatelessProcessGroup, as: SPG

  @impl Mix.Task
  def run(argv) do
    {opts, _, _} = OptionParser.parse(argv, strict: [size: :integer])
    size = Keyword.get(opts, :size, 3)
    Mix.Task.run("app.start")

    {:ok, sup} =
      Supervisor.start_link([{VllmBridge.Pool, name: Demo.Pool, size: size}],
        strategy: :one_for_one
      )

    rt = fn extra -> [__runtime__: [pool: Demo.Pool] ++ extra] end

    {groups, _} =
      step("start #{size} workers and form a #{size}-rank group", fn ->
        port = free_port()

        0..(size - 1)
        |> Enum.map(fn rank ->
          Task.async(fn ->
            SPG.create(
              nil,
              "127.0.0.1",
              port,
              rank,
              size,
              [],
              rt.(worker: rank) ++ [store_timeout: 60]
            )
          end)
        end)
        |> Task.await_many(120_000)
        |> Enum.map(fn {:ok, group} -> group end)
      end)

    on_all = fn fun ->
      groups |> Enum.map(&Task.async(fn -> fun.(&1) end)) |> Task.await_many(60_000)
    end

    payload = %{model: "demo", layers: [1, 2, 3], dtype: {:bf, 16}, ok?: true}

    step("broadcast_obj from rank 0", fn ->
      results = on_all.(fn g -> SPG.broadcast_obj(g, payload, 0) end)
      true = Enum.all?(results, &(&1 == {:ok, payload}))
      "every rank got #{inspect(payload)}"
    end)

    step("all_gather_obj of {rank, rank * 1.5}", fn ->
      results =
        on_all.(fn g ->
          {:ok, rank} = SPG.rank(g)
          SPG.all_gather_obj(g, {rank, rank * 1.5})
        end)

      {:ok, gathered} = hd(results)
      true = Enum.all?(results, &(&1 == {:ok, gathered}))
      inspect(gathered)
    end)

    step("barrier", fn ->
      results = on_all.(fn g -> SPG.barrier(g, [10.0]) end)
      true = Enum.all?(results, &(&1 == {:ok, nil}))
      "all #{size} ranks passed"
    end)

    step("send_obj a tensor 0 -> 1, recv_obj on 1", fn ->
      data = for x <- [1.0, 2.0, 3.0, 4.0], into: <<>>, do: <<x::float-32-little>>
      {:ok, tensor} = VllmBridge.Tensor.new({:f, 32}, {2, 2}, data)
      [g0, g1 | _] = groups
      receiver = Task.async(fn -> SPG.recv_obj(g1, 0) end)
      {:ok, nil} = SPG.send_obj(g0, tensor, 1)
      {:ok, got} = Task.await(receiver, 60_000)
      true = got == tensor
      "rank 1 got #{inspect(got)}"
    end)

    step("release the groups", fn ->
      {:ok, n} = VllmBridge.Runtime.release(groups)
      "#{n} handles released"
    end)

    Supervisor.stop(sup)
  end

  defp step(title, fun) do
    {micros, result} = :timer.tc(fun)
    ms = :erlang.float_to_binary(micros / 1000, decimals: 1)
    summary = if is_binary(result), do: ": " <> result, else: ""
    Mix.shell().info(String.pad_leading(ms, 9) <> " ms  " <> title <> summary)
    {result, micros}
  end

  defp free_port do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :gen_tcp.close(socket)
    port
  end
end
