Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.ProtoTest do
  use ExUnit.Case, async: true

  import Bitwise

  alias VllmBridge.{Error, Proto}

  doctest VllmBridge.Proto

  defp bin(iodata), do: IO.iodata_to_binary(iodata)

  defp request_roundtrip(request) do
    {:ok, iodata} = Proto.encode_request(request)
    {:ok, decoded} = Proto.decode_request(bin(iodata))
    decoded
  end

  @requests [
    %{id: 1, session: "", op: {:ping, %{payload: <<145, 1>>}}},
    %{id: 2, session: "", op: {:ping, %{payload: ""}}},
    %{
      id: 3,
      session: "s1",
      op: {:create, %{class_name: "StatelessProcessGroup", args: <<146, 1>>, kwargs: ""}}
    },
    %{
      id: 0xFFFFFFFFFFFFFFFF,
      session: "default",
      op: {:call, %{handle: 300, method: "barrier", args: "", kwargs: <<128>>}}
    },
    %{id: 5, session: "", op: {:call_function, %{function: "f", args: "", kwargs: ""}}},
    %{id: 6, session: "", op: {:get_attr, %{handle: 0, name: "rank"}}},
    %{id: 7, session: "", op: {:release, %{handles: [1, 300, 1 <<< 40]}}},
    %{id: 8, session: "", op: {:release, %{handles: []}}},
    %{id: 9, session: "job", op: {:release_session, %{}}},
    %{id: 10, session: "", op: {:describe, %{}}}
  ]

  test "requests round-trip with every field filled" do
    for request <- @requests, do: assert(request_roundtrip(request) == request)
  end

  test "encoding follows the canonical rules" do
    # the set oneof member is written even when empty; defaults are omitted
    {:ok, iodata} = Proto.encode_request(%{id: 2, session: "", op: {:ping, %{payload: ""}}})
    assert bin(iodata) == <<0x08, 2, 0x8A, 0x01, 0>>

    # packed repeated uint64
    {:ok, iodata} =
      Proto.encode_request(%{id: 7, session: "", op: {:release, %{handles: [1, 300]}}})

    assert bin(iodata) == <<0x08, 7, 0x72, 5, 0x0A, 3, 1, 0xAC, 0x02>>

    # iodata in bytes fields
    {:ok, iodata} =
      Proto.encode_request(%{id: 1, session: "", op: {:ping, %{payload: [[0x91], "", [1]]}}})

    assert bin(iodata) == <<8, 1, 0x8A, 1, 4, 0x0A, 2, 0x91, 1>>
  end

  test "the decoder accepts any field order, unpacked repeated and unknown fields" do
    # release op first, then session, then id; handles unpacked; unknown fields 99 (varint),
    # 98 (len), 97 (fixed64), 96 (fixed32)
    op = <<0x08, 1, 0x08, 0xAC, 0x02, 0x0A, 1, 5>>

    bytes =
      <<0x72, byte_size(op), op::binary, 0x12, 1, ?s, 0x98, 0x06, 7, 0x92, 0x06, 2, "xy", 0x89,
        0x06, 0::64, 0x85, 0x06, 0::32, 0x08, 42>>

    assert {:ok, %{id: 42, session: "s", op: {:release, %{handles: [1, 300, 5]}}}} =
             Proto.decode_request(bytes)
  end

  test "malformed requests are protocol errors" do
    for bytes <- [<<0x08>>, <<0x08, 1>>, <<0x08, 1, 0x8A, 1, 5, 0>>, <<0x0F>>, <<0x12, 1, 1>>] do
      assert {:error, %Error{category: :protocol}} = Proto.decode_request(bytes), inspect(bytes)
    end

    # wrong wire type for a known field
    assert {:error, %Error{category: :protocol}} = Proto.decode_request(<<0x0A, 0, 0x82, 1, 0>>)
  end

  test "bad request maps are bad_args errors" do
    assert {:error, %Error{category: :bad_args}} =
             Proto.encode_request(%{id: 1, session: "", op: {:nope, %{}}})

    assert {:error, %Error{category: :bad_args}} =
             Proto.encode_request(%{id: 1, session: "", op: {:ping, %{payload: :x}}})

    assert {:error, %Error{category: :bad_args}} =
             Proto.encode_request(%{id: -1, session: "", op: {:describe, %{}}})

    assert {:error, %Error{category: :bad_args}} = Proto.encode_request(:nope)
  end

  test "replies round-trip, value and error" do
    replies = [
      %{id: 11, result: {:value, <<192>>}},
      %{id: 12, result: {:value, ""}},
      %{
        id: 13,
        result:
          {:error,
           %{
             category: "python",
             message: "RuntimeError: boom",
             python_type: "RuntimeError",
             traceback: "Traceback...",
             details: <<128>>
           }}
      },
      %{
        id: 0,
        result:
          {:error,
           %{category: "protocol", message: "x", python_type: "", traceback: "", details: ""}}
      }
    ]

    for reply <- replies do
      {:ok, iodata} = Proto.encode_reply(reply)
      assert Proto.decode_reply(bin(iodata)) == {:ok, reply}
      assert Proto.reply_id(bin(iodata)) == {:ok, reply.id}
    end
  end

  test "value replies: the short path for the canonical layout, the field loop for the rest" do
    for id <- [1, 127, 128, 300, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF],
        value <- ["", <<0xC0>>, :binary.copy(<<7>>, 200), :binary.copy(<<9>>, 70_000)] do
      {:ok, iodata} = Proto.encode_reply(%{id: id, result: {:value, value}})
      canonical = bin(iodata)
      assert Proto.decode_reply(canonical) == {:ok, %{id: id, result: {:value, value}}}

      # an unknown field after the value, the value given twice (the last wins)
      assert Proto.decode_reply(canonical <> <<0x98, 0x06, 1>>) ==
               {:ok, %{id: id, result: {:value, value}}}

      assert Proto.decode_reply(canonical <> <<0x12, 1, 0xC3>>) ==
               {:ok, %{id: id, result: {:value, <<0xC3>>}}}

      # truncated, or a stray byte after the value: errors, not a shorter value
      truncated = binary_part(canonical, 0, byte_size(canonical) - 1)

      if value != "" do
        assert {:error, %Error{category: :protocol}} = Proto.decode_reply(truncated)
      end

      assert {:error, %Error{category: :protocol}} = Proto.decode_reply(canonical <> <<0x80>>)
    end
  end

  test "reply_id reads the first field only, and falls back for other orders" do
    assert Proto.reply_id(<<8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01>>) ==
             {:ok, 0xFFFFFFFFFFFFFFFF}

    assert Proto.reply_id(<<0x12, 1, 0xC0, 0x08, 9>>) == {:ok, 9}
    assert {:error, %Error{category: :protocol}} = Proto.reply_id(<<8, 0x80>>)
    assert {:error, %Error{category: :protocol}} = Proto.reply_id(<<>>)
  end

  test "agrees with the Python protobuf runtime" do
    python = VllmBridge.TestPython.python!()

    hexes =
      Enum.map_join(@requests, ",", fn r ->
        {:ok, io} = Proto.encode_request(r)
        "\"" <> Base.encode16(bin(io), case: :lower) <> "\""
      end)

    script = """
    import sys, tempfile, subprocess, importlib
    from google.protobuf import descriptor_pool
    from grpc_tools import protoc
    out = tempfile.mkdtemp()
    assert protoc.main(["protoc", "-Iproto", "--python_out=" + out, "proto/bridge.proto"]) == 0
    sys.path.insert(0, out)
    pb = importlib.import_module("bridge_pb2")
    for h in [#{hexes}]:
        data = bytes.fromhex(h)
        m = pb.Request()
        m.ParseFromString(data)
        assert m.SerializeToString(deterministic=True) == data, (h, m)
    """

    assert {out, 0} =
             System.cmd(python, ["-c", script],
               cd: VllmBridge.TestPython.root(),
               stderr_to_stdout: true
             )

    assert out == ""
  end
end
