defmodule VllmBridge.Tensor do
  @moduledoc """
  A dense CPU tensor as plain data: an element type, a shape and the raw bytes.

      %VllmBridge.Tensor{type: {:f, 32}, shape: {2, 3}, data: <<...24 bytes...>>}

  This is what crosses the bridge as msgpack extension 1 and becomes a
  `torch.Tensor` on the Python side (see `docs/protocol.md`). The struct holds
  no process and no native resource, so it can be stored, sent and compared
  like any other term; convert to and from Nx (`Nx.from_binary/2` +
  `Nx.reshape/2`, `Nx.to_binary/1`) when Nx is around, since the types follow
  Nx's conventions:

  | type | torch dtype | type | torch dtype |
  |---|---|---|---|
  | `{:f, 16}` | float16 | `{:s, 8}` | int8 |
  | `{:bf, 16}` | bfloat16 | `{:s, 16}` | int16 |
  | `{:f, 32}` | float32 | `{:s, 32}` | int32 |
  | `{:f, 64}` | float64 | `{:s, 64}` | int64 |
  | `{:c, 64}` | complex64 | `{:u, 8}` | uint8 |
  | `{:c, 128}` | complex128 | `{:pred, 8}` | bool |

  `{:u, 16}`, `{:u, 32}` and `{:u, 64}` are accepted too (recent torch
  versions have them).

  `data` holds the elements in row-major order, little-endian, exactly
  `product(shape) * bits / 8` bytes. A scalar (0-dimensional tensor) has shape
  `{}` and one element. Large `data` binaries are reference-counted by the
  VM, and the encoder puts them on the wire without copying them.

  `new/3` validates; `from_list/2` and `to_list/1` are conveniences for tests
  and small values, not a numeric library.
  """

  @enforce_keys [:type, :shape, :data]
  defstruct [:type, :shape, :data]

  @typedoc "An element type, in Nx's notation."
  @type type ::
          {:f, 16 | 32 | 64}
          | {:bf, 16}
          | {:s, 8 | 16 | 32 | 64}
          | {:u, 8 | 16 | 32 | 64}
          | {:c, 64 | 128}
          | {:pred, 8}

  @type shape :: tuple()

  @type t :: %__MODULE__{type: type(), shape: shape(), data: binary()}

  @types [
    {:f, 16},
    {:f, 32},
    {:f, 64},
    {:bf, 16},
    {:s, 8},
    {:s, 16},
    {:s, 32},
    {:s, 64},
    {:u, 8},
    {:u, 16},
    {:u, 32},
    {:u, 64},
    {:c, 64},
    {:c, 128},
    {:pred, 8}
  ]

  @kinds %{f: ?f, bf: ?b, s: ?s, u: ?u, c: ?c, pred: ?p}

  # torch's sizes and strides are int64: the largest extent it can hold
  @max_extent 0x7FFFFFFFFFFFFFFF

  @doc "Returns every supported element type."
  @spec types() :: [type()]
  def types, do: @types

  @doc """
  Builds a tensor, checking that `type` is supported, that `shape` is a tuple
  of non-negative integers that torch can hold (see `check_shape/1`) and that
  `data` has exactly the right size.

  ## Examples

      iex> {:ok, t} = VllmBridge.Tensor.new({:s, 32}, {2}, <<1::32-little, 2::32-little>>)
      iex> t.shape
      {2}

      iex> {:error, %VllmBridge.Error{category: :bad_args}} =
      ...>   VllmBridge.Tensor.new({:f, 32}, {2}, <<0, 0, 0, 0>>)
  """
  @spec new(type(), shape(), binary()) :: {:ok, t()} | {:error, VllmBridge.Error.t()}
  def new(type, shape, data) do
    tensor = %__MODULE__{type: type, shape: shape, data: data}

    case validate(tensor) do
      :ok -> {:ok, tensor}
      {:error, _} = error -> error
    end
  end

  @doc """
  Checks a tensor's type, shape (`check_shape/1`) and data size; returns `:ok`
  or a `:bad_args` error saying what is wrong.
  """
  @spec validate(t()) :: :ok | {:error, VllmBridge.Error.t()}
  def validate(%__MODULE__{type: type, shape: shape, data: data}) do
    cond do
      type not in @types ->
        bad("unsupported tensor type #{inspect(type)}", type: type)

      (shape_error = check_shape(shape)) != :ok ->
        shape_error

      not is_binary(data) ->
        bad("tensor data must be a binary", type: type)

      byte_size(data) != byte_size_of(type, shape) ->
        bad(
          "tensor data is #{byte_size(data)} bytes, but #{inspect(type)} with shape " <>
            "#{inspect(shape)} needs #{byte_size_of(type, shape)}",
          type: type,
          shape: shape
        )

      true ->
        :ok
    end
  end

  def validate(other), do: bad("not a tensor: #{inspect(other)}", term: other)

  @doc """
  Checks a shape: a tuple of non-negative integers that torch can hold.

  torch keeps sizes and strides as signed 64-bit integers, so every dimension,
  and the product of the dimensions that are not 0 (the largest stride times
  its size), must be below 2^63, even when a 0 makes the tensor empty.
  Returns `:ok` or a `:bad_args` error naming the shape. `validate/1` and the
  decoder of replies (`VllmBridge.Msgpack.decode/2`) apply it.

  ## Examples

      iex> VllmBridge.Tensor.check_shape({2, 3})
      :ok

      iex> {:error, error} = VllmBridge.Tensor.check_shape({0, 4_611_686_018_427_387_904, 4})
      iex> error.message =~ "shape {0, 4611686018427387904, 4} is too large"
      true
  """
  @spec check_shape(term()) :: :ok | {:error, VllmBridge.Error.t()}
  def check_shape(shape) when is_tuple(shape) do
    case extent(Tuple.to_list(shape), 1) do
      :ok ->
        :ok

      :not_dims ->
        bad("tensor shape must be a tuple of non-negative integers, got #{inspect(shape)}",
          shape: shape
        )

      :too_large ->
        bad(
          "tensor shape #{inspect(shape)} is too large: torch's sizes and strides are signed " <>
            "64-bit (every dimension, and the product of the dimensions that are not 0, must " <>
            "be below 2^63)",
          shape: shape
        )
    end
  end

  def check_shape(shape) do
    bad("tensor shape must be a tuple of non-negative integers, got #{inspect(shape)}",
      shape: shape
    )
  end

  # The product of the non-zero dimensions so far is `acc` (< 2^63).
  defp extent([], _acc), do: :ok
  defp extent([0 | rest], acc), do: extent(rest, acc)

  defp extent([dim | rest], acc) when is_integer(dim) and dim > 0 do
    acc = acc * dim
    if acc <= @max_extent, do: extent(rest, acc), else: too_large(rest)
  end

  defp extent(_dims, _acc), do: :not_dims

  # A shape that is not made of dimensions says so first.
  defp too_large(rest) do
    if Enum.all?(rest, &(is_integer(&1) and &1 >= 0)), do: :too_large, else: :not_dims
  end

  @doc """
  The number of elements of a shape (`1` for the scalar shape `{}`).

  ## Examples

      iex> VllmBridge.Tensor.size({2, 3})
      6
      iex> VllmBridge.Tensor.size({})
      1
  """
  @spec size(shape()) :: non_neg_integer()
  def size(shape) when is_tuple(shape) do
    shape |> Tuple.to_list() |> Enum.reduce(1, &(&1 * &2))
  end

  @doc "The number of bytes `product(shape) * bits / 8` of a type and shape."
  @spec byte_size_of(type(), shape()) :: non_neg_integer()
  def byte_size_of({_kind, bits}, shape), do: div(size(shape) * bits, 8)

  @doc """
  The wire code of a type's kind: one ASCII byte (`?f`, `?b`, `?s`, `?u`,
  `?c`, `?p`), or `nil` for an unknown kind.
  """
  @spec kind_byte(atom()) :: byte() | nil
  def kind_byte(kind), do: Map.get(@kinds, kind)

  @doc """
  The type for a wire `kind` byte and `bits`, or `nil` when that is not a
  supported type.
  """
  @spec type_from_wire(byte(), non_neg_integer()) :: type() | nil
  for {kind, byte} <- @kinds, {^kind, bits} <- @types do
    def type_from_wire(unquote(byte), unquote(bits)), do: {unquote(kind), unquote(bits)}
  end

  def type_from_wire(_byte, _bits), do: nil

  @doc """
  Builds a tensor from a number or (nested, rectangular) lists of numbers; the
  shape follows the nesting, so a bare number gives a scalar.

  Floats may also be `:nan`, `:infinity` or `:neg_infinity`; complex elements
  are `{re, im}` tuples (or plain numbers); booleans are `true`/`false` (or
  `1`/`0`). `{:bf, 16}` rounds towards zero (it keeps the upper half of the
  float32).

  ## Examples

      iex> {:ok, t} = VllmBridge.Tensor.from_list([[1, 2], [3, 4]], {:u, 8})
      iex> {t.shape, t.data}
      {{2, 2}, <<1, 2, 3, 4>>}
  """
  @spec from_list(number() | list(), type()) :: {:ok, t()} | {:error, VllmBridge.Error.t()}
  def from_list(list, type) when type in @types do
    with {:ok, shape} <- infer_shape(list) do
      try do
        data =
          [list]
          |> List.flatten()
          |> Enum.map(&encode_element(&1, type))
          |> IO.iodata_to_binary()

        {:ok, %__MODULE__{type: type, shape: shape, data: data}}
      catch
        {:bad_element, element} ->
          bad("cannot store #{inspect(element)} as #{inspect(type)}", term: element)
      end
    end
  end

  def from_list(_list, type), do: bad("unsupported tensor type #{inspect(type)}", type: type)

  @doc """
  Returns the elements as nested lists following the shape (a bare element for
  a scalar). Inverse of `from_list/2` (for `{:pred, 8}` it gives booleans).

  ## Examples

      iex> {:ok, t} = VllmBridge.Tensor.from_list([1.5, -2.0], {:f, 32})
      iex> VllmBridge.Tensor.to_list(t)
      [1.5, -2.0]
  """
  @spec to_list(t()) :: term()
  def to_list(%__MODULE__{type: {_, bits} = type, shape: shape, data: data}) do
    flat = for <<element::bitstring-size(bits) <- data>>, do: decode_element(element, type)
    nest(flat, Tuple.to_list(shape))
  end

  @doc """
  Returns `count` elements in row-major order, starting at flat index `from`,
  decoding only those (the rest of `data` is not touched). Fewer come back
  when the tensor ends first.

  ## Examples

      iex> {:ok, t} = VllmBridge.Tensor.from_list([[1, 2, 3], [4, 5, 6]], {:s, 32})
      iex> VllmBridge.Tensor.elements(t, 2, 3)
      [3, 4, 5]
  """
  @spec elements(t(), non_neg_integer(), non_neg_integer()) :: [term()]
  def elements(%__MODULE__{type: {_, bits} = type, data: data}, from, count)
      when is_integer(from) and from >= 0 and is_integer(count) and count >= 0 do
    size = div(bits, 8)
    start = min(from * size, byte_size(data))
    part = binary_part(data, start, min(count * size, byte_size(data) - start))
    for <<element::bitstring-size(bits) <- part>>, do: decode_element(element, type)
  end

  @doc """
  The element type's short name, as `inspect/2` prints it (`"f32"`, `"bf16"`,
  `"s64"`, `"u8"`, `"c64"`, `"pred"`).
  """
  @spec type_name(type()) :: String.t()
  def type_name({:pred, 8}), do: "pred"
  def type_name({kind, bits}), do: "#{kind}#{bits}"

  # -- helpers ---------------------------------------------------------------

  defp infer_shape(list) when is_list(list) do
    case list do
      [] ->
        {:ok, {0}}

      [first | _] ->
        with {:ok, inner} <- infer_shape(first),
             true <- Enum.all?(list, &(infer_shape(&1) == {:ok, inner})) do
          {:ok, Tuple.insert_at(inner, 0, length(list))}
        else
          _ -> bad("lists are not rectangular", term: list)
        end
    end
  end

  defp infer_shape(_scalar), do: {:ok, {}}

  defp bad(message, details) do
    {:error, VllmBridge.Error.new(:bad_args, message, details: Map.new(details))}
  end

  defp encode_element(:nan, {:f, 16}), do: <<0x7E00::16-little>>
  defp encode_element(:nan, {:f, 32}), do: <<0x7FC00000::32-little>>
  defp encode_element(:nan, {:f, 64}), do: <<0x7FF8000000000000::64-little>>
  defp encode_element(:nan, {:bf, 16}), do: <<0x7FC0::16-little>>
  defp encode_element(:infinity, {:f, 16}), do: <<0x7C00::16-little>>
  defp encode_element(:infinity, {:f, 32}), do: <<0x7F800000::32-little>>
  defp encode_element(:infinity, {:f, 64}), do: <<0x7FF0000000000000::64-little>>
  defp encode_element(:infinity, {:bf, 16}), do: <<0x7F80::16-little>>
  defp encode_element(:neg_infinity, {:f, 16}), do: <<0xFC00::16-little>>
  defp encode_element(:neg_infinity, {:f, 32}), do: <<0xFF800000::32-little>>
  defp encode_element(:neg_infinity, {:f, 64}), do: <<0xFFF0000000000000::64-little>>
  defp encode_element(:neg_infinity, {:bf, 16}), do: <<0xFF80::16-little>>

  defp encode_element(x, {:f, bits}) when is_number(x), do: <<x::float-little-size(bits)>>

  defp encode_element(x, {:bf, 16}) when is_number(x) do
    <<_low::binary-size(2), high::binary-size(2)>> = <<x::float-little-32>>
    high
  end

  defp encode_element(x, {:s, bits}) when is_integer(x), do: <<x::signed-little-size(bits)>>
  defp encode_element(x, {:u, bits}) when is_integer(x) and x >= 0, do: <<x::little-size(bits)>>

  defp encode_element({re, im}, {:c, bits}) when is_number(re) and is_number(im) do
    half = div(bits, 2)
    <<re::float-little-size(half), im::float-little-size(half)>>
  end

  defp encode_element(x, {:c, _} = type) when is_number(x), do: encode_element({x, 0}, type)
  defp encode_element(x, {:pred, 8}) when x in [true, 1], do: <<1>>
  defp encode_element(x, {:pred, 8}) when x in [false, 0], do: <<0>>
  defp encode_element(x, _type), do: throw({:bad_element, x})

  defp decode_element(element, {:f, bits}) do
    case element do
      <<x::float-little-size(bits)>> -> x
      special -> special_float(special)
    end
  end

  defp decode_element(<<high::binary-size(2)>>, {:bf, 16}),
    do: decode_element(<<0, 0, high::binary>>, {:f, 32})

  defp decode_element(element, {:s, bits}) do
    <<x::signed-little-size(bits)>> = element
    x
  end

  defp decode_element(element, {:u, bits}) do
    <<x::little-size(bits)>> = element
    x
  end

  defp decode_element(element, {:c, bits}) do
    half = div(bits, 2)
    <<re::binary-size(div(half, 8)), im::binary-size(div(half, 8))>> = element
    {decode_element(re, {:f, half}), decode_element(im, {:f, half})}
  end

  defp decode_element(<<x>>, {:pred, 8}), do: x != 0

  # NaN and the infinities do not match float bit syntax.
  defp special_float(bits) do
    size = bit_size(bits)
    exp_size = %{16 => 5, 32 => 8, 64 => 11}[size]
    <<int::little-size(size)>> = bits
    <<sign::1, _exp::size(exp_size), mantissa::bitstring>> = <<int::size(size)>>

    cond do
      mantissa != <<0::size(size - 1 - exp_size)>> -> :nan
      sign == 1 -> :neg_infinity
      true -> :infinity
    end
  end

  defp nest(flat, []), do: hd(flat)
  defp nest(flat, [_n]), do: flat

  defp nest(flat, [n | rest]) do
    chunk = Enum.reduce(rest, 1, &(&1 * &2))

    if chunk == 0 do
      List.duplicate(nest([], rest), n)
    else
      flat |> Enum.chunk_every(chunk) |> Enum.map(&nest(&1, rest))
    end
  end
