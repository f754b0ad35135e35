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
    * `:owner` - the process whose ref this is (see "Lifetime"), or `nil`
      for a ref that lives until released

  Calls on a ref always go to `:worker`. When that worker has died (and
  perhaps been replaced by a fresh one at the same place in the pool) the
  object is gone, and calls return an error of category `:stale_ref` instead
  of being sent elsewhere.

  ## Lifetime

  A ref belongs to the process that asked for it: when that process exits
  (normally or not), the worker forgets the object, as a port or an ETS table
  goes with its owner. Inside a `Task` the owner is the process that started
  the task (for tasks started by tasks, the process that started the first
  of them: the last of the `$callers` chain), so

      Task.async(fn -> Vllm.Distributed.StatelessProcessGroup.create(host, port, 0, 1) end)
      |> Task.await()

  returns a ref that lives as long as the caller of `Task.async/1`, not as
  long as the task.

  The `:__runtime__` option `owner:` names another owner: a pid, a
  registered name (the process registered under it now), or `:none` for a
  ref that lives until `VllmBridge.Runtime.release/2` or
  `VllmBridge.Runtime.release_session/2`. Refs made in a session other than
  the default one (`session: "..."`) live until released unless `owner:` is
  given too.

  Each ref is counted on its own: when two processes are given the same
  object (both call `get_world_group/0`), it lives until both have released
  their refs or exited. `VllmBridge.Runtime.release/2` releases the ref's
  owner's hold on the object, whichever process calls it; releasing it again
  does nothing.

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
  defstruct id: nil, class: "", pool: nil, worker: nil, session: "", index: nil, owner: nil

  @type t :: %__MODULE__{
          id: non_neg_integer(),
          class: String.t(),
          pool: atom() | nil,
          worker: pid() | nil,
          session: String.t(),
          index: non_neg_integer() | nil,
          owner: pid() | nil
        }

  @doc """
  Builds a ref from a handle id and class name, with `fields` (a keyword list
  or map of `:pool`, `:worker`, `:session`, `:index`, `:owner`) stamped on it. Unknown fields are
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
        index: index,
        owner: owner
      })
      when is_integer(id) and id >= 0 and id <= 0xFFFF_FFFF_FFFF_FFFF and is_binary(class) and
             is_atom(pool) and (is_pid(worker) or is_nil(worker)) and is_binary(session) and
             (is_nil(index) or (is_integer(index) and index >= 0)) and
             (is_pid(owner) or is_nil(owner)),
      do: true

  def well_formed?(_term), do: false

  @doc """
  Whether `a` and `b` name the same object: the same handle in the same
  worker and session. Refs to one object held by different owners (see
  "Lifetime") are not equal as terms, but name the same object.

  ## Examples

      iex> a = VllmBridge.Ref.new(7, "Store", worker: self(), owner: self())
      iex> VllmBridge.Ref.same_object?(a, %{a | owner: nil})
      true
      iex> VllmBridge.Ref.same_object?(a, %{a | id: 8})
      false
  """
  @spec same_object?(t(), t()) :: boolean()
  def same_object?(%__MODULE__{} = a, %__MODULE__{} = b),
    do: a.id == b.id and a.worker == b.worker and a.session == b.session

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
  Stamps `fields` (`:pool`, `:worker`, `:session`, `:index`, `:owner`, as
  a keyword list or map) on `ref`; other keys are ignored.
  """
  @spec stamp(t(), keyword() | map() | nil) :: t()
  def stamp(%__MODULE__{} = ref, nil), do: ref

  def stamp(%__MODULE__{} = ref, fields) when is_list(fields) or is_map(fields) do
    Enum.reduce(fields, ref, fn
      {:pool, pool}, acc -> %{acc | pool: pool}
      {:worker, worker}, acc -> %{acc | worker: worker}
      {:session, session}, acc -> %{acc | session: session}
      {:index, index}, acc -> %{acc | index: index}
      {:owner, owner}, acc -> %{acc | owner: owner}
      _, acc -> acc
    end)
  end
end
