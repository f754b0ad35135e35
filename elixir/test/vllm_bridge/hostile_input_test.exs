Code.require_file("support/test_python.exs", __DIR__)
Code.require_file("support/fault_helpers.exs", __DIR__)

defmodule VllmBridge.HostileInputTest do
  # The reproductions of issue 15 through the public API, against real Python
  # workers: values that crashed or wedged a worker are refused by the Elixir
  # encoder before anything is sent, and, written by hand past the encoder,
  # get one error reply each from a worker that serves on (same OS pid).
  use ExUnit.Case, async: true

  import VllmBridge.PoolHelpers
  import VllmBridge.FaultHelpers

  alias VllmBridge.{Error, Pool, Proto, Runtime, Tensor, Worker}

  @moduletag timeout: 120_000

  # the issue's tensor: no data, as its shape says, but strides beyond int64
  @huge_shape {0, 4_611_686_018_427_387_904, 4}

  setup %{test: test} do
    %{pool: pool, worker: worker, os_pid: os_pid} = one_worker_pool!(test)
    # a worker these values wedge would not even exit when its stdin closes
    on_exit(fn -> if os_alive?(os_pid), do: kill9(os_pid) end)
    %{port: port} = :sys.get_state(worker)
    rt = [__runtime__: [pool: pool, worker: 0, timeout: 10_000]]
    %{pool: pool, worker: worker, os_pid: os_pid, port: port, rt: rt}
  end

  defp nest(inner, depth, wrap), do: Enum.reduce(1..depth//1, inner, fn _, acc -> wrap.(acc) end)

  # Bytes written to the worker's port so far (by anyone).
  defp written(port) do
    {:output, bytes} = :erlang.port_info(port, :output)
    bytes
  end

  # msgpack of a tuple nested `depth` deep, {{...{1}...}}, written by hand
  defp tuples_bin(depth) do
    Enum.reduce(1..depth//1, <<1>>, fn _, inner -> ext_bin(4, <<0x91, inner::binary>>) end)
  end

  defp ext_bin(type, payload) do
    case byte_size(payload) do
      n when n in [1, 2, 4, 8, 16] ->
        <<%{1 => 0xD4, 2 => 0xD5, 4 => 0xD6, 8 => 0xD7, 16 => 0xD8}[n], type, payload::binary>>

      n when n <= 0xFF ->
        <<0xC7, n, type, payload::binary>>

      n when n <= 0xFFFF ->
        <<0xC8, n::16, type, payload::binary>>

      n ->
        <<0xC9, n::32, type, payload::binary>>
    end
  end

  defp error_reply!(reply) do
    assert {:ok, %{result: {:error, error}}} = Proto.decode_reply(reply)
    Error.from_reply(error)
  end

  defp still_serving!(%{worker: worker, os_pid: os_pid, rt: rt}) do
    assert {:ok, {:still, "here"}} = Runtime.ping({:still, "here"}, rt)
    assert {:ok, ^os_pid} = Worker.os_pid(worker)
  end

  test "Runtime.ping/2 of a tuple nested 300 deep: :bad_args, nothing sent, the worker serves on",
       %{port: port, rt: rt} = ctx do
    deep = nest(1, 300, &{&1})
    before = written(port)

    assert {:error, %Error{category: :bad_args, message: message}} = Runtime.ping(deep, rt)
    assert message =~ "nested deeper than 128"
    assert written(port) == before, "the refused ping was sent"

    # the same for arguments: the argument list is a level, so an argument may
    # nest 127 deep (and a keyword argument too: the keywords are a map)
    ok = nest(1, 127, &[&1])
    assert {:ok, ^ok} = Runtime.call_function("echo", [ok], rt)
    assert {:ok, ^ok} = Runtime.call_function("echo", [], [value: ok] ++ rt)
    before = written(port)

    for opts <- [[], [__args__: [nest(1, 128, &[&1])]], [value: nest(1, 128, &%{"k" => &1})]] do
      args = if opts == [], do: [nest(1, 128, &{&1})], else: []

      assert {:error, %Error{category: :bad_args, message: message}} =
               Runtime.call_function("echo", args, opts ++ rt)

      assert message =~ "nested deeper than 128"
    end

    assert written(port) == before, "a refused call was sent"
    # a ping's term is not in a list: it may nest 128 deep
    assert {:ok, _} = Runtime.ping(nest(1, 128, &{&1}), rt)
    still_serving!(ctx)
  end

  test "map keys that are one key in Python: :bad_args naming both, nothing sent",
       %{port: port, rt: rt} = ctx do
    before = written(port)

    for {map, keys} <- [
          {%{true => 1, 1 => 2}, ["true", "1"]},
          {%{:a => 1, "a" => 2}, [":a", ~s("a")]},
          {%{1 => :a, 1.0 => :b}, ["1", "1.0"]},
          {%{"deep" => [%{{:a, 0} => 1, {"a", false} => 2}]}, ["{:a, 0}", ~s({"a", false})]}
        ] do
      assert {:error, %Error{category: :bad_args, message: message}} = Runtime.ping(map, rt)
      assert message =~ "would be one key in Python"
      for key <- keys, do: assert(message =~ key, message)
    end

    assert written(port) == before, "a refused ping was sent"
    # keys that differ in Python too cross as they are
    mixed = %{1 => :one, "1" => :string, :b => 2, 0.5 => :half, nil => :none}
    assert {:ok, ^mixed} = Runtime.ping(mixed, rt)
    still_serving!(ctx)
  end

  test "a 300-deep tuple written by hand into a Ping frame: a bad_args reply, the worker serves on",
       %{pool: pool, worker: worker} = ctx do
    payload = tuples_bin(300)
    assert byte_size(payload) < 1500
    {:ok, 0, ^worker, channel, _timeout} = Pool.route(pool, {0, worker})

    # by the worker's pid (which hands out its channel) and by its channel
    for via <- [worker, channel] do
      id = Worker.new_id()
      frame = frame!(id, {:ping, %{payload: payload}})
      assert {:ok, reply} = Worker.request(via, id, frame, 10_000)
      assert %Error{category: :bad_args, message: message} = error_reply!(reply)
      assert message =~ "nested deeper than 128"
    end

    # and Elixir decodes the deepest value Python may send back
    assert {:ok, deepest} = Runtime.call_function("nested", [127], ctx.rt)
    assert deepest == nest(0, 127, &[&1])

    assert {:error, %Error{category: :encode, message: message}} =
             Runtime.call_function("nested", [129], ctx.rt)

    assert message =~ "nested deeper than 128"
    still_serving!(ctx)
  end

  test "300 tensors with an impossible shape, written by hand: 300 error replies, then a call works",
       %{worker: worker} = ctx do
    tensor = %Tensor{type: {:f, 32}, shape: @huge_shape, data: <<>>}
    # the struct is refused by the Elixir encoder, naming the shape
    assert {:error, %Error{category: :encode, message: message}} = Runtime.ping(tensor, ctx.rt)
    assert message =~ inspect(@huge_shape)

    payload = ext_bin(1, <<?f, 32, 3, 0::64, 4_611_686_018_427_387_904::64, 4::64>>)

    # all 300 in flight at once, each answered within 5 s
    requests =
      for _ <- 1..300 do
        id = Worker.new_id()
        Worker.send_request(worker, id, frame!(id, {:ping, %{payload: payload}}))
      end

    for request <- requests do
      assert {:ok, reply} = Worker.await(request, 5_000)
      assert %Error{category: :bad_args, message: message} = error_reply!(reply)
      assert message =~ "is too large"
    end

    assert {:ok, 1} = Runtime.call_function("echo", [1], ctx.rt)
    still_serving!(ctx)
  end

  test "refs forged by hand, at every way in: :bad_args, nothing sent, the worker serves on",
       %{pool: pool, port: port, rt: rt} = ctx do
    {:ok, counter} = Runtime.call_class("Counter", [], rt)

    forged = [
      %{__struct__: VllmBridge.Ref},
      %{__struct__: VllmBridge.Ref, id: counter.id},
      Map.delete(counter, :pool),
      Map.delete(counter, :worker),
      %{counter | id: -1},
      %{counter | class: 5},
      %{counter | worker: :not_a_pid},
      %{counter | pool: "not an atom"},
      %{counter | session: 7},
      %{counter | index: :first}
    ]

    before = written(port)

    for ref <- forged do
      ways_in = [
        call_method: fn -> Runtime.call_method(ref, "incr", [], rt) end,
        get_attr: fn -> Runtime.get_attr(ref, "value", rt) end,
        release: fn -> Runtime.release(ref, rt) end,
        release_list: fn -> Runtime.release([counter, ref], rt) end,
        argument: fn -> Runtime.call_function("echo", [[1, {ref}]], rt) end,
        keyword: fn -> Runtime.call_function("echo", [1], [x: %{"k" => ref}] ++ rt) end,
        placement: fn ->
          Runtime.call_function("echo", [1], __runtime__: [pool: pool, worker: ref])
        end,
        static: fn -> Runtime.call_static(ref, "echo", [1], rt) end
      ]

      for {way, call} <- ways_in do
        assert {:error, %Error{category: :bad_args, message: message}} = call.(),
               "#{way} of #{inspect(ref, structs: false)}"

        assert message =~ "not a well-formed %VllmBridge.Ref{}"
      end
    end

    # a ping's term is a value, not a call's arguments: the encoder refuses it
    assert {:error, %Error{category: :encode, message: message}} =
             Runtime.ping(%{__struct__: VllmBridge.Ref, worker: self()}, rt)

    assert message =~ "not a well-formed ref"
    assert written(port) == before, "a call with a forged ref was sent"
    # the real ref still names its object
    assert {:ok, 1} = Runtime.call_method(counter, "incr", [], rt)
    still_serving!(ctx)
  end
end
