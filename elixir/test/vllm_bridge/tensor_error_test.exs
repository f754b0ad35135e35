defmodule VllmBridge.TensorErrorTest do
  use ExUnit.Case, async: true

  import Bitwise

  alias VllmBridge.{Error, Msgpack, Ref, Tensor}

  doctest VllmBridge.Tensor
  doctest VllmBridge.Error
  doctest VllmBridge.Ref

  describe "Tensor" do
    test "new/3 validates type, shape and size" do
      assert {:ok, %Tensor{shape: {}}} = Tensor.new({:f, 64}, {}, <<1.0::float-64-little>>)
      assert {:ok, %Tensor{}} = Tensor.new({:pred, 8}, {0, 3}, "")
      assert {:error, %Error{category: :bad_args}} = Tensor.new({:f, 8}, {1}, <<0>>)
      assert {:error, %Error{category: :bad_args}} = Tensor.new({:f, 32}, [1], <<0::32>>)
      assert {:error, %Error{category: :bad_args}} = Tensor.new({:f, 32}, {-1}, "")
      assert {:error, %Error{message: msg}} = Tensor.new({:s, 16}, {2, 2}, <<0::48>>)
      assert msg =~ "needs 8"
    end

    test "from_list/2 and to_list/1 round-trip every type" do
      cases = [
        {{:f, 16}, [[1.0, -2.5], [0.5, 0.0]]},
        {{:f, 32}, [1.5, :nan, :infinity, :neg_infinity]},
        {{:f, 64}, 3.25},
        {{:bf, 16}, [1.0, -2.0, 0.5]},
        {{:s, 8}, [-128, 127]},
        {{:s, 64}, [[-1], [1 <<< 40]]},
        {{:u, 8}, [0, 255]},
        {{:u, 32}, [4_000_000_000]},
        {{:c, 64}, [{1.0, -1.0}, {0.0, 2.5}]},
        {{:c, 128}, [{1.0, 0.0}]},
        {{:pred, 8}, [true, false, true]},
        {{:f, 32}, []}
      ]

      for {type, list} <- cases do
        assert {:ok, tensor} = Tensor.from_list(list, type)
        assert :ok = Tensor.validate(tensor)
        assert Tensor.to_list(tensor) == list, inspect(type)
      end

      assert {:ok, %Tensor{shape: {2, 3}}} = Tensor.from_list([[1, 2, 3], [4, 5, 6]], {:s, 32})
      assert {:error, %Error{category: :bad_args}} = Tensor.from_list([[1], [2, 3]], {:s, 32})
      assert {:error, %Error{category: :bad_args}} = Tensor.from_list([-1], {:u, 8})
      assert {:error, %Error{category: :bad_args}} = Tensor.from_list([1], {:x, 8})
    end

    test "an empty tensor with a zero inner dimension" do
      tensor = %Tensor{type: {:u, 8}, shape: {2, 0}, data: ""}
      assert Tensor.to_list(tensor) == [[], []]
    end
  end

  describe "Error" do
    test "from_reply/1 maps categories and decodes details" do
      details = Msgpack.encode!(%{"handle" => 7}) |> IO.iodata_to_binary()

      error =
        Error.from_reply(%{
          category: "not_found",
          message: "no handle 7",
          python_type: "",
          traceback: "",
          details: details
        })

      assert %Error{
               category: :not_found,
               python_type: nil,
               python_traceback: nil,
               details: %{"handle" => 7}
             } = error

      assert Exception.message(error) == "(not_found) no handle 7"

      odd = Error.from_reply(%{category: "weird", message: "m", details: <<0xC1>>})

      assert %Error{category: :protocol, details: %{"category" => "weird", "raw" => <<0xC1>>}} =
               odd
    end

    test "python errors format with type and traceback, and can be raised" do
      error =
        Error.from_reply(%{
          category: "python",
          message: "boom",
          python_type: "RuntimeError",
          traceback: "Traceback (most recent call last):\n  boom\n",
          details: ""
        })

      assert Exception.message(error) =~ "(python) RuntimeError: boom\n\nTraceback"
      assert_raise Error, ~r/RuntimeError/, fn -> raise error end
    end

    test "every category is known" do
      assert :stale_ref in Error.categories()
      assert %Error{category: :timeout} = Error.new(:timeout, "late")
    end
  end

  describe "Ref" do
    test "stamp/2 sets placement fields only" do
      ref = Ref.new(1, "X") |> Ref.stamp(pool: :p, worker: self(), other: 1)
      assert %Ref{pool: :p, session: ""} = ref
      assert ref.worker == self()
      assert Ref.stamp(ref, nil) == ref
    end
  end
end
