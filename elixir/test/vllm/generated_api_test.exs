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

  # Seed 001 (GroupCoordinator).
  @group_coordinator [
    _all_gather_out_place: [3, 4],
    _all_reduce_out_place: [2, 3],
    _reduce_scatter_out_place: [3, 4],
    all_gather: [3, 4],
    all_gatherv: [3, 4],
    all_reduce: [2, 3],
    barrier: [1, 2],
    broadcast: [3, 4],
    broadcast_object: [2, 3],
    broadcast_object_list: [3, 4],
    broadcast_tensor_dict: [2, 3],
    combine: [3, 4],
    create_mq_broadcaster: [2, 3],
    create_single_reader_mq_broadcasters: [2, 3],
    destroy: [1, 2],
    # dispatch/3..5 as the seed documents it; dispatch/6 is vLLM 0.34's (top-k).
    dispatch: [4, 5, 6],
    dispatch_router_logits: [3, 4, 5],
    first_rank: [1],
    gather: [3, 4],
    graph_capture: [2, 3],
    is_first_rank: [1],
    is_last_rank: [1],
    last_rank: [1],
    new: [5, 6],
    next_rank: [1],
    prepare_communication_buffer_for_model: [2, 3],
    prev_rank: [1],
    recv: [4, 5],
    recv_object: [2, 3],
    recv_tensor_dict: [2, 3],
    reduce_scatter: [3, 4],
    reduce_scatterv: [3, 4],
    send: [3, 4],
    send_object: [3, 4],
    send_tensor_dict: [3, 4]
  ]

  # Seed 003 (DeviceCommunicatorBase).
  @device_communicator [
    all_gather: [3, 4],
    all_gatherv: [3, 4],
    all_reduce: [2, 3],
    combine: [3, 4],
    destroy: [1, 2],
    dispatch: [4, 5, 6],
    dispatch_router_logits: [3, 4, 5],
    gather: [3, 4],
    new: [2, 3],
    prepare_communication_buffer_for_model: [2, 3],
    recv: [4, 5],
    reduce_scatter: [3, 4],
    reduce_scatterv: [3, 4],
    send: [3, 4]
  ]

  # MessageQueue, with vLLM 0.33's shutdown and shutting_down, and 0.34's recv.
  @message_queue [
    broadcast_object: [2, 3],
    close: [1, 2],
    dequeue: [2, 3],
    enqueue: [3, 4],
    recv: [3, 4],
    shutdown: [1, 2],
    shutting_down: [1, 2],
    wait_until_ready: [2, 3]
  ]

  @generated [
    Vllm.Distributed,
    SPG,
    Vllm.Distributed.GroupCoordinator,
    Vllm.Distributed.DeviceCommunicatorBase,
    Vllm.Distributed.TensorMetadata,
    Vllm.Distributed.GraphCaptureContext,
    Vllm.Distributed.MessageQueue,
    Vllm.Distributed.NFSWorkspace
  ]

  for {module, documented} <- [
        {SPG, @documented},
        {Vllm.Distributed.GroupCoordinator, @group_coordinator},
        {Vllm.Distributed.DeviceCommunicatorBase, @device_communicator},
        {Vllm.Distributed.MessageQueue, @message_queue}
      ] do
    test "#{inspect(module)} has every documented function at its documented arities" do
      module = unquote(module)
      Code.ensure_loaded!(module)

      for {name, arities} <- unquote(documented), arity <- arities do
        assert function_exported?(module, name, arity), "missing #{name}/#{arity}"
      end
    end
  end

  test "every public function has a @doc and a @spec returning {:ok, _} | {:error, Error}" do
    for module <- @generated do
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
        # Functions with default arguments (opts, and args when every optional
        # positional parameter may be left out) have one spec, at the full arity.
        assert Enum.any?(0..2, &({name, arity + &1} in spec_names)),
               "#{inspect(module)}.#{name}/#{arity} has no @spec"
      end

      for {_, [spec | _]} <- specs do
        rendered = Macro.to_string(Code.Typespec.spec_to_quoted(:f, spec))
        # A long result type is rendered over several lines: "{:ok," ends one of them.
        assert rendered =~ ~r/\{:ok,\s/ and rendered =~ "{:error, VllmBridge.Error.t()}", rendered
      end
    end
  end

  test "dispatch/5 takes the seeds' router logits, dispatch/6 vLLM 0.34's top-k routing" do
    for module <- [Vllm.Distributed.GroupCoordinator, Vllm.Distributed.DeviceCommunicatorBase] do
      {:docs_v1, _, _, _, _, _, docs} = Code.fetch_docs(module)

      signature = fn arity ->
        Enum.find_value(docs, fn
          {{:function, :dispatch, ^arity}, _, [text], _, _} -> text
          _ -> nil
        end)
      end

      assert signature.(5) =~ "dispatch(ref, hidden_states, router_logits, args"
      assert signature.(6) == "dispatch(ref, hidden_states, topk_weights, topk_ids, args, opts)"
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
