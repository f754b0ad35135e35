defmodule VllmBridge.Runtime.Options do
  @moduledoc """
  The arguments and options of a `VllmBridge.Runtime` call, read and checked
  in one pass (see "Arguments and options" there).

  `parse/2` walks the options once, splitting `:__runtime__` and `:__args__`
  from the Python keyword arguments, and walks `:__runtime__` once; as with
  `Keyword.get/2`, the first of a key given twice wins. Invalid options are
  `{:error, %VllmBridge.Error{category: :bad_args}}` naming the option, with
  the offending term in `details.term`. When several options are invalid the
  error names the first in this order: the options list, `:__args__`, the
  `:__runtime__` list, unknown `:__runtime__` keys, then `node`, `pool`,
  `timeout`, `session`, `worker` and `owner`.
  """

  alias VllmBridge.{Error, Pool, Ref}
  alias VllmBridge.Worker.Options, as: WorkerOptions

  @runtime_keys [:pool, :node, :worker, :timeout, :session, :owner]

  # compiled into their callers (every call reads its options)
  @compile {:inline, runtime: 1, put: 3}
  @default_pool Pool.default_name()

  @typedoc """
  A parsed call: the positional arguments (with `:__args__` appended), the
  Python keyword arguments in the order given (and whether there are any),
  and the `:__runtime__` settings, `nil` where not given (`pool` is then the
  default pool; `pool: {name, node}` is `pool: name, node: node`).
  """
  @type t :: %{
          args: [term()],
          kwargs: keyword(),
          kwargs?: boolean(),
          pool: Pool.name(),
          node: node() | nil,
          worker: non_neg_integer() | pid() | Ref.t() | nil,
          timeout: timeout() | nil,
          session: String.t() | nil,
          owner: pid() | atom() | nil
        }

  # A proper list (length/1 fails the guard on an improper one). Argument
  # lists are short; an improper one is refused here, before anything walks it.
  defguardp is_proper(list) when is_list(list) and length(list) >= 0

  @doc """
  Reads a call's positional arguments and options.

  ## Examples

      iex> {:ok, call} = VllmBridge.Runtime.Options.parse([1], store_timeout: 30, __args__: [2])
      iex> {call.args, call.kwargs, call.pool}
      {[1, 2], [store_timeout: 30], VllmBridge.DefaultPool}

      iex> {:error, error} = VllmBridge.Runtime.Options.parse([], __runtime__: [timeout: -1])
      iex> error.message
      ":__runtime__ timeout must be a non-negative integer (ms, at most 4294967295) or :infinity"
  """
  @spec parse(list(), keyword()) :: {:ok, t()} | {:error, Error.t()}
  def parse(args, opts) when is_list(args) do
    case split(opts) do
      # A keyword list where the optional positional arguments go is options
      # (`barrier(group, timeout: 10)`), given before the others.
      {_runtime, [{key, _} | _] = extra, _kwargs} = split when is_atom(key) and is_proper(args) ->
        if Keyword.keyword?(extra),
          do: parse(args, extra ++ drop_args(opts)),
          else: parse_split(args, opts, split)

      split ->
        parse_split(args, opts, split)
    end
  end

  def parse(args, _opts), do: bad("positional arguments must be a list", args)

  defp parse_split(args, opts, split) do
    case split do
      {runtime, extra, kwargs} when is_proper(args) and is_proper(extra) ->
        with {:ok, pool, node, worker, timeout, session, owner} <- runtime(runtime) do
          {:ok,
           %{
             args: if(extra == [], do: args, else: args ++ extra),
             kwargs: kwargs,
             kwargs?: kwargs != [],
             pool: pool,
             node: node,
             worker: worker,
             timeout: timeout,
             session: session,
             owner: owner
           }}
        end

      {_runtime, extra, _kwargs} when is_proper(args) ->
        bad(
          "args (the optional positional arguments, in order) must be a list, or a " <>
            "keyword list of options",
          extra
        )

      {_runtime, _extra, _kwargs} ->
        bad("positional arguments must be a proper list", args)

      :error ->
        bad("options must be a keyword list", opts)
    end
  end

  # opts without its first :__args__ (the one split/1 took).
  defp drop_args([{:__args__, _} | rest]), do: rest
  defp drop_args([other | rest]), do: [other | drop_args(rest)]
  defp drop_args([]), do: []

  @doc """
  Checks the `args` of a generated function whose later optional parameters
  are taken by name only (`names`): parameters that may themselves be lists,
  such as `MessageQueue.broadcast_object/3`'s `obj`. `args` may hold at most
  `max` positional arguments (the parameters before those), or be a keyword
  list of options; anything longer is refused, so that a list meant as the
  value is never read as the argument list.

  ## Examples

      iex> VllmBridge.Runtime.Options.by_name([], 0, ["obj"])
      {:ok, []}

      iex> VllmBridge.Runtime.Options.by_name([obj: [7]], 0, ["obj"])
      {:ok, [obj: [7]]}

      iex> {:error, error} = VllmBridge.Runtime.Options.by_name([7], 0, ["obj"])
      iex> error.message
      "obj is given by name only (obj: value), as a value that is a list would read as the positional arguments: args may hold 0 of them, got [7]"
  """
  @spec by_name(term(), non_neg_integer(), [String.t()]) ::
          {:ok, list()} | {:error, Error.t()}
  def by_name(args, max, names) when is_proper(args) do
    if length(args) <= max or Keyword.keyword?(args) do
      {:ok, args}
    else
      named = Enum.join(names, ", ")
      example = Enum.map_join(names, ", ", &"#{&1}: value")

      bad(
        "#{named} #{if match?([_], names), do: "is", else: "are"} given by name only " <>
          "(#{example}), as a value that is a list would read as the positional " <>
          "arguments: args may hold #{max} of them, got #{inspect(args, charlists: :as_lists)}",
        args
      )
    end
  end

  def by_name(args, _max, _names), do: {:ok, args}

  @doc """
  Reads the options of a call that passes no Python keyword arguments
  (`VllmBridge.Runtime.ping/2`, `describe/1`, `release/2`,
  `release_session/2`, named `function` in errors): its runtime options given
  plainly (`pool: P, timeout: 5_000`), or under `:__runtime__` as every call
  takes them (plain ones first, when both are given).

  ## Examples

      iex> {:ok, call} = VllmBridge.Runtime.Options.parse_plain([timeout: 5_000], "ping/2")
      iex> call.timeout
      5000

      iex> {:error, error} = VllmBridge.Runtime.Options.parse_plain([store_timeout: 5], "ping/2")
      iex> error.message
      "ping/2 takes only runtime options ([:pool, :node, :worker, :timeout, :session, :owner], plainly or under :__runtime__), not [:store_timeout]"
  """
  @spec parse_plain(keyword(), String.t()) :: {:ok, t()} | {:error, Error.t()}
  def parse_plain(opts, function) when is_proper(opts) do
    case Enum.split_with(opts, &match?({key, _} when key in @runtime_keys, &1)) do
      {plain, []} ->
        parse([], __runtime__: plain)

      {plain, [{:__runtime__, runtime}]} when is_proper(runtime) ->
        parse([], __runtime__: plain ++ runtime)

      {_plain, other} ->
        keys = for {key, _} <- other, key != :__runtime__, do: key

        if keys == [] or not Keyword.keyword?(other) do
          bad("options must be a keyword list", opts)
        else
          bad(
            "#{function} takes only runtime options (#{inspect(@runtime_keys)}, plainly or " <>
              "under :__runtime__), not #{inspect(keys)}",
            opts
          )
        end
    end
  end

  def parse_plain(opts, _function), do: bad("options must be a keyword list", opts)

  # {runtime, extra, kwargs}: the first :__runtime__ and :__args__ (the others
  # are dropped, as Keyword.pop/3 does), and the rest in order; :error when
  # opts is not a keyword list. Body-recursive: option lists are short.
  defp split([]), do: {[], [], []}

  defp split([{:__runtime__, runtime} | rest]) do
    with {_, extra, kwargs} <- split(rest), do: {runtime, extra, kwargs}
  end

  defp split([{:__args__, extra} | rest]) do
    with {runtime, _, kwargs} <- split(rest), do: {runtime, extra, kwargs}
  end

  defp split([{key, _} = kwarg | rest]) when is_atom(key) do
    with {runtime, extra, kwargs} <- split(rest), do: {runtime, extra, [kwarg | kwargs]}
  end

  defp split(_other), do: :error

  defp runtime([]), do: {:ok, @default_pool, nil, nil, nil, nil, nil}

  defp runtime(runtime) do
    case walk(runtime) do
      :error ->
        bad(":__runtime__ must be a keyword list", runtime)

      {_pool, _node, _worker, _timeout, _session, _owner, [_ | _] = unknown} ->
        bad(
          "unknown :__runtime__ options #{inspect(unknown)} (known: #{inspect(@runtime_keys)})",
          runtime
        )

      {pool, node, worker, timeout, session, owner, []} ->
        check(pool, node, worker, timeout, session, owner, runtime)
    end
  end

  # {pool, node, worker, timeout, session, owner, unknown keys in order};
  # built from the end, so a key given twice keeps its first value.
  defp walk([]), do: {nil, nil, nil, nil, nil, nil, []}

  defp walk([{key, value} | rest]) when is_atom(key) do
    case walk(rest) do
      :error -> :error
      acc -> put(acc, key, value)
    end
  end

  defp walk(_other), do: :error

  for {key, i} <- Enum.with_index(@runtime_keys, 1) do
    defp put(acc, unquote(key), value), do: :erlang.setelement(unquote(i), acc, value)
  end

  defp put(acc, key, _value), do: :erlang.setelement(7, acc, [key | elem(acc, 6)])

  defp check(pool, node, worker, timeout, session, owner, runtime) do
    cond do
      node != nil and not (is_atom(node) and node != true and node != false) ->
        bad(":__runtime__ node must be a node name (an atom)", node)

      is_tuple(pool) and tuple_size(pool) == 2 ->
        pool_on_node(pool, node, worker, timeout, session, owner, runtime)

      pool != nil and not is_atom(pool) ->
        bad(":__runtime__ pool must be an atom or {pool, node}", pool)

      timeout != nil and not WorkerOptions.timeout?(timeout, 0) ->
        bad(
          ":__runtime__ timeout must be a non-negative integer (ms, at most 4294967295) " <>
            "or :infinity",
          timeout
        )

      session != nil and not is_binary(session) ->
        bad(":__runtime__ session must be a string", session)

      worker != nil and
          not ((is_integer(worker) and worker >= 0) or is_struct(worker, Ref) or is_pid(worker)) ->
        bad(":__runtime__ worker must be an index, a ref or a pid", worker)

      owner != nil and not (is_pid(owner) or (is_atom(owner) and owner not in [true, false])) ->
        bad(":__runtime__ owner must be a pid, a registered name or :none", owner)

      true ->
        {:ok, pool || @default_pool, node, worker, timeout, session, owner}
    end
  end

  # pool: {name, node} is pool: name, node: node (the same checks again).
  defp pool_on_node({name, on} = pool, node, worker, timeout, session, owner, runtime) do
    cond do
      not (is_atom(name) and name != nil and is_atom(on) and on != nil) ->
        bad(":__runtime__ pool must be an atom or {pool, node}", pool)

      node not in [nil, on] ->
        bad(
          ":__runtime__ names two nodes: pool: #{inspect(pool)} and node: #{inspect(node)}",
          runtime
        )

      true ->
        check(name, on, worker, timeout, session, owner, runtime)
    end
  end

  defp bad(message, term) do
    {:error, Error.new(:bad_args, message, details: %{term: term})}
  end
end
