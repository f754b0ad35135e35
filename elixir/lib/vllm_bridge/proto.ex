defmodule VllmBridge.Proto do
  @moduledoc """
  A hand-written proto3 codec for the envelopes of `proto/bridge.proto`.

  The schema is small and fixed, so this module encodes and decodes it with
  binary pattern matching instead of a protobuf library (none is available
  to the runtime, and none is needed). The fields of each message come from
  `VllmBridge.Proto.Schema`, generated from the .proto. Messages are plain
  maps and tagged tuples:

      # Request
      %{id: 1, session: "", op: {:ping, %{payload: <<0x91, 0x01>>}}}
      # with a deadline: the worker gives up on it 500 ms after reading it
      %{id: 2, session: "", deadline_ms: 500, op: {:describe, %{}}}

      # ops
      {:create, %{class_name: s, args: b, kwargs: b}}
      {:call, %{handle: i, method: s, args: b, kwargs: b}}
      {:call_function, %{function: s, args: b, kwargs: b}}
      {:get_attr, %{handle: i, name: s}}
      {:release, %{handles: [i]}}
      {:release_session, %{}}
      {:describe, %{}}
      {:ping, %{payload: b}}

      # Reply
      %{id: 1, result: {:value, msgpack_bytes}}
      %{id: 1, result: {:error, %{category: s, message: s, python_type: s,
                                  traceback: s, details: b}}}
      # what the worker's process printed (id 0; see docs/protocol.md)
      %{id: 0, result: {:output, %{text: b, dropped: i}}}

  ## Canonical bytes

  Encoders write fields in field-number order and leave out fields that hold
  their proto3 default (`0`, `""`, no elements), except the member of the
  `oneof` that is set, which is always written (even when empty). Repeated
  `uint64` fields are packed. Equal messages therefore have equal bytes in
  Elixir and Python, which the shared vectors in `tests/vectors/` check.

  Encoding returns iodata; the `bytes` fields (`args`, `kwargs`, `payload`,
  `details`, `value`) may be given as iodata, typically straight from
  `VllmBridge.Msgpack.encode/1`, so a large argument is never copied on its
  way to the port.

  ## Lenient decoding

  Decoders accept anything a conforming proto3 encoder may write: fields in
  any order, unknown fields (skipped), repeated fields packed or not, and a
  field given twice (the last one wins; messages are not merged). Decoded
  messages have every field, defaults filled in, except a request's
  `:deadline_ms`, which is there only when it is not 0 (none). A message whose `oneof` is
  not set is refused: the bridge never sends one.
  """

  import Bitwise

  alias VllmBridge.Error
  alias VllmBridge.Proto.Schema

  @typedoc "A decoded or to-be-encoded bridge.proto `Request`."
  @type request :: %{
          required(:id) => pos_integer(),
          required(:session) => binary(),
          optional(:deadline_ms) => non_neg_integer(),
          required(:op) => op()
        }

  @type op ::
          {:create, %{class_name: binary(), args: iodata(), kwargs: iodata()}}
          | {:call,
             %{handle: non_neg_integer(), method: binary(), args: iodata(), kwargs: iodata()}}
          | {:call_function, %{function: binary(), args: iodata(), kwargs: iodata()}}
          | {:get_attr, %{handle: non_neg_integer(), name: binary()}}
          | {:release, %{handles: [non_neg_integer()]}}
          | {:release_session, %{}}
          | {:describe, %{}}
          | {:ping, %{payload: iodata()}}

  @typedoc "The `error` member of a `Reply`."
  @type reply_error :: %{
          category: binary(),
          message: binary(),
          python_type: binary(),
          traceback: binary(),
          details: iodata()
        }

  @typedoc """
  The `output` member of a `Reply` (id 0): lines the worker's process wrote on
  its stdout and stderr, each ending in a newline, and how many lines it
  dropped before them.
  """
  @type reply_output :: %{text: iodata(), dropped: non_neg_integer()}

  @typedoc "A decoded or to-be-encoded bridge.proto `Reply`."
  @type reply :: %{
          id: non_neg_integer(),
          result: {:value, iodata()} | {:error, reply_error()} | {:output, reply_output()}
        }

  # A field's tag (key) as bytes, at compile time.
  tag_bytes = fn number, type ->
    key = number <<< 3 ||| type
    if key < 0x80, do: <<key>>, else: <<(key &&& 0x7F) ||| 0x80, key >>> 7>>
  end

  # wire types
  @varint 0
  @i64 1
  @len 2
  @i32 5

  # Field layouts, {field number, key, kind}, from the generated schema: each
  # operation's field number and layout, and those of a reply's error and output.
  [op: ops] = Schema.oneofs(:request)
  @op_fields for {number, op, message} <- ops, do: {op, {number, Schema.fields(message)}}
  @op_numbers Enum.map(@op_fields, fn {_op, {number, _layout}} -> number end)
  @error_fields Schema.fields(:error)
  @output_fields Schema.fields(:output)
  # The rest of Request and Reply is written out below, its keys as constants (the
  # reply's id, 0x08, and value, 0x12, are read at byte level); the schema must still
  # say what they say, or the build stops here.
  [{1, :id, :uint64}, {2, :session, :string}, {3, :deadline_ms, :uint64}] =
    Schema.fields(:request)

  [{1, :id, :uint64}] = Schema.fields(:reply)

  [result: [{2, :value, :bytes}, {3, :error, :error}, {4, :output, :output}]] =
    Schema.oneofs(:reply)

  # The field writers, the varint writer and reader are small and on every
  # call's path: compiled into their callers, not called (each call is a
  # reduction of the caller's).
  @compile {:inline, uint64_field: 3, string_field: 3, bytes_field: 4, varint: 1}

  # Seven bits a byte, low first; every byte but the last has its top bit set.
  # Values below 2^28 (ids, lengths, handles) written in place (a macro: the
  # compiler does not inline a function into one it inlines itself), longer
  # ones by encode_long_varint/1.
  defmacrop encode_varint(value) do
    quote do
      case unquote(value) do
        v when v < 0x80 ->
          <<v>>

        v when v < 0x4000 ->
          <<1::1, v::7, v >>> 7>>

        v when v < 0x200000 ->
          <<1::1, v::7, 1::1, v >>> 7::7, v >>> 14>>

        v when v < 0x10000000 ->
          <<1::1, v::7, 1::1, v >>> 7::7, 1::1, v >>> 14::7, v >>> 21>>

        v ->
          encode_long_varint(v)
      end
    end
  end

  ## Requests -----------------------------------------------------------------

  @doc """
  The most values one repeated field (a release's handles) may hold: the
  worker refuses a request with more (docs/protocol.md, "Limits"), so a
  longer list goes in several requests.
  """
  @spec max_repeated() :: pos_integer()
  def max_repeated, do: 1_048_576

  @doc """
  Encodes a `Request` as iodata.

  Returns `{:error, %VllmBridge.Error{category: :bad_args}}` when the map
  does not have the documented shape.

  ## Examples

      iex> {:ok, iodata} = VllmBridge.Proto.encode_request(%{id: 1, session: "", op: {:describe, %{}}})
      iex> IO.iodata_to_binary(iodata)
      <<8, 1, 130, 1, 0>>
  """
  @spec encode_request(request()) :: {:ok, iodata()} | {:error, Error.t()}
  def encode_request(%{id: id, op: {op, fields}} = request) when is_map(fields) do
    session = with %{session: session} <- request, do: session, else: (_ -> "")
    deadline = with %{deadline_ms: deadline} <- request, do: deadline, else: (_ -> 0)

    {:ok,
     [
       uint64_field(unquote(tag_bytes.(1, @varint)), 1, id),
       string_field(unquote(tag_bytes.(2, @len)), 2, session),
       uint64_field(unquote(tag_bytes.(3, @varint)), 3, deadline) | encode_op(op, fields)
     ]}
  catch
    {__MODULE__, error} -> {:error, error}
  end

  def encode_request(other), do: {:error, bad("not a request: #{inspect(other, limit: 8)}")}

  @doc """
  Decodes a `Request`. Errors are `:protocol` errors.

  ## Examples

      iex> VllmBridge.Proto.decode_request(<<8, 1, 130, 1, 0>>)
      {:ok, %{id: 1, session: "", op: {:describe, %{}}}}
  """
  @spec decode_request(binary()) :: {:ok, request()} | {:error, Error.t()}
  def decode_request(binary) when is_binary(binary) do
    acc =
      fold_fields(binary, %{id: 0, session: "", op: nil}, fn
        1, @varint, value, acc -> %{acc | id: value}
        2, @len, value, acc -> %{acc | session: value}
        3, @varint, 0, acc -> Map.delete(acc, :deadline_ms)
        3, @varint, value, acc -> Map.put(acc, :deadline_ms, value)
        n, @len, value, acc when n in @op_numbers -> %{acc | op: decode_op(n, value)}
        n, type, _value, _acc when n in [1, 2, 3] or n in @op_numbers -> wrong_type(n, type)
        _n, _type, _value, acc -> acc
      end)

    case acc do
      %{op: nil} -> {:error, protocol("request has no operation")}
      request -> {:ok, request}
    end
  catch
    {__MODULE__, error} -> {:error, error}
  end

  for {op, {number, layout}} <- @op_fields do
    defp decode_op(unquote(number), binary) do
      {unquote(op), decode_fields(binary, unquote(Macro.escape(layout)))}
    end
  end

  ## Replies ------------------------------------------------------------------

  @doc """
  Encodes a `Reply` as iodata.

  ## Examples

      iex> {:ok, iodata} = VllmBridge.Proto.encode_reply(%{id: 5, result: {:value, <<0xC0>>}})
      iex> IO.iodata_to_binary(iodata)
      <<8, 5, 18, 1, 0xC0>>
  """
  @spec encode_reply(reply()) :: {:ok, iodata()} | {:error, Error.t()}
  def encode_reply(%{id: id, result: result}) do
    body =
      case result do
        {:value, value} -> bytes_field(tag(2, @len), 2, value, true)
        {:error, %{} = error} -> len_field(3, encode_fields(@error_fields, error))
        {:output, %{} = output} -> len_field(4, encode_fields(@output_fields, output))
        other -> bad!("not a reply result: #{inspect(other, limit: 8)}")
      end

    {:ok, [uint64_field(tag(1, @varint), 1, id) | body]}
  catch
    {__MODULE__, error} -> {:error, error}
  end

  def encode_reply(other), do: {:error, bad("not a reply: #{inspect(other, limit: 8)}")}

  @doc """
  Decodes a `Reply`. Errors are `:protocol` errors.

  ## Examples

      iex> VllmBridge.Proto.decode_reply(<<8, 5, 18, 1, 0xC0>>)
      {:ok, %{id: 5, result: {:value, <<0xC0>>}}}
  """
  @spec decode_reply(binary()) :: {:ok, reply()} | {:error, Error.t()}
  def decode_reply(<<0x08, rest::binary>> = binary) do
    # The canonical value reply (id, then the value, nothing else), read
    # without the general field loop; anything else takes that loop.
    with {id, <<0x12, rest::binary>>} <- varint(rest),
         {size, value} when byte_size(value) == size <- varint(rest) do
      {:ok, %{id: id, result: {:value, value}}}
    else
      _ -> decode_any_reply(binary)
    end
  end

  def decode_reply(binary) when is_binary(binary), do: decode_any_reply(binary)

  defp decode_any_reply(binary) do
    acc =
      fold_fields(binary, %{id: 0, result: nil}, fn
        1, @varint, value, acc -> %{acc | id: value}
        2, @len, value, acc -> %{acc | result: {:value, value}}
        3, @len, value, acc -> %{acc | result: {:error, decode_fields(value, @error_fields)}}
        4, @len, value, acc -> %{acc | result: {:output, decode_fields(value, @output_fields)}}
        n, type, _value, _acc when n in 1..4 -> wrong_type(n, type)
        _n, _type, _value, acc -> acc
      end)

    case acc do
      %{result: nil} -> {:error, protocol("reply has no value, error or output")}
      reply -> {:ok, reply}
    end
  catch
    {__MODULE__, error} -> {:error, error}
  end

  @doc """
  Reads the id of an encoded `Reply` without decoding the rest.

  An id is never 0, and encoders write fields in field-number order, so a
  reply starts with `0x08 varint(id)`. A reply that does not start with field
  1 carries id 0 (the worker could not read the request's id) and gives
  `{:ok, 0}`. Replies written by other encoders in another field order are
  handled by decoding them in full.

  ## Examples

      iex> VllmBridge.Proto.reply_id(<<8, 0x96, 0x01, 18, 1, 0xC0>>)
      {:ok, 150}
  """
  @spec reply_id(binary()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def reply_id(<<0x08, rest::binary>> = binary) do
    case varint(rest) do
      {id, _rest} -> {:ok, id}
      :error -> {:error, protocol("truncated reply id", binary)}
    end
  end

  def reply_id(binary) when is_binary(binary) do
    case decode_reply(binary) do
      {:ok, %{id: id}} -> {:ok, id}
      {:error, _} = error -> error
    end
  end

  ## Field encoding -----------------------------------------------------------

  # One clause per op, unrolled at compile time: the op's fields in number
  # order, each read from the map by a pattern (a field left out of the map
  # holds its default, which is not written) and written after its tag, a
  # constant; then the op's own tag and the body's length.
  for {op, {number, layout}} <- @op_fields do
    fields = Macro.var(:fields, __MODULE__)

    parts =
      for {n, name, kind} <- layout do
        default =
          Macro.escape(Map.fetch!(%{uint64: 0, string: "", bytes: "", packed_uint64: []}, kind))

        value =
          quote(
            do:
              with(%{unquote(name) => v} <- unquote(fields), do: v, else: (_ -> unquote(default)))
          )

        case kind do
          :uint64 ->
            quote(do: uint64_field(unquote(tag_bytes.(n, @varint)), unquote(n), unquote(value)))

          :string ->
            quote(do: string_field(unquote(tag_bytes.(n, @len)), unquote(n), unquote(value)))

          :bytes ->
            quote(
              do: bytes_field(unquote(tag_bytes.(n, @len)), unquote(n), unquote(value), false)
            )

          :packed_uint64 ->
            quote(do: encode_field(:packed_uint64, unquote(n), unquote(value), unquote(name)))
        end
      end

    defp encode_op(unquote(op), unquote(fields)) do
      body = unquote(parts)
      [unquote(tag_bytes.(number, @len)), encode_varint(:erlang.iolist_size(body)) | body]
    end
  end

  defp encode_op(op, _fields), do: bad!("unknown request op #{inspect(op)}")

  defp encode_fields(layout, fields) do
    for {number, key, kind} <- layout do
      case Map.fetch(fields, key) do
        {:ok, value} -> encode_field(kind, number, value, key)
        :error -> []
      end
    end
  end

  defp encode_field(:uint64, number, value, _key),
    do: uint64_field(tag(number, @varint), number, value)

  defp encode_field(:string, number, value, _key),
    do: string_field(tag(number, @len), number, value)

  defp encode_field(:bytes, number, value, _key),
    do: bytes_field(tag(number, @len), number, value, false)

  defp encode_field(:packed_uint64, number, values, key) when is_list(values) do
    case values do
      [] -> []
      _ -> len_field(number, Enum.map(values, &uint64!(&1, key)))
    end
  end

  defp encode_field(_kind, _number, value, key) do
    bad!("field #{key}: expected a list, got #{inspect(value, limit: 8)}")
  end

  # A field's writers take its tag (a constant) and its number (for errors).
  defp uint64_field(_tag, _number, 0), do: []

  defp uint64_field(tag, _number, value)
       when is_integer(value) and value > 0 and value <= 0xFFFFFFFFFFFFFFFF,
       do: [tag | encode_varint(value)]

  defp uint64_field(_tag, number, value), do: uint64!(value, number)

  defp string_field(_tag, _number, ""), do: []

  defp string_field(tag, _number, value) when is_binary(value) do
    [tag, encode_varint(byte_size(value)) | value]
  end

  defp string_field(_tag, number, value),
    do: bad!("field #{number}: expected a string, got #{inspect(value, limit: 8)}")

  defp bytes_field(_tag, _number, "", false), do: []

  defp bytes_field(tag, _number, value, _always?) when is_binary(value),
    do: [tag, encode_varint(byte_size(value)) | value]

  defp bytes_field(tag, number, value, always?) do
    size =
      try do
        :erlang.iolist_size(value)
      rescue
        ArgumentError ->
          bad!("field #{number}: expected iodata, got #{inspect(value, limit: 8)}")
      end

    if size == 0 and not always?,
      do: [],
      else: [tag, encode_varint(size) | value]
  end

  defp len_field(number, iodata) do
    [tag(number, @len), encode_varint(:erlang.iolist_size(iodata)) | iodata]
  end

  # Field tags are constants: one clause per (field number, wire type) in use,
  # written out at compile time instead of varint-encoded for every field.
  max_number =
    Enum.max(
      for message <- Schema.messages(),
          {number, _, _} <-
            Schema.fields(message) ++ Enum.concat(Keyword.values(Schema.oneofs(message))),
          do: number
    )

  for number <- 1..max_number, type <- [@varint, @len] do
    defp tag(unquote(number), unquote(type)), do: unquote(tag_bytes.(number, type))
  end

  defp uint64!(value, _where)
       when is_integer(value) and value >= 0 and value <= 0xFFFFFFFFFFFFFFFF,
       do: encode_varint(value)

  defp uint64!(value, where),
    do: bad!("field #{where}: expected a uint64, got #{inspect(value, limit: 8)}")

  # (encode_varint/1's values from 2^28, and its own rest)
  defp encode_long_varint(value) when value < 0x80, do: <<value>>

  defp encode_long_varint(value),
    do: <<1::1, value::7, encode_long_varint(value >>> 7)::binary>>

  ## Field decoding -----------------------------------------------------------

  # Calls fun.(number, wire_type, value, acc) for every field; a length-
  # delimited value is a sub-binary, a fixed one an integer.
  defp fold_fields(<<>>, acc, _fun), do: acc

  defp fold_fields(binary, acc, fun) do
    {key, rest} = varint!(binary, binary)
    number = key >>> 3

    if number == 0, do: throw({__MODULE__, protocol("field number 0", binary)})

    {value, rest} =
      case key &&& 7 do
        @varint ->
          varint!(rest, binary)

        @len ->
          {size, rest} = varint!(rest, binary)

          case rest do
            <<value::binary-size(size), rest::binary>> -> {value, rest}
            _ -> throw({__MODULE__, protocol("truncated length-delimited field", binary)})
          end

        @i64 ->
          case rest do
            <<value::little-64, rest::binary>> -> {value, rest}
            _ -> throw({__MODULE__, protocol("truncated fixed64 field", binary)})
          end

        @i32 ->
          case rest do
            <<value::little-32, rest::binary>> -> {value, rest}
            _ -> throw({__MODULE__, protocol("truncated fixed32 field", binary)})
          end

        type ->
          throw({__MODULE__, protocol("unsupported wire type #{type}", binary)})
      end

    fold_fields(rest, fun.(number, key &&& 7, value, acc), fun)
  end

  defp decode_fields(binary, layout) do
    defaults = Map.new(layout, fn {_n, key, kind} -> {key, default(kind)} end)

    binary
    |> fold_fields({defaults, %{}}, fn number, type, value, {acc, packed} ->
      case List.keyfind(layout, number, 0) do
        nil ->
          {acc, packed}

        {_, key, :packed_uint64} ->
          # repeated: packed (len) or one element at a time (varint)
          values =
            case type do
              @len -> unpack_varints(value, [])
              @varint -> [value]
              _ -> wrong_type(number, type)
            end

          {acc, Map.update(packed, key, [values], &[values | &1])}

        {_, key, :uint64} when type == @varint ->
          {Map.put(acc, key, value), packed}

        {_, key, kind} when kind in [:string, :bytes] and type == @len ->
          {Map.put(acc, key, value), packed}

        _ ->
          wrong_type(number, type)
      end
    end)
    |> then(fn {acc, packed} ->
      Enum.reduce(packed, acc, fn {key, chunks}, acc ->
        Map.put(acc, key, chunks |> :lists.reverse() |> Enum.concat())
      end)
    end)
  end

  defp default(:uint64), do: 0
  defp default(:string), do: ""
  defp default(:bytes), do: ""
  defp default(:packed_uint64), do: []

  defp unpack_varints(<<>>, acc), do: :lists.reverse(acc)

  defp unpack_varints(binary, acc) do
    {value, rest} = varint!(binary, binary)
    unpack_varints(rest, [value | acc])
  end

  defp varint!(binary, whole) do
    case varint(binary) do
      :error -> throw({__MODULE__, protocol("truncated or overlong varint", whole)})
      ok -> ok
    end
  end

  # 64-bit varints: at most 10 bytes; bits beyond 64 are dropped as protobuf does.
  defp varint(<<0::1, b0::7, rest::binary>>), do: {b0, rest}
  # (two and three bytes, the usual ids and lengths, without the loop)
  defp varint(<<1::1, b0::7, 0::1, b1::7, rest::binary>>), do: {b0 ||| b1 <<< 7, rest}

  defp varint(<<1::1, b0::7, 1::1, b1::7, 0::1, b2::7, rest::binary>>),
    do: {b0 ||| b1 <<< 7 ||| b2 <<< 14, rest}

  defp varint(binary), do: varint(binary, 0, 0)

  defp varint(<<1::1, bits::7, rest::binary>>, shift, acc) when shift < 63,
    do: varint(rest, shift + 7, acc ||| bits <<< shift)

  defp varint(<<0::1, bits::7, rest::binary>>, shift, acc) when shift <= 63,
    do: {(acc ||| bits <<< shift) &&& 0xFFFFFFFFFFFFFFFF, rest}

  defp varint(_binary, _shift, _acc), do: :error

  @spec wrong_type(pos_integer(), non_neg_integer()) :: no_return()
  defp wrong_type(number, type) do
    throw({__MODULE__, protocol("field #{number} has wire type #{type}")})
  end

  defp protocol(message, binary \\ nil) do
    details = if binary, do: %{bytes: byte_size(binary)}, else: %{}
    Error.new(:protocol, "protobuf: " <> message, details: details)
  end

  defp bad(message), do: Error.new(:bad_args, "protobuf: " <> message)

  @spec bad!(String.t()) :: no_return()
  defp bad!(message), do: throw({__MODULE__, bad(message)})
end
