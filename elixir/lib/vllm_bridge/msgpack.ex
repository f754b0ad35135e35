defmodule VllmBridge.Msgpack do
  @moduledoc """
  The value codec of the bridge: canonical msgpack with four extension types.

  Arguments, keyword arguments and results travel as msgpack *inside* the
  protobuf envelope (`VllmBridge.Proto`). The encoding is canonical, the same
  bytes `msgpack-python` writes with `use_bin_type=True`, so both sides of the
  bridge agree byte for byte (the shared vectors in `tests/vectors/` check it):

  | Elixir | msgpack |
  |---|---|
  | `nil`, `true`, `false` | nil, true, false |
  | integer | the smallest int form; outside the 64-bit range: an `:encode` error |
  | float | always float64 |
  | binary that is valid UTF-8 | str (the smallest form) |
  | any other binary | bin |
  | list | array |
  | map (entries in the map's iteration order) | map |
  | other atom | extension 3 (the atom's name) |
  | tuple | extension 4 (a msgpack array of the elements) |
  | `%VllmBridge.Tensor{}` | extension 1 (kind, bits, shape, raw data) |
  | `%VllmBridge.Ref{}` | extension 2 (handle id, class name) |

  Pids, ports, references, functions, bitstrings that are not binaries,
  improper lists and structs other than the two above cannot be encoded: the
  result is `{:error, %VllmBridge.Error{category: :encode}}` naming the term.

  ## Large values are not copied

  `encode/1` returns iodata. Every binary, and the data of a tensor, is placed
  in that iodata as the very binary you passed in (for a binary over 64 bytes,
  a reference to the same off-heap bytes), so encoding a 64 MiB tensor
  allocates a few bytes of header, not 64 MiB. `decode/2` likewise returns str, bin and
  tensor data as sub-binaries of its input: they keep the input alive, so use
  `:binary.copy/1` on a small piece you keep for long from a large reply.

  ## Decoding atoms

  An atom arrives as its name. `decode/2` returns the existing atom of that
  name, and **the name as a binary when no such atom exists**: atoms are never
  created from wire data (the atom table is finite and never collected).
  Atoms your code uses literally always exist, so round trips of your own
  atoms are exact.

  ## Decoding special floats

  Elixir floats cannot be NaN or infinite; float64/float32 values that are
  decode as `:nan`, `:infinity` and `:neg_infinity` (as Nx does). These atoms
  encode back as atoms, not floats.

  ## Map keys that are one key in Python

  Python compares `True`, `1` and `1.0` equal (and `False`, `0`, `0.0`, `-0.0`),
  and an atom arrives as a string of its name, so keys that differ here would
  be one key there, and all but one value would be lost. `encode/1` refuses
  such a map with a `:bad_args` error naming both keys, before anything is
  sent: `%{true => 1, 1 => 2}`, `%{:a => 1, "a" => 2}`, `%{1 => :x, 1.0 => :y}`
  and tuples of those (`%{{:a, 1} => 1, {"a", true} => 2}`).

  ## Nesting limit

  Lists, maps and tuples may nest at most `max_depth/0` (128) levels deep, in
  both directions, the same rule as the Python worker's: a scalar, binary,
  atom, tensor or ref is 0 deep, and a list, map or tuple is one level more
  than its deepest element (keys and values, for a map), so an empty one is 1
  deep. `encode/1` refuses a deeper term with a `:bad_args` error that says
  "nested deeper than 128", before anything is sent; `decode/2` refuses deeper
  input with a `:protocol` error that says the same. Both stay bounded in time
  and stack whatever the input.

  The positional arguments of a call travel as one msgpack array, and keyword
  arguments as one map, so that container is a level of its own: a value
  passed as an argument may be nested 127 deep. `VllmBridge.Runtime.ping/2`
  sends its term alone, which may be nested 128 deep.

  ## Refs

  A ref on the wire is only a handle id and a class name; `decode/2` returns a
  `%VllmBridge.Ref{}` with the fields given in `opts[:ref]` (`:pool`,
  `:worker`, `:session`) stamped on it, which is how the runtime records
  where the object lives.
  """

  import Bitwise

  alias VllmBridge.{Error, Ref, Tensor}

  @ext_tensor 1
  @ext_ref 2
  # The handles of the refs decoded with an owner since take_handed/0 (see there).
  @handed :"$vllm_bridge_handed"
  @ext_atom 3
  @ext_tuple 4

  @max_u32 0xFFFFFFFF
  @max_u64 0xFFFFFFFFFFFFFFFF
  @min_s64 -0x8000000000000000
  @max_depth 128

  # Small writers on every call's path: compiled into their callers.
  @compile {:inline, enc_uint: 1, list_header: 1}
  @max_extent 0x7FFFFFFFFFFFFFFF

  @doc """
  How deep lists, maps and tuples may nest in one value: #{@max_depth} (see
  "Nesting limit").

  ## Examples

      iex> VllmBridge.Msgpack.max_depth()
      128
  """
  @spec max_depth() :: pos_integer()
  def max_depth, do: @max_depth

  @doc """
  Encodes a term as canonical msgpack iodata.

  A term nested deeper than `max_depth/0` is a `:bad_args` error; a term that
  cannot cross the wire is an `:encode` error naming it.

  ## Examples

      iex> {:ok, iodata} = VllmBridge.Msgpack.encode(%{"a" => [1, 2.5, {:ok, nil}]})
      iex> IO.iodata_to_binary(iodata) |> Base.encode16(case: :lower)
      "81a1619301cb4004000000000000c7060492d5036f6bc0"

      iex> {:error, error} = VllmBridge.Msgpack.encode(%{pid: self()})
      iex> error.category
      :encode
  """
  @spec encode(term()) :: {:ok, iodata()} | {:error, Error.t()}
  def encode(term) do
    {:ok, enc(term, @max_depth)}
  catch
    {__MODULE__, %Error{} = error} -> {:error, error}
  end

  @doc """
  Like `encode/1`, but returns the iodata or raises `VllmBridge.Error`.
  """
  @spec encode!(term()) :: iodata()
  def encode!(term) do
    case encode(term) do
      {:ok, iodata} -> iodata
      {:error, error} -> raise error
    end
  end

  @doc """
  Decodes one msgpack value that fills the whole binary.

  ## Options

    * `:ref` - a keyword list or map of fields (`:pool`, `:worker`,
      `:session`) stamped on every `%VllmBridge.Ref{}` decoded

  Malformed input, trailing bytes, unknown extension types, tensors whose
  shape torch cannot hold (`VllmBridge.Tensor.check_shape/1`) and values
  nested deeper than `max_depth/0` give
  `{:error, %VllmBridge.Error{category: :protocol}}`; no input makes it raise.

  ## Examples

      iex> VllmBridge.Msgpack.decode(<<0x92, 0x01, 0xA2, "hi">>)
      {:ok, [1, "hi"]}

      iex> VllmBridge.Msgpack.decode(<<0xD7, 2, 7::64>>, ref: [session: "s"])
      {:ok, %VllmBridge.Ref{id: 7, class: "", session: "s"}}
  """
  @spec decode(binary(), keyword()) :: {:ok, term()} | {:error, Error.t()}
  def decode(binary, opts \\ [])

  def decode(binary, opts) when is_binary(binary) and is_list(opts) do
    # the one option read in place: this runs for every call's reply
    ref =
      case opts do
        [] -> nil
        [{:ref, ref} | _] -> ref
        _ -> Keyword.get(opts, :ref)
      end

    case d(binary, [], 0, ref) do
      {term, <<>>} ->
        {:ok, term}

      {_term, rest} ->
        {:error,
         Error.new(:protocol, "msgpack: #{byte_size(rest)} trailing bytes after the value",
           details: %{offset: byte_size(binary) - byte_size(rest)}
         )}
    end
  catch
    {__MODULE__, message, rest} ->
      {:error,
       Error.new(:protocol, "msgpack: " <> message,
         details: %{offset: byte_size(binary) - byte_size(rest)}
       )}
  end

  def decode(other, _opts) do
    {:error,
     Error.new(:bad_args, "msgpack: decode/2 needs a binary, got #{inspect(other, limit: 5)}")}
  end

  @doc """
  The handle ids of the refs that `decode/2` decoded, in this process, with an
  `:owner` pid among their `:ref` fields since the last call (one id per ref,
  repeats included), and forgets them: `[]` when there were none.

  The runtime counts each ref it hands to an owner (see `VllmBridge.Ref`,
  "Lifetime"); it takes them right after decoding a reply, in the same
  process, so nothing else can come in between.

  ## Examples

      iex> ref = <<0xD7, 2, 7::64>>
      iex> {:ok, _} = VllmBridge.Msgpack.decode(<<0x92>> <> ref <> ref, ref: [owner: self()])
      iex> VllmBridge.Msgpack.take_handed()
      [7, 7]
      iex> VllmBridge.Msgpack.take_handed()
      []
  """
  @spec take_handed() :: [non_neg_integer()]
  def take_handed do
    case :erlang.erase(@handed) do
      :undefined -> []
      ids -> ids
    end
  end

  ## Encoding -----------------------------------------------------------------

  defp enc(nil, _left), do: <<0xC0>>
  defp enc(false, _left), do: <<0xC2>>
  defp enc(true, _left), do: <<0xC3>>

  defp enc(int, _left) when is_integer(int) do
    cond do
      int >= 0 -> enc_uint(int)
      int >= -32 -> <<int::8-signed>>
      int >= -0x80 -> <<0xD0, int::8-signed>>
      int >= -0x8000 -> <<0xD1, int::16-signed>>
      int >= -0x80000000 -> <<0xD2, int::32-signed>>
      int >= @min_s64 -> <<0xD3, int::64-signed>>
      true -> fail(int, "integers below -2^63 do not fit msgpack")
    end
  end

  defp enc(float, _left) when is_float(float), do: <<0xCB, float::float-64>>

  defp enc(bin, _left) when is_binary(bin) do
    size = byte_size(bin)

    header =
      if utf8?(bin) do
        cond do
          size < 32 -> <<0b101::3, size::5>>
          size <= 0xFF -> <<0xD9, size>>
          size <= 0xFFFF -> <<0xDA, size::16>>
          size <= @max_u32 -> <<0xDB, size::32>>
          true -> fail(bin, "strings above 4 GiB do not fit msgpack")
        end
      else
        cond do
          size <= 0xFF -> <<0xC4, size>>
          size <= 0xFFFF -> <<0xC5, size::16>>
          size <= @max_u32 -> <<0xC6, size::32>>
          true -> fail(bin, "binaries above 4 GiB do not fit msgpack")
        end
      end

    [header | bin]
  end

  defp enc(atom, _left) when is_atom(atom) do
    name = Atom.to_string(atom)
    [ext_header(byte_size(name), @ext_atom, atom) | name]
  end

  defp enc(list, left) when is_list(list) and left > 0,
    do: enc_list(list, list, [], 0, left - 1)

  defp enc(%Tensor{type: type, shape: shape, data: data} = tensor, _left) do
    case Tensor.validate(tensor) do
      :ok ->
        {kind, bits} = type
        dims = shape |> Tuple.to_list() |> Enum.map(&<<&1::64>>)
        ndim = tuple_size(shape)
        if ndim > 255, do: fail(tensor, "tensors above 255 dimensions do not fit the wire")
        head = [Tensor.kind_byte(kind), bits, ndim | dims]
        size = 3 + 8 * ndim + byte_size(data)
        [ext_header(size, @ext_tensor, tensor), head | data]

      {:error, error} ->
        fail(tensor, error.message)
    end
  end

  defp enc(%Ref{id: id, class: class} = ref, _left) do
    cond do
      not (is_integer(id) and id >= 0 and id <= @max_u64) ->
        fail(ref, "ref id must be an unsigned 64-bit integer")

      not is_binary(class) ->
        fail(ref, "ref class must be a binary")

      true ->
        [ext_header(8 + byte_size(class), @ext_ref, ref), <<id::64>> | class]
    end
  end

  defp enc(%Ref{} = forged, _left),
    do: fail(forged, "not a well-formed ref: it has no :id or no :class field")

  defp enc(%struct{} = term, _left) do
    fail(
      term,
      "structs cannot be encoded (only VllmBridge.Tensor and VllmBridge.Ref are); " <>
        "convert #{inspect(struct)} with Map.from_struct/1 or to a plain value first"
    )
  end

  defp enc(map, left) when is_map(map) and left > 0 do
    size = map_size(map)

    header =
      cond do
        size < 16 -> <<0b1000::4, size::4>>
        size <= 0xFFFF -> <<0xDE, size::16>>
        true -> <<0xDF, size::32>>
      end

    if size > 1, do: check_keys(map)
    left = left - 1
    [header | :maps.fold(fn k, v, acc -> [acc, enc(k, left) | enc(v, left)] end, [], map)]
  end

  defp enc(tuple, left) when is_tuple(tuple) and left > 0 do
    payload = [list_header(tuple_size(tuple)) | enc_items(Tuple.to_list(tuple), left - 1, [])]
    [ext_header(IO.iodata_length(payload), @ext_tuple, tuple) | payload]
  end

  # a list, map or tuple with no level left (structs were handled above)
  defp enc(container, 0) when is_list(container) or is_map(container) or is_tuple(container),
    do: too_deep()

  defp enc(pid, _left) when is_pid(pid), do: fail(pid, "pids cannot cross the bridge")
  defp enc(port, _left) when is_port(port), do: fail(port, "ports cannot cross the bridge")

  defp enc(ref, _left) when is_reference(ref),
    do: fail(ref, "references cannot cross the bridge")

  defp enc(fun, _left) when is_function(fun), do: fail(fun, "functions cannot cross the bridge")

  defp enc(bits, _left) when is_bitstring(bits),
    do: fail(bits, "bitstrings that are not whole bytes cannot be encoded")

  # Keys all binaries, or all atoms, or all integers are distinct in Python too;
  # other maps are checked key by key, as Python will see them.
  defp check_keys(map) do
    case :maps.next(:maps.iterator(map)) do
      {key, _value, rest} -> if same_kind(rest, kind(key)), do: :ok, else: python_keys(map)
    end
  end

  defp same_kind(iter, kind) when kind in [:binary, :atom, :integer] do
    case :maps.next(iter) do
      :none -> true
      {key, _value, rest} -> kind(key) == kind and same_kind(rest, kind)
    end
  end

  defp same_kind(_iter, _kind), do: false

  defp kind(key) when is_binary(key), do: :binary
  defp kind(key) when is_boolean(key) or is_nil(key), do: :other
  defp kind(key) when is_atom(key), do: :atom
  defp kind(key) when is_integer(key), do: :integer
  defp kind(_key), do: :other

  defp python_keys(map) do
    :maps.fold(
      fn key, _value, seen ->
        python = python_key(key)

        case seen do
          %{^python => other} ->
            message =
              "map keys #{inspect(other)} and #{inspect(key)} would be one key in Python " <>
                "(true == 1 == 1.0 there, and an atom is the string of its name), and one " <>
                "value would be lost: use keys that differ there"

            throw({__MODULE__, Error.new(:bad_args, message, details: %{keys: [other, key]})})

          _ ->
            Map.put(seen, python, key)
        end
      end,
      %{},
      map
    )
  end

  # What a key is in Python, as far as equality goes.
  defp python_key(true), do: 1
  defp python_key(false), do: 0
  defp python_key(nil), do: nil
  defp python_key(key) when is_atom(key), do: Atom.to_string(key)
  defp python_key(key) when is_float(key) and key == trunc(key), do: trunc(key)

  defp python_key(key) when is_tuple(key),
    do: key |> Tuple.to_list() |> Enum.map(&python_key/1) |> List.to_tuple()

  defp python_key(key), do: key

  defp enc_uint(int) when int < 0x80, do: <<int>>
  defp enc_uint(int) when int <= 0xFF, do: <<0xCC, int>>
  defp enc_uint(int) when int <= 0xFFFF, do: <<0xCD, int::16>>
  defp enc_uint(int) when int <= @max_u32, do: <<0xCE, int::32>>
  defp enc_uint(int) when int <= @max_u64, do: <<0xCF, int::64>>
  defp enc_uint(int), do: fail(int, "integers above 2^64-1 do not fit msgpack")

  defp enc_items([head | tail], left, acc), do: enc_items(tail, left, [acc | enc(head, left)])
  defp enc_items([], _left, acc), do: acc

  defp enc_list([head | tail], whole, acc, n, left),
    do: enc_list(tail, whole, [acc | enc(head, left)], n + 1, left)

  defp enc_list([], _whole, acc, n, _left), do: [list_header(n) | acc]

  defp enc_list(_improper, whole, _acc, _n, _left),
    do: fail(whole, "improper lists cannot be encoded")

  defp list_header(n) when n < 16, do: <<0b1001::4, n::4>>
  defp list_header(n) when n <= 0xFFFF, do: <<0xDC, n::16>>
  defp list_header(n), do: <<0xDD, n::32>>

  defp ext_header(1, type, _term), do: <<0xD4, type>>
  defp ext_header(2, type, _term), do: <<0xD5, type>>
  defp ext_header(4, type, _term), do: <<0xD6, type>>
  defp ext_header(8, type, _term), do: <<0xD7, type>>
  defp ext_header(16, type, _term), do: <<0xD8, type>>
  defp ext_header(size, type, _term) when size <= 0xFF, do: <<0xC7, size, type>>
  defp ext_header(size, type, _term) when size <= 0xFFFF, do: <<0xC8, size::16, type>>
  defp ext_header(size, type, _term) when size <= @max_u32, do: <<0xC9, size::32, type>>
  defp ext_header(_size, _type, term), do: fail(term, "extension payloads above 4 GiB")

  @spec too_deep() :: no_return()
  defp too_deep do
    message =
      "cannot encode a value nested deeper than #{@max_depth} levels of lists, maps and " <>
        "tuples (the argument list of a call is one of them)"

    throw({__MODULE__, Error.new(:bad_args, message, details: %{max_depth: @max_depth})})
  end

  @spec fail(term(), String.t()) :: no_return()
  defp fail(term, why) do
    message = "cannot encode #{inspect(term, limit: 8, printable_limit: 80)}: #{why}"
    throw({__MODULE__, Error.new(:encode, message, details: %{term: term})})
  end

  # UTF-8 validity, eight ASCII bytes at a time where possible (two 32-bit
  # words: a 64-bit one would be a bignum); from the first byte that is not
  # ASCII, by the VM's own check (a BIF: 4x faster than matching code points
  # here, and it refuses what `<<_::utf8>>` refuses: surrogates, overlong forms,
  # code points past U+10FFFF).
  defp utf8?(<<w1::32, w2::32, rest::binary>>) when ((w1 ||| w2) &&& 0x80808080) == 0,
    do: utf8?(rest)

  defp utf8?(<<byte, rest::binary>>) when byte < 0x80, do: utf8?(rest)
  defp utf8?(<<>>), do: true
  defp utf8?(rest), do: is_binary(:unicode.characters_to_binary(rest))

  ## Decoding -----------------------------------------------------------------

  # A stack machine: d/4 reads the next value, v/5 hands a finished value to
  # the innermost open array or map. Both keep the binary first and only ever
  # tail-call each other, so the VM keeps one match context for the whole
  # input instead of making a sub-binary per value. Stack frames:
  # {:a, left, acc} (array), {:k, left, acc} (map, a key is next) and
  # {:v, left, key, acc} (map, the value of key is next). `dp` is the number
  # of containers open around the next value (enclosing tuples included): a
  # container opened at dp = @max_depth would nest deeper than the limit.
  defp d(<<byte, rest::binary>>, st, dp, r) when byte < 0x80, do: v(rest, st, dp, r, byte)
  defp d(<<0b1000::4, n::4, rest::binary>>, st, dp, r), do: map(rest, st, dp, r, n)
  defp d(<<0b1001::4, n::4, rest::binary>>, st, dp, r), do: array(rest, st, dp, r, n)

  defp d(<<0b101::3, n::5, s::binary-size(n), rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, s)

  defp d(<<0xC0, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, nil)
  defp d(<<0xC2, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, false)
  defp d(<<0xC3, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, true)
  defp d(<<0xC4, n, s::binary-size(n), rest::binary>>, st, dp, r), do: v(rest, st, dp, r, s)
  defp d(<<0xC5, n::16, s::binary-size(n), rest::binary>>, st, dp, r), do: v(rest, st, dp, r, s)
  defp d(<<0xC6, n::32, s::binary-size(n), rest::binary>>, st, dp, r), do: v(rest, st, dp, r, s)

  defp d(<<0xC7, n, t, p::binary-size(n), rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xC8, n::16, t, p::binary-size(n), rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xC9, n::32, t, p::binary-size(n), rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xCA, x::float-32, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, x)

  defp d(<<0xCA, x::bitstring-32, rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, special(x))

  defp d(<<0xCB, x::float-64, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, x)

  defp d(<<0xCB, x::bitstring-64, rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, special(x))

  defp d(<<0xCC, i, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)
  defp d(<<0xCD, i::16, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)
  defp d(<<0xCE, i::32, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)
  defp d(<<0xCF, i::64, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)
  defp d(<<0xD0, i::8-signed, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)
  defp d(<<0xD1, i::16-signed, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)
  defp d(<<0xD2, i::32-signed, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)
  defp d(<<0xD3, i::64-signed, rest::binary>>, st, dp, r), do: v(rest, st, dp, r, i)

  defp d(<<0xD4, t, p::binary-1, rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xD5, t, p::binary-2, rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xD6, t, p::binary-4, rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xD7, t, p::binary-8, rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xD8, t, p::binary-16, rest::binary>>, st, dp, r),
    do: v(rest, st, dp, r, ext(t, p, dp, r))

  defp d(<<0xD9, n, s::binary-size(n), rest::binary>>, st, dp, r), do: v(rest, st, dp, r, s)
  defp d(<<0xDA, n::16, s::binary-size(n), rest::binary>>, st, dp, r), do: v(rest, st, dp, r, s)
  defp d(<<0xDB, n::32, s::binary-size(n), rest::binary>>, st, dp, r), do: v(rest, st, dp, r, s)
  defp d(<<0xDC, n::16, rest::binary>>, st, dp, r), do: array(rest, st, dp, r, n)
  defp d(<<0xDD, n::32, rest::binary>>, st, dp, r), do: array(rest, st, dp, r, n)
  defp d(<<0xDE, n::16, rest::binary>>, st, dp, r), do: map(rest, st, dp, r, n)
  defp d(<<0xDF, n::32, rest::binary>>, st, dp, r), do: map(rest, st, dp, r, n)
  defp d(<<i::8-signed, rest::binary>>, st, dp, r) when i >= -32, do: v(rest, st, dp, r, i)
  defp d(<<>> = rest, _st, _dp, _r), do: throw({__MODULE__, "unexpected end of input", rest})

  defp d(<<0xC1, _::binary>> = rest, _st, _dp, _r),
    do: throw({__MODULE__, "invalid byte 0xc1", rest})

  defp d(<<byte, _::binary>> = rest, _st, _dp, _r) do
    throw({__MODULE__, "truncated value (type byte 0x#{hex(byte)})", rest})
  end

  # (a container's bytes are still in `rest` for the error's offset)
  defp array(rest, _st, @max_depth, _r, _n), do: deep(rest)
  defp array(rest, st, dp, r, 0), do: v(rest, st, dp, r, [])
  defp array(rest, st, dp, r, n), do: d(rest, [{:a, n, []} | st], dp + 1, r)

  defp map(rest, _st, @max_depth, _r, _n), do: deep(rest)
  defp map(rest, st, dp, r, 0), do: v(rest, st, dp, r, %{})
  defp map(rest, st, dp, r, n), do: d(rest, [{:k, n, []} | st], dp + 1, r)

  defp v(rest, [], _dp, _r, value), do: {value, rest}

  defp v(rest, [{:a, 1, acc} | st], dp, r, value),
    do: v(rest, st, dp - 1, r, :lists.reverse(acc, [value]))

  defp v(rest, [{:a, n, acc} | st], dp, r, value),
    do: d(rest, [{:a, n - 1, [value | acc]} | st], dp, r)

  defp v(rest, [{:k, n, acc} | st], dp, r, key), do: d(rest, [{:v, n, key, acc} | st], dp, r)

  defp v(rest, [{:v, 1, key, acc} | st], dp, r, value),
    do: v(rest, st, dp - 1, r, :maps.from_list(:lists.reverse(acc, [{key, value}])))

  defp v(rest, [{:v, n, key, acc} | st], dp, r, value),
    do: d(rest, [{:k, n - 1, [{key, value} | acc]} | st], dp, r)

  @spec deep(binary()) :: no_return()
  defp deep(rest) do
    throw({__MODULE__, "value nested deeper than #{@max_depth} levels", rest})
  end

  defp ext(@ext_atom, name, _dp, _r) do
    :erlang.binary_to_existing_atom(name, :utf8)
  rescue
    ArgumentError -> name
  end

  # A tuple is one level, its payload array: the array opens at the tuple's
  # own depth, so the tuple is counted once.
  defp ext(@ext_tuple, payload, dp, r) do
    case d(payload, [], dp, r) do
      {list, <<>>} when is_list(list) -> List.to_tuple(list)
      _ -> throw({__MODULE__, "tuple extension must hold exactly one array", payload})
    end
  end

  defp ext(@ext_ref, <<id::64, class::binary>>, _dp, r) do
    ref = Ref.stamp(%Ref{id: id, class: class}, r)
    if is_pid(ref.owner), do: Process.put(@handed, [id | Process.get(@handed, [])])
    ref
  end

  defp ext(@ext_tensor, <<kind, bits, ndim, dims::binary-size(ndim * 8), data::binary>> = p, _, _) do
    type = Tensor.type_from_wire(kind, bits) || throw({__MODULE__, "unknown tensor type", p})

    case dims(dims, [], 1, 1) do
      {shape, numel} when byte_size(data) * 8 == numel * bits ->
        %Tensor{type: type, shape: shape, data: data}

      {_shape, _numel} ->
        throw({__MODULE__, "tensor data size does not match its type and shape", p})

      :too_large ->
        shape = List.to_tuple(for <<d::64 <- dims>>, do: d)
        {:error, error} = Tensor.check_shape(shape)
        throw({__MODULE__, error.message, p})
    end
  end

  defp ext(type, payload, _dp, _r) when type in [@ext_ref, @ext_tensor] do
    throw({__MODULE__, "malformed extension #{type} payload", payload})
  end

  defp ext(type, payload, _dp, _r) do
    throw({__MODULE__, "unknown extension type #{type}", payload})
  end

  # A tensor's shape and element count, in one pass over its u64 dimensions;
  # :too_large when torch could not hold it (the product of the dimensions
  # that are not 0, `extent`, must stay below 2^63: Tensor.check_shape/1).
  defp dims(<<0::64, rest::binary>>, acc, _numel, extent), do: dims(rest, [0 | acc], 0, extent)

  defp dims(<<dim::64, rest::binary>>, acc, numel, extent) do
    extent = extent * dim

    if extent <= @max_extent,
      do: dims(rest, [dim | acc], numel * dim, extent),
      else: :too_large
  end

  defp dims(<<>>, acc, numel, _extent), do: {List.to_tuple(:lists.reverse(acc)), numel}

  defp special(bits) do
    {exp_size, man_size} = if bit_size(bits) == 32, do: {8, 23}, else: {11, 52}
    <<sign::1, _exp::size(exp_size), mantissa::size(man_size)>> = bits

    cond do
      mantissa != 0 -> :nan
      sign == 1 -> :neg_infinity
      true -> :infinity
    end
  end

  defp hex(byte), do: Integer.to_string(byte, 16) |> String.downcase()
end
