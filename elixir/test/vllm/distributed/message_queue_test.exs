Code.require_file("../../vllm_bridge/support/test_python.exs", __DIR__)

defmodule Vllm.Distributed.MessageQueueTest do
  # A MessageQueue driven from Elixir: a reader's `shutdown/1` ends the
  # `dequeue` that waits on the same queue, as it does for Python's threads.
  # Calls on one object otherwise run one at a time, so `shutdown` is the
  # method that does not wait for its turn. Real worker, real shared memory.
  use ExUnit.Case, async: false

  alias Vllm.Distributed.MessageQueue, as: MQ
  alias VllmBridge.{Error, Pool}

  @pool __MODULE__.Pool
  @rt [pool: @pool, worker: 0]

  setup do
    start_supervised!({Pool, name: @pool, size: 1, timeout: 30_000})
    {:ok, writer} = MQ.new(1, 1, [], __runtime__: @rt)
    {:ok, handle} = MQ.export_handle(writer, __runtime__: @rt)
    {:ok, reader} = MQ.create_from_handle(writer, handle, 0, __runtime__: @rt)

    [writer, reader]
    |> Enum.map(&Task.async(fn -> MQ.wait_until_ready(&1, [10], __runtime__: @rt) end))
    |> Task.await_many(20_000)
    |> Enum.each(&({:ok, nil} = &1))

    %{writer: writer, reader: reader}
  end

  test "shutdown ends a dequeue that waits on the same queue", %{reader: reader} do
    waiting = Task.async(fn -> timed(fn -> MQ.dequeue(reader, [], __runtime__: @rt) end) end)
    Process.sleep(300)

    {shutdown, took} =
      timed(fn -> MQ.shutdown(reader, __runtime__: Keyword.put(@rt, :timeout, 5_000)) end)

    assert shutdown == {:ok, nil}
    assert took < 2_000

    {dequeued, waited} = Task.await(waiting, 10_000)
    assert {:error, %Error{python_type: "WaitCancelled", message: message}} = dequeued
    assert message =~ "cancelled"
    assert waited < 300 + took + 2_000

    assert MQ.shutting_down(reader, __runtime__: @rt) == {:ok, true}
  end

  test "the writer's messages still arrive in order", %{writer: writer, reader: reader} do
    for n <- 1..3, do: {:ok, nil} = MQ.enqueue(writer, n, [5], __runtime__: @rt)
    assert for(_ <- 1..3, do: MQ.dequeue(reader, [5], __runtime__: @rt)) == [ok: 1, ok: 2, ok: 3]
  end

  test "recv reads the next message of a reader's end, as vLLM's static recv",
       %{writer: writer, reader: reader} do
    {:ok, nil} = MQ.enqueue(writer, "one", [5], __runtime__: @rt)
    assert MQ.recv(reader, reader, 5.0, __runtime__: @rt) == {:ok, "one"}

    # A negative timeout looks once, as 0: nothing is there.
    assert {:error, %Error{python_type: "GroupTimeout"}} =
             MQ.recv(reader, reader, -1.0, __runtime__: @rt)

    assert {:error, %Error{python_type: "StateError"}} =
             MQ.recv(writer, writer, 1.0, __runtime__: @rt)
  end

  defp timed(fun) do
    start = System.monotonic_time(:millisecond)
    result = fun.()
    {result, System.monotonic_time(:millisecond) - start}
  end
end
