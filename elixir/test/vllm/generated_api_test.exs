defmodule Vllm.GeneratedApiTest do
  # The generated modules have the documented names and arities (seeds 000/002),
  # each with @doc and @spec.
  use ExUnit.Case, async: true

  alias Vllm.Distributed.StatelessProcessGroup, as: SPG

  @documented [
    new: [5, 6],
    create: [6, 7],
    all_gather_obj: [2, 3],
    barrier: [2, 3],
    broadcast_obj: [3, 4],
    send_obj: [3, 4],
    recv_obj: [2, 3],
    expire_data: [1, 2],
    broadcast_send_counter: [1],
    data_expiration_seconds: [1],
    rank: [1],
    world_size: [1]
  ]

  test "StatelessProcessGroup has every documented function at its documented arities" do
    Code.ensure_loaded!(SPG)

    for {name, arities} <- @documented, arity <- arities do
      assert function_exported?(SPG, name, arity), "missing #{name}/#{arity}"
    end
  end

  test "every public function has a @doc and a @spec returning {:ok, _} | {:error, Error}" do
    for module <- [SPG, Vllm.Distributed] do
      {:docs_v1, _, :elixir, _, %{"en" => moduledoc}, _, docs} = Code.fetch_docs(module)
      assert moduledoc != ""
      {:ok, specs} = Code.Typespec.fetch_specs(module)
      spec_names = for {{name, arity}, _} <- specs, do: {name, arity}

      for {name, arity} <- module.__info__(:functions) do
        doc =
          Enum.find_value(docs, fn
            {{:function, ^name, a}, _, _, %{"en" => text}, _} when a >= arity - 1 -> text
            _ -> nil
          end)

        assert doc, "#{inspect(module)}.#{name}/#{arity} has no @doc"
        # Functions with a default argument have one spec, at the full arity.
        assert {name, arity} in spec_names or {name, arity + 1} in spec_names,
               "#{inspect(module)}.#{name}/#{arity} has no @spec"
      end

      for {_, [spec | _]} <- specs do
        rendered = Macro.to_string(Code.Typespec.spec_to_quoted(:f, spec))
        assert rendered =~ "{:ok, " and rendered =~ "{:error, VllmBridge.Error.t()}", rendered
      end
    end
  end

  test "the documented summary lines are the generated docs' first lines" do
    {:docs_v1, _, _, _, _, _, docs} = Code.fetch_docs(SPG)

    first_line = fn name ->
      Enum.find_value(docs, fn
        {{:function, ^name, _}, _, _, %{"en" => text}, _} -> text |> String.split("\n") |> hd()
        _ -> nil
      end)
    end

    assert first_line.(:all_gather_obj) == "All gather an object from all ranks."
    assert first_line.(:barrier) == "A robust barrier to synchronize all ranks."

    assert first_line.(:broadcast_obj) ==
             "Broadcast an object from a source rank to all other ranks."

    assert first_line.(:send_obj) == "Send an object to a destination rank."
    assert first_line.(:recv_obj) == "Receive an object from a source rank."

    assert first_line.(:expire_data) ==
             "Expire data that is older than data_expiration_seconds seconds."

    assert first_line.(:create) ==
             "A replacement for `torch.distributed.init_process_group` that does not"
  end
end
