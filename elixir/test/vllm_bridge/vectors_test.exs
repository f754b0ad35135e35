Code.require_file("support/test_python.exs", __DIR__)

defmodule VllmBridge.VectorsTest do
  @moduledoc false
  # The shared test vectors written by the Python implementation
  # (tests/vectors/*.txt, one `name<TAB>hex<TAB>elixir_literal` per line):
  # Elixir must decode Python's bytes to the literal and encode the literal to
  # the same bytes; and Python (tests/vectors/check.py) must decode Elixir's
  # encodings to its own cases.
  use ExUnit.Case, async: true

  alias VllmBridge.{Msgpack, Proto}

  @root VllmBridge.TestPython.root()
  @dir Path.join(@root, "tests/vectors")

  defp vectors(file) do
    path = Path.join(@dir, file)
    assert File.exists?(path), "#{path} is missing (the Python side writes it)"

    for line <- path |> File.read!() |> String.split("\n", trim: true) do
      [name, hex, literal] = String.split(line, "\t", parts: 3)
      {value, _binding} = Code.eval_string(literal)
      {name, Base.decode16!(hex, case: :mixed), value}
    end
  end

  defp decode("request_" <> _, bytes), do: Proto.decode_request(bytes)
  defp decode("reply_" <> _, bytes), do: Proto.decode_reply(bytes)

  defp encode("request_" <> _, value), do: Proto.encode_request(value)
  defp encode("reply_" <> _, value), do: Proto.encode_reply(value)

  test "msgpack vectors: decode(bytes) === literal and encode(literal) == bytes" do
    vectors = vectors("msgpack.txt")
    assert vectors != []

    for {name, bytes, value} <- vectors do
      assert Msgpack.decode(bytes) === {:ok, value}, "#{name}: decode"
      assert {:ok, iodata} = Msgpack.encode(value), "#{name}: encode"
      assert IO.iodata_to_binary(iodata) == bytes, "#{name}: encode"
    end
  end

  test "envelope vectors: decode(bytes) == literal and encode(literal) == bytes" do
    vectors = vectors("envelope.txt")
    assert vectors != []

    for {name, bytes, value} <- vectors do
      assert decode(name, bytes) === {:ok, value}, "#{name}: decode"
      assert {:ok, iodata} = encode(name, value), "#{name}: encode"
      assert IO.iodata_to_binary(iodata) == bytes, "#{name}: encode"
    end
  end

  @tag timeout: 60_000
  test "Python decodes Elixir's encodings to its own cases" do
    python = VllmBridge.TestPython.python!()
    check = Path.join(@dir, "check.py")
    assert File.exists?(check)

    for {kind, file} <- [{"msgpack", "msgpack.txt"}, {"envelope", "envelope.txt"}] do
      lines =
        for {name, _bytes, value} <- vectors(file) do
          {:ok, iodata} =
            if kind == "msgpack", do: Msgpack.encode(value), else: encode(name, value)

          [name, "\t", Base.encode16(IO.iodata_to_binary(iodata), case: :lower), "\n"]
        end

      path =
        Path.join(
          System.tmp_dir!(),
          "vllm_bridge_#{kind}_#{System.unique_integer([:positive])}"
        )

      File.write!(path, lines)

      try do
        {output, status} =
          System.cmd(python, [check, kind, path], cd: @root, stderr_to_stdout: true)

        assert status == 0, "check.py #{kind} failed:\n#{output}"
      after
        File.rm(path)
      end
    end
  end
end
