defmodule VllmBridge.Worker.Pending do
  @moduledoc """
  A worker's table of calls in flight: request id -> reply address.

  The table is a public ETS set owned by the worker process
  (`VllmBridge.Worker.Server`) and outlives the Python processes of failed
  starts. Callers enter their own calls here before they write them to the
  port (`VllmBridge.Worker.Call`); the worker enters its own requests.

  An entry is `{id, address, caller}`:

    * a caller's alias (a reference), with the caller's pid;
    * `:health`, `:handshake` or `:release` for the worker's own health
      ping, start handshake or release of holds, with `nil`: nobody waits for
      their replies.

  The caller's pid lets the worker find and forget the entries of callers
  that died (`sweep/1`).
  """

  alias VllmBridge.Error

  @typedoc "A table of pending calls."
  @type t :: :ets.tid()

  @typedoc "Where a reply goes: a caller's alias, or the worker's own request."
  @type address :: reference() | :health | :handshake | :release

  @doc "A new, empty table, owned by the calling process."
  @spec new() :: t()
  def new, do: :ets.new(VllmBridge.Worker, [:set, :public, write_concurrency: true])

  @doc """
  Enters a caller's call: `:ok`, or a `:bad_args` error when a call with
  that id is already in flight. Raises `ArgumentError` when the table is
  gone (its worker stopped).
  """
  @spec enter(t(), pos_integer(), address(), pid()) :: :ok | {:error, Error.t()}
  def enter(table, id, address, caller) do
    if :ets.insert_new(table, {id, address, caller}),
      do: :ok,
      else: {:error, Error.new(:bad_args, "request id #{id} is already in flight")}
  end

  @doc "Enters the worker's own health ping, start handshake or release."
  @spec enter_own(t(), pos_integer(), :health | :handshake | :release) :: true
  def enter_own(table, id, kind) when kind in [:health, :handshake, :release] do
    :ets.insert(table, {id, kind, nil})
  end

  @doc """
  Removes the entry for `id` and hands `result` to its caller, in one table
  operation (a reply's whole business with the table): `:answered` when a
  caller was answered, `:health` or `:handshake` for the worker's own ping
  (nobody is answered), `nil` when there is no entry.
  """
  @spec answer_id(t(), pos_integer(), term()) ::
          :answered | :health | :handshake | :release | nil
  def answer_id(table, id, result) do
    case :ets.take(table, id) do
      [{_id, tag, _caller}] when is_reference(tag) ->
        send(tag, {tag, result})
        :answered

      [{_id, own, _caller}] ->
        own

      [] ->
        nil
    end
  end

  @doc """
  Answers the caller's call `id` with `{:error, error}` and forgets it, if
  it is still in flight (the worker's own requests are left alone).
  """
  @spec fail(t(), pos_integer(), Error.t()) :: :ok
  def fail(table, id, error) do
    with [{^id, tag, _caller}] when is_reference(tag) <- :ets.lookup(table, id),
         1 <- :ets.select_delete(table, [{{id, tag, :_}, [], [true]}]) do
      send(tag, {tag, {:error, error}})
    end

    :ok
  end

  @doc "Forgets the entry for `id`, if any (also when the table is gone)."
  @spec delete(t(), pos_integer()) :: true
  def delete(table, id) do
    :ets.delete(table, id)
  rescue
    ArgumentError -> true
  end

  @doc """
  Hands `result` to the caller at `address`; the worker's own pings have
  nobody to hand it to.
  """
  @spec answer(address(), term()) :: :ok | term()
  def answer(tag, result) when is_reference(tag), do: send(tag, {tag, result})
  def answer(own, _result) when own in [:health, :handshake, :release], do: :ok

  @doc """
  Answers every entry with `{:error, error}` and empties the table. Entries
  are taken one by one, so each caller hears once even when another process
  empties the table at the same time.
  """
  @spec fail_all(t(), Error.t()) :: :ok
  def fail_all(table, error) do
    for {id, _to, _caller} <- :ets.tab2list(table),
        [{_id, to, _caller}] <- [:ets.take(table, id)],
        do: answer(to, {:error, error})

    :ok
  end

  @doc """
  Forgets the entries of callers that died (local ones: a remote caller
  cannot be asked cheaply, and its call times out anyway).
  """
  @spec sweep(t()) :: :ok
  def sweep(table) do
    for {id, pid} <-
          :ets.select(table, [{{:"$1", :_, :"$2"}, [{:is_pid, :"$2"}], [{{:"$1", :"$2"}}]}]),
        node(pid) == node() and not Process.alive?(pid) do
      :ets.delete(table, id)
    end

    :ok
  end

  @doc "The count of callers' calls in flight (the worker's own pings are not counted)."
  @spec callers(t()) :: non_neg_integer()
  def callers(table) do
    :ets.select_count(table, [{{:_, :_, :"$1"}, [{:is_pid, :"$1"}], [true]}])
  end

  @doc """
  The count of entries that are not the worker's own pings (what
  `VllmBridge.Worker.info/1` reports as `:pending`).
  """
  @spec pending(t()) :: non_neg_integer()
  def pending(table) do
    own = :ets.select_count(table, [{{:_, :"$1", :_}, [{:is_atom, :"$1"}], [true]}])
    :ets.info(table, :size) - own
  end
end
