# The driving node of tests/test_elixir_across_hosts.py, run on its own host:
#
#     elixir --name a@ADDRESS --cookie COOKIE -pa _build/dev/lib/vllm_bridge/ebin \
#       tests/elixir_hosts/driver.exs b@PEER_ADDRESS SIGNAL_DIR
#
# Starts :vllm_bridge and a pool of 2 workers (:hosts_ranks), connects to the
# peer (node.exs, retried until its pool answers), forms a 4-rank
# StatelessProcessGroup through the generated module, ranks 0-1 on this pool
# and 2-3 on the peer's, the store on this node's address, and runs
# broadcast_obj, all_gather_obj, barrier and send_obj/recv_obj across (a wrong
# result raises). Then it creates SIGNAL_DIR/formed and waits for the peer's
# nodedown (the test kills the peer's BEAM), and records, each call bounded so
# that a hang is recorded rather than waited out: a barrier (5 s timeout) and
# an all_gather_obj after it on ranks 0-1, calls on the ranks 2-3 refs, the
# release of the group, and a fresh 2-rank group on this pool alone. It prints
# what it saw as one line (msgpack, base64) and exits.

alias Vllm.Distributed.StatelessProcessGroup, as: SPG
alias VllmBridge.{Error, Pool, Ref, Runtime, Worker}

