Code.require_file("support/fuzz.exs", __DIR__)

defmodule VllmBridge.FuzzTest do
  # The decoders of bytes that come from Python (VllmBridge.Msgpack.decode/2,
  # VllmBridge.Proto.decode_reply/1 and reply_id/1, VllmBridge.Error.from_reply/1)
  # and Proto.decode_request/1, fed random and mutated frames: each must
  # return {:ok, _} or {:error, %VllmBridge.Error{}} and never raise, and
  # valid frames must round-trip exactly.
  #
  # VLLM_BRIDGE_FUZZ_FRAMES frames per decoder (default 100_000), from seed
  # VLLM_BRIDGE_FUZZ_SEED (default 15); a failure prints the seed and the frame.
  # `mix test --only fuzz` runs only these.
  use ExUnit.Case, async: true

  import VllmBridge.Fuzz

  alias VllmBridge.{Error, Msgpack, Proto}

  @moduletag :fuzz
  @moduletag timeout: 3_600_000

  @default_frames 100_000
  @default_seed 15

  defp frames do
    case System.get_env("VLLM_BRIDGE_FUZZ_FRAMES") do
      nil -> @default_frames
      value -> String.to_integer(value)
    end
  end

  defp seed do
    case System.get_env("VLLM_BRIDGE_FUZZ_SEED") do
      nil -> @default_seed
      value -> String.to_integer(value)
    end
  end

  # Runs `fun` on `frame`: {:ok, result} or {:raised, kind, reason, stacktrace}.
  defp run(fun, frame) do
    {:ok, fun.(frame)}
  rescue
    error -> {:raised, :error, error, __STACKTRACE__}
  catch
    kind, reason -> {:raised, kind, reason, __STACKTRACE__}
  end

  # `fun.(frame)` must be {:ok, _} or {:error, %Error{}}; returns it.
  defp check!(name, fun, frame, ctx) do
    case run(fun, frame) do
      {:ok, {:ok, _} = ok} ->
        ok

      {:ok, {:error, %Error{}} = error} ->
        error

      {:ok, other} ->
        flunk(failure(ctx, "#{name} returned #{inspect(other, limit: 20)}", frame))

      {:raised, kind, reason, stack} ->
        flunk(failure(ctx, "#{name} raised " <> Exception.format(kind, reason, stack), frame))
    end
  end

  defp failure({seed, i}, what, frame) do
    """
    frame #{i}: #{what}
    frame: #{hex(frame)}
    reproduce with VLLM_BRIDGE_FUZZ_SEED=#{seed} (and VLLM_BRIDGE_FUZZ_FRAMES=#{frames()}): \
    mix test --only fuzz
    """
  end

  test "Msgpack.decode/2: valid terms round-trip exactly; mutated and random bytes never raise" do
    seed = seed()
    seed!(seed, 1)
    ref_opts = [pool: :fuzz_pool, worker: self(), session: "s", index: 0]
    stats = %{roundtrip: 0, ok: 0, error: 0}

    {stats, _last} =
      Enum.reduce(1..frames(), {stats, encode!([1, "x"])}, fn i, {stats, last} ->
        ctx = {seed, i}

        {frame, stats, last} =
          case rem(i, 10) do
            k when k in [0, 1, 2] ->
              # a valid term, checked to round-trip, then decoded like the rest
              # (a term nested up to the limit costs ~1 ms to build: one in 50)
              term = if rem(i, 50) == 0, do: nested(between(100, 128)), else: term(between(0, 5))
              frame = encode!(term)

              case run(&Msgpack.decode/1, frame) do
                {:ok, {:ok, back}} when back === term ->
                  :ok

                other ->
                  flunk(
                    failure(
                      ctx,
                      "#{inspect(term, limit: 10)} came back as #{inspect(other)}",
                      frame
                    )
                  )
              end

              {frame, %{stats | roundtrip: stats.roundtrip + 1}, frame}

            3 ->
              # too deep: refused by the encoder (one in 50), and by the decoder
              # when hand-made
              if rem(i, 50) == 3 do
                term = nested(between(129, 140))
                {:error, %Error{category: :bad_args, message: message}} = Msgpack.encode(term)
                assert message =~ "nested deeper than 128", failure(ctx, message, "")
              end

              frame = deep(encode!(term(1)), between(129, 300))

              case run(&Msgpack.decode/1, frame) do
                {:ok,
                 {:error,
                  %Error{
                    category: :protocol,
                    message: "msgpack: value nested deeper than 128" <> _
                  }}} ->
                  :ok

                other ->
                  flunk(failure(ctx, "a too deep value gave #{inspect(other, limit: 5)}", frame))
              end

              {frame, stats, last}

            k when k in [4, 5, 6, 7] ->
              {mutate(last, encode!(term(3))), stats, last}

            8 ->
              {:crypto.strong_rand_bytes(between(0, 64)), stats, last}

            9 ->
              {deep(last), stats, last}
          end

        stats =
          case check!("Msgpack.decode/2", &Msgpack.decode(&1, ref: ref_opts), frame, ctx) do
            {:ok, _} -> %{stats | ok: stats.ok + 1}
            {:error, _} -> %{stats | error: stats.error + 1}
          end

        {stats, last}
      end)

    # the mix exercises both answers
    assert stats.roundtrip > frames() * 0.25
    assert stats.error > frames() * 0.2
  end

  test "Proto.decode_reply/1, reply_id/1 and Error.from_reply/1 never raise" do
    seed = seed()
    seed!(seed, 2)

    Enum.reduce(1..frames(), elem(reply(), 0), fn i, last ->
      ctx = {seed, i}

      {frame, last} =
        case rem(i, 4) do
          0 ->
            {frame, expected} = reply()

            assert Proto.decode_reply(frame) == {:ok, expected},
                   failure(ctx, "a valid reply did not round-trip", frame)

            {frame, frame}

          1 ->
            {:crypto.strong_rand_bytes(between(0, 48)), last}

          _ ->
            {mutate(last, elem(reply(), 0)), last}
        end

      check!("Proto.reply_id/1", &Proto.reply_id/1, frame, ctx)

      case check!("Proto.decode_reply/1", &Proto.decode_reply/1, frame, ctx) do
        {:ok, %{result: {:value, value}}} ->
          # what the runtime does with a value reply
          decode = &Msgpack.decode(&1, ref: [pool: :p, worker: self(), session: ""])
          check!("Msgpack.decode/2 of a reply's value", decode, value, ctx)

        {:ok, %{result: {:error, error}}} ->
          from_reply = &{:ok, Error.from_reply(&1)}

          case run(from_reply, error) do
            {:ok, {:ok, %Error{}}} ->
              :ok

            other ->
              flunk(failure(ctx, "Error.from_reply/1 gave #{inspect(other, limit: 20)}", frame))
          end

        {:ok, %{result: {:output, %{text: text, dropped: dropped}}}} ->
          # what the worker logs from an output frame
          assert is_binary(text) and is_integer(dropped) and dropped >= 0,
                 failure(ctx, "an output frame decoded to bad fields", frame)

        {:error, _} ->
          :ok
      end

      last
    end)
  end

  test "Proto.decode_request/1 never raises" do
    seed = seed()
    seed!(seed, 3)

    Enum.reduce(1..frames(), request(), fn i, last ->
      ctx = {seed, i}

      {frame, last} =
        case rem(i, 4) do
          0 -> {request(), request()}
          1 -> {:crypto.strong_rand_bytes(between(0, 48)), last}
          _ -> {mutate(last, request()), last}
        end

      check!("Proto.decode_request/1", &Proto.decode_request/1, frame, ctx)
      last
    end)
  end
end
