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
      generated modules put their `args`, the optional positional
      parameters, there); a keyword list there is taken as options, before
      the others (so `SPG.barrier(group, timeout: 10)` passes `timeout=10`)
    * `:__runtime__` - how to run the call, a keyword list of:
      * `:pool` - the `VllmBridge.Pool` (default `VllmBridge.DefaultPool`),
        or `{pool, node}` for a pool of another node (same as `node:`)
      * `:node` - the node whose pool runs a constructor or function
        (default: this node; see "Across nodes")
      * `:worker` - where to run a constructor or function: a worker index,
        a worker pid, or a `VllmBridge.Ref` (run next to that object).
        Default: the worker of the first ref among the top-level arguments,
        else round-robin
      * `:timeout` - ms to wait for the reply (default: the pool's `:timeout`).
        The worker is told too (the request's `deadline_ms`): a call whose
        turn comes after it is not run, and a wait in Python (a `recv_obj`, a
        barrier) gives up at it instead of running on; see "Timeouts" in
        `docs/guide-elixir.md`
      * `:session` - the session that owns created handles and may use them
        (default `""`, the worker's default session; calls on a ref default
        to the ref's session)
      * `:owner` - the process whose refs the results are: they are released
        when it exits (see "Lifetime" in `VllmBridge.Ref`). A pid, a
        registered name, or `:none` (refs that live until released). Default:
        the calling process, or inside a `Task` the process that started it;
        in a session other than `""`, `:none`

  Values cross the bridge as described in `VllmBridge.Msgpack`; results that
  cannot (a process group, a store) come back as `%VllmBridge.Ref{}`s stamped
  with their pool, worker, session and owner.

  ## Placement and stale refs

  An object lives in one worker's Python process, so a call on a ref goes to
  the worker pid the ref carries, never elsewhere. When that worker has died
  (its Python process went with it, and the pool may have started a fresh one
  at the same index), the call returns an error of category `:stale_ref`
  without sending anything.

  ## Across nodes

  A pool on another node of an Erlang cluster is used like a local one; the
  control plane is Erlang distribution, nothing else:

      # a constructor or function on node b's pool
      {:ok, group} =
        Vllm.Distributed.StatelessProcessGroup.create(nil, host, port, 2, 4, [],
          __runtime__: [pool: MyApp.Ranks, node: :"b@10.0.0.2", worker: 0]
        )

      # calls on the ref go back to node b by themselves
      {:ok, 2} = Vllm.Distributed.StatelessProcessGroup.rank(group)

  When the placement names a worker on another node (a ref whose `:worker`
  pid is remote, `worker:` a remote pid or ref, a ref among the arguments, or
  `node:` / `pool: {pool, node}`), the whole call runs there:
  `:erpc.call(node, VllmBridge.Runtime, fun, args, timeout)` with the same
  arguments and options. Placement, the stale-ref check, encoding and the
  reply's decoding all happen on the node that owns the worker, and the refs
  that come back keep their remote worker pid, so later calls on them route
  back. Calls on local refs take the same path as before (one `node/1`
  comparison more).

  Precedence: a `worker:` ref or pid, and otherwise (when `worker:` is not
  given) a ref among the arguments, decide the node by themselves, since the
  object lives there; `node:` applies to `worker:` indexes and round-robin.
  `release/2` splits its refs by node; `release_session/2` and `describe/1`
  run on the `node:` given.

  Failures of the remote call are data too: a node that is down or
  unreachable gives a `:worker` error, a call that outlives its `timeout:`
  (plus 5 s of slack for the network) a `:timeout` error,
  both naming the node. Without `timeout:`, the remote node applies its
  pool's default timeout, and a node that dies is noticed by the connection
  (at once when its host closes it, else after the distribution tick time).
  The remote node must run the `:vllm_bridge` application (same version) and
  the pool the call names. See `docs/deploy.md` for a real multi-machine set-up.

  ## Results

  Every function returns `{:ok, value}` or `{:error, %VllmBridge.Error{}}`
  and never raises: bad arguments or options are `:bad_args` errors, Python
  exceptions are `:python` errors with `python_type` and `python_traceback`,
  and the worker keeps serving after every error.
  """

  alias VllmBridge.{Error, Msgpack, Pool, Proto, Ref, Telemetry, Tensor, Worker}
  alias VllmBridge.Runtime.Options

  # Slack added to a caller's timeout for a call forwarded to another node, so
  # that the remote node's own :timeout error normally arrives first.
  @remote_margin 5_000

  # The worker's deadline is the caller's timeout less this much (at most; a
  # twentieth of short timeouts): the worker gives up first, so its own
  # :timeout reply, which names what it waited for, normally arrives in time,
  # and a wait that gave up has taken nothing, rather than giving up just after
  # the caller stopped waiting. 25 ms was too little on a busy 2-core machine:
  # the reply of a wait that gave up landed 2 to 28 ms after it, now and then
  # after the caller's own timer.
  @deadline_margin 250

  # The steps every call takes, compiled into their callers instead of called
  # one from the next (each call is a reduction of the calling process).
  @compile {:inline,
            run: 3,
            send_op: 3,
            prepare: 3,
            finish: 5,
            owner: 2,
            caller: 0,
            gone: 2,
            deadline_ms: 1,
            check_name: 2,
            no_kwargs: 2,
            encode: 2,
            encode_args: 1,
            encode_kwargs: 1,
            check_refs: 2,
            check_kwarg_refs: 2,
            first_ref: 2,
            worker_target: 5}

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
         {:ok, ctx} <- Options.parse(args, opts),
         {:ok, target} <- place(ctx),
         {:ok, ctx} <- encode(ctx, target) do
      run(target, ctx, {:create, %{class_name: class_name, args: ctx.args, kwargs: ctx.kwargs}})
    else
      {:remote, node, timeout} ->
        remote(node, :call_class, [class_name, args, owned(opts, "")], timeout)

      {:error, _} = error ->
        error
    end
  end

  @doc """
  Calls an exported method on the object `ref` names,
  `obj.method(*args, **kwargs)`, in the worker that holds it.
  """
  @spec call_method(Ref.t(), String.t(), args(), opts()) :: result()
  def call_method(ref, method, args \\ [], opts \\ []) do
    with :ok <- check_name(method, "method name"),
         {:ok, ctx} <- Options.parse(args, opts),
         {:ok, target} <- ref_target(ref, ctx),
         {:ok, ctx} <- encode(ctx, target) do
      run(
        target,
        ctx,
        {:call, %{handle: ref.id, method: method, args: ctx.args, kwargs: ctx.kwargs}}
      )
    else
      {:remote, node, timeout} ->
        remote(node, :call_method, [ref, method, args, owned(opts, ref.session)], timeout)

      {:error, _} = error ->
        error
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
         {:ok, ctx} <- Options.parse(args, opts),
         {:ok, target} <- place(ctx),
         {:ok, ctx} <- encode(ctx, target) do
      run(target, ctx, {:call_function, %{function: name, args: ctx.args, kwargs: ctx.kwargs}})
    else
      {:remote, node, timeout} ->
        remote(node, :call_function, [name, args, owned(opts, "")], timeout)

      {:error, _} = error ->
        error
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
    cond do
      not Ref.well_formed?(ref) ->
        not_a_ref(ref)

      not Keyword.keyword?(opts) ->
        bad("options must be a keyword list", opts)

      true ->
        {runtime, opts} = Keyword.pop(opts, :__runtime__, [])

        if Keyword.keyword?(runtime) do
          runtime = Keyword.update(runtime, :worker, ref, &(&1 || ref))
          call_function(name, args, [{:__runtime__, runtime} | opts])
        else
          bad(":__runtime__ must be a keyword list", runtime)
        end
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
         {:ok, ctx} <- Options.parse([], opts),
         :ok <- no_kwargs(ctx, "get_attr/3"),
         {:ok, target} <- ref_target(ref, ctx) do
      run(target, ctx, {:get_attr, %{handle: ref.id, name: name}})
    else
      {:remote, node, timeout} ->
        remote(node, :get_attr, [ref, name, owned(opts, ref.session)], timeout)

      {:error, _} = error ->
        error
    end
  end

  @doc """
  Releases one ref or a list of refs: their workers forget the objects.

  Returns the number of objects freed: an object that another ref still holds
  (see "Lifetime" in `VllmBridge.Ref`) lives on and is not counted. Refs whose
  worker is gone count as 0 (their objects are gone already); releasing a ref
  twice is harmless.
  Refs held on other nodes are released there (one remote call per node, in
  flight together); refs on a node that is down or unreachable count as 0
  too, since nothing can reach their objects any more. Only `:__runtime__`
  `timeout:` applies.
  """
  @spec release(Ref.t() | [Ref.t()], opts()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def release(refs, opts \\ [])
  def release(%Ref{} = ref, opts), do: release([ref], opts)

  def release(refs, opts) when is_list(refs) do
    with :ok <- all_refs(refs),
         {:ok, ctx} <- Options.parse_plain(opts, "release/2") do
      {local, remote} =
        Enum.split_with(refs, &(not is_pid(&1.worker) or node(&1.worker) == node()))

      requests = release_remote(remote, opts)

      local
      |> Enum.group_by(&{&1.pool || ctx.pool, &1.worker, &1.session})
      |> Enum.flat_map(fn {{pool, _worker, session}, group} ->
        ref = hd(group)

        case ref_target(%{ref | pool: pool}, %{ctx | session: nil}) do
          {:ok, target} ->
            # A ref with an owner gives back its owner's holds, as many as the
            # worker counted for it (none when given back already); one without
            # gives back one. A request names at most Proto.max_repeated/0
            # handles (the worker's bound on a repeated field): more go in
            # several, counted together.
            free = for %Ref{owner: nil, id: id} <- group, uniq: true, do: id

            owned =
              for %Ref{owner: pid, id: id} when is_pid(pid) <- group, uniq: true, do: {pid, id}

            handles = free ++ Worker.disown(target.worker, session, owned)

            for handles <- Enum.chunk_every(handles, Proto.max_repeated()),
                do: {target, %{ctx | session: session}, {:release, %{handles: handles}}}

          {:error, %Error{category: :stale_ref}} ->
            []

          {:error, _} = error ->
            [error]
        end
      end)
      |> run_many()
      |> add_remote_counts(requests, ctx.timeout)
    end
  end

  def release(other, _opts), do: bad("release/2 needs a ref or a list of refs", other)

  @doc """
  Releases every handle owned by `session` in every worker of the pool
  (of the `:__runtime__` `node:`, default this node). Returns the number of
  objects freed.
  """
  @spec release_session(String.t(), opts()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def release_session(session, opts \\ [])

  def release_session(session, opts) when is_binary(session) do
    with {:ok, ctx} <- Options.parse_plain(opts, "release_session/2"),
         :ok <- local_node(ctx),
         {:ok, timeout} <- Pool.timeout(ctx.pool),
         {:ok, workers} <- Pool.workers(ctx.pool) do
      ctx = %{ctx | session: session}

      workers
      |> Enum.map(fn {index, pid} ->
        # (a worker gone since the lookup: its pid, which answers :worker)
        via =
          case Pool.route(ctx.pool, {index, pid}) do
            {:ok, _index, _pid, via, _timeout} -> via
            {:error, _} -> pid
          end

        target = worker_target(ctx.pool, nil, pid, via, timeout)
        {target, ctx, {:release_session, %{}}}
      end)
      |> run_many()
    else
      {:remote, node, timeout} -> remote(node, :release_session, [session, opts], timeout)
      {:error, _} = error -> error
    end
  end

  def release_session(other, _opts), do: bad("a session must be a string", other)

  @doc """
  The export table of a worker: its classes, functions, methods and
  attributes, with signatures and docstrings.
  """
  @spec describe(opts()) :: {:ok, map()} | {:error, Error.t()}
  def describe(opts \\ []) do
    with {:ok, ctx} <- Options.parse_plain(opts, "describe/1"),
         {:ok, target} <- place(ctx) do
      run(target, ctx, {:describe, %{}})
    else
      {:remote, node, timeout} -> remote(node, :describe, [opts], timeout)
      {:error, _} = error -> error
    end
  end

  @doc """
  Sends `term` to a worker and returns what comes back: the same term, for
  every term the bridge can carry (a round trip through Python's codec).

  `ping/2`, `describe/1`, `release/2` and `release_session/2` pass no Python
  keyword arguments, so their options are the runtime options, given plainly
  (`Runtime.ping(:x, pool: MyPool, timeout: 5_000)`) or under `:__runtime__`.
  """
  @spec ping(term(), opts()) :: result()
  def ping(term, opts \\ []) do
    with {:ok, ctx} <- Options.parse_plain(opts, "ping/2"),
         {:ok, payload} <- Msgpack.encode(term),
         {:ok, target} <- place(ctx) do
      run(target, ctx, {:ping, %{payload: payload}})
    else
      {:remote, node, timeout} -> remote(node, :ping, [term, owned(opts, "", :plain)], timeout)
      {:error, _} = error -> error
    end
  end

  ## Options -------------------------------------------------------------------

  # Encodes the positional and keyword arguments, once the call is known to
  # run on this node, in `target`'s worker.
  defp encode(ctx, target) do
    with :ok <- check_refs(ctx.args, target),
         :ok <- check_kwarg_refs(ctx.kwargs, target),
         {:ok, args} <- encode_args(ctx.args),
         {:ok, kwargs} <- encode_kwargs(ctx.kwargs) do
      {:ok, %{ctx | args: args, kwargs: kwargs}}
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

  defp all_refs([ref | rest]) do
    cond do
      Ref.well_formed?(ref) -> all_refs(rest)
      is_struct(ref, Ref) -> not_a_ref(ref)
      true -> bad("release/2 needs refs", ref)
    end
  end

  defp all_refs([]), do: :ok
  defp all_refs(tail), do: bad("release/2 needs a proper list of refs", tail)

  ## Placement -----------------------------------------------------------------

  # A target: the pool and the worker pid (and, for a ref, its session); or
  # {:remote, node, timeout} when the call must run on another node.
  defp place(%{worker: %Ref{} = ref} = ctx), do: ref_target(ref, ctx)

  defp place(%{worker: pid} = ctx) when is_pid(pid) and node(pid) != node(),
    do: {:remote, node(pid), ctx.timeout}

  defp place(%{worker: pid, pool: pool}) when is_pid(pid) do
    case Pool.route(pool, pid) do
      {:ok, index, pid, via, timeout} -> {:ok, worker_target(pool, index, pid, via, timeout)}
      {:error, _} -> bad("#{inspect(pid)} is not a running worker of pool #{inspect(pool)}", pid)
    end
  end

  defp place(%{worker: nil} = ctx) do
    case first_ref(ctx.args, ctx.kwargs) do
      %Ref{worker: pid} = ref when is_pid(pid) -> ref_target(ref, ctx)
      _ -> place_in_pool(ctx)
    end
  end

  defp place(ctx), do: place_in_pool(ctx)

  defp place_in_pool(%{node: on} = ctx) when on != nil and on != node(),
    do: {:remote, on, ctx.timeout}

  defp place_in_pool(%{worker: index, pool: pool}) when is_integer(index) do
    with {:ok, index, pid, via, timeout} <- Pool.route(pool, index),
         do: {:ok, worker_target(pool, index, pid, via, timeout)}
  end

  defp place_in_pool(%{pool: pool}) do
    with {:ok, index, pid, via, timeout} <- Pool.route(pool, :next),
         do: {:ok, worker_target(pool, index, pid, via, timeout)}
  end

  # via: the worker's channel (see VllmBridge.Worker), or its pid in the moment
  # before it has published one; timeout: the pool's default.
  defp worker_target(pool, index, pid, via, timeout),
    do: %{pool: pool, worker: pid, index: index, session: nil, via: via, timeout: timeout}

  # The first ref among the top-level arguments, then the keyword arguments.
  defp first_ref([], []), do: nil
  defp first_ref(args, kwargs), do: find_ref(args, kwargs)

  defp find_ref([%Ref{} = ref | _], _kwargs), do: ref
  defp find_ref([_ | rest], kwargs), do: find_ref(rest, kwargs)
  defp find_ref([], [{_key, %Ref{} = ref} | _]), do: ref
  defp find_ref([], [_ | rest]), do: find_ref([], rest)
  defp find_ref([], []), do: nil

  # A ref given as the call's object or placement: checked whole first, since a
  # map that only claims to be a ref may lack any field read below.
  defp ref_target(ref, ctx) do
    if Ref.well_formed?(ref), do: locate(ref, ctx), else: not_a_ref(ref)
  end

  defp locate(%Ref{worker: pid}, ctx) when is_pid(pid) and node(pid) != node(),
    do: {:remote, node(pid), ctx.timeout}

  defp locate(%Ref{worker: pid, pool: ref_pool, index: index} = ref, ctx)
       when is_pid(pid) do
    pool = ref_pool || ctx.pool

    # A ref the runtime stamped knows its worker's index: one registry lookup
    # tells whether that worker still runs there (a search by pid costs ~3 us)
    # and gives the way in to it (its channel, see VllmBridge.Worker).
    found =
      Pool.route(pool, if(is_integer(index) and ref_pool != nil, do: {index, pid}, else: pid))

    case found do
      {:ok, index, _pid, via, timeout} ->
        {:ok,
         %{
           pool: pool,
           worker: pid,
           index: index,
           session: ref.session,
           via: via,
           timeout: timeout,
           ref: ref
         }}

      {:error, _} ->
        {:error, stale(ref, pool)}
    end
  end

  defp locate(%Ref{} = ref, _ctx) do
    bad(
      "#{describe_ref(ref)} names no worker (refs come from the runtime; do not build them by hand)",
      ref
    )
  end

  defp not_a_ref(%Ref{} = ref) do
    bad(
      "not a well-formed %VllmBridge.Ref{}: a field is missing or of the wrong type " <>
        "(refs come from the runtime; do not build them by hand)",
      ref
    )
  end

  defp not_a_ref(other), do: bad("expected a %VllmBridge.Ref{}", other)

  defp stale(ref, pool) do
    Error.new(
      :stale_ref,
      "stale ref: #{describe_ref(ref)} was held by worker #{inspect(ref.worker)}, which is no " <>
        "longer running in pool #{inspect(pool)}; the object died with it",
      details: %{handle: ref.id, class: ref.class, worker: ref.worker, pool: pool}
    )
  end

  # A ref crosses the wire as a bare handle id, which names an object only in
  # the worker that made it: every ref among the arguments (nested in lists,
  # maps and tuples too) must live in the worker the call runs on, or the call
  # would reach another object there.
  # (Lists may be improper here: the encoder refuses them later with a clear error.)
  defp check_refs([], _target), do: :ok
  defp check_refs(args, target), do: check_list(args, target)

  defp check_kwarg_refs([], _target), do: :ok
  defp check_kwarg_refs(kwargs, target), do: check_kwarg_list(kwargs, target)

  # (a number, string or atom holds no ref: the next element without a call)
  defp check_list([head | tail], target)
       when is_number(head) or is_binary(head) or is_atom(head),
       do: check_list(tail, target)

  defp check_list([head | tail], target) do
    case check_ref(head, target) do
      :ok -> check_list(tail, target)
      error -> error
    end
  end

  defp check_list(_tail, _target), do: :ok

  defp check_kwarg_list([{_key, value} | rest], target) do
    case check_ref(value, target) do
      :ok -> check_kwarg_list(rest, target)
      error -> error
    end
  end

  defp check_kwarg_list([], _target), do: :ok

  defp check_ref(%Ref{} = ref, target) do
    cond do
      not Ref.well_formed?(ref) -> not_a_ref(ref)
      ref.worker == target.worker -> :ok
      true -> foreign_ref(ref, target)
    end
  end

  defp check_ref(%Tensor{}, _target), do: :ok
  defp check_ref(%_{}, _target), do: :ok
  defp check_ref([_ | _] = list, target), do: check_list(list, target)
  defp check_ref(map, target) when is_map(map), do: check_list(Map.to_list(map), target)
  defp check_ref(tuple, target) when is_tuple(tuple), do: check_list(Tuple.to_list(tuple), target)
  defp check_ref(_other, _target), do: :ok

  # A ref of another worker among the arguments: a mistake while that worker
  # runs, a stale ref once it is gone.
  defp foreign_ref(ref, target) do
    pool = ref.pool || target.pool

    if is_pid(ref.worker) and match?({:ok, _, _, _, _}, Pool.route(pool, ref.worker)) do
      bad(
        "#{describe_ref(ref)} lives in worker #{inspect(ref.worker)}, but this call runs in " <>
          "worker #{inspect(target.worker)}: pass refs only to calls on their own worker",
        ref
      )
    else
      {:error, stale(ref, pool)}
    end
  end

  # release_session/2 runs where node: says.
  defp local_node(%{node: on} = ctx) when on != nil and on != node(),
    do: {:remote, on, ctx.timeout}

  defp local_node(_ctx), do: :ok

  defp describe_ref(%Ref{class: "", id: id}), do: "handle #{id}"
  defp describe_ref(%Ref{class: class, id: id}), do: "#{class} handle #{id}"

  ## Other nodes ---------------------------------------------------------------

  # The options of a call that runs on another node, with the owner of its
  # refs decided here when it is the default one (the process that runs the
  # call there exits at once): the caller, for calls in the default session
  # (`session`, or a ref's) that name no owner and no other session.
  defp owned(opts, session, plain \\ nil) do
    runtime = Keyword.get(opts, :__runtime__, [])
    named = if plain, do: opts ++ runtime, else: runtime

    if session != "" or Keyword.has_key?(named, :owner) or Keyword.has_key?(named, :session),
      do: opts,
      else: [{:__runtime__, [{:owner, caller()} | runtime]} | Keyword.delete(opts, :__runtime__)]
  end

  # Runs the same public function on `node`, where the call is local.
  defp remote(node, fun, args, timeout) do
    :erpc.call(node, __MODULE__, fun, args, remote_timeout(timeout))
    |> on_node(node)
  catch
    kind, reason -> {:error, remote_error(kind, reason, node, fun, timeout)}
  end

  defp remote_timeout(nil), do: :infinity
  defp remote_timeout(:infinity), do: :infinity
  defp remote_timeout(ms), do: ms + @remote_margin

  # The errors the runtime adds (not those a Python worker sent) name the node.
  defp on_node({:error, %Error{category: category} = error}, node)
       when category in [:worker, :timeout, :stale_ref] do
    {:error,
     %{
       error
       | message: "#{error.message} (on node #{inspect(node)})",
         details: Map.put(error.details, :node, node)
     }}
  end

  defp on_node(result, _node), do: result

  defp remote_error(:error, {:erpc, :noconnection}, node, fun, _timeout) do
    Error.new(
      :worker,
      "node #{inspect(node)} is down or unreachable (no Erlang distribution connection); " <>
        "#{fun} was not run, and the objects of that node's workers are out of reach",
      details: %{node: node, function: fun}
    )
  end

  defp remote_error(:error, {:erpc, :timeout}, node, fun, timeout) do
    Error.new(
      :timeout,
      "no reply from node #{inspect(node)} to #{fun} within #{timeout} ms " <>
        "(+#{@remote_margin} ms network slack); the call may still be running there",
      details: %{node: node, function: fun, timeout: timeout}
    )
  end

  defp remote_error(:error, {:exception, :undef, [{__MODULE__, fun, _, _} | _]}, node, fun, _) do
    Error.new(
      :worker,
      "VllmBridge.Runtime.#{fun} is not loaded on node #{inspect(node)}: run the same " <>
        ":vllm_bridge version there",
      details: %{node: node, function: fun}
    )
  end

  defp remote_error(kind, reason, node, fun, _timeout) do
    reason =
      case {kind, reason} do
        {:error, {:exception, exception, stack}} -> Exception.format(:error, exception, stack)
        {:exit, {:exception, exit_reason}} -> Exception.format_exit(exit_reason)
        {:exit, {:signal, signal}} -> "killed: " <> Exception.format_exit(signal)
        {:error, {:erpc, erpc}} -> "erpc: #{inspect(erpc)}"
        other -> inspect(other)
      end

    Error.new(:worker, "#{fun} failed on node #{inspect(node)}: #{reason}",
      details: %{node: node, function: fun}
    )
  end

  # release/2 of the refs held on other nodes: one request per node, sent now.
  defp release_remote([], _opts), do: []

  defp release_remote(refs, opts) do
    refs
    |> Enum.group_by(&node(&1.worker))
    |> Enum.map(fn {node, refs} ->
      {node, :erpc.send_request(node, __MODULE__, :release, [refs, opts])}
    end)
  end

  defp add_remote_counts(result, [], _timeout), do: result

  defp add_remote_counts(result, requests, timeout) do
    requests
    |> Enum.map(fn {node, request} ->
      try do
        :erpc.receive_response(request, remote_timeout(timeout)) |> on_node(node)
      catch
        :error, {:erpc, :noconnection} -> {:ok, 0}
        kind, reason -> {:error, remote_error(kind, reason, node, :release, timeout)}
      end
    end)
    |> Enum.reduce(result, fn
      {:ok, count}, {:ok, total} -> {:ok, total + count}
      {:error, _} = error, {:ok, _} -> error
      _, error -> error
    end)
  end

  ## Requests ------------------------------------------------------------------

  # One cached check when telemetry is absent (see VllmBridge.Telemetry).
  defp run(target, ctx, op) do
    if Telemetry.enabled?(),
      do: Telemetry.span_call(call_metadata(target, ctx, op), fn -> send_op(target, ctx, op) end),
      else: send_op(target, ctx, op)
  end

  defp send_op(target, ctx, op) do
    with {:ok, session, owner, id, frame, timeout} <- prepare(target, ctx, op) do
      target.via
      |> Worker.request(id, frame, timeout)
      |> finish(target, session, owner, id)
      |> gone(target)
    end
  end

  # Requests to several workers, in flight together (each written by the
  # caller, as every call is: Worker.send_request/3 is request/4 without the
  # wait); sums integer results. A single request is a plain call.
  defp run_many([{target, ctx, op}]), do: sum(run(target, ctx, op), {:ok, 0})

  defp run_many(jobs) do
    jobs
    |> Enum.map(fn
      {:error, _} = error ->
        error

      {target, ctx, op} ->
        span = if Telemetry.enabled?(), do: call_metadata(target, ctx, op)
        start = if span, do: Telemetry.call_start(span)

        case prepare(target, ctx, op) do
          {:ok, session, owner, id, frame, timeout} ->
            request = Worker.send_request(target.via, id, frame)
            {target, {session, owner}, id, timeout, request, {span, start}}

          {:error, _} = error ->
            if span, do: Telemetry.call_stop(start, span, error), else: error
        end
    end)
    |> Enum.map(fn
      {:error, _} = error ->
        error

      {target, {session, owner}, id, timeout, request, {span, start}} ->
        result = request |> Worker.await(timeout) |> finish(target, session, owner, id)
        if span, do: Telemetry.call_stop(start, span, result), else: result
    end)
    |> Enum.reduce({:ok, 0}, &sum/2)
  end

  defp sum({:ok, count}, {:ok, total}) when is_integer(count), do: {:ok, total + count}
  defp sum({:ok, _other}, acc), do: acc
  defp sum({:error, _} = error, {:ok, _}), do: error
  defp sum(_, error), do: error

  defp prepare(target, ctx, op) do
    session = ctx.session || target.session || ""
    id = Worker.new_id()

    timeout = ctx.timeout || target.timeout
    request = %{id: id, session: session, deadline_ms: deadline_ms(timeout), op: op}

    with {:ok, owner} <- owner(ctx.owner, session),
         {:ok, frame} <- Proto.encode_request(request) do
      {:ok, session, owner, id, frame, timeout}
    end
  end

  # The process whose refs a call's results are (nil: refs that live until
  # released); see "Lifetime" in VllmBridge.Ref.
  defp owner(nil, ""), do: {:ok, caller()}
  defp owner(nil, _session), do: {:ok, nil}
  defp owner(:none, _session), do: {:ok, nil}
  defp owner(pid, _session) when is_pid(pid), do: {:ok, pid}

  defp owner(name, _session) do
    case Process.whereis(name) do
      nil -> bad(":__runtime__ owner #{inspect(name)} is not a registered process", name)
      pid -> {:ok, pid}
    end
  end

  # The calling process, or the process that started the first Task of the
  # chain this one runs in (the last of $callers).
  defp caller do
    case :erlang.get(:"$callers") do
      [_ | _] = callers -> List.last(callers)
      _ -> self()
    end
  end

  # The metadata of a call's telemetry events (see VllmBridge.Telemetry).
  defp call_metadata(target, ctx, op) do
    {operation, name} = operation(op, target)

    %{
      pool: target.pool,
      index: target.index,
      worker: target.worker,
      operation: operation,
      name: name,
      session: ctx.session || target.session || ""
    }
  end

  defp operation({:create, %{class_name: name}}, _target), do: {:call_class, name}

  defp operation({:call, %{method: method}}, %{ref: %Ref{class: class}})
       when is_binary(class) and class != "",
       do: {:call_method, class <> "." <> method}

  defp operation({:call, %{method: method}}, _target), do: {:call_method, method}
  defp operation({:call_function, %{function: name}}, _target), do: {:call_function, name}
  defp operation({:get_attr, %{name: name}}, _target), do: {:get_attr, name}
  defp operation({kind, _}, _target), do: {kind, nil}

  # The request's deadline_ms for a caller's timeout (0: none).
  # (max(ms - min(div(ms, 20), @deadline_margin), 1), by cases.)
  defp deadline_ms(:infinity), do: 0
  defp deadline_ms(ms) when ms >= 20 * @deadline_margin, do: ms - @deadline_margin
  defp deadline_ms(ms) when ms >= 20, do: ms - div(ms, 20)
  defp deadline_ms(ms) when ms > 0, do: ms
  defp deadline_ms(_ms), do: 1

  defp finish({:ok, reply}, target, session, owner, id) do
    case Proto.decode_reply(reply) do
      {:ok, %{id: ^id, result: {:value, value}}} ->
        result =
          Msgpack.decode(value,
            ref: [
              pool: target.pool,
              worker: target.worker,
              session: session,
              index: target.index,
              owner: owner
            ]
          )

        # Each ref handed to an owner is a hold the worker counted: it is given
        # back when the owner exits (or by release/2).
        if owner != nil do
          case Msgpack.take_handed() do
            [] -> :ok
            ids -> Worker.own(target.worker, owner, session, ids)
          end
        end

        result

      {:ok, %{id: ^id, result: {:error, error}}} ->
        {:error, Error.from_reply(error)}

      {:ok, %{id: ^id, result: {:output, _}}} ->
        {:error, Error.new(:protocol, "the reply to request #{id} is an output frame")}

      {:ok, %{id: other}} ->
        {:error, Error.new(:protocol, "reply id #{other} does not match request id #{id}")}

      {:error, _} = error ->
        error
    end
  end

  defp finish({:error, _} = error, _target, _session, _owner, _id), do: error

  # A ref's worker that had died before the call (Pool.route/3 does not ask
  # whether it is alive): the ref is stale, whether or not the pool has
  # replaced the worker yet.
  defp gone(
         {:error, %Error{category: :worker, details: %{reason: :noproc}}},
         %{ref: ref} = target
       ),
       do: {:error, stale(ref, target.pool)}

  defp gone(result, _target), do: result

  defp bad(message, term) do
    {:error, Error.new(:bad_args, message, details: %{term: term})}
  end
end
