Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.RefOwnerTest do
  # Issue 40: refs outlived the processes that asked for them (300 processes
  # that made an object and exited left 300 objects held), and one release
  # broke another caller's ref to the same object. Now a ref belongs to its
  # owner (the caller, or the process that started its Task): the worker
  # forgets the object when the owner exits, and each ref is counted.
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers

  alias VllmBridge.{Error, Pool, Ref, Runtime, Worker}

  @moduletag timeout: 120_000

  setup %{test: test} do
    pool = start_pool!(:"#{test}", 1)
    {:ok, worker} = Pool.worker(pool, 0)
    rt = [__runtime__: [pool: pool, worker: 0]]
    {:ok, before} = Runtime.call_function("live_counters", [], rt)
    %{pool: pool, worker: worker, rt: rt, before: before}
  end

  defp live(rt) do
    {:ok, count} = Runtime.call_function("live_counters", [], rt)
    count
  end

  defp owners(worker) do
    {:ok, %{owners: owners}} = Worker.info(worker)
    owners
  end

  # Runs `fun` in a process of its own (not a Task: no $callers), which then
  # exits normally or crashes; returns what `fun` returned once it has exited.
  defp in_process(fun, exit \\ :normal) do
    parent = self()

    {pid, monitor} =
      spawn_monitor(fn ->
        send(parent, {self(), fun.()})
        if exit == :crash, do: exit(:crashed_on_purpose), else: :ok
      end)

    receive do
      {^pid, result} ->
        receive do
          {:DOWN, ^monitor, :process, ^pid, _} -> result
        end

      {:DOWN, ^monitor, :process, ^pid, reason} ->
        flunk("the process exited before it returned: #{inspect(reason)}")
    end
  end

  test "refs are released when the processes that made them exit or crash", ctx do
    %{rt: rt, before: before, worker: worker} = ctx
    parent = self()

    for i <- 1..300 do
      spawn(fn ->
        {:ok, %Ref{}} = Runtime.call_class("Counter", [], ctx.rt)
        send(parent, :made)
        if rem(i, 2) == 0, do: exit(:crashed_on_purpose)
      end)
    end

    for _ <- 1..300, do: assert_receive(:made, 30_000)
    assert eventually(fn -> live(rt) == before end)
    assert eventually(fn -> owners(worker) == 0 end)
  end

  test "a ref made in a Task belongs to the process that started the Task", ctx do
    %{rt: rt, before: before} = ctx

    assert {:ok, 1} =
             in_process(fn ->
               {:ok, counter} =
                 Task.async(fn -> Runtime.call_class("Counter", [], rt) end) |> Task.await()

               assert counter.owner == self()
               # nested tasks too: the owner is the process that started the first
               {:ok, nested} =
                 Task.async(fn ->
                   Task.async(fn -> Runtime.call_class("Counter", [], rt) end) |> Task.await()
                 end)
                 |> Task.await()

               assert nested.owner == self()
               # the tasks have exited: their refs still work
               {:ok, 1} = Runtime.call_method(nested, "incr")
               Runtime.call_method(counter, "incr")
             end)

    assert eventually(fn -> live(rt) == before end)
  end

  test "owner: :none, a named owner and another session outlive the caller", ctx do
    %{rt: rt, before: before, worker: worker} = ctx
    keeper = spawn(fn -> receive do: (:stop -> :ok) end)
    Process.register(keeper, :"#{ctx.test} keeper")
    on_exit(fn -> Process.exit(keeper, :kill) end)
    [runtime] = Keyword.values(rt)

    refs =
      in_process(fn ->
        for extra <- [[owner: :none], [owner: :"#{ctx.test} keeper"], [session: "kept"]] do
          {:ok, ref} = Runtime.call_class("Counter", [], __runtime__: runtime ++ extra)
          ref
        end
      end)

    assert [%Ref{owner: nil}, %Ref{owner: ^keeper}, %Ref{owner: nil, session: "kept"}] = refs
    # the caller's exit has been handled (it owned nothing), the objects live
    assert owners(worker) == 1
    assert live(rt) == before + 3
    for ref <- refs, do: assert({:ok, _} = Runtime.call_method(ref, "incr"))

    send(keeper, :stop)
    assert eventually(fn -> live(rt) == before + 2 end)
    assert {:ok, 1} = Runtime.release(hd(refs))
    assert {:ok, 1} = Runtime.release_session("kept", pool: ctx.pool)
    assert live(rt) == before
  end

  test "an object given to two processes lives until both have released it", ctx do
    %{rt: rt, before: before} = ctx
    {:ok, mine} = Runtime.call_class("Counter", [5], rt)
    parent = self()

    other =
      spawn(fn ->
        # the same object, returned to another process: the same handle
        {:ok, theirs} = Runtime.ping(mine, ctx.rt)
        send(parent, {:theirs, theirs})
        receive do: (:release -> send(parent, {:released, Runtime.release(theirs)}))
        receive do: (:stop -> :ok)
      end)

    assert_receive {:theirs, theirs}, 10_000
    assert theirs.id == mine.id and theirs.owner == other
    # this process's release leaves the other's ref working
    assert {:ok, 0} = Runtime.release(mine)
    assert {:ok, 0} = Runtime.release(mine)
    assert {:ok, 6} = Runtime.call_method(theirs, "incr")
    send(other, :release)
    assert_receive {:released, {:ok, 1}}, 10_000
    assert live(rt) == before

    assert {:error, %Error{category: :not_found}} = Runtime.call_method(theirs, "incr")
    send(other, :stop)
  end

  # A reply whose caller gave up (here: a request with no deadline for Python, and a
  # caller that waits 100 ms for a call that takes 500 ms) still held the object Python
  # counted as handed out; the worker now releases the refs of such a reply.
  test "the refs of a reply that comes after its caller gave up are released", ctx do
    %{worker: worker, rt: rt, before: before} = ctx
    id = Worker.new_id()
    {:ok, args} = VllmBridge.Msgpack.encode([0.5])
    op = {:call_function, %{function: "counter_after", args: args, kwargs: ""}}
    {:ok, frame} = VllmBridge.Proto.encode_request(%{id: id, session: "", op: op})

    assert {:error, %Error{category: :timeout}} = Worker.request(worker, id, frame, 100)

    # made, and on its way back
    assert live(rt) == before + 1
    assert eventually(fn -> live(rt) == before end)
  end

  test "an owner that is not a pid, a registered name or :none is refused", ctx do
    [runtime] = Keyword.values(ctx.rt)

    assert {:error, %Error{category: :bad_args, message: message}} =
             Runtime.call_class("Counter", [], __runtime__: runtime ++ [owner: :nobody_here])

    assert message =~ "owner :nobody_here is not a registered process"

    assert {:error, %Error{category: :bad_args}} =
             Runtime.call_class("Counter", [], __runtime__: runtime ++ [owner: "me"])

    assert live(ctx.rt) == ctx.before
  end
end
