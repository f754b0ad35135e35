defmodule VllmBridge.Runtime do
  @moduledoc """
  Calls into Python workers: construct objects, call their methods, call
  module functions, read attributes, release what you no longer need.

      {:ok, group} =
        VllmBridge.Runtime.call_function(
          "StatelessProcessGroup.create",
          ["127.0.0.1", 29_500, 0, 1],
          store_timeout: 30
        )

      {:ok, 1} = VllmBridge.Runtime.get_attr(group, "world_size")
      {:ok, ["hi"]} = VllmBridge.Runtime.call_method(group, "all_gather_obj", ["hi"])
      {:ok, 1} = VllmBridge.Runtime.release(group)

  The generated `Vllm.*` modules are thin wrappers over these functions.

  ## Arguments and options

  `args` is the list of positional arguments. `opts` is a keyword list: every
  key becomes a Python keyword argument (`store_timeout: 30` is
  `store_timeout=30`), except two:

    * `:__args__` - a list appended to the positional arguments (the
      generated modules put optional positional parameters there)
    * `:__runtime__` - how to run the call, a keyword list of:
      * `:pool` - the `VllmBridge.Pool` (default `VllmBridge.DefaultPool`)
      * `:worker` - where to run a constructor or function: a worker index,
        or a `VllmBridge.Ref` (run next to that object). Default: the worker
        of the first ref among the top-level arguments, else round-robin
      * `:timeout` - ms to wait for the reply (default: the pool's `:timeout`)
      * `:session` - the session that owns created handles and may use them
        (default `""`, the worker's default session; calls on a ref default
        to the ref's session)

  Values cross the bridge as described in `VllmBridge.Msgpack`; results that
  cannot (a process group, a store) come back as `%VllmBridge.Ref{}`s stamped
  with their pool, worker and session.

  ## Placement and stale refs

  An object lives in one worker's Python process, so a call on a ref goes to
  the worker pid the ref carries, never elsewhere. When that worker has died
  (its Python process went with it, and the pool may have started a fresh one
  at the same index), the call returns an error of category `:stale_ref`
  without sending anything.

  ## Results

  Every function returns `{:ok, value}` or `{:error, %VllmBridge.Error{}}`
  and never raises: bad arguments or options are `:bad_args` errors, Python
  exceptions are `:python` errors with `python_type` and `python_traceback`,
  and the worker keeps serving after every error.
  """

  alias VllmBridge.{Error, Msgpack, Pool, Proto, Ref, Worker}

  @runtime_keys [:pool, :worker, :timeout, :session]

  @typedoc "Positional arguments."
  @type args :: [term()]

  @typedoc "Python keyword arguments plus `:__args__` and `:__runtime__`."
  @type opts :: keyword()

  @type result :: {:ok, term()} | {:error, Error.t()}

  @doc """
  Constructs an exported class, `ClassName(*args, **kwargs)`, in a worker and
  returns a ref to the new object.
  """
  @spec call_class(String.t(), args(), opts()) :: {:ok, Ref.t()} | {:error, Error.t()}
  def call_class(class_name, args, opts \\ []) do
    with :ok <- check_name(class_name, "class name"),
         {:ok, ctx} <- context(args, opts),
         {:ok, target} <- place(ctx) do
      run(target, ctx, {:create, %{class_name: class_name, args: ctx.args, kwargs: ctx.kwargs}})
    end
  end

  @doc """
  Calls an exported method on the object `ref` names,
  `obj.method(*args, **kwargs)`, in the worker that holds it.
  """
  @spec call_method(Ref.t(), String.t(), args(), opts()) :: result()
  def call_method(ref, method, args \\ [], opts \\ []) do
    with :ok <- check_name(method, "method name"),
         {:ok, ctx} <- context(args, opts),
         {:ok, target} <- ref_target(ref, ctx) do
      run(
        target,
        ctx,
        {:call, %{handle: ref.id, method: method, args: ctx.args, kwargs: ctx.kwargs}}
      )
    end
  end

  @doc """
  Calls an exported module function or static method by its exported name
  (`"stateless_init_torch_distributed_process_group"`,
  `"StatelessProcessGroup.create"`).
  """
  @spec call_function(String.t(), args(), opts()) :: result()
  def call_function(name, args, opts \\ []) do
    with :ok <- check_name(name, "function name"),
         {:ok, ctx} <- context(args, opts),
         {:ok, target} <- place(ctx) do
      run(target, ctx, {:call_function, %{function: name, args: ctx.args, kwargs: ctx.kwargs}})
    end
  end

  @doc """
  Calls an exported static or class method (`"StatelessProcessGroup.create"`)
  where the documented Elixir signature puts a ref first: `ref` is `nil`, or
  a ref used only for placement (the call runs on that ref's worker, as with
  `__runtime__: [worker: ref]`); it is not passed to Python.
  """
  @spec call_static(Ref.t() | nil, String.t(), args(), opts()) :: result()
  def call_static(ref, name, args, opts \\ [])
  def call_static(nil, name, args, opts), do: call_function(name, args, opts)

  def call_static(%Ref{} = ref, name, args, opts) when is_list(opts) do
    if Keyword.keyword?(opts) do
      {runtime, opts} = Keyword.pop(opts, :__runtime__, [])

      if Keyword.keyword?(runtime) do
        runtime = Keyword.update(runtime, :worker, ref, &(&1 || ref))
        call_function(name, args, [{:__runtime__, runtime} | opts])
      else
        bad(":__runtime__ must be a keyword list", runtime)
      end
    else
      bad("options must be a keyword list", opts)
    end
  end

  def call_static(other, _name, _args, _opts) do
    bad("the first argument of a static method is nil or a ref (for placement)", other)
  end

  @doc """
  Reads an exported attribute or property of the object `ref` names.
  """
  @spec get_attr(Ref.t(), String.t(), opts()) :: result()
  def get_attr(ref, name, opts \\ []) do
    with :ok <- check_name(name, "attribute name"),
         {:ok, ctx} <- context([], opts),
         :ok <- no_kwargs(ctx, "get_attr/3"),
         {:ok, target} <- ref_target(ref, ctx) do
      run(target, ctx, {:get_attr, %{handle: ref.id, name: name}})
    end
  end

  @doc """
  Releases one ref or a list of refs: their workers forget the objects.

  Returns the number of objects freed. Refs whose worker is gone count as 0
  (their objects are gone already); releasing a ref twice is harmless.
  Only `:__runtime__` `timeout:` applies.
  """
  @spec release(Ref.t() | [Ref.t()], opts()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def release(refs, opts \\ [])
  def release(%Ref{} = ref, opts), do: release([ref], opts)

  def release(refs, opts) when is_list(refs) do
    with :ok <- all_refs(refs),
         {:ok, ctx} <- context([], opts),
         :ok <- no_kwargs(ctx, "release/2") do
      refs
      |> Enum.group_by(&{&1.pool || ctx.pool, &1.worker, &1.session})
      |> Enum.flat_map(fn {{pool, _worker, session}, group} ->
        ref = hd(group)

        case ref_target(%{ref | pool: pool}, %{ctx | session: nil}) do
          {:ok, target} ->
            handles = group |> Enum.map(& &1.id) |> Enum.uniq()
            [{target, %{ctx | session: session}, {:release, %{handles: handles}}}]

          {:error, %Error{category: :stale_ref}} ->
            []

          {:error, _} = error ->
            [error]
        end
      end)
      |> run_many()
    end
  end

  def release(other, _opts), do: bad("release/2 needs a ref or a list of refs", other)

  @doc """
  Releases every handle owned by `session` in every worker of the pool.
  Returns the number of objects freed.
  """
  @spec release_session(String.t(), opts()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def release_session(session, opts \\ [])

  def release_session(session, opts) when is_binary(session) do
    with {:ok, ctx} <- context([], opts),
         :ok <- no_kwargs(ctx, "release_session/2"),
         {:ok, workers} <- Pool.workers(ctx.pool) do
      ctx = %{ctx | session: session}

      workers
      |> Enum.map(fn {_index, pid} ->
        {%{pool: ctx.pool, worker: pid}, ctx, {:release_session, %{}}}
      end)
      |> run_many()
    end
  end

  def release_session(other, _opts), do: bad("a session must be a string", other)

  @doc """
  The export table of a worker: its classes, functions, methods and
  attributes, with signatures and docstrings.
  """
  @spec describe(opts()) :: {:ok, map()} | {:error, Error.t()}
  def describe(opts \\ []) do
    with {:ok, ctx} <- context([], opts),
         :ok <- no_kwargs(ctx, "describe/1"),
         {:ok, target} <- place(ctx) do
      run(target, ctx, {:describe, %{}})
    end
  end

  @doc """
  Sends `term` to a worker and returns what comes back: the same term, for
  every term the bridge can carry (a round trip through Python's codec).
  """
  @spec ping(term(), opts()) :: result()
  def ping(term, opts \\ []) do
    with {:ok, ctx} <- context([], opts),
         :ok <- no_kwargs(ctx, "ping/2"),
         {:ok, payload} <- Msgpack.encode(term),
         {:ok, target} <- place(ctx) do
      run(target, ctx, {:ping, %{payload: payload}})
    end
  end

  ## Options -------------------------------------------------------------------

  defp context(args, opts) when is_list(args) and is_list(opts) do
    with true <- Keyword.keyword?(opts) || bad("options must be a keyword list", opts),
         {runtime, opts} = Keyword.pop(opts, :__runtime__, []),
         {extra, kwargs} = Keyword.pop(opts, :__args__, []),
         true <- is_list(extra) || bad(":__args__ must be a list", extra),
         {:ok, runtime} <- runtime_opts(runtime),
         {:ok, encoded_args} <- encode_args(args ++ extra),
         {:ok, encoded_kwargs} <- encode_kwargs(kwargs) do
      {:ok,
       %{
         args: encoded_args,
         kwargs: encoded_kwargs,
         kwargs?: kwargs != [],
         refs:
           for(value <- args ++ extra ++ Keyword.values(kwargs), is_struct(value, Ref), do: value),
         pool: Keyword.get(runtime, :pool) || Pool.default_name(),
         worker: Keyword.get(runtime, :worker),
         timeout: Keyword.get(runtime, :timeout),
         session: Keyword.get(runtime, :session)
       }}
    end
  end

  defp context(args, opts) when is_list(args), do: bad("options must be a keyword list", opts)
  defp context(args, _opts), do: bad("positional arguments must be a list", args)

  defp runtime_opts(runtime) do
    cond do
      not Keyword.keyword?(runtime) ->
        bad(":__runtime__ must be a keyword list", runtime)

      (unknown = Keyword.keys(runtime) -- @runtime_keys) != [] ->
        bad(
          "unknown :__runtime__ options #{inspect(unknown)} (known: #{inspect(@runtime_keys)})",
          runtime
        )

      (pool = runtime[:pool]) != nil and not is_atom(pool) ->
        bad(":__runtime__ pool must be an atom", pool)

      (timeout = runtime[:timeout]) != nil and
          not ((is_integer(timeout) and timeout >= 0) or timeout == :infinity) ->
        bad(":__runtime__ timeout must be a non-negative integer (ms) or :infinity", timeout)

      (session = runtime[:session]) != nil and not is_binary(session) ->
        bad(":__runtime__ session must be a string", session)

      (worker = runtime[:worker]) != nil and
          not ((is_integer(worker) and worker >= 0) or is_struct(worker, Ref) or is_pid(worker)) ->
        bad(":__runtime__ worker must be an index, a ref or a pid", worker)

      true ->
        {:ok, runtime}
    end
  end

  defp encode_args([]), do: {:ok, ""}
  defp encode_args(args), do: Msgpack.encode(args)

  defp encode_kwargs([]), do: {:ok, ""}

  defp encode_kwargs(kwargs) do
    kwargs
    |> Map.new(fn {key, value} -> {Atom.to_string(key), value} end)
    |> Msgpack.encode()
  end

  defp no_kwargs(%{kwargs?: false}, _function), do: :ok

  defp no_kwargs(_ctx, function) do
    bad("#{function} takes no Python keyword arguments, only :__runtime__", nil)
  end

  defp check_name(name, _what) when is_binary(name) and name != "", do: :ok
  defp check_name(name, what), do: bad("the #{what} must be a non-empty string", name)

  defp all_refs(refs) do
    case Enum.reject(refs, &is_struct(&1, Ref)) do
      [] -> :ok
      [other | _] -> bad("release/2 needs refs", other)
    end
  end

  ## Placement -----------------------------------------------------------------

  # A target: the pool and the worker pid (and, for a ref, its session).
  defp place(%{worker: %Ref{} = ref} = ctx), do: ref_target(ref, ctx)
  defp place(%{worker: index, pool: pool}) when is_integer(index), do: target(pool, index)

  defp place(%{worker: pid, pool: pool}) when is_pid(pid) do
    case Pool.index_of(pool, pid) do
      {:ok, _index} -> {:ok, %{pool: pool, worker: pid}}
      :error -> bad("#{inspect(pid)} is not a running worker of pool #{inspect(pool)}", pid)
    end
  end

  defp place(%{refs: [%Ref{worker: pid} = ref | _]} = ctx) when is_pid(pid),
    do: ref_target(ref, ctx)

  defp place(%{pool: pool}) do
    with {:ok, pid} <- Pool.next_worker(pool),
         do: {:ok, %{pool: pool, worker: pid}}
  end

  defp target(pool, index) do
    with {:ok, pid} <- Pool.worker(pool, index),
         do: {:ok, %{pool: pool, worker: pid}}
  end

  defp ref_target(%Ref{worker: pid, pool: ref_pool} = ref, ctx) when is_pid(pid) do
    pool = ref_pool || ctx.pool

    case Pool.index_of(pool, pid) do
      {:ok, _index} ->
        {:ok, %{pool: pool, worker: pid, session: ref.session}}

      :error ->
        {:error, stale(ref, pool)}
    end
  end

  defp ref_target(%Ref{} = ref, _ctx) do
    bad(
      "#{describe_ref(ref)} names no worker (refs come from the runtime; do not build them by hand)",
      ref
    )
  end

  defp ref_target(other, _ctx), do: bad("expected a %VllmBridge.Ref{}", other)

  defp stale(ref, pool) do
    Error.new(
      :stale_ref,
      "stale ref: #{describe_ref(ref)} was held by worker #{inspect(ref.worker)}, which is no " <>
        "longer running in pool #{inspect(pool)}; the object died with it",
      details: %{handle: ref.id, class: ref.class, worker: ref.worker, pool: pool}
    )
  end

  defp describe_ref(%Ref{class: "", id: id}), do: "handle #{id}"
  defp describe_ref(%Ref{class: class, id: id}), do: "#{class} handle #{id}"

  ## Requests ------------------------------------------------------------------

  defp run(target, ctx, op) do
    with {:ok, session, id, frame, timeout} <- prepare(target, ctx, op) do
      target.worker
      |> Worker.request(id, frame, timeout)
      |> finish(target, session, id)
    end
  end

  # Requests to several workers, in flight together; sums integer results.
  defp run_many(jobs) do
    jobs
    |> Enum.map(fn
      {:error, _} = error ->
        error

      {target, ctx, op} ->
        with {:ok, session, id, frame, timeout} <- prepare(target, ctx, op) do
          {target, session, id, timeout, Worker.send_request(target.worker, id, frame)}
        end
    end)
    |> Enum.map(fn
      {:error, _} = error ->
        error

      {target, session, id, timeout, request} ->
        request |> Worker.await(timeout) |> finish(target, session, id)
    end)
    |> Enum.reduce({:ok, 0}, fn
      {:ok, count}, {:ok, total} when is_integer(count) -> {:ok, total + count}
      {:ok, _other}, acc -> acc
      {:error, _} = error, {:ok, _} -> error
      _, error -> error
    end)
  end

  defp prepare(target, ctx, op) do
    session = ctx.session || Map.get(target, :session) || ""
    id = Worker.new_id()

    with {:ok, timeout} <- call_timeout(ctx, target.pool),
         {:ok, frame} <- Proto.encode_request(%{id: id, session: session, op: op}) do
      {:ok, session, id, frame, timeout}
    end
  end

  defp call_timeout(%{timeout: nil}, pool), do: Pool.timeout(pool)
  defp call_timeout(%{timeout: timeout}, _pool), do: {:ok, timeout}

  defp finish({:ok, reply}, target, session, id) do
    case Proto.decode_reply(reply) do
      {:ok, %{id: ^id, result: {:value, value}}} ->
        Msgpack.decode(value, ref: [pool: target.pool, worker: target.worker, session: session])

      {:ok, %{id: ^id, result: {:error, error}}} ->
        {:error, Error.from_reply(error)}

      {:ok, %{id: other}} ->
        {:error, Error.new(:protocol, "reply id #{other} does not match request id #{id}")}

      {:error, _} = error ->
        error
    end
  end

  defp finish({:error, _} = error, _target, _session, _id), do: error

  defp bad(message, term) do
    {:error, Error.new(:bad_args, message, details: %{term: term})}
  end
end
