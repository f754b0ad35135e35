defmodule VllmBridge.Fuzz do
  @moduledoc false
  # Generators for the decoder fuzz test (fuzz_test.exs): random terms the
  # bridge can carry, valid msgpack and envelopes built from them, and
  # mutations of such bytes. Everything draws from the calling process's
  # :rand state, so seeding it (seed!/2) makes a run reproducible.

  import Bitwise

  alias VllmBridge.{Msgpack, Proto, Ref, Tensor}

  @atoms [:ok, :error, :a, :nan, :infinity, :neg_infinity, :some_atom, Kernel, :"é ü"]

  # integers at every boundary of msgpack's integer forms
  @ints [
    0,
    1,
    31,
    127,
    128,
    255,
    256,
    65_535,
    65_536,
    0xFFFFFFFF,
    0x100000000,
    0xFFFFFFFFFFFFFFFF,
    -1,
    -32,
    -33,
    -128,
    -129,
    -32_768,
    -32_769,
    -0x80000000,
    -0x80000001,
    -0x8000000000000000
  ]

  # bytes that start something interesting in msgpack
  @special_bytes [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xC0, 0xC1, 0xC4, 0xC7, 0xC9] ++
                   [0xCB, 0xCF, 0xD3, 0xD4, 0xD8, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]

  @categories ~w(protocol not_found not_exported bad_args encode python busy timeout worker stale_ref)

  @doc "Seeds this process's :rand for stream `k` of run `seed`."
  def seed!(seed, k), do: :rand.seed(:exsss, {seed, k, 0x5EED})

  @doc "A uniform integer in first..last."
  def between(first, last), do: first + :rand.uniform(last - first + 1) - 1

  @doc "A random term the bridge can carry, nested at most `depth` deep."
  def term(depth) do
    case :rand.uniform(if depth > 0, do: 14, else: 9) do
      1 -> nil
      2 -> :rand.uniform(2) == 1
      3 -> int()
      4 -> float()
      5 -> text()
      6 -> bytes()
      7 -> Enum.random(@atoms)
      8 -> tensor()
      9 -> ref()
      n when n in 10..11 -> for _ <- 1..between(0, 5)//1, do: term(depth - 1)
      12 -> distinct(Map.new(1..between(0, 4)//1, fn _ -> {term(depth - 1), term(depth - 1)} end))
      _ -> List.to_tuple(for _ <- 1..between(0, 4)//1, do: term(depth - 1))
    end
  end

  @doc "A term whose deepest branch is exactly `depth` containers deep."
  def nested(depth) do
    Enum.reduce(1..depth//1, term(0), fn _, inner ->
      case :rand.uniform(4) do
        1 -> [inner | for(_ <- 1..between(0, 2)//1, do: term(0))]
        2 -> {term(0), inner}
        3 -> distinct(%{"k" => inner, term(0) => term(0)})
        4 -> %{inner => 1}
      end
    end)
  end

  # A map whose keys are one key in Python (true and 1, :a and "a") is refused by
  # the encoder: a fuzzed map that has such keys gets their inspected text instead.
  defp distinct(map) do
    case Msgpack.encode(map) do
      {:error, %{category: :bad_args, message: "map keys " <> _}} ->
        Map.new(map, fn {key, value} -> {inspect(key), value} end)

      _ ->
        map
    end
  end

  defp int do
    case :rand.uniform(3) do
      1 -> Enum.random(@ints)
      2 -> between(-1000, 1000)
      3 -> between(-0x8000000000000000, 0xFFFFFFFFFFFFFFFF)
    end
  end

  defp float do
    case :rand.uniform(4) do
      1 -> 0.0
      2 -> :rand.uniform() * 10
      3 -> -:rand.normal() * 1.0e300
      4 -> :rand.uniform() * 1.0e-300
    end
  end

  defp text do
    length = Enum.random([0, 1, 5, 31, 32, between(0, 40), 255, 256])

    for _ <- 1..length//1,
        into: "",
        do: <<Enum.random([?a, ?Z, ?0, 0xE9, 0x4E2D, 0x1F600])::utf8>>
  end

  defp bytes do
    length = Enum.random([0, 1, 7, between(0, 40), 255, 256])
    :crypto.strong_rand_bytes(length) <> <<0xFF>>
  end

  defp tensor do
    {_kind, bits} = type = Enum.random(Tensor.types())
    shape = List.to_tuple(for _ <- 1..between(0, 3)//1, do: between(0, 4))
    data = :crypto.strong_rand_bytes(div(Tensor.size(shape) * bits, 8))
    %Tensor{type: type, shape: shape, data: data}
  end

  defp ref, do: %Ref{id: between(0, 0xFFFFFFFFFFFFFFFF), class: Enum.random(["", "Counter", "é"])}

  @doc "Canonical msgpack of `term` (a binary)."
  def encode!(term), do: term |> Msgpack.encode!() |> IO.iodata_to_binary()

  @doc "A random encoded `Reply` and the map it encodes (defaults filled in)."
  def reply do
    id = Enum.random([1, 127, 128, 0xFFFFFFFFFFFFFFFF, between(1, 1_000_000)])

    result =
      case :rand.uniform(4) do
        4 ->
          {:output, %{text: text(), dropped: Enum.random([0, 1, between(2, 1_000_000)])}}

        3 ->
          {:error,
           %{
             category: Enum.random(@categories ++ ["", "nonsense"]),
             message: text(),
             python_type: Enum.random(["", "ValueError"]),
             traceback: text(),
             details: Enum.random(["", encode!(%{"k" => term(2)}), encode!(term(2))])
           }}

        _ ->
          {:value, encode!(term(3))}
      end

    reply = %{id: id, result: result}
    {:ok, iodata} = Proto.encode_reply(reply)
    {IO.iodata_to_binary(iodata), reply}
  end

  @doc "A random encoded `Request`."
  def request do
    args = encode!(for _ <- 1..between(0, 3)//1, do: term(2))
    kwargs = Enum.random(["", encode!(%{"k" => term(1)})])

    op =
      Enum.random([
        {:create, %{class_name: "Counter", args: args, kwargs: kwargs}},
        {:call, %{handle: between(0, 1000), method: "incr", args: args, kwargs: kwargs}},
        {:call_function, %{function: "echo", args: args, kwargs: kwargs}},
        {:get_attr, %{handle: between(0, 1000), name: "value"}},
        {:release, %{handles: for(_ <- 1..between(0, 4)//1, do: between(0, 1 <<< 40))}},
        {:release_session, %{}},
        {:describe, %{}},
        {:ping, %{payload: encode!(term(3))}}
      ])

    {:ok, iodata} = Proto.encode_request(%{id: between(1, 1 <<< 40), session: text(), op: op})

    IO.iodata_to_binary(iodata)
  end

  @doc """
  A mutation of `bin`: bit flips, byte changes, truncation, insertion,
  deletion, splicing with `other`, a length field set huge, or nesting.
  """
  def mutate(bin, other) do
    case :rand.uniform(10) do
      1 -> flip_bits(bin)
      2 -> set_bytes(bin)
      3 -> binary_part(bin, 0, at(bin))
      4 -> insert(bin, :crypto.strong_rand_bytes(between(1, 8)))
      5 -> delete(bin)
      6 -> splice(bin, other)
      7 -> huge_length(bin)
      8 -> deep(bin)
      9 -> insert(bin, <<Enum.random(@special_bytes)>>)
      10 -> bin |> set_bytes() |> mutate(other)
    end
  end

  defp at(bin), do: between(0, byte_size(bin))

  defp flip_bits(<<>>), do: <<>>

  defp flip_bits(bin) do
    Enum.reduce(1..between(1, 3), bin, fn _, acc ->
      bit = between(0, bit_size(acc) - 1)
      <<head::size(bit), b::1, tail::bitstring>> = acc
      <<head::size(bit), 1 - b::1, tail::bitstring>>
    end)
  end

  defp set_bytes(<<>>), do: <<>>

  defp set_bytes(bin) do
    Enum.reduce(1..between(1, 3), bin, fn _, acc ->
      i = between(0, byte_size(acc) - 1)
      <<head::binary-size(i), _, tail::binary>> = acc
      byte = if :rand.uniform(2) == 1, do: Enum.random(@special_bytes), else: between(0, 255)
      <<head::binary, byte, tail::binary>>
    end)
  end

  defp insert(bin, piece) do
    i = at(bin)
    <<head::binary-size(i), tail::binary>> = bin
    head <> piece <> tail
  end

  defp delete(bin) do
    i = at(bin)
    cut = min(byte_size(bin) - i, between(1, 8))
    binary_part(bin, 0, i) <> binary_part(bin, i + cut, byte_size(bin) - i - cut)
  end

  defp splice(bin, other) do
    j = at(other)
    binary_part(bin, 0, at(bin)) <> binary_part(other, j, byte_size(other) - j)
  end

  # The bytes after a length-carrying msgpack type byte, or after a protobuf
  # key, set to the largest length they can say.
  defp huge_length(bin) do
    i = at(bin)
    <<head::binary-size(i), tail::binary>> = bin

    huge =
      Enum.random([
        <<0xFF>>,
        <<0xFF, 0xFF>>,
        <<0xFF, 0xFF, 0xFF, 0xFF>>,
        # varints: 2^32 - 1 and 2^64 - 1
        <<0xFF, 0xFF, 0xFF, 0xFF, 0x0F>>,
        <<0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01>>
      ])

    case tail do
      <<type, rest::binary>> when type in [0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9, 0xD9, 0xDA] ->
        head <> <<type>> <> huge <> drop(rest, byte_size(huge))

      <<type, rest::binary>> when type in [0xDB, 0xDC, 0xDD, 0xDE, 0xDF] ->
        head <> <<type>> <> huge <> drop(rest, byte_size(huge))

      _ ->
        # a length-delimited protobuf field (or anything): a huge varint here
        head <> Enum.random([<<0x12>>, <<0x1A>>, <<0x8A, 0x01>>, <<>>]) <> huge <> tail
    end
  end

  defp drop(bin, n) when byte_size(bin) <= n, do: <<>>
  defp drop(bin, n), do: binary_part(bin, n, byte_size(bin) - n)

  @doc "`bin` inside `depth` arrays, maps or tuples (written by hand), or a deep prefix."
  def deep(bin), do: deep(bin, Enum.random([127, 128, 129, 200, 300, 5_000, 100_000]))

  def deep(bin, depth) do
    case :rand.uniform(4) do
      1 -> :binary.copy(<<0x91>>, depth) <> bin
      2 -> :binary.copy(<<0x81, 0xA1, ?k>>, depth) <> bin
      3 -> :binary.copy(<<0xDC, 0, 1>>, depth) <> bin
      4 -> Enum.reduce(1..min(depth, 400)//1, bin, fn _, inner -> tuple_ext(inner) end)
    end
  end

  defp tuple_ext(inner) do
    payload = <<0x91, inner::binary>>

    case byte_size(payload) do
      n when n <= 0xFF -> <<0xC7, n, 4, payload::binary>>
      n when n <= 0xFFFF -> <<0xC8, n::16, 4, payload::binary>>
      n -> <<0xC9, n::32, 4, payload::binary>>
    end
  end

  @doc "Up to `max` bytes of `bin` in hex, for failure messages."
  def hex(bin, max \\ 300) do
    shown = binary_part(bin, 0, min(byte_size(bin), max))
    more = if byte_size(bin) > max, do: "... (#{byte_size(bin)} bytes)", else: ""
    Base.encode16(shown, case: :lower) <> more
  end
end