end

defimpl Inspect, for: VllmBridge.Tensor do
  # Shows the type, the shape and the values, as Nx does: at most `opts.limit`
  # elements (50 by default; `limit: :infinity` for all), decoded from the
  # front of `data` only, so inspecting a large tensor costs what it prints.
  import Inspect.Algebra

  alias VllmBridge.Tensor

  def inspect(%Tensor{type: {_, bits} = type, shape: shape, data: data} = tensor, opts) do
    dims = Tuple.to_list(shape)
    header = Tensor.type_name(type) <> Enum.map_join(dims, &"[#{&1}]")
    expected = Enum.reduce(dims, 1, &(&1 * &2)) * div(bits, 8)

    body =
      if byte_size(data) == expected do
        budget = if opts.limit == :infinity, do: :infinity, else: max(opts.limit, 1)
        {doc, _left} = values(tensor, dims, 0, budget, opts)
        doc
      else
        "(invalid: #{byte_size(data)} bytes of data where the shape needs #{expected})"
      end

    force_unfit(concat([nest(concat([line(), header, line(), body]), 2), line()]))
    |> then(&concat(["#VllmBridge.Tensor<", &1, ">"]))
  end

  # The values of the sub-tensor of shape `dims` at flat index `at`, within a
  # budget of elements: {doc, budget left}.
  defp values(tensor, [], at, budget, _opts) do
    [x] = Tensor.elements(tensor, at, 1)
    {element(x), spend(budget, 1)}
  end

  defp values(tensor, [n], at, budget, opts) do
    shown = if budget == :infinity, do: n, else: min(n, budget)
    docs = tensor |> Tensor.elements(at, shown) |> Enum.map(&element/1)
    {list(docs, shown < n, opts), spend(budget, shown)}
  end

  defp values(tensor, [n | rest], at, budget, opts) do
    chunk = Enum.reduce(rest, 1, &(&1 * &2))

    {docs, budget, cut} =
      Enum.reduce_while(0..(n - 1)//1, {[], budget, false}, fn i, {docs, left, _} ->
        if left == 0 do
          {:halt, {docs, left, true}}
        else
          {doc, left} = values(tensor, rest, at + i * chunk, left, opts)
          {:cont, {[doc | docs], left, false}}
        end
      end)

    {list(Enum.reverse(docs), cut, opts), budget}
  end

  defp list(docs, cut, opts) do
    docs = if cut, do: docs ++ ["..."], else: docs
    container_doc("[", docs, "]", %{opts | limit: :infinity}, fn doc, _ -> doc end)
  end

  defp spend(:infinity, _), do: :infinity
  defp spend(budget, count), do: budget - count

  defp element(:nan), do: "NaN"
  defp element(:infinity), do: "Inf"
  defp element(:neg_infinity), do: "-Inf"
  defp element({re, im}), do: "#{element(re)}+#{element(im)}i"
  defp element(x), do: to_string(x)
end
