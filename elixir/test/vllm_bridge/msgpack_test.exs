Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.MsgpackTest do
  use ExUnit.Case, async: true

  import Bitwise

  alias VllmBridge.{Error, Msgpack, Ref, Tensor}

  doctest VllmBridge.Msgpack

  defp hex(term),
    do: term |> Msgpack.encode!() |> IO.iodata_to_binary() |> Base.encode16(case: :lower)

  defp binaries(bin) when is_binary(bin), do: [bin]
  defp binaries(byte) when is_integer(byte), do: []
  defp binaries([]), do: []
  defp binaries([head | tail]), do: binaries(head) ++ binaries(tail)

  defp roundtrip(term) do
    {:ok, iodata} = Msgpack.encode(term)
    {:ok, back} = Msgpack.decode(IO.iodata_to_binary(iodata))
    back
  end

  describe "canonical encoding" do
    test "nil and booleans" do
      assert hex(nil) == "c0"
      assert hex(true) == "c3"
      assert hex(false) == "c2"
    end

    test "integers take the smallest form" do
      cases = [
        {0, "00"},
        {127, "7f"},
        {128, "cc80"},
        {255, "ccff"},
        {256, "cd0100"},
        {65_535, "cdffff"},
        {65_536, "ce00010000"},
        {4_294_967_295, "ceffffffff"},
        {4_294_967_296, "cf0000000100000000"},
        {18_446_744_073_709_551_615, "cfffffffffffffffff"},
        {-1, "ff"},
        {-32, "e0"},
        {-33, "d0df"},
        {-128, "d080"},
        {-129, "d1ff7f"},
        {-32_768, "d18000"},
        {-32_769, "d2ffff7fff"},
        {-2_147_483_648, "d280000000"},
        {-2_147_483_649, "d3ffffffff7fffffff"},
        {-9_223_372_036_854_775_808, "d38000000000000000"}
      ]

      for {int, expected} <- cases do
        assert hex(int) == expected, "#{int}"
        assert roundtrip(int) === int
      end
    end

    test "integers beyond 64 bits are refused, naming the term" do
      assert {:error, %Error{category: :encode, message: message}} = Msgpack.encode([1 <<< 64])
      assert message =~ "18446744073709551616"
      assert {:error, %Error{category: :encode}} = Msgpack.encode(-(1 <<< 63) - 1)
    end

    test "floats are always float64" do
      assert hex(1.5) == "cb3ff8000000000000"
      assert hex(0.0) == "cb0000000000000000"
      assert roundtrip(-2.25) === -2.25
    end

    test "valid UTF-8 is str, anything else bin" do
      assert hex("") == "a0"
      assert hex("hi") == "a26869"
      assert hex(String.duplicate("a", 31)) =~ ~r/^bf/
      assert hex(String.duplicate("a", 32)) =~ ~r/^d920/
      assert hex(String.duplicate("a", 256)) =~ ~r/^da0100/
      assert hex(String.duplicate("a", 65_536)) =~ ~r/^db00010000/
      assert hex("héllo") == "a668c3a96c6c6f"
      assert hex(<<255>>) == "c401ff"
      assert hex(:binary.copy(<<255>>, 256)) =~ ~r/^c50100/
      assert hex(:binary.copy(<<255>>, 65_536)) =~ ~r/^c600010000/
      # a long ASCII run followed by an invalid byte
      assert hex(String.duplicate("a", 100) <> <<0xC3>>) =~ ~r/^c465/
      assert roundtrip(<<0, 1, 2, 255>>) == <<0, 1, 2, 255>>
    end

    test "str or bin exactly as String.valid?/1 says, for random and mutated text" do
      :rand.seed(:exsss, {7, 11, 2026})
      text = "ascii, é, ß, 中文, 😀, \u{FFFF}, \u{10FFFF}"

      mutated =
        for _ <- 1..2_000 do
          at = :rand.uniform(byte_size(text)) - 1
          <<head::binary-size(at), _, tail::binary>> = text
          head <> <<:rand.uniform(256) - 1>> <> tail
        end

      random = for n <- 1..1_000, do: :crypto.strong_rand_bytes(rem(n, 40))

      for bin <- [text | mutated ++ random] do
        <<type, _::binary>> = bin |> Msgpack.encode!() |> IO.iodata_to_binary()
        str? = type in [0xD9, 0xDA, 0xDB] or type >>> 5 == 0b101
        assert str? == String.valid?(bin), inspect(bin)
      end
    end

    test "lists and maps" do
      assert hex([]) == "90"
      assert hex([1, [2]]) == "920191" <> "02"
      assert hex(Enum.to_list(1..16)) =~ ~r/^dc0010/
      assert hex(%{}) == "80"
      assert hex(%{"a" => 1}) == "81a16101"
      assert hex(Map.new(1..16, &{&1, &1})) =~ ~r/^de0010/

      assert roundtrip(%{1 => [%{"x" => nil}], "k" => -1.0}) == %{
               1 => [%{"x" => nil}],
               "k" => -1.0
             }
    end

    test "improper lists, pids, functions, refs, ports and structs are refused" do
      for term <- [[1 | 2], self(), fn -> :ok end, make_ref(), <<1::3>>, URI.parse("x:y")] do
        assert {:error, %Error{category: :encode, details: %{term: ^term}}} = Msgpack.encode(term)
      end

      assert_raise Error, ~r/pids cannot cross/, fn -> Msgpack.encode!(%{"a" => self()}) end
    end
  end

  describe "extensions" do
    test "atoms are ext 3, except nil/true/false" do
      assert hex(:ok) == "d5036f6b"
      assert hex(:a) == "d40361"
      assert roundtrip(:some_atom) == :some_atom
      assert roundtrip(Elixir.Kernel) == Kernel
    end

    test "unknown atom names decode to binaries, never new atoms" do
      name = "vllm_bridge_never_an_atom_#{System.unique_integer([:positive])}"
      bin = <<0xC7, byte_size(name), 3, name::binary>>
      assert {:ok, ^name} = Msgpack.decode(bin)
      assert_raise ArgumentError, fn -> String.to_existing_atom(name) end
    end

    test "tuples are ext 4 around an array" do
      assert hex({}) == "d40490"
      assert hex({:ok, nil}) == "c7060492d5036f6bc0"
      assert roundtrip({1, {2, "x"}, [{}]}) == {1, {2, "x"}, [{}]}
      assert {:error, %Error{category: :protocol}} = Msgpack.decode(<<0xD4, 4, 1>>)
    end

    test "refs are ext 2: handle u64 + class, stamped on decode" do
      ref = %Ref{id: 7, class: "StatelessProcessGroup"}
      assert "c71d02" <> rest = hex(ref)
      assert rest == "0000000000000007" <> Base.encode16("StatelessProcessGroup", case: :lower)
      assert hex(%Ref{id: 1, class: ""}) == "d7020000000000000001"

      {:ok, iodata} = Msgpack.encode([ref])
      pid = self()

      assert {:ok,
              [%Ref{id: 7, class: "StatelessProcessGroup", worker: ^pid, pool: :p, session: "s"}]} =
               Msgpack.decode(IO.iodata_to_binary(iodata),
                 ref: [worker: pid, pool: :p, session: "s"]
               )

      # pool/worker/session never go on the wire
      assert hex(%{ref | worker: self(), pool: :p, session: "s"}) == hex(ref)
    end

    test "tensors are ext 1: kind, bits, ndim, dims, data" do
      {:ok, t} = Tensor.new({:f, 32}, {2}, <<1.0::float-32-little, 2.0::float-32-little>>)
      assert hex(t) == "c713016620010000000000000002" <> "0000803f00000040"
      {:ok, scalar} = Tensor.new({:s, 64}, {}, <<5::64-little>>)
      assert hex(scalar) == "c70b01734000" <> "0500000000000000"

      for type <- Tensor.types() do
        {_, bits} = type
        data = :binary.copy(<<0>>, div(bits, 8) * 6)
        tensor = %Tensor{type: type, shape: {2, 3}, data: data}
        assert roundtrip(tensor) == tensor
      end

      empty = %Tensor{type: {:bf, 16}, shape: {0, 4}, data: ""}
      assert roundtrip(empty) == empty
    end

    test "invalid tensors are refused" do
      assert {:error, %Error{category: :encode}} =
               Msgpack.encode(%Tensor{type: {:f, 32}, shape: {3}, data: <<0::32>>})

      assert {:error, %Error{category: :encode}} =
               Msgpack.encode(%Tensor{type: {:q, 4}, shape: {}, data: <<0>>})

      # wire: data too short for the shape
      assert {:error, %Error{category: :protocol}} =
               Msgpack.decode(<<0xC7, 11, 1, ?f, 32, 1, 2::64>>)
    end

    test "a 64 MiB tensor is not copied by the encoder" do
      data = :binary.copy(<<1, 2, 3, 4>>, 16 * 1024 * 1024)
      tensor = %Tensor{type: {:f, 32}, shape: {16 * 1024 * 1024}, data: data}
      {:ok, iodata} = Msgpack.encode(tensor)
      parts = binaries(iodata)
      # the data binary is in the iodata as the very same term
      assert Enum.any?(parts, &(is_binary(&1) and :erts_debug.same(&1, data)))
      assert Enum.sum(for p <- parts, is_binary(p), do: byte_size(p)) < byte_size(data) + 64

      {us, {:ok, _}} = :timer.tc(fn -> Msgpack.encode(tensor) end)
      assert us < 50_000
    end

    test "a large str is referenced, not copied" do
      big = String.duplicate("abcdefgh", 1024)
      {:ok, [_header | body]} = Msgpack.encode(big)
      assert :erts_debug.same(body, big)
    end
  end

  describe "decoding" do
    test "special floats become atoms" do
      assert {:ok, :nan} = Msgpack.decode(<<0xCB, 0x7FF8000000000000::64>>)
      assert {:ok, :infinity} = Msgpack.decode(<<0xCB, 0x7FF0000000000000::64>>)
      assert {:ok, :neg_infinity} = Msgpack.decode(<<0xCA, 0xFF800000::32>>)
      assert {:ok, 1.5} = Msgpack.decode(<<0xCA, 1.5::float-32>>)
    end

    test "non-canonical but valid forms are accepted" do
      assert {:ok, 1} = Msgpack.decode(<<0xCF, 1::64>>)
      assert {:ok, "a"} = Msgpack.decode(<<0xDA, 1::16, ?a>>)
      assert {:ok, [1]} = Msgpack.decode(<<0xDD, 1::32, 1>>)
      assert {:ok, %{1 => 2}} = Msgpack.decode(<<0xDF, 1::32, 1, 2>>)
      assert {:ok, <<7>>} = Msgpack.decode(<<0xC6, 1::32, 7>>)
      assert {:ok, -1} = Msgpack.decode(<<0xD3, -1::64>>)
    end

    test "malformed input is a protocol error with an offset" do
      for bad <- [<<>>, <<0x92, 1>>, <<0xC1>>, <<0xD9, 5, "ab">>, <<1, 2>>, <<0xD4, 9, 0>>] do
        assert {:error, %Error{category: :protocol, details: %{offset: _}}} = Msgpack.decode(bad),
               inspect(bad)
      end

      assert {:error, %Error{category: :bad_args}} = Msgpack.decode(:nope)
    end
  end

  # `inner` wrapped in `depth` one-element containers made by `wrap`.
  defp nest(inner, depth, wrap), do: Enum.reduce(1..depth//1, inner, fn _, acc -> wrap.(acc) end)

  # msgpack of a tuple nested `depth` deep, written by hand (the encoder refuses deep ones).
  defp tuples_bin(depth) do
    Enum.reduce(1..depth//1, <<1>>, fn _, inner -> ext_bin(4, <<0x91, inner::binary>>) end)
  end

  defp ext_bin(type, payload) do
    case byte_size(payload) do
      n when n in [1, 2, 4, 8, 16] ->
        code = %{1 => 0xD4, 2 => 0xD5, 4 => 0xD6, 8 => 0xD7, 16 => 0xD8}[n]
        <<code, type, payload::binary>>

      n when n <= 0xFF ->
        <<0xC7, n, type, payload::binary>>

      n when n <= 0xFFFF ->
        <<0xC8, n::16, type, payload::binary>>

      n ->
        <<0xC9, n::32, type, payload::binary>>
    end
  end

  describe "nesting limit" do
    test "max_depth/0 is 128" do
      assert Msgpack.max_depth() == 128
    end

    for name <- [:list, :tuple, :map_value, :map_key] do
      test "#{name}s nested 128 deep round-trip; 129 deep are refused both ways" do
        wrap = &wrap(unquote(name), &1)
        ok = nest(1, 128, wrap)
        assert roundtrip(ok) == ok

        deep = nest(1, 129, wrap)
        assert {:error, %Error{category: :bad_args, message: message}} = Msgpack.encode(deep)
        assert message =~ "nested deeper than 128"

        # the same bytes, written by hand: one more level around the 128-deep value
        inner = ok |> Msgpack.encode!() |> IO.iodata_to_binary()
        bytes = deep_bytes(unquote(name), inner)

        assert {:error, %Error{category: :protocol, message: message}} = Msgpack.decode(bytes)
        assert message =~ "nested deeper than 128"
      end
    end

    test "an empty container is one level; scalars, tensors and refs are none" do
      assert {:ok, _} = Msgpack.encode(nest([], 127, &[&1]))
      assert {:error, %Error{category: :bad_args}} = Msgpack.encode(nest([], 128, &[&1]))
      assert {:error, %Error{category: :bad_args}} = Msgpack.encode(nest(%{}, 128, &{&1}))
      assert {:error, %Error{category: :bad_args}} = Msgpack.encode(nest({}, 128, &%{1 => &1}))
      assert {:ok, _} = Msgpack.decode(:binary.copy(<<0x91>>, 127) <> <<0x90>>)
      assert {:error, %Error{}} = Msgpack.decode(:binary.copy(<<0x91>>, 128) <> <<0x90>>)
      assert {:error, %Error{}} = Msgpack.decode(:binary.copy(<<0x91>>, 128) <> <<0x80>>)

      tensor = %Tensor{type: {:u, 8}, shape: {1}, data: <<7>>}

      for leaf <- [tensor, %Ref{id: 1}, :atom, "str", <<0xFF>>, 1.5, nil] do
        assert roundtrip(nest(leaf, 128, &[&1])) == nest(leaf, 128, &[&1])
        assert {:error, %Error{category: :bad_args}} = Msgpack.encode(nest(leaf, 129, &[&1]))
      end
    end

    test "the deepest branch counts, wherever it is" do
      shallow = Enum.to_list(1..10)
      # a list, a map, then tuples
      ok = [shallow, %{"a" => shallow, "b" => nest(0, 126, &{&1})}, shallow]
      assert roundtrip(ok) == ok
      deep = [shallow, %{"a" => shallow, "b" => nest(0, 127, &{&1})}, shallow]
      assert {:error, %Error{message: message}} = Msgpack.encode(deep)
      assert message =~ "nested deeper than 128"
    end

    test "a tuple nested 300 deep (the issue's 1.4 KB value)" do
      deep = nest(1, 300, &{&1})
      assert {:error, %Error{category: :bad_args, message: message}} = Msgpack.encode(deep)
      assert message =~ "nested deeper than 128"

      bytes = tuples_bin(300)
      assert byte_size(bytes) < 1500
      assert {:error, %Error{category: :protocol, message: message}} = Msgpack.decode(bytes)
      assert message =~ "nested deeper than 128"
      assert Msgpack.decode(tuples_bin(128)) == {:ok, nest(1, 128, &{&1})}
    end

    test "a million nested arrays are refused at once, not walked" do
      bytes = :binary.copy(<<0x91>>, 1_000_000) <> <<0xC0>>
      {us, result} = :timer.tc(fn -> Msgpack.decode(bytes) end)
      # (the offset is just past the header of the 129th array)
      assert {:error, %Error{category: :protocol, details: %{offset: 129}}} = result
      assert us < 100_000
    end
  end

  defp wrap(:list, x), do: [x]
  defp wrap(:tuple, x), do: {x}
  defp wrap(:map_value, x), do: %{"k" => x}
  defp wrap(:map_key, x), do: %{x => 1}

  defp deep_bytes(:list, inner), do: <<0x91, inner::binary>>
  defp deep_bytes(:tuple, inner), do: ext_bin(4, <<0x91, inner::binary>>)
  defp deep_bytes(:map_value, inner), do: <<0x81, 0xA1, ?k, inner::binary>>
  defp deep_bytes(:map_key, inner), do: <<0x81, inner::binary, 1>>

  describe "tensor shapes torch cannot hold" do
    # the issue's tensor: no data, as its shape says, but strides beyond int64
    @huge {0, 4_611_686_018_427_387_904, 4}

    test "Tensor.check_shape/1: every dim and the product of the non-zero dims below 2^63" do
      for shape <- [{}, {0}, {2, 3}, {(1 <<< 63) - 1}, {1 <<< 31, 1 <<< 31, 1}, {0, 1 <<< 62, 1}] do
        assert Tensor.check_shape(shape) == :ok, inspect(shape)
      end

      for shape <- [@huge, {1 <<< 63}, {0, 1 <<< 63}, {1 <<< 32, 1 <<< 31}, {1 <<< 64, 0}] do
        assert {:error, %Error{category: :bad_args, message: message}} = Tensor.check_shape(shape)

        assert message =~ "shape #{inspect(shape)} is too large"
      end

      for shape <- [{-1}, {1.0}, [2], {1 <<< 63, -1}, nil] do
        assert {:error, %Error{category: :bad_args, message: message}} = Tensor.check_shape(shape)

        assert message =~ "non-negative integers"
      end
    end

    test "validate/1 and the encoder refuse them, naming the shape" do
      tensor = %Tensor{type: {:f, 32}, shape: @huge, data: <<>>}
      assert {:error, %Error{category: :bad_args, message: message}} = Tensor.validate(tensor)
      assert message =~ "{0, 4611686018427387904, 4}"
      assert {:error, %Error{category: :encode, message: message}} = Msgpack.encode([tensor])
      assert message =~ "shape {0, 4611686018427387904, 4} is too large"
    end

    test "the decoder refuses them, naming the shape" do
      bytes = ext_bin(1, <<?f, 32, 3, 0::64, 1 <<< 62::64, 4::64>>)
      assert {:error, %Error{category: :protocol, message: message}} = Msgpack.decode(bytes)
      assert message =~ "shape {0, 4611686018427387904, 4} is too large"

      # 255 dimensions of 2^64 - 1: refused without multiplying them all out
      dims = :binary.copy(<<0xFFFFFFFFFFFFFFFF::64>>, 255)
      bytes = ext_bin(1, <<?f, 32, 255, dims::binary>>)
      assert {:error, %Error{category: :protocol, message: message}} = Msgpack.decode(bytes)
      assert message =~ "is too large"

      # the largest shape that fits still decodes (when its data is empty)
      bytes = ext_bin(1, <<?u, 8, 2, 0::64, (1 <<< 63) - 1::64>>)

      assert {:ok, %Tensor{shape: {0, 9_223_372_036_854_775_807}, data: ""}} =
               Msgpack.decode(bytes)
    end
  end

  test "agrees with msgpack-python" do
    python = VllmBridge.TestPython.python!()

    terms = [
      nil,
      [1, -1, 200, -200, 70_000, -70_000, 1 <<< 40, -(1 <<< 40), 1.25],
      %{"k" => ["é", <<0xFF, 0>>, String.duplicate("z", 300)]},
      String.duplicate("x", 70_000)
    ]

    hexes = Enum.map_join(terms, ",", &("\"" <> hex(&1) <> "\""))

    script = """
    import msgpack, sys
    terms = [None, [1, -1, 200, -200, 70000, -70000, 1 << 40, -(1 << 40), 1.25],
             {"k": ["é", b"\\xff\\x00", "z" * 300]}, "x" * 70000]
    got = [#{hexes}]
    for t, h in zip(terms, got):
        assert msgpack.packb(t, use_bin_type=True).hex() == h, (t, h)
    """

    path =
      Path.join(
        System.tmp_dir!(),
        "vllm_bridge_msgpack_#{System.unique_integer([:positive])}.py"
      )

    File.write!(path, script)

    try do
      assert {_, 0} = System.cmd(python, [path], stderr_to_stdout: true)
    after
      File.rm(path)
    end
  end
end
