defmodule VllmBridge.TensorInspectTest do
  use ExUnit.Case, async: true

  alias VllmBridge.Tensor

  doctest Tensor, only: [elements: 3]

  test "inspect shows the type, the shape and the values" do
    {:ok, t} = Tensor.from_list([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], {:f, 32})

    assert inspect(t) ==
             "#VllmBridge.Tensor<\n  f32[2][3]\n  [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]\n>"

    {:ok, scalar} = Tensor.from_list(3, {:s, 64})
    assert inspect(scalar) == "#VllmBridge.Tensor<\n  s64\n  3\n>"

    {:ok, special} = Tensor.from_list([:nan, :infinity, :neg_infinity], {:bf, 16})
    assert inspect(special) =~ "bf16[3]\n  [NaN, Inf, -Inf]"

    {:ok, flags} = Tensor.from_list([true, false], {:pred, 8})
    assert inspect(flags) =~ "pred[2]\n  [true, false]"
  end

  test "inspect shows at most :limit elements, and decodes no more" do
    {:ok, t} = Tensor.from_list(Enum.to_list(1..10), {:s, 32})
    assert inspect(t, limit: 3) =~ "[1, 2, 3, ...]"
    assert inspect(t, limit: :infinity) =~ "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"

    # A 64 MiB tensor prints its first 50 elements, and its data is never decoded
    # whole: counted in reductions (the BEAM's work units, not time), decoding its
    # 16M floats would cost far more than the 2M allowed here.
    data = :binary.copy(<<0, 0, 128, 63>>, 16 * 1024 * 1024)
    big = %Tensor{type: {:f, 32}, shape: {4096, 4096}, data: data}

    {reductions, text} =
      Task.async(fn ->
        {:reductions, before} = Process.info(self(), :reductions)
        text = inspect(big)
        {:reductions, after_} = Process.info(self(), :reductions)
        {after_ - before, text}
      end)
      |> Task.await()

    assert text =~ "f32[4096][4096]"
    assert length(Regex.scan(~r/1\.0/, text)) == 50
    assert reductions < 2_000_000
  end

  test "inspect of a struct whose data does not match its shape says so, and does not raise" do
    bad = %Tensor{type: {:f, 32}, shape: {2}, data: <<1, 2, 3>>}
    assert inspect(bad) =~ "(invalid: 3 bytes of data where the shape needs 8)"
  end

  test "empty tensors" do
    {:ok, e} = Tensor.from_list([], {:f, 32})
    assert inspect(e) =~ "f32[0]\n  []"
    assert inspect(%Tensor{type: {:u, 8}, shape: {2, 0}, data: <<>>}) =~ "u8[2][0]\n  [[], []]"
  end
end
