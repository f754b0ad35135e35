defmodule VllmBridge.Runtime.OptionsTest do
  use ExUnit.Case, async: true
  import Bitwise

  alias VllmBridge.{Error, Ref}
  alias VllmBridge.Runtime.Options

  doctest VllmBridge.Runtime.Options

  defp parse!(args, opts) do
    assert {:ok, call} = Options.parse(args, opts)
    call
  end

  # {message, term} of the :bad_args error
  defp bad(args, opts) do
    assert {:error, %Error{category: :bad_args, message: message, details: %{term: term}}} =
             Options.parse(args, opts)

    {message, term}
  end

  describe "valid options" do
    test "none: the defaults" do
      assert parse!([1, 2], []) == %{
               args: [1, 2],
               kwargs: [],
               kwargs?: false,
               pool: VllmBridge.DefaultPool,
               node: nil,
               worker: nil,
               timeout: nil,
               session: nil,
               owner: nil
             }
    end

    test "keyword arguments keep their order; :__args__ is appended to the positional ones" do
      call = parse!([1], b: 2, __args__: [3, 4], a: 1, __runtime__: [timeout: 5])
      assert call.args == [1, 3, 4]
      assert call.kwargs == [b: 2, a: 1]
      assert call.kwargs?
      assert call.timeout == 5
    end

    test "every :__runtime__ option" do
      ref = %Ref{id: 1, worker: self()}
      pid = self()

      for worker <- [0, 3, ref, pid] do
        call =
          parse!([],
            __runtime__: [pool: P, node: :n@h, worker: worker, timeout: 0, session: "s"]
          )

        assert %{pool: P, node: :n@h, worker: ^worker, timeout: 0, session: "s"} = call
      end

      assert parse!([], __runtime__: [timeout: :infinity]).timeout == :infinity
      assert parse!([], __runtime__: [pool: nil, node: nil]).pool == VllmBridge.DefaultPool
    end

    test "pool: {name, node} is pool: name, node: node; the same node given twice is fine" do
      assert %{pool: P, node: :n@h} = parse!([], __runtime__: [pool: {P, :n@h}])
      assert %{pool: P, node: :n@h} = parse!([], __runtime__: [node: :n@h, pool: {P, :n@h}])
    end

    test "a key given twice: the first wins, as with Keyword.get/2" do
      call = parse!([], __runtime__: [timeout: 1, timeout: -1], __runtime__: [nope: 1])
      assert call.timeout == 1
      assert parse!([], __args__: [1], __args__: :nope).args == [1]
      assert parse!([], __runtime__: [pool: nil, pool: 7]).pool == VllmBridge.DefaultPool
    end
  end

  describe "invalid options: a :bad_args error naming the option" do
    test "positional arguments and the options list" do
      assert bad(:nope, []) == {"positional arguments must be a list", :nope}
      assert bad([], :nope) == {"options must be a keyword list", :nope}
      assert bad([], [:x]) == {"options must be a keyword list", [:x]}
      assert bad([], [{"a", 1}]) == {"options must be a keyword list", [{"a", 1}]}

      assert bad([], [{:a, 1} | :improper]) ==
               {"options must be a keyword list", [{:a, 1} | :improper]}
    end

    test ":__args__" do
      assert bad([], __args__: :nope) ==
               {"args (the optional positional arguments, in order) must be a list, or a " <>
                  "keyword list of options", :nope}
    end

    test ":__args__ given as a keyword list is options, before the others" do
      call = parse!([1], __args__: [timeout: 10, __runtime__: [timeout: 5]], b: 2)
      assert {call.args, call.kwargs, call.timeout} == {[1], [timeout: 10, b: 2], 5}
      # a list of tuples that is not a keyword list stays positional
      assert parse!([], __args__: [{:a, 1}, 2]).args == [{:a, 1}, 2]
    end

    test ":__runtime__ not a keyword list" do
      assert bad([], __runtime__: :nope) == {":__runtime__ must be a keyword list", :nope}
      assert bad([], __runtime__: [:pool]) == {":__runtime__ must be a keyword list", [:pool]}
    end

    test "unknown :__runtime__ keys, all named in order" do
      rt = [pool: P, nope: 1, other: 2, nope: 3]
      {message, term} = bad([], __runtime__: rt)
      assert term == rt
      assert message =~ "unknown :__runtime__ options [:nope, :other, :nope]"
      assert message =~ "(known: [:pool, :node, :worker, :timeout, :session, :owner])"
    end

    test "node" do
      for node <- ["n@h", true, false, 1] do
        assert bad([], __runtime__: [node: node]) ==
                 {":__runtime__ node must be a node name (an atom)", node}
      end

      # the node of pool: {name, node} is checked the same way
      assert bad([], __runtime__: [pool: {P, true}]) ==
               {":__runtime__ node must be a node name (an atom)", true}
    end

    test "pool" do
      for pool <- ["p", 1, {P}, {P, :n, :x}] do
        assert bad([], __runtime__: [pool: pool]) ==
                 {":__runtime__ pool must be an atom or {pool, node}", pool}
      end

      for pool <- [{"p", :n@h}, {P, "n"}, {nil, :n@h}, {P, nil}] do
        assert bad([], __runtime__: [pool: pool]) ==
                 {":__runtime__ pool must be an atom or {pool, node}", pool}
      end

      rt = [pool: {P, :a@h}, node: :b@h]

      assert bad([], __runtime__: rt) ==
               {":__runtime__ names two nodes: pool: {P, :a@h} and node: :b@h", rt}
    end

    test "timeout" do
      # (past 4294967295 ms no `receive ... after` can wait: it raised in the caller)
      for timeout <- [-1, 1.5, "1", :never, 4_294_967_296, 1 <<< 64] do
        assert bad([], __runtime__: [timeout: timeout]) ==
                 {":__runtime__ timeout must be a non-negative integer (ms, at most " <>
                    "4294967295) or :infinity", timeout}
      end

      assert {:ok, %{timeout: 4_294_967_295}} =
               VllmBridge.Runtime.Options.parse([], __runtime__: [timeout: 4_294_967_295])
    end

    test "session" do
      for session <- [:s, 1, ~c"s"] do
        assert bad([], __runtime__: [session: session]) ==
                 {":__runtime__ session must be a string", session}
      end
    end

    test "worker" do
      for worker <- [-1, "0", 1.0, %{id: 1}] do
        assert bad([], __runtime__: [worker: worker]) ==
                 {":__runtime__ worker must be an index, a ref or a pid", worker}
      end
    end

    test "several invalid options: the first in the documented order" do
      assert {"args (the optional positional arguments" <> _, :x} =
               bad([], __runtime__: [timeout: -1], __args__: :x)

      assert {"unknown :__runtime__ options [:nope]" <> _, _} =
               bad([], __runtime__: [worker: -1, nope: 1])

      assert {":__runtime__ node must" <> _, 1} =
               bad([], __runtime__: [worker: -1, timeout: -1, node: 1])

      assert {":__runtime__ timeout must" <> _, -1} =
               bad([], __runtime__: [worker: -1, session: 1, timeout: -1])

      assert {":__runtime__ session must" <> _, 1} =
               bad([], __runtime__: [worker: -1, session: 1])
    end
  end
end