defmodule Driver do
  def now, do: System.monotonic_time(:millisecond)

  # Runs fun, giving up after bound ms: %{ms:, ok: | category:, message:, ...}
  # or %{ms:, hung: true}.
  def timed(bound, fun) do
    start = now()
    task = Task.async(fun)

    case Task.yield(task, bound) || Task.shutdown(task, :brutal_kill) do
      {:ok, result} -> Map.put(outcome(result), :ms, now() - start)
      _ -> %{hung: true, ms: now() - start}
    end
  end

  # The same call on several ranks at once.
  def on_ranks(ranks, bound, fun) do
    ranks
    |> Enum.map(&Task.async(fn -> timed(bound, fn -> fun.(&1) end) end))
    |> Task.await_many(:infinity)
  end

  def outcome({:ok, value}), do: %{ok: value}

  def outcome({:error, %Error{} = e}),
    do: %{category: e.category, message: e.message, python_type: e.python_type}

  def outcome(other), do: %{other: inspect(other)}

  def ok!({:ok, value}, _what), do: value
  def ok!(other, what), do: raise("#{what}: #{inspect(other)}")

  def check!(got, expected, what) do
    got == expected || raise "#{what}: got #{inspect(got)}, expected #{inspect(expected)}"
  end

  # Retries fun (true when done) every 200 ms for at most ms.
  def until!(ms, what, fun) do
    deadline = now() + ms

    Stream.repeatedly(fn ->
      fun.() || ((now() < deadline || raise(what)) && Process.sleep(200))
    end)
    |> Enum.find(&(&1 == true))
  end

  def free_port(address) do
    {:ok, socket} = :gen_tcp.listen(0, ip: address, reuseaddr: true)
    {:ok, port} = :inet.port(socket)
    :ok = :gen_tcp.close(socket)
    port
  end

  def os_pids(pool) do
    for index <- 0..1, do: ok!(Worker.os_pid(ok!(Pool.worker(pool, index), "worker")), "os_pid")
  end

  def main([peer, signal_dir]) do
    peer = String.to_atom(peer)
    address = node() |> Atom.to_string() |> String.split("@") |> List.last()
    {:ok, ip} = :inet.parse_address(String.to_charlist(address))
    pool = :hosts_ranks
    world = 4

    {:ok, _} = Application.ensure_all_started(:vllm_bridge)

    {:ok, _} =
      Supervisor.start_child(VllmBridge.Supervisor, {Pool, name: pool, size: 2, timeout: 90_000})

    # the peer's pool answers on both workers
    until!(90_000, "the peer #{peer} did not come up", fn ->
      Node.connect(peer) == true and
        Enum.all?(
          0..1,
          &(Runtime.ping(:up, __runtime__: [pool: {pool, peer}, worker: &1]) == {:ok, :up})
        )
    end)

    true = Node.monitor(peer, true)

    rt = fn rank ->
      if rank < 2, do: [pool: pool, worker: rank], else: [pool: {pool, peer}, worker: rank - 2]
    end

    all = Enum.to_list(0..(world - 1))
    port = free_port(ip)

    groups =
      all
      |> Enum.map(fn rank ->
        Task.async(fn ->
          SPG.create(nil, address, port, rank, world, [],
            __runtime__: rt.(rank),
            store_timeout: 60
          )
        end)
      end)
      |> Task.await_many(120_000)
      |> Enum.map(&ok!(&1, "create"))

    check!(Enum.map(groups, &Ref.node/1), [node(), node(), peer, peer], "the refs' nodes")
    group = &Enum.at(groups, &1)

    each = fn fun ->
      all |> Enum.map(&Task.async(fn -> fun.(&1) end)) |> Task.await_many(60_000)
    end

    for src <- [0, 3] do
      got = each.(&SPG.broadcast_obj(group.(&1), if(&1 == src, do: %{"from" => src}), src))
      check!(got, List.duplicate({:ok, %{"from" => src}}, world), "broadcast_obj from #{src}")
    end

    expected = for rank <- all, do: {rank, "node#{div(rank, 2)}"}
    got = each.(&SPG.all_gather_obj(group.(&1), {&1, "node#{div(&1, 2)}"}))
    check!(got, List.duplicate({:ok, expected}, world), "all_gather_obj")
    check!(each.(&SPG.barrier(group.(&1), [30])), List.duplicate({:ok, nil}, world), "barrier")

    # send/recv across the nodes, both ways: 1 -> 2 and 3 -> 0
    recv2 = Task.async(fn -> SPG.recv_obj(group.(2), 1) end)
    recv0 = Task.async(fn -> SPG.recv_obj(group.(0), 3) end)
    check!(SPG.send_obj(group.(1), "to 2", 2), {:ok, nil}, "send_obj 1 -> 2")
    check!(SPG.send_obj(group.(3), "to 0", 0), {:ok, nil}, "send_obj 3 -> 0")
    check!(Task.await_many([recv2, recv0], 60_000), [{:ok, "to 2"}, {:ok, "to 0"}], "recv_obj")

    workers_before = os_pids(pool)
    File.touch!(Path.join(signal_dir, "formed"))
    signalled = now()

    nodedown_ms =
      receive do
        {:nodedown, ^peer} -> now() - signalled
      after
        60_000 -> raise "no nodedown of #{peer} within 60 s of #{signal_dir}/formed"
      end

    # ranks 0-1 wait for ranks 2-3, which are gone: each fails at its timeout
    barrier = on_ranks([0, 1], 30_000, &SPG.barrier(group.(&1), [5]))

    # after a failed barrier the group is unusable: refused at once
    all_gather =
      on_ranks([0, 1], 30_000, &SPG.all_gather_obj(group.(&1), &1, __runtime__: [timeout: 5_000]))

    # calls on the refs the dead node held
    remote = %{
      rank: timed(15_000, fn -> SPG.rank(group.(2)) end),
      barrier: timed(15_000, fn -> SPG.barrier(group.(3), [5]) end),
      all_gather_obj: timed(15_000, fn -> SPG.all_gather_obj(group.(2), :x) end)
    }

    released = timed(15_000, fn -> Runtime.release(groups) end)

    # this node's pool keeps serving: a fresh group on it alone
    port = free_port(ip)

    fresh =
      on_ranks([0, 1], 60_000, fn rank ->
        with {:ok, g} <-
               SPG.create(nil, address, port, rank, 2, [],
                 __runtime__: [pool: pool, worker: rank],
                 store_timeout: 30
               ),
             {:ok, gathered} <- SPG.all_gather_obj(g, rank * 10),
             {:ok, nil} <- SPG.barrier(g, [10]),
             {:ok, _} <- Runtime.release(g) do
          {:ok, %{gathered: gathered, node: Ref.node(g) == node()}}
        end
      end)

    # one line: the bridge's own msgpack, base64 (the test reads it with its codec)
    %{
      nodedown_ms: nodedown_ms,
      barrier: barrier,
      all_gather_obj: all_gather,
      remote: remote,
      released: released,
      fresh: fresh,
      workers_before: workers_before,
      workers_after: os_pids(pool),
      connected: Node.list()
    }
    |> VllmBridge.Msgpack.encode!()
    |> IO.iodata_to_binary()
    |> Base.encode64()
    |> IO.puts()
  end
end

Driver.main(System.argv())
