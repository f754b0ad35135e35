defmodule VllmBridge.Ref do
  @moduledoc """
  A reference to one live Python object held by one worker.

  Results that cannot cross the wire as values (a `StatelessProcessGroup`, a
  store, a socket) come back as refs. On the wire a ref is only
  `{id, class}` (msgpack extension 2); when the runtime decodes a reply it
  stamps the ref with where the object lives:

    * `:id` - the worker's handle number
    * `:class` - the Python class name (informative; may be `""`)
    * `:pool` - the name of the `VllmBridge.Pool` that holds the worker
    * `:worker` - the pid of the `VllmBridge.Worker` that holds the object
    * `:index` - that worker's place in the pool (so that checking it is still
      there is one registry lookup)
    * `:session` - the session that owns the handle

  Calls on a ref always go to `:worker`. When that worker has died (and
  perhaps been replaced by a fresh one at the same place in the pool) the
  object is gone, and calls return an error of category `:stale_ref` instead
  of being sent elsewhere.

  ## Refs across nodes

  A ref is an ordinary term: it can be sent to, stored on, or returned from
  another node of an Erlang cluster. Its `:worker` pid says which node holds
  the object (`node/1` here), and `:pool` is the pool's name on that node.
  `VllmBridge.Runtime` runs a call on a ref held by another node on that
  node (the stale-ref check included), so the same ref works from anywhere
  in the cluster; when that node is down or unreachable the call returns a
  `:worker` error naming it.

  Treat refs as opaque: pass them back to `VllmBridge.Runtime` (or the
  generated `Vllm.*` modules) and do not build them by hand outside tests.
  """

  @enforce_keys [:id]
  defstruct id: nil, class: "", pool: nil, worker: nil, session: "", index: nil

  @type t :: %__MODULE__{
          id: non_neg_integer(),
          class: String.t(),
          pool: atom() | nil,
          worker: pid() | nil,
          session: String.t(),
          index: non_neg_integer() | nil
        }

  @doc """
  Builds a ref from a handle id and class name, with `fields` (a keyword list
  or map of `:pool`, `:worker`, `:session`) stamped on it. Unknown fields are
  ignored.

  ## Examples

      iex> VllmBridge.Ref.new(7, "StatelessProcessGroup", session: "s1")
      %VllmBridge.Ref{id: 7, class: "StatelessProcessGroup", session: "s1"}
  """
  @spec new(non_neg_integer(), String.t(), keyword() | map()) :: t()
  def new(id, class, fields \\ []) when is_integer(id) and id >= 0 and is_binary(class) do
    stamp(%__MODULE__{id: id, class: class}, fields)
  end

  @doc """
  Whether `term` is a ref as the runtime makes them: a `%VllmBridge.Ref{}`
  with every field, each of its type. A map that only claims to be a ref
  (its `__struct__` set by hand, a field missing or of another type) is not,
  and the runtime refuses it with a `:bad_args` error wherever it meets one.

  ## Examples

      iex> VllmBridge.Ref.well_formed?(VllmBridge.Ref.new(7, "Store", session: "s1"))
      true

      iex> VllmBridge.Ref.well_formed?(%{__struct__: VllmBridge.Ref, id: 7})
      false
  """
  @spec well_formed?(term()) :: boolean()
  def well_formed?(%__MODULE__{
        id: id,
        class: class,
        pool: pool,
        worker: worker,
        session: session,
        index: index
      })
      when is_integer(id) and id >= 0 and id <= 0xFFFF_FFFF_FFFF_FFFF and is_binary(class) and
             is_atom(pool) and (is_pid(worker) or is_nil(worker)) and is_binary(session) and
             (is_nil(index) or (is_integer(index) and index >= 0)),
      do: true

  def well_formed?(_term), do: false

  @doc """
  The node that holds the object: the node of the ref's worker, or `nil` for
  a ref that names no worker.

  ## Examples

      iex> VllmBridge.Ref.node(VllmBridge.Ref.new(7, "Store", worker: self()))
      node()

      iex> VllmBridge.Ref.node(VllmBridge.Ref.new(7, "Store"))
      nil
  """
  @spec node(t()) :: node() | nil
  def node(%__MODULE__{worker: pid}) when is_pid(pid), do: Kernel.node(pid)
  def node(%__MODULE__{}), do: nil

  @doc """
  Whether the object lives on this node (its worker is a local pid).
  """
  @spec local?(t()) :: boolean()
  def local?(%__MODULE__{worker: pid}) when is_pid(pid), do: Kernel.node(pid) == Kernel.node()
  def local?(%__MODULE__{}), do: false

  @doc """
  Stamps `fields` (`:pool`, `:worker`, `:session`, `:index`, as a keyword
  list or map) on `ref`; other keys are ignored.
  """
  @spec stamp(t(), keyword() | map() | nil) :: t()
  def stamp(%__MODULE__{} = ref, nil), do: ref

  def stamp(%__MODULE__{} = ref, fields) when is_list(fields) or is_map(fields) do
    Enum.reduce(fields, ref, fn
      {:pool, pool}, acc -> %{acc | pool: pool}
      {:worker, worker}, acc -> %{acc | worker: worker}
      {:session, session}, acc -> %{acc | session: session}
      {:index, index}, acc -> %{acc | index: index}
      _, acc -> acc
    end)
  end
end
